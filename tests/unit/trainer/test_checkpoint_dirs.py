"""The checkpoint root's layout: completion markers, the ``latest`` pointer, selection, retention."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from megatron_gkd.trainer import checkpoint_dirs
from megatron_gkd.trainer.checkpoint_dirs import (
    commit,
    find_checkpoint,
    incomplete_reason,
    iter_name,
    prune,
    read_latest,
    temp_name,
    write_latest,
)


def _fake_save(root: Path, step: int, nonce: str = "ab12") -> Path:
    """A temporary directory holding what a save writes (two shard files and metadata)."""
    root.mkdir(parents=True, exist_ok=True)
    temp = root / temp_name(step, nonce)
    (temp / "sub").mkdir(parents=True)
    (temp / "__0_0.distcp").write_bytes(os.urandom(1000 + step))
    (temp / "__1_0.distcp").write_bytes(os.urandom(700))
    (temp / "common.pt").write_bytes(b"common")
    (temp / "sub" / "nested.bin").write_bytes(b"x" * 10)
    return temp


def _saved(root: Path, *steps: int) -> None:
    for step in steps:
        commit(_fake_save(root, step), root, step)


def test_commit_renames_marks_and_points_latest(tmp_path):
    _saved(tmp_path, 1, 2)
    assert read_latest(tmp_path) == "iter_0000002"
    assert incomplete_reason(tmp_path / "iter_0000002") is None
    assert not list(tmp_path.glob(".tmp-*"))
    found = find_checkpoint(tmp_path)
    assert (found.path.name, found.step) == ("iter_0000002", 2)


def test_latest_is_replaced_only_after_the_checkpoint_is_complete(tmp_path, monkeypatch):
    _saved(tmp_path, 1)
    seen = []
    real_replace = os.replace

    def checking_replace(src, dst):
        if Path(dst).name == checkpoint_dirs.LATEST:
            target = tmp_path / Path(src).read_text().strip()
            seen.append((target.name, incomplete_reason(target)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", checking_replace)
    _saved(tmp_path, 2)
    assert seen == [("iter_0000002", None)]


def test_a_failed_rename_leaves_latest_on_the_previous_checkpoint(tmp_path, monkeypatch):
    _saved(tmp_path, 1)
    temp = _fake_save(tmp_path, 2)

    def crash(src, dst):
        raise OSError("simulated crash during rename")

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(OSError, match="simulated crash"):
        commit(temp, tmp_path, 2)
    assert read_latest(tmp_path) == "iter_0000001"
    assert find_checkpoint(tmp_path).step == 1


def test_recommitting_a_step_replaces_it(tmp_path):
    _saved(tmp_path, 1)
    (tmp_path / "iter_0000001" / checkpoint_dirs.MARKER).unlink()
    commit(_fake_save(tmp_path, 1, nonce="cd34"), tmp_path, 1)
    assert incomplete_reason(tmp_path / "iter_0000001") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "latest"]


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda d: (d / checkpoint_dirs.MARKER).unlink(), "no completion marker"),
        (lambda d: (d / checkpoint_dirs.MARKER).write_text("{"), "unreadable completion marker"),
        (lambda d: (d / "__1_0.distcp").unlink(), "file __1_0.distcp is missing"),
        (
            lambda d: (d / "sub" / "nested.bin").write_bytes(b"x"),
            "file sub/nested.bin has 1 bytes, the marker says 10",
        ),
    ],
    ids=["no-marker", "torn-marker", "missing-file", "truncated-file"],
)
def test_damaged_checkpoints_are_skipped_and_logged(tmp_path, caplog, damage, reason):
    _saved(tmp_path, 1, 2, 3)
    damage(tmp_path / "iter_0000003")
    write_latest(tmp_path, "iter_0000002")
    with caplog.at_level(logging.WARNING, logger=checkpoint_dirs.__name__):
        found = find_checkpoint(tmp_path)
    assert found.step == 2
    messages = [record.getMessage() for record in caplog.records]
    expected = f"iter_0000003 is incomplete ({reason}"
    matches = [m for m in messages if m.startswith(expected) and m.endswith("; resuming from iter_0000002")]
    assert matches, messages


def test_latest_naming_an_incomplete_checkpoint_falls_back_to_a_scan(tmp_path, caplog):
    _saved(tmp_path, 1, 2)
    (tmp_path / "iter_0000002" / checkpoint_dirs.MARKER).unlink()
    _fake_save(tmp_path, 3)  # a save killed before its marker
    with caplog.at_level(logging.WARNING, logger=checkpoint_dirs.__name__):
        found = find_checkpoint(tmp_path)
    assert found.step == 1
    messages = [record.getMessage() for record in caplog.records]
    assert any("names 'iter_0000002', which is incomplete (no completion marker)" in m for m in messages)
    assert "iter_0000002 is incomplete (no completion marker); resuming from iter_0000001" in messages
    assert (
        f"{temp_name(3, 'ab12')} is incomplete (a save that never finished); resuming from iter_0000001"
        in messages
    )


def test_a_newer_complete_checkpoint_than_latest_is_reported(tmp_path, caplog):
    _saved(tmp_path, 1, 2)
    write_latest(tmp_path, "iter_0000001")  # e.g. a crash between the rename and the pointer
    with caplog.at_level(logging.WARNING, logger=checkpoint_dirs.__name__):
        assert find_checkpoint(tmp_path).step == 1
    messages = [record.getMessage() for record in caplog.records]
    assert any("iter_0000002 is complete and newer than iter_0000001" in m for m in messages), messages


def test_no_checkpoint_and_explicit_steps(tmp_path):
    assert find_checkpoint(tmp_path / "missing") is None
    _fake_save(tmp_path, 1)
    assert find_checkpoint(tmp_path) is None
    _saved(tmp_path, 2, 3)
    assert find_checkpoint(tmp_path, step=2).path.name == "iter_0000002"
    with pytest.raises(FileNotFoundError, match="iter_0000005: it does not exist"):
        find_checkpoint(tmp_path, step=5)


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    _saved(tmp_path, 1, 2, 3)
    (tmp_path / "iter_0000002" / checkpoint_dirs.MARKER).unlink()  # incomplete: left as evidence
    stale = _fake_save(tmp_path, 4, nonce="ee")  # a killed save
    _saved(tmp_path, 5)
    removed = prune(tmp_path, 2, keep=tmp_path / "iter_0000005")
    assert sorted(p.name for p in removed) == sorted(["iter_0000001", stale.name])
    remaining = sorted(p.name for p in tmp_path.iterdir())
    assert remaining == ["iter_0000002", "iter_0000003", "iter_0000005", "latest"]
    with pytest.raises(ValueError, match="keep_last_n must be >= 1"):
        prune(tmp_path, 0, keep=tmp_path / "iter_0000005")


def test_names():
    assert iter_name(42) == "iter_0000042"
    assert temp_name(3, "0f") == ".tmp-iter_0000003-0f"
    with pytest.raises(ValueError, match="step must be >= 0"):
        iter_name(-1)


# --- resuming from an older step: newer checkpoints are retired (issue 14, item 10) ------------------

def test_retiring_moves_newer_checkpoints_aside_and_repoints_latest(tmp_path, caplog):
    _saved(tmp_path, 50, 100)
    (tmp_path / "iter_0000120").mkdir()  # a torn directory of the abandoned branch
    with caplog.at_level(logging.WARNING, logger=checkpoint_dirs.__name__):
        retired = checkpoint_dirs.retire_newer(tmp_path, 50)
    assert sorted(path.parent.name for path in retired) == [checkpoint_dirs.ABANDONED] * 2
    assert sorted(path.name.split(".")[0] for path in retired) == ["iter_0000100", "iter_0000120"]
    assert incomplete_reason(next(p for p in retired if p.name.startswith("iter_0000100"))) is None
    assert read_latest(tmp_path) == "iter_0000050"
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_dirs.ABANDONED, "iter_0000050", "latest"]
    messages = [record.getMessage() for record in caplog.records]
    assert any("iter_0000100 is newer than step 50" in m and "moved to" in m for m in messages), messages
    # Selection never follows the abandoned branch, with or without the pointer.
    (tmp_path / checkpoint_dirs.LATEST).unlink()
    assert find_checkpoint(tmp_path).step == 50


def test_saving_an_older_step_retires_the_abandoned_branch_before_pruning(tmp_path):
    """The issue's sequence: resume from 50 while 100 exists, save 60, 70, 80 with keep_last_n=2."""
    _saved(tmp_path, 50, 100)
    for step in (60, 70, 80):
        checkpoint_dirs.prepare_save(tmp_path, step)
        final = commit(_fake_save(tmp_path, step), tmp_path, step)
        prune(tmp_path, 2, keep=final)
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_dirs.ABANDONED, "iter_0000070", "iter_0000080", "latest"]
    (tmp_path / checkpoint_dirs.LATEST).unlink()
    assert find_checkpoint(tmp_path).step == 80


