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

A crash inside :func:`commit` leaves a complete temporary directory, or a previous copy moved aside
as ``.old-iter_*``; :func:`recover` (run before every selection and save) finishes or rolls back
such a commit. The marker can also hold a blake3 hash of every file (``content_hashes=True``), which
selection then checks besides the sizes.

Resuming from a step older than the newest checkpoint abandons the newer ones: :func:`retire_newer`
moves them into ``<root>/abandoned/`` (logged), so neither selection nor ``keep_last_n`` ever follows
that branch again.

Trust boundary: checkpoints are loaded with pickle (torch's loader), so a checkpoint root must be
storage that only the job's owner can write; :func:`find_checkpoint` warns about a root, checkpoint
or file that other users can write.

Everything here is plain filesystem work done by one rank (rank 0); the callers broadcast results.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import secrets
import shutil
import stat
import time
from pathlib import Path

import blake3

logger = logging.getLogger(__name__)

MARKER = "COMPLETE"
LATEST = "latest"
ABANDONED = "abandoned"
"""Sub-directory of the root where :func:`retire_newer` moves the checkpoints of an abandoned branch."""
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_TEMP_RE = re.compile(r"^\.tmp-iter_(\d{7,})-([0-9a-f]+)$")
_OLD_RE = re.compile(r"^\.old-iter_(\d{7,})-([0-9a-f]+)$")


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


def _blake3(path: Path) -> str:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if path.stat().st_size:
        hasher.update_mmap(path)
    return hasher.hexdigest()


def write_marker(directory: Path, step: int, *, content_hashes: bool = False) -> None:
    """Fsyncs every file of ``directory``, then writes (and fsyncs) the marker that lists them.

    Args:
        content_hashes: also record each file's blake3 hash (reads every file once more).
    """
    files = _files(directory)
    for name in files:
        _fsync(directory / name)
    for sub in {(directory / name).parent for name in files}:
        _fsync(sub)
    marker = {"step": step, "files": files, "written_at": time.time()}
    if content_hashes:
        marker["blake3"] = {name: _blake3(directory / name) for name in files}
    with open(directory / MARKER, "w") as stream:
        json.dump(marker, stream, indent=1)
        stream.flush()
        os.fsync(stream.fileno())
    _fsync(directory)


def incomplete_reason(directory: Path, *, verify_hashes: bool | None = False) -> str | None:
    """Why ``directory`` is not a complete checkpoint, or ``None`` if it is.

    Args:
        verify_hashes: also compare every file with its blake3 hash in the marker: ``True`` requires
            hashes, ``None`` checks them where the marker has them, ``False`` checks sizes only.
    """
    if not directory.is_dir():
        return "it does not exist"
    try:
        with open(directory / MARKER) as stream:
            marker = json.load(stream)
        files = marker["files"]
        hashes = marker.get("blake3")
    except FileNotFoundError:
        return "no completion marker"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"unreadable completion marker: {error}"
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            return f"file {name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"file {name} has {actual} bytes, the marker says {size}"
    if verify_hashes is False or (verify_hashes is None and hashes is None):
        return None
    if not isinstance(hashes, dict) or set(hashes) != set(files):
        return "the completion marker holds no content hashes"
    for name in files:
        if _blake3(directory / name) != hashes[name]:
            return f"file {name} does not match its blake3 hash"
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


def commit(temp_dir: Path, root: Path, step: int, *, content_hashes: bool = False) -> Path:
    """Makes the save in ``temp_dir`` the checkpoint of ``step``: marker, rename, then ``latest``.

    An existing ``iter_<step>`` (an older save of the same step, complete or not) is moved aside
    first and deleted after the rename; ``latest`` is never pointed at it in between. A crash between
    the steps is undone or finished by :func:`recover`.
    """
    write_marker(temp_dir, step, content_hashes=content_hashes)
    return _install(temp_dir, root, step)


def _install(temp_dir: Path, root: Path, step: int, *, point_latest: bool = True) -> Path:
    final = root / iter_name(step)
    replaced = None
    if final.exists():
        replaced = root / f".old-{final.name}-{temp_dir.name.rsplit('-', 1)[-1]}"
        os.rename(final, replaced)
    os.rename(temp_dir, final)
    _fsync(root)
    if point_latest:
        write_latest(root, final.name)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return final


def recover(root: Path) -> list[str]:
    """Finishes or rolls back a :func:`commit` that a crash interrupted; returns what was done.

    * ``.old-iter_S-N`` (the previous copy of S, moved aside by a re-save): deleted when ``iter_S``
      is complete; else replaced by the re-save's complete ``.tmp-iter_S-N`` when there is one (the
      crash came between the two renames); else renamed back to ``iter_S``.
    * A complete ``.tmp-iter_S-*`` (its marker is written only once every rank's files are on disk)
      that is newer than every complete checkpoint: installed as ``iter_S`` (the crash came before
      its rename). An older one belongs to a save that was given up and is left to :func:`prune`.

    ``latest`` is pointed at an installed checkpoint unless it already names a newer complete one.
    """
    if not root.is_dir():
        return []
    done = []
    for old in sorted(entry for entry in root.iterdir() if _OLD_RE.match(entry.name)):
        match = _OLD_RE.match(old.name)
        _attempt(done, root, old.name, lambda: _recover_old(root, old, int(match.group(1)), match.group(2)))
    newest = max((_step_of(e.name) for e in root.iterdir() if _ITER_RE.match(e.name) and incomplete_reason(e) is None),
                 default=-1)
    temps = sorted((_step_of(e.name), e) for e in root.iterdir() if _TEMP_RE.match(e.name) and incomplete_reason(e) is None)
    if temps and temps[-1][0] >= newest:
        step, temp = temps[-1]

        def install() -> str:
            _install(temp, root, step, point_latest=_may_point_latest(root, step))
            return f"finished the interrupted commit of {iter_name(step)} from {temp.name}"

        _attempt(done, root, temp.name, install)
    return done


def _attempt(done: list[str], root: Path, name: str, action) -> None:
    # A root that cannot be changed now (read-only, a full disk) must not stop a resume from a
    # complete checkpoint: the interrupted commit is left for the next attempt.
    try:
        message = action()
    except OSError as error:
        logger.warning("checkpoint root %s: could not recover %s (%s); left as it is", root, name, error)
        return
    if message:
        done.append(message)
        logger.warning("checkpoint root %s: %s", root, message)


def _recover_old(root: Path, old: Path, step: int, nonce: str) -> str | None:
    final, temp = root / iter_name(step), root / temp_name(step, nonce)
    if final.exists():
        if incomplete_reason(final) is not None:
            logger.warning("%s and an incomplete %s both exist in %s; left for you to inspect", old.name, final.name, root)
            return None
        shutil.rmtree(old)
        return f"removed {old.name}, the replaced copy of the complete {final.name}"
    if temp.is_dir() and incomplete_reason(temp) is None:
        _install(temp, root, step, point_latest=_may_point_latest(root, step))
        shutil.rmtree(old)
        return f"finished the interrupted commit of {final.name} from {temp.name} (removed {old.name})"
    os.rename(old, final)
    _fsync(root)
    return f"put {old.name} back as {final.name}: the save that replaced it never completed"


def _may_point_latest(root: Path, step: int) -> bool:
    pointer = read_latest(root)
    pointer_step = _step_of(pointer) if pointer else None
    return pointer_step is None or pointer_step <= step or incomplete_reason(root / pointer) is not None


def retire_newer(root: Path, step: int) -> list[Path]:
    """Moves every ``iter_*`` newer than ``step`` into ``<root>/abandoned/`` (resuming from ``step``
    abandons them); returns their new paths.

    Each move is logged. ``latest`` is re-pointed when it named a moved checkpoint (or nothing): at
    ``iter_<step>`` if that is complete, else the newest complete checkpoint before it.
    """
    newer = sorted(entry for entry in root.iterdir() if _ITER_RE.match(entry.name) and _step_of(entry.name) > step)
    if not newer:
        return []
    abandoned = root / ABANDONED
    abandoned.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(2)
    moved = []
    for entry in newer:
        target = abandoned / f"{entry.name}.{stamp}"
        os.rename(entry, target)
        moved.append(target)
        logger.warning(
            "%s is newer than step %d, which this run resumes from: moved to %s (an abandoned branch; "
            "delete it when it is no longer needed, or move it back and resume from it explicitly)",
            entry.name, step, target,
        )
    _fsync(abandoned)
    _fsync(root)
    pointer = read_latest(root)
    if pointer is None or not (root / pointer).is_dir():
        complete = [s for s in (_step_of(e.name) for e in root.iterdir() if _ITER_RE.match(e.name))
                    if s <= step and incomplete_reason(root / iter_name(s)) is None]
        if complete:
            write_latest(root, iter_name(max(complete)))
    return moved


def prepare_save(root: Path, step: int) -> list[Path]:
    """Before a save of ``step``: :func:`recover`, then :func:`retire_newer` (a save of ``step``
    while newer checkpoints exist means the run resumed from an older one)."""
    recover(root)
    return retire_newer(root, step)


def _step_of(name: str) -> int | None:
    match = _ITER_RE.match(name) or _TEMP_RE.match(name)
    return int(match.group(1)) if match else None


@dataclasses.dataclass(frozen=True)
class Found:
    """A complete checkpoint chosen for resuming."""

    path: Path
    step: int


def find_checkpoint(root: str | os.PathLike, step: int | None = None, *, verify_hashes: bool | None = None) -> Found | None:
    """The checkpoint to resume from: ``latest`` if it names a complete one, else the newest complete.

    An interrupted commit is finished or rolled back first (:func:`recover`). Every newer directory
    that is skipped (no marker, a file missing or truncated, a temporary directory of a save that
    never finished) is logged with the reason and the choice made.

    Args:
        root: the checkpoint root.
        step: resume from exactly this step instead.
        verify_hashes: check the chosen checkpoint's files against the blake3 hashes in its marker
            (``None``: where the marker has them; ``True``: a checkpoint without hashes is refused).

    Returns:
        The choice, or ``None`` when the root holds no complete checkpoint.

    Raises:
        FileNotFoundError: ``step`` was given and that checkpoint is missing or incomplete.
    """
    root = Path(root)
    recover(root)
    if step is not None:
        reason = incomplete_reason(root / iter_name(step), verify_hashes=verify_hashes)
        if reason is not None:
            raise FileNotFoundError(
                f"cannot resume from {root / iter_name(step)}: {reason}; pick another step or "
                "leave the step unset to resume from the newest complete checkpoint"
            )
        _warn_if_others_can_write(root, root / iter_name(step))
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
        if name.startswith(".tmp-") and reason in (None, "no completion marker"):
            reasons[name] = "a save that never finished"

    def usable(name: str) -> bool:
        # Content hashes are read only for the checkpoints that would be chosen.
        if reasons[name] is None and verify_hashes is not False:
            reasons[name] = incomplete_reason(root / name, verify_hashes=verify_hashes)
        return reasons[name] is None

    chosen = None
    pointer = read_latest(root)
    if pointer is not None:
        pointer_step = _step_of(pointer)
        valid_name = pointer_step is not None and not pointer.startswith(".")
        if valid_name and pointer in reasons and usable(pointer):
            chosen = Found(root / pointer, pointer_step)
        else:
            pointer_reason = reasons.get(pointer, "it does not exist") if valid_name else None
            logger.warning(
                "%s names %r, which is %s; looking for the newest complete checkpoint",
                root / LATEST,
                pointer,
                f"incomplete ({pointer_reason})" if valid_name else "not a checkpoint name",
            )
    if chosen is None:
        for entry_step, entry in candidates:
            if not entry.name.startswith(".") and usable(entry.name):
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
                "says, which moves it to %s/ (to resume from it instead, stop now and point %s at %s)",
                entry.name, chosen_name, LATEST, chosen_name, ABANDONED, LATEST, entry.name,
            )
    if chosen is not None:
        _warn_if_others_can_write(root, chosen.path)
    return chosen


