"""Platform detection and the setup-before-Megatron contract.

The contract is about process state (what was imported, and when), so those cases run in fresh
interpreters.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from megatron_gkd import platform


def _run_python(code: str, env: dict | None = None, extra_path: str | None = None) -> subprocess.CompletedProcess:
    environment = dict(os.environ)
    environment.pop(platform.PLATFORM_ENV, None)
    environment.update(env or {})
    if extra_path:
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [extra_path, environment.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=environment, timeout=300
    )


def test_detect_honours_environment(monkeypatch):
    monkeypatch.setenv(platform.PLATFORM_ENV, "CPU")
    assert platform.detect() == "cpu"
    monkeypatch.setenv(platform.PLATFORM_ENV, "tpu")
    with pytest.raises(ValueError, match="cuda, npu, cpu"):
        platform.detect()


def test_detect_on_this_machine_is_cpu(monkeypatch):
    monkeypatch.delenv(platform.PLATFORM_ENV, raising=False)
    assert platform.detect() == "cpu"


def test_setup_twice_is_harmless():
    first = platform.setup("cpu")
    assert platform.setup() is first
    assert platform.setup("cpu") is first
    assert platform.dist_backend() == "gloo"
    assert platform.device().type == "cpu"


def test_setup_cannot_switch_platform():
    platform.setup("cpu")
    with pytest.raises(ValueError, match="already set up as 'cpu'"):
        platform.setup("cuda")


def test_unknown_platform_name():
    with pytest.raises(ValueError, match="not one of"):
        platform.setup("tpu")


def test_megatron_before_setup_is_a_clear_error():
    result = _run_python(
        """
        import megatron.core
        from megatron_gkd import platform
        platform.setup("cpu")
        """
    )
    assert result.returncode != 0
    assert "imported before megatron_gkd.platform.setup()" in result.stderr


def test_parallel_before_setup_is_a_clear_error():
    result = _run_python(
        """
        from megatron_gkd import parallel
        parallel.initialize()
        """
    )
    assert result.returncode != 0
    assert "platform.setup() has not been called" in result.stderr


def test_setup_twice_in_fresh_process_then_megatron_runs():
    result = _run_python(
        """
        from megatron_gkd import platform
        platform.setup("cpu"); platform.setup()
        import torch
        from megatron.core.tensor_parallel import random
        tracker = random.get_cuda_rng_tracker()
        tracker.add("model-parallel-rng", 7)
        with tracker.fork():
            torch.randn(2)
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


STAND_IN_MINDSPEED = """
import sys
# MindSpeed patches Megatron as it is imported: it must come first.
assert not any(m.startswith("megatron.core") for m in sys.modules), "Megatron imported before MindSpeed"
import torch_npu
ADAPTED = True
"""


