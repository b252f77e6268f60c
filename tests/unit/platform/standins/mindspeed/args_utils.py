"""How MindSpeed reads its options (stand-in of ``mindspeed/args_utils.py``, branch ``core_r0.16.0``).

``get_mindspeed_args()`` parses ``sys.argv`` once per process with the flags its features register
(``parse_known_args``); a flag no feature registers (Megatron's own, such as ``--use-flash-attn``) is kept
in the namespace as well: ``--flag`` alone is ``True``, one value is that value, several are a list. The
stand-in registers the flags of the features megatron-gkd configures, with MindSpeed's defaults and choices.
"""

from __future__ import annotations

import argparse
import sys

_ARGS: argparse.Namespace | None = None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="MindSpeed Arguments", allow_abbrev=False)
    parser.add_argument("--optimization-level", type=int, choices=[0, 1, 2], default=2)
    parser.add_argument("--use-fused-rmsnorm", action="store_true")
    parser.add_argument("--use-fused-swiglu", action="store_true")
    parser.add_argument("--use-fused-rotary-pos-emb", action="store_true")
    parser.add_argument("--context-parallel-algo", type=str, default="megatron_cp_algo",
                        choices=["megatron_cp_algo", "hybrid_cp_algo", "hybrid_adaptive_cp_algo", "kvallgather_cp_algo",
                                 "ulysses_cp_algo", "adaptive_cp_algo"])
    parser.add_argument("--ulysses-degree-in-cp", type=int, default=None)
    parser.add_argument("--cp-window-size", type=int, default=1)
    parser.add_argument("--use-cp-send-recv-overlap", action="store_true")
    return parser


def _fold_unknown(unknown: list[str]) -> dict:
    folded, key = {}, None
    for token in unknown:
        if token.startswith("-"):
            name, _, value = token.partition("=")
            key = name.lstrip("-").replace("-", "_")
            folded[key] = [value] if value else []
        elif key is not None:
            folded[key].append(token)
    return {name: True if not values else values[0] if len(values) == 1 else values
            for name, values in folded.items()}


def get_mindspeed_args() -> argparse.Namespace:
    global _ARGS
    if _ARGS is None:
        known, unknown = _parser().parse_known_args(sys.argv[1:])
        _ARGS = argparse.Namespace(**{**vars(known), **_fold_unknown(unknown)})
    return _ARGS
