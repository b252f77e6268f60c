"""Each patch of the CPU adaptor, one test (or more) per patch, through Megatron-Core's own code."""

import importlib
import sys
import textwrap

import pytest
import torch

from megatron_gkd.platform import cpu_adaptor
from megatron_gkd.platform.host_cuda import HOST_CUDA
from megatron_gkd.platform.source_patch import SourceRewrite
from megatron_gkd.platform.torch_view import TORCH_VIEW, to_host_device


def test_every_patch_is_documented():
    names = [patch.name for patch in cpu_adaptor.PATCHES]
    assert len(names) == len(set(names))
    for patch in cpu_adaptor.PATCHES:
        assert patch.upstream and patch.why_safe, patch.name


def test_module_patches_were_applied_on_import():
    for patch in cpu_adaptor.PATCHES:
        if patch.target.startswith("megatron.core.") and not patch.target.endswith("*"):
            importlib.import_module(patch.target)
    applied = cpu_adaptor.applied_patches()
    for patch in cpu_adaptor.PATCHES:
        if not patch.target.endswith("*"):
            assert patch.name in applied, patch.name


# --- torch_view ---------------------------------------------------------------------------------


def test_megatron_modules_see_the_torch_view_and_others_do_not():
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer import utils

    assert layers.torch is TORCH_VIEW and utils.torch is TORCH_VIEW
    assert torch.cuda is not HOST_CUDA, "the real torch must stay untouched"
    assert sys.modules["torch"] is torch


def test_megatron_literal_cuda_tensors_land_on_the_host():
    from megatron.core.transformer.utils import get_default_causal_mask

    mask = get_default_causal_mask(4)
    assert mask.device.type == "cpu"
    assert torch.equal(mask, torch.triu(torch.ones(4, 4), diagonal=1).bool())


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda"), 0])
def test_factories_map_cuda_devices_to_host(device):
    assert TORCH_VIEW.zeros(2, device=device).device.type == "cpu"
    assert to_host_device(device) == torch.device("cpu")


def test_factories_leave_other_devices_and_drop_pinning():
    assert to_host_device("meta") == "meta"
    assert TORCH_VIEW.empty(3, device="meta").device.type == "meta"
    assert TORCH_VIEW.tensor([1, 2], device="cuda", pin_memory=True).tolist() == [1, 2]


def test_real_torch_still_refuses_cuda():
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


def test_host_cuda_namespace():
    assert HOST_CUDA.current_device() == torch.device("cpu")
    stream = HOST_CUDA.Stream()
    stream.synchronize()
    with HOST_CUDA.stream(stream):
        event = HOST_CUDA.Event(enable_timing=True)
        event.record()
    event.synchronize()
    state = HOST_CUDA.get_rng_state()
    first = torch.rand(3)
    HOST_CUDA.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    assert HOST_CUDA.memory_allocated() == 0
    assert HOST_CUDA.FloatTensor is torch.cuda.FloatTensor


# --- tensor_cuda_method -------------------------------------------------------------------------


def test_tensor_cuda_stays_on_host():
    tensor = torch.arange(3)
    assert tensor.cuda() is tensor


# --- host_rng_state -----------------------------------------------------------------------------


def test_rng_tracker_forks_a_reproducible_stream_and_restores_the_outer_one():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    torch.manual_seed(0)
    tracker.add("tp", 123)
    outer = torch.get_rng_state()
    with tracker.fork("tp"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outer), "fork() must restore the surrounding state"
    with tracker.fork("tp"):
        second = torch.rand(3)
    torch.manual_seed(123)
    expected = torch.rand(6)
    assert torch.equal(torch.cat([first, second]), expected), "the forked stream continues across forks"


def test_model_parallel_seed_gives_each_tp_rank_its_own_stream():
    from megatron.core.tensor_parallel import random

    draws = []
    for tp_rank in (0, 1):
        random.model_parallel_cuda_manual_seed(5, tp_rank=tp_rank, ep_rank=0, etp_rank=0, force_reset_rng=True)
        with random.get_cuda_rng_tracker().fork():
            draws.append(torch.rand(4))
    assert not torch.equal(draws[0], draws[1])


# --- missing_te_general_gemm --------------------------------------------------------------------


def test_router_gating_uses_torch_without_transformer_engine():
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None
    inputs = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    out = moe_utils.router_gating_linear(inputs, weight, None, torch.float64)
    torch.testing.assert_close(out, inputs @ weight.T)
    out.sum().backward()
    torch.testing.assert_close(inputs.grad, torch.ones(5, 4, dtype=torch.float64) @ weight.detach())


# --- type-string rewrites -----------------------------------------------------------------------


