"""The host kernels of the cross-tokenizer loss (megatron_gkd.losses.cross_vocab_kernels). Their values are checked
through the loss, on both paths, by test_cross_vocab.py and test_cross_vocab_heavy.py (the cross_vocab_paths
fixture); here, that the loss takes them where it should."""

import torch

from megatron_gkd.losses import cross_vocab_kernels


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
    """Another numba or LLVM than the cpu extra's may not build the prefetch intrinsic: the loops then compile without
    it, and a warning says what that costs."""
    def broken():
        raise RuntimeError("no llvm.prefetch here")

    monkeypatch.setattr(cross_vocab_kernels, "_prefetch", cross_vocab_kernels._prefetch)
    monkeypatch.setattr(cross_vocab_kernels, "_prefetch_intrinsic", broken)
    cross_vocab_kernels._compiled.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="megatron_gkd.losses.cross_vocab_kernels"):
            kernels = cross_vocab_kernels._compiled()
        assert "no software prefetch (RuntimeError: no llvm.prefetch here)" in caplog.text
        assert cross_vocab_kernels._prefetch is cross_vocab_kernels._no_prefetch
        assert callable(kernels.grad_rows)
    finally:
        cross_vocab_kernels._compiled.cache_clear()