# --- the crash window of a re-save (issue 14, item 11) -----------------------------------------------

def _crash_on_rename(monkeypatch, call: int) -> None:
    """``os.rename`` raises on its ``call``-th use (1-based), as a kill at that point would leave it."""
    real_rename, calls = os.rename, []

    def rename(src, dst):
        calls.append(src)
        if len(calls) == call:
            raise OSError("simulated crash")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)


def _resave_and_crash(root: Path, monkeypatch, call: int) -> bytes:
    _saved(root, 1)
    temp = _fake_save(root, 1, nonce="cd34")
    new_shard = (temp / "__0_0.distcp").read_bytes()
    _crash_on_rename(monkeypatch, call)
    with pytest.raises(OSError, match="simulated crash"):
        commit(temp, root, 1)
    monkeypatch.undo()
    return new_shard


def test_a_crash_between_the_two_renames_of_a_resave_is_recovered(tmp_path, monkeypatch, caplog):
    new_shard = _resave_and_crash(tmp_path, monkeypatch, call=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".old-iter_0000001-cd34", ".tmp-iter_0000001-cd34", "latest"]
    with caplog.at_level(logging.INFO, logger=checkpoint_dirs.__name__):
        found = find_checkpoint(tmp_path)
    assert (found.path.name, found.step) == ("iter_0000001", 1)
    assert (found.path / "__0_0.distcp").read_bytes() == new_shard  # the re-save, complete, won
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "latest"]
    messages = [record.getMessage() for record in caplog.records]
    assert any("finished the interrupted commit of iter_0000001" in m for m in messages), messages
    assert not any("point latest at .tmp" in m for m in messages)


