"""On-disk layout of a checkpoint root: names, completion markers, the ``latest`` pointer, retention.

::

    <root>/iter_0000002/               a checkpoint (Megatron dist_checkpointing files + COMPLETE)
    <root>/.tmp-iter_0000003-1a2b3c4d/ a save in progress, or one killed mid-way: never loaded
    <root>/latest                      one line naming the newest complete checkpoint: iter_0000002

A checkpoint is *complete* when its marker ``COMPLETE`` exists and every file the marker lists has
the size it lists. :func:`commit` writes the marker last (after fsyncing every file), renames the
temporary directory into place, and only then replaces ``latest`` (temporary file + ``os.replace``).
A crash at any point therefore leaves ``latest`` naming a complete checkpoint (or nothing), and
:func:`find_checkpoint` skips, and logs, any directory without a valid marker.

Everything here is plain filesystem work done by one rank (rank 0); the callers broadcast results.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

logger = logging.getLogger(__name__)

MARKER = "COMPLETE"
LATEST = "latest"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_TEMP_RE = re.compile(r"^\.tmp-iter_(\d{7,})-[0-9a-f]+$")


def iter_name(step: int) -> str:
    """``iter_0000042`` for step 42."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"iter_{step:07d}"


def temp_name(step: int, nonce: str) -> str:
    """The name a save of ``step`` writes under before it is complete."""
    return f".tmp-{iter_name(step)}-{nonce}"


def _fsync(path: Path) -> None:
    # Directories are fsynced too: that is what makes a rename or a new entry durable.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(directory: Path) -> dict[str, int]:
    return {
        str(path.relative_to(directory)): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MARKER
    }


def write_marker(directory: Path, step: int) -> None:
    """Fsyncs every file of ``directory``, then writes (and fsyncs) the marker that lists them."""
    files = _files(directory)
    for name in files:
        _fsync(directory / name)
    for sub in {(directory / name).parent for name in files}:
        _fsync(sub)
    marker = {"step": step, "files": files, "written_at": time.time()}
    with open(directory / MARKER, "w") as stream:
        json.dump(marker, stream, indent=1)
        stream.flush()
        os.fsync(stream.fileno())
    _fsync(directory)


def incomplete_reason(directory: Path) -> str | None:
    """Why ``directory`` is not a complete checkpoint, or ``None`` if it is."""
    if not directory.is_dir():
        return "it does not exist"
    try:
        with open(directory / MARKER) as stream:
            marker = json.load(stream)
        files = marker["files"]
    except FileNotFoundError:
        return "no completion marker"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"unreadable completion marker: {error}"
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            return f"file {name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"file {name} has {actual} bytes, the marker says {size}"
    return None


def write_latest(root: Path, name: str) -> None:
    """Points ``<root>/latest`` at ``name`` atomically (readers see the old or the new name)."""
    temp = root / f".{LATEST}.tmp-{os.getpid()}"
    with open(temp, "w") as stream:
        stream.write(name + "\n")
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temp, root / LATEST)
    _fsync(root)


def read_latest(root: Path) -> str | None:
    """The name in ``<root>/latest``, or ``None`` if there is no (readable) pointer."""
    try:
        return (root / LATEST).read_text().strip() or None
    except OSError:
        return None


def commit(temp_dir: Path, root: Path, step: int) -> Path:
    """Makes the save in ``temp_dir`` the checkpoint of ``step``: marker, rename, then ``latest``.

    An existing ``iter_<step>`` (an older save of the same step, complete or not) is moved aside
    first and deleted after the rename; ``latest`` is never pointed at it in between.
    """
    final = root / iter_name(step)
    write_marker(temp_dir, step)
    replaced = None
    if final.exists():
        replaced = root / f".old-{final.name}-{temp_dir.name.rsplit('-', 1)[-1]}"
        os.rename(final, replaced)
    os.rename(temp_dir, final)
    _fsync(root)
    write_latest(root, final.name)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return final


def _step_of(name: str) -> int | None:
    match = _ITER_RE.match(name) or _TEMP_RE.match(name)
    return int(match.group(1)) if match else None


@dataclasses.dataclass(frozen=True)
class Found:
    """A complete checkpoint chosen for resuming."""

    path: Path
    step: int