def test_npu_imports_mindspeed_before_megatron(tmp_path):
    (tmp_path / "torch_npu.py").write_text("npu = None\n")
    (tmp_path / "mindspeed").mkdir()
    (tmp_path / "mindspeed" / "__init__.py").write_text("")
    (tmp_path / "mindspeed" / "megatron_adaptor.py").write_text(STAND_IN_MINDSPEED)
    result = _run_python(
        """
        import sys
        from megatron_gkd import platform
        chosen = platform.setup()
        assert chosen.name == "npu" and chosen.dist_backend == "hccl", chosen
        assert sys.modules["mindspeed.megatron_adaptor"].ADAPTED
        import megatron.core
        print("ok")
        """,
        env={platform.PLATFORM_ENV: "npu"},
        extra_path=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_npu_without_mindspeed_says_how_to_install(tmp_path):
    (tmp_path / "torch_npu.py").write_text("npu = None\n")
    result = _run_python(
        "from megatron_gkd import platform; platform.setup('npu')",
        extra_path=str(tmp_path),
    )
    assert result.returncode != 0
    assert "MindSpeed from Ascend's source" in result.stderr


def test_npu_without_torch_npu_is_actionable():
    result = _run_python("from megatron_gkd import platform; platform.setup('npu')")
    assert result.returncode != 0
    assert "needs torch_npu" in result.stderr


STANDINS = pathlib.Path(__file__).resolve().parent / "standins"


def test_npu_hands_the_mindspeed_options_to_mindspeed_and_restores_argv():
    result = _run_python(
        """
        import sys
        sys.argv = ["pretrain_gkd.py", "--config", "x.yaml", "rollout.n=8"]
        from megatron_gkd import platform
        from megatron_gkd.platform.npu import MindSpeedConfig
        options = MindSpeedConfig(use_flash_attn=True, use_fused_swiglu=True, context_parallel_algo="hybrid_cp_algo",
                                  ulysses_degree_in_cp=2, extra_args=["--cp-window-size", "2"])
        platform.setup("npu", mindspeed=options)
        args = vars(sys.modules["mindspeed.args_utils"].get_mindspeed_args())
        assert sys.argv == ["pretrain_gkd.py", "--config", "x.yaml", "rollout.n=8"], sys.argv
        assert args["use_flash_attn"] is True and args["use_fused_swiglu"] is True and args["swiglu"] is True, args
        assert args["context_parallel_algo"] == "hybrid_cp_algo" and args["ulysses_degree_in_cp"] == 2, args
        assert args["cp_window_size"] == 2 and args["use_fused_rmsnorm"] is False and "config" not in args, args
        platform.setup(mindspeed=options)  # the same options again: harmless
        try:
            platform.setup(mindspeed=MindSpeedConfig())
        except ValueError as error:
            print("refused:", error)
        """,
        extra_path=str(STANDINS),
    )
    assert result.returncode == 0, result.stderr
    assert "refused: MindSpeed was imported with other options" in result.stdout


def test_mindspeed_imported_before_setup_cannot_take_options():
    result = _run_python(
        """
        import mindspeed.megatron_adaptor
        from megatron_gkd import platform
        from megatron_gkd.platform.npu import MindSpeedConfig
        platform.setup("npu", mindspeed=MindSpeedConfig(use_flash_attn=True))
        """,
        extra_path=str(STANDINS),
    )
    assert result.returncode != 0
    assert "cannot receive the configured ones (--use-flash-attn); let platform.setup() import it" in result.stderr


def test_an_option_mindspeed_rejects_is_an_error_naming_it():
    result = _run_python(
        """
        from megatron_gkd import platform
        from megatron_gkd.platform.npu import MindSpeedConfig
        platform.setup("npu", mindspeed=MindSpeedConfig(extra_args=["--cp-window-size", "two"]))
        """,
        extra_path=str(STANDINS),
    )
    assert result.returncode != 0
    assert "MindSpeed rejected its options ['--cp-window-size', 'two']" in result.stderr


def test_mindspeed_options_off_npu_are_inert_and_say_so(caplog):
    from megatron_gkd.platform.npu import MindSpeedConfig

    platform.setup("cpu", mindspeed=MindSpeedConfig())
    assert "MindSpeed" not in caplog.text  # the defaults are not worth a warning
    platform.setup("cpu", mindspeed=MindSpeedConfig(use_flash_attn=True, optimization_level=1))
    assert ("mindspeed.use_flash_attn=True, mindspeed.optimization_level=1: MindSpeed runs only on the npu platform; "
            "on cpu these options have no effect") in caplog.text


def test_cuda_without_transformer_engine_gets_only_the_adaptors_fallback_fixes():
    """Seen on an H200 without Transformer Engine: Megatron-Core's MoE router raised NameError on
    te_general_gemm. setup("cuda") installs the adaptor's patches for Megatron without Transformer Engine
    and none of its host redirects (tensors must still go to the GPU). Transformer Engine is absent here,
    as on that machine; setup itself needs no GPU."""
    result = _run_python(
        """
        import torch
        cuda_method = torch.Tensor.cuda
        from megatron_gkd import platform
        platform.setup("cuda")
        from megatron.core.transformer.moe import moe_utils
        from megatron.core.transformer import torch_norm
        from megatron_gkd.platform import cpu_adaptor
        assert moe_utils.te_general_gemm is None
        assert moe_utils.torch is torch, "the host's torch view must not be installed on cuda"
        assert torch.Tensor.cuda is cuda_method
        print(sorted(set(cpu_adaptor.applied_patches())))
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "['missing_te_general_gemm', 'sequence_parallel_torch_norm']"