def test_pruning_after_the_crash_keeps_the_resaved_checkpoint(tmp_path, monkeypatch):
    new_shard = _resave_and_crash(tmp_path, monkeypatch, call=2)
    final = commit(_fake_save(tmp_path, 2), tmp_path, 2)
    prune(tmp_path, 2, keep=final)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "iter_0000002", "latest"]
    assert (tmp_path / "iter_0000001" / "__0_0.distcp").read_bytes() == new_shard


def test_other_interrupted_commits_are_finished_or_rolled_back(tmp_path, monkeypatch):
    # Killed before the first rename of a re-save: the complete new copy replaces the old one.
    new_shard = _resave_and_crash(tmp_path / "a", monkeypatch, call=1)
    assert find_checkpoint(tmp_path / "a").path.joinpath("__0_0.distcp").read_bytes() == new_shard
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["iter_0000001", "latest"]
    # Killed after the second rename, before the old copy was deleted.
    root = tmp_path / "b"
    _saved(root, 1)
    old = root / ".old-iter_0000001-cd34"
    (root / "iter_0000001").rename(old)
    commit(_fake_save(root, 1, nonce="cd34"), root, 1)
    old.mkdir(exist_ok=True)
    assert checkpoint_dirs.recover(root) and not old.exists()
    # The old copy moved aside and no complete new copy: the old one is put back.
    root = tmp_path / "c"
    _saved(root, 1)
    (root / "iter_0000001").rename(root / ".old-iter_0000001-cd34")
    _fake_save(root, 1, nonce="cd34")  # never got its marker
    assert find_checkpoint(root).path.name == "iter_0000001"
    assert incomplete_reason(root / "iter_0000001") is None


def test_content_hashes_detect_a_changed_byte(tmp_path, caplog):
    _saved(tmp_path, 1)
    commit(_fake_save(tmp_path, 2), tmp_path, 2, content_hashes=True)
    shard = tmp_path / "iter_0000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[17] ^= 1
    shard.write_bytes(bytes(data))  # same size: the size check cannot see it
    assert incomplete_reason(tmp_path / "iter_0000002") is None
    assert incomplete_reason(tmp_path / "iter_0000002", verify_hashes=True) == "file __0_0.distcp does not match its blake3 hash"
    with caplog.at_level(logging.WARNING, logger=checkpoint_dirs.__name__):
        assert find_checkpoint(tmp_path).step == 1  # the marker holds hashes: they are checked
    assert any("iter_0000002 is incomplete (file __0_0.distcp does not match" in r.getMessage() for r in caplog.records)
    assert find_checkpoint(tmp_path, verify_hashes=False).step == 2
    # Asking for hashes where the marker has none refuses the checkpoint.
    assert incomplete_reason(tmp_path / "iter_0000001", verify_hashes=True) == "the completion marker holds no content hashes"


# --- the trust boundary (issue 14, item 13) ----------------------------------------------------------

def test_a_checkpoint_root_others_can_write_is_reported(tmp_path, caplog):
    _saved(tmp_path, 1)
    os.chmod(tmp_path, 0o777)
    with caplog.at_level(logging.WARNING, logger=checkpoint_dirs.__name__):
        assert find_checkpoint(tmp_path).step == 1
    messages = [record.getMessage() for record in caplog.records]
    assert any("writable by other users" in m and "pickle" in m for m in messages), messages
