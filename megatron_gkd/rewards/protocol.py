"""The reward worker's protocol: frames on its pipes and what one batch's reply holds.

Frames are an 8-byte big-endian length and a pickle. Both ends are this project's code, so pickle carries
nothing the trainer did not send itself; a reward's values are reduced to builtins in the worker
(:func:`plain`) so that the trainer never unpickles an object of the user's classes.

    trainer -> worker   {"target": "module:Class", "kind": str, "config": {...}}     once
    worker -> trainer   ("ready", name) | ("error", description)
    trainer -> worker   (prompts, responses, records)                                per batch
    worker -> trainer   ("ok", values, seconds) | ("raised", description, record, traceback, seconds)
"""

from __future__ import annotations

import collections.abc
import numbers
import pickle
import struct
import time
import traceback
from typing import Any, BinaryIO

_LENGTH = struct.Struct(">Q")


def write_frame(stream: BinaryIO, obj: Any) -> None:
    """Sends one pickled object (raises ``BrokenPipeError`` / ``OSError`` when the other end is gone)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: BinaryIO, max_bytes: int | None = None) -> Any:
    """One object, or None at the end of the stream (the other end closed it or exited).

    Raises:
        ValueError: the frame is longer than ``max_bytes`` (what a stray write into the stream looks like).
        pickle.UnpicklingError: the frame is not a pickle.
    """
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(header)
    if max_bytes is not None and length > max_bytes:
        raise ValueError(f"a frame of {length} bytes announced, at most {max_bytes} expected")
    data = stream.read(length)
    if len(data) < length:
        return None
    return pickle.loads(data)


def plain(values: Any) -> tuple:
    """A reward function's result as builtins: ``("sequence", items)`` or ``("not a sequence", type, repr)``."""
    if hasattr(values, "tolist") and not isinstance(values, (str, bytes)):  # numpy arrays, torch tensors
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, collections.abc.Sequence):
        return ("not a sequence", type(values).__name__, repr(values)[:80])
    items: list[Any] = []
    for value in values:
        if isinstance(value, numbers.Real):  # bool and numpy floats too
            try:
                items.append(float(value))
            except OverflowError:  # an int too large for a float
                items.append(float("inf"))
        else:
            items.append((type(value).__name__, repr(value)[:80]))
    return ("sequence", items)


def describe_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _first_failing(reward, prompts: list, responses: list, records: list) -> int | None:
    """The first record that fails on its own (the batched call raised and did not say where), or None."""
    for i, call in enumerate(zip(prompts, responses, records)):
        try:
            reward(*([part] for part in call))
        except Exception:  # noqa: BLE001 - only where it fails is asked
            return i
    return None


def compute(reward, prompts: list, responses: list, records: list) -> tuple:
    """One batch's reply frame (``ok`` with plain values, or ``raised`` naming the first failing record)."""
    start = time.perf_counter()
    try:
        values = reward(prompts, responses, records)
    except Exception as error:  # noqa: BLE001 - reported to the trainer, which stops the run
        text = traceback.format_exc()
        record = _first_failing(reward, prompts, responses, records)
        return ("raised", describe_error(error), record, text, time.perf_counter() - start)
    return ("ok", plain(values), time.perf_counter() - start)
