"""vLLM's reload warnings: the ones that say nothing are dropped, every other one fails the reload, in words.

The real reloads (a vLLM engine, one tensor of many reloaded; tied heads) are in tests/e2e/rollout/test_rollout_vllm.py
and tests/e2e/weight_sync/test_tied_engines.py.
"""

import importlib.util
import logging
import pathlib

import pytest

from megatron_gkd.weight_sync.reload_logs import (
    DERIVED_PARAMETERS,
    FAILED_TO_LOAD,
    INPLACE_LOGGER,
    LAYERWISE_LOGGER,
    NOT_LOADED,
    ReloadAudit,
)


def _record(message: str, *args, logger: str = LAYERWISE_LOGGER) -> logging.LogRecord:
    return logging.getLogger(logger).makeRecord(logger, logging.WARNING, "layerwise.py", 266, message, args, None)


def test_harmless_layers_are_dropped_and_the_rest_are_kept_as_problems():
    audit = ReloadAudit({"RotaryEmbedding", "ParallelLMHead"})
    assert not audit.filter(_record(FAILED_TO_LOAD, "RotaryEmbedding"))
    assert not audit.filter(_record(FAILED_TO_LOAD, "ParallelLMHead"))
    assert audit.problems() is None
    # Layers that should have received weights and did not: dropped from the log, kept for the error.
    assert not audit.filter(_record(FAILED_TO_LOAD, "QKVParallelLinear"))
    assert not audit.filter(_record(FAILED_TO_LOAD, "QKVParallelLinear"))
    assert not audit.filter(_record(FAILED_TO_LOAD, "VocabParallelEmbedding"))
    names = {f"model.layers.{i}.mlp.down_proj.weight" for i in range(7)}
    names |= {"model.layers.0.self_attn.mla_attn.mla_attn.W_UK_T", "model.layers.0.self_attn.mla_attn.mla_attn.W_UV"}
    assert not audit.filter(_record(NOT_LOADED, names, logger=INPLACE_LOGGER))
    problems = audit.problems()
    assert "QKVParallelLinear x2" in problems and "VocabParallelEmbedding x1" in problems
    assert "model.layers.0.mlp.down_proj.weight" in problems and "and 2 more" in problems  # MLA's derived two: not
    assert "W_UK_T" not in problems
    # Any other message of those loggers, even naming a harmless class, is shown.
    assert audit.filter(_record("%s: Excessive loading", "RotaryEmbedding"))
    audit.reset({"RotaryEmbedding"})
    assert audit.problems() is None


def test_a_problem_never_reaches_the_handlers_of_the_vllm_logger_but_other_warnings_do():
    logger = logging.getLogger(LAYERWISE_LOGGER)
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler, audit = Collect(), ReloadAudit({"RotaryEmbedding"})
    installed = [f for f in logger.filters if isinstance(f, ReloadAudit)]  # a real reload earlier in this process
    for existing in installed:
        logger.removeFilter(existing)
    logger.addHandler(handler)
    logger.addFilter(audit)
    try:
        logger.warning(FAILED_TO_LOAD, "RotaryEmbedding")
        logger.warning(FAILED_TO_LOAD, "RowParallelLinear")
        logger.warning("Allocating %.1f MB of device memory", 3.0)
    finally:
        logger.removeFilter(audit)
        logger.removeHandler(handler)
        for existing in installed:
            logger.addFilter(existing)
    assert seen == ["Allocating 3.0 MB of device memory"]
    assert audit.problems() == "layers that got no weights: RowParallelLinear x1"


def test_vllm_still_logs_the_message_the_filter_matches():
    """A vLLM upgrade that rewords the warning would make the filter inert: fail here instead."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    source = pathlib.Path(spec.origin).parent / "model_executor" / "model_loader" / "reload" / "layerwise.py"
    assert f'logger.warning("{FAILED_TO_LOAD}", layer.__class__.__name__)' in source.read_text()
    mla = source.parents[2] / "layers" / "attention" / "mla_attention.py"
    for name in DERIVED_PARAMETERS:  # still made from kv_b_proj in the layer's processing
        assert f'replace_parameter(self, "{name}",' in mla.read_text()
    inplace = source.parent / "inplace.py"
    assert " ".join(f'"{NOT_LOADED}",'.split()) in " ".join(inplace.read_text().split())


def test_only_the_tokenizerless_chat_template_warmup_failure_is_dropped():
    from megatron_gkd.rollout.vllm_engine import TokenizerlessWarmupWarning

    def record(error: BaseException) -> logging.LogRecord:
        return logging.getLogger("vllm.renderers.base").makeRecord(
            "vllm.renderers.base", logging.WARNING, "base.py", 380, "Chat template warmup failed", (),
            (type(error), error, None))

    warmup = TokenizerlessWarmupWarning()
    assert not warmup.filter(record(ValueError("Tokenizer not available when `skip_tokenizer_init=True`")))
    assert warmup.filter(record(ValueError("template error at line 3")))
    assert warmup.filter(record(RuntimeError("skip_tokenizer_init")))


def test_expected_startup_warnings_match_vllm_and_nothing_else():
    """Each silenced start-up warning is still vLLM's wording, in the module whose logger the filter sits on."""
    from megatron_gkd.rollout.vllm_engine import EXPECTED_STARTUP_WARNINGS, ExpectedWarnings

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    root = pathlib.Path(spec.origin).parent
    for name, prefixes in EXPECTED_STARTUP_WARNINGS.items():
        source = " ".join((root / (name.removeprefix("vllm.").replace(".", "/") + ".py")).read_text().split())
        for prefix in prefixes:
            # vLLM splits long messages over adjacent string literals: compare with the quotes joined.
            assert prefix in source.replace('" "', ""), (name, prefix)
        expected = ExpectedWarnings(prefixes)
        record = logging.getLogger(name).makeRecord(name, logging.WARNING, "x.py", 1, prefixes[0] + " more", (), None)
        assert not expected.filter(record)
        other = logging.getLogger(name).makeRecord(name, logging.WARNING, "x.py", 1, "Failed to allocate the KV cache",
                                                   (), None)
        assert expected.filter(other)
