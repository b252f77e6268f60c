"""The host kernels of the cross-tokenizer loss (megatron_gkd.losses.cross_vocab.kernels). Their values are checked
through the loss, on both paths, by test_cross_vocab.py and test_cross_vocab_heavy.py (the cross_vocab_paths
fixture); here, that the loss takes them where it should."""

import numpy
import torch

from megatron_gkd.losses.cross_vocab import kernels as cross_vocab_kernels


def test_the_host_kernels_serve_cpu_fp32_and_fp64_logits(monkeypatch):
    """The cpu extra brings numba, so on the host the kernels are the path the loss takes; this fails where they
    would silently never run."""
    monkeypatch.setattr(cross_vocab_kernels, "ENABLED", True)
    assert cross_vocab_kernels.available(torch.device("cpu"), torch.float32)
    assert cross_vocab_kernels.available(torch.device("cpu"), torch.float64)
    assert not cross_vocab_kernels.available(torch.device("cpu"), torch.bfloat16)
    assert not cross_vocab_kernels.available(torch.device("meta"), torch.float32)
    monkeypatch.setattr(cross_vocab_kernels, "ENABLED", False)
    assert not cross_vocab_kernels.available(torch.device("cpu"), torch.float32)


def test_without_the_prefetch_hint_the_kernels_still_compile(monkeypatch, caplog):
    """Another numba or LLVM than the cpu extra's may not build the prefetch intrinsic: the backward's loop then
    compiles without it (compiled afresh here, not read from numba's cache) and gives the same gradient, and a
    warning says what that costs."""
    import numba

    def broken():
        raise RuntimeError("no llvm.prefetch here")

    def gradient(grad_rows) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        z = torch.randn(3, 40, generator=generator)
        indptr = torch.tensor([0, 20, 20, 40])  # three teacher ids: 20 entries, none, 20 (past the prefetch distance)
        student = torch.cat([torch.arange(0, 40, 2), torch.arange(1, 40, 2)])
        weight = torch.rand(40, generator=generator)
        ids = torch.tensor([[0, 2], [1, 0], [2, 2]])
        coef = torch.tensor([[0.5, -1.0], [3.0, 0.25], [0.0, 2.0]])
        out = torch.zeros(3, 40)
        grad_rows(z.numpy(), ids.numpy(), coef.numpy(), torch.zeros(3, 2).numpy(), indptr.numpy(), student.numpy(),
                  weight.numpy(), numpy.float32(1.0), out.numpy())
        return out

    expected = gradient(cross_vocab_kernels._compiled().grad_rows)
    monkeypatch.setattr(cross_vocab_kernels, "_prefetch", cross_vocab_kernels._prefetch)
    monkeypatch.setattr(cross_vocab_kernels, "_prefetch_intrinsic", broken)
    cross_vocab_kernels._compiled.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="megatron_gkd.losses.cross_vocab.kernels"):
            cross_vocab_kernels._compiled()
        assert "no software prefetch (RuntimeError: no llvm.prefetch here)" in caplog.text
        assert cross_vocab_kernels._prefetch.py_func is cross_vocab_kernels._no_prefetch
        plain = numba.njit(cross_vocab_kernels._grad_rows)
        assert torch.allclose(gradient(plain), expected, rtol=1e-6, atol=0)
        assert expected.abs().sum() > 0
    finally:
        cross_vocab_kernels._compiled.cache_clear()
