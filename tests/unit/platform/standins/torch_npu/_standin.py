"""The stand-in's recorder (not part of real torch_npu): every request made of the stand-in ``torch_npu`` and
``mindspeed`` is appended, with the call stack that made it, to ``$TORCH_NPU_STANDIN_RECORD/<pid>.jsonl``
(nothing is recorded when the variable is unset).

A stack keeps only the frames a test reasons about: this repository's files (as repository-relative paths,
the stand-ins' own frames left out) and Megatron-Core's (``megatron/core/...``), innermost last. ``caller`` is the
innermost frame outside the stand-ins, whoever's: a library that asks the device API itself (accelerate asks
``torch.npu.is_available()`` as it is imported, under the first ``transformers`` call that imports it) is told
apart from the project file that made that call.
"""

from __future__ import annotations

import json
import os
import pathlib
import threading
import traceback

RECORD_ENV = "TORCH_NPU_STANDIN_RECORD"
REPO = pathlib.Path(__file__).resolve().parents[5]
STANDINS = pathlib.Path(__file__).resolve().parents[1]
_lock = threading.Lock()


def _frame_name(filename: str) -> str | None:
    path = pathlib.Path(filename)
    if path.is_relative_to(STANDINS):
        return None
    if path.is_relative_to(REPO) and ".venv" not in path.parts:
        return str(path.relative_to(REPO))
    parts = path.parts
    for index in range(len(parts) - 1):
        if parts[index] == "megatron" and parts[index + 1] == "core":
            return "/".join(parts[index:])
    return None


def record(kind: str, **detail) -> None:
    """Appends one request: ``kind`` (e.g. ``set_device``), JSON-able ``detail`` and the caller's stack."""
    directory = os.environ.get(RECORD_ENV)
    if not directory:
        return
    frames = traceback.extract_stack()[:-1]
    stack = [name for name in (_frame_name(frame.filename) for frame in frames) if name]
    outside = [frame.filename for frame in frames if not pathlib.Path(frame.filename).is_relative_to(STANDINS)]
    caller = _frame_name(outside[-1]) or outside[-1] if outside else None
    line = json.dumps({"kind": kind, "rank": os.environ.get("RANK"), "pid": os.getpid(), "detail": detail,
                       "stack": stack, "caller": caller}, default=str)
    with _lock, open(pathlib.Path(directory) / f"{os.getpid()}.jsonl", "a") as out:
        out.write(line + "\n")