def _warn_if_others_can_write(root: Path, checkpoint: Path) -> None:
    """The trust boundary: torch's loader unpickles checkpoint files, so whoever can write them can
    run code in this job."""
    paths = [root, checkpoint, *(path for path in checkpoint.rglob("*"))]
    writable = [path for path in paths if path.exists() and path.lstat().st_mode & stat.S_IWOTH and not path.is_symlink()]
    if writable:
        logger.warning(
            "%s is writable by other users (%d such paths, e.g. %s): checkpoints are loaded with pickle "
            "(torch's loader), so anyone who can write there can run code in this job; keep checkpoint "
            "roots on storage only the job's owner can write (chmod o-w)",
            writable[0], len(writable), ", ".join(str(p) for p in writable[:3]),
        )


def prune(root: Path, keep_last_n: int, keep: Path) -> list[Path]:
    """Deletes all but the newest ``keep_last_n`` complete checkpoints, and stale temporary dirs.

    ``keep`` (the checkpoint just written, which ``latest`` names) is never deleted. Incomplete
    ``iter_*`` directories are left alone: they are evidence, and :func:`find_checkpoint` skips them.

    Returns:
        The deleted directories.
    """
    if keep_last_n < 1:
        raise ValueError(f"keep_last_n must be >= 1 (or None to keep all), got {keep_last_n}")
    recover(root)  # a complete temporary directory may be the only copy of a checkpoint
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