def find_checkpoint(root: str | os.PathLike, step: int | None = None) -> Found | None:
    """The checkpoint to resume from: ``latest`` if it names a complete one, else the newest complete.

    Every newer directory that is skipped (no marker, a file missing or truncated, a temporary
    directory of a save that never finished) is logged with the reason and the choice made.

    Args:
        root: the checkpoint root.
        step: resume from exactly this step instead.

    Returns:
        The choice, or ``None`` when the root holds no complete checkpoint.

    Raises:
        FileNotFoundError: ``step`` was given and that checkpoint is missing or incomplete.
    """
    root = Path(root)
    if step is not None:
        reason = incomplete_reason(root / iter_name(step))
        if reason is not None:
            raise FileNotFoundError(
                f"cannot resume from {root / iter_name(step)}: {reason}; pick another step or "
                "leave the step unset to resume from the newest complete checkpoint"
            )
        return Found(root / iter_name(step), step)
    if not root.is_dir():
        return None

    candidates = sorted(
        ((_step_of(entry.name), entry) for entry in root.iterdir() if _step_of(entry.name) is not None),
        key=lambda item: (item[0], item[1].name.startswith(".")),
        reverse=True,
    )
    reasons = {entry.name: incomplete_reason(entry) for _, entry in candidates}
    for name, reason in reasons.items():
        if name.startswith(".tmp-") and reason == "no completion marker":
            reasons[name] = "a save that never finished"

    chosen = None
    pointer = read_latest(root)
    if pointer is not None:
        pointer_step = _step_of(pointer)
        pointer_reason = reasons.get(pointer, "it does not exist") if pointer_step is not None else None
        if pointer_step is not None and pointer_reason is None and not pointer.startswith("."):
            chosen = Found(root / pointer, pointer_step)
        else:
            logger.warning(
                "%s names %r, which is %s; looking for the newest complete checkpoint",
                root / LATEST,
                pointer,
                f"incomplete ({pointer_reason})" if pointer_step is not None else "not a checkpoint name",
            )
    if chosen is None:
        for entry_step, entry in candidates:
            if not entry.name.startswith(".") and reasons[entry.name] is None:
                chosen = Found(entry, entry_step)
                break

    chosen_name = chosen.path.name if chosen else "nothing (no complete checkpoint)"
    for entry_step, entry in candidates:
        reason = reasons[entry.name]
        if reason is not None and (chosen is None or entry_step >= chosen.step):
            logger.warning("%s is incomplete (%s); resuming from %s", entry.name, reason, chosen_name)
        elif reason is None and chosen is not None and entry_step > chosen.step:
            logger.warning(
                "%s is complete and newer than %s, which %s names; resuming from %s as the pointer "
                "says (point %s at %s to resume from it)",
                entry.name,
                chosen_name,
                LATEST,
                chosen_name,
                LATEST,
                entry.name,
            )
    return chosen


def prune(root: Path, keep_last_n: int, keep: Path) -> list[Path]:
    """Deletes all but the newest ``keep_last_n`` complete checkpoints, and stale temporary dirs.

    ``keep`` (the checkpoint just written, which ``latest`` names) is never deleted. Incomplete
    ``iter_*`` directories are left alone: they are evidence, and :func:`find_checkpoint` skips them.

    Returns:
        The deleted directories.
    """
    if keep_last_n < 1:
        raise ValueError(f"keep_last_n must be >= 1 (or None to keep all), got {keep_last_n}")
    complete = sorted(
        (
            (_step_of(entry.name), entry)
            for entry in root.iterdir()
            if _ITER_RE.match(entry.name) and incomplete_reason(entry) is None
        ),
        reverse=True,
    )
    doomed = [entry for _, entry in complete[keep_last_n:] if entry != keep]
    # A temporary directory is either this save's (already renamed away) or a killed save's.
    doomed += [entry for entry in root.iterdir() if _TEMP_RE.match(entry.name)]
    for entry in doomed:
        shutil.rmtree(entry, ignore_errors=True)
        logger.info("removed %s (keep_last_n=%d)", entry, keep_last_n)
    return doomed