def test_clip_grads_accepts_host_fp32_gradients():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    for param in params:
        param.grad = torch.full((3,), 2.0)
    clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=4.0)
    for param in params:
        torch.testing.assert_close(param.grad, torch.full((3,), 2.0 / (4.0 + 1e-6)))


def test_clip_grads_scales_each_gradient_in_place():
    """Upstream's host fallback wrote ``grad.copy_(grad * scale)``: a temporary as large as each gradient at the end of
    every clipped step (the word embedding's 0.58 GiB at the 0.6B shape). In place, the same values, no temporary."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    params = [torch.nn.Parameter(torch.ones(5)) for _ in range(2)]
    grads = [torch.linspace(-3.0, 3.0, 5), torch.full((5,), 0.3)]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    storages = [param.grad.data_ptr() for param in params]
    with Ops() as ops:
        clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=7.0)
    assert "mul.Tensor" not in ops.names and "copy_.default" not in ops.names, ops.names
    assert [param.grad.data_ptr() for param in params] == storages
    for param, grad in zip(params, grads):
        assert torch.equal(param.grad, grad * (1.0 / (7.0 + 1e-6)))


def test_optimizer_type_checks_were_rewritten():
    # Behaviour is covered by the bf16 and distributed-optimizer training tests
    # (tests/distributed/parallel/test_megatron_training.py); here: the right functions were replaced.
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    rewritten = [
        clip_grads.clip_grad_by_total_norm_fp32,
        optimizer.Float16OptimizerWithFloat16Params.__init__,
        distrib_optimizer.DistributedOptimizer.__init__,
        distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups.__func__,
    ]
    cuda_types = {"torch.cuda.FloatTensor", "torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor"}
    for function in rewritten:
        assert getattr(function, "__megatron_gkd_rewritten__", False), function.__qualname__
        assert not cuda_types & _string_constants(function.__code__), function.__qualname__


def _string_constants(code) -> set[str]:
    found = set()
    for const in code.co_consts:
        if isinstance(const, str):
            found.add(const)
        elif hasattr(const, "co_consts"):
            found |= _string_constants(const)
        elif isinstance(const, tuple):
            found |= {c for c in const if isinstance(c, str)}
    return found


# --- source rewrites and version pinning --------------------------------------------------------

TOY_MODULE = '''
class Base:
    def __init__(self):
        self.kind = "base"

class Child(Base):
    def __init__(self):
        super().__init__()
        self.device = 'torch.cuda.FloatTensor'

    @classmethod
    def make(cls):
        return 'torch.cuda.FloatTensor'
'''


@pytest.fixture
def toy_module(tmp_path, monkeypatch):
    (tmp_path / "adaptor_toy.py").write_text(textwrap.dedent(TOY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("adaptor_toy")
    yield module
    sys.modules.pop("adaptor_toy", None)


def test_source_rewrite_keeps_zero_argument_super_and_classmethods(toy_module):
    fix = (("'torch.cuda.FloatTensor'", "'torch.FloatTensor'"),)
    SourceRewrite("Child.__init__", fix).apply(toy_module)
    SourceRewrite("Child.make", fix).apply(toy_module)
    child = toy_module.Child()
    assert (child.kind, child.device) == ("base", "torch.FloatTensor")
    assert toy_module.Child.make() == "torch.FloatTensor"


def test_source_rewrite_refuses_text_that_is_not_there(toy_module):
    with pytest.raises(RuntimeError, match="not the one the adaptor was verified against"):
        SourceRewrite("Child.__init__", (("device = 'cuda'", "device = 'cpu'"),)).apply(toy_module)


def test_other_megatron_versions_are_refused(monkeypatch):
    monkeypatch.setattr(cpu_adaptor.importlib.metadata, "version", lambda name: "0.17.0")
    with pytest.raises(RuntimeError, match="verified against megatron-core==0.16.1"):
        cpu_adaptor.check_megatron_version()


# --- sequence_parallel_torch_norm ---------------------------------------------------------------


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_torch_norm_marks_weights_for_the_sequence_parallel_all_reduce(sequence_parallel):
    import types

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = types.SimpleNamespace(
        layernorm_zero_centered_gamma=False,
        persist_layer_norm=False,
        sequence_parallel=sequence_parallel,
        memory_efficient_layer_norm=False,
        normalization="RMSNorm",
    )
    norm = WrappedTorchNorm(config, 8)
    assert isinstance(norm, torch.nn.RMSNorm)
    assert norm.weight.sequence_parallel is sequence_parallel


# --- mla_have_te --------------------------------------------------------------------------------


def test_multi_latent_attention_does_not_take_the_transformer_engine_path():
    from megatron.core.transformer import multi_latent_attention

    assert multi_latent_attention.HAVE_TE is False
