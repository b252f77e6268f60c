"""``--backend-arg``: what the trainer and the launcher write is what the teacher's command line reads back."""

from megatron_gkd.teacher.service.cli import _backend_kwargs, build_parser
from megatron_gkd.teacher.service.replicas import backend_arg_flags


def test_backend_args_round_trip_through_the_command_line():
    backend_args = {"max_top_k": 256, "dtype": "bfloat16", "enforce_eager": True, "limits": {"a": [1, 2]},
                    "ratio": 0.25, "empty": None}
    flags = backend_arg_flags(backend_args)
    assert flags[::2] == ["--backend-arg"] * len(backend_args)
    args = build_parser().parse_args(["serve", "--model", "m", *flags])
    assert _backend_kwargs(args.backend_arg) == backend_args
