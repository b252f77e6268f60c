"""vLLM's reload warnings: the two that say nothing are dropped, every other one still shows.

The real reload (a vLLM engine, one tensor of many reloaded) is in tests/e2e/rollout/test_rollout_vllm.py.
"""

import importlib.util
import logging
import pathlib

import pytest

from megatron_gkd.weight_sync.reload_logs import FAILED_TO_LOAD, LAYERWISE_LOGGER, HarmlessReloadWarnings


def _record(message: str, *args) -> logging.LogRecord:
    return logging.getLogger(LAYERWISE_LOGGER).makeRecord(LAYERWISE_LOGGER, logging.WARNING, "layerwise.py", 266,
                                                          message, args, None)


def test_only_the_named_harmless_layers_are_dropped():
    harmless = HarmlessReloadWarnings({"RotaryEmbedding", "ParallelLMHead"})
    assert not harmless.filter(_record(FAILED_TO_LOAD, "RotaryEmbedding"))
    assert not harmless.filter(_record(FAILED_TO_LOAD, "ParallelLMHead"))
    # A layer that should have received weights and did not: a real failure, shown.
    assert harmless.filter(_record(FAILED_TO_LOAD, "QKVParallelLinear"))
    assert harmless.filter(_record(FAILED_TO_LOAD, "VocabParallelEmbedding"))
    # Any other message of that logger, even naming a harmless class, is shown.
    assert harmless.filter(_record("%s: Excessive loading", "RotaryEmbedding"))


def test_a_real_failure_reaches_the_handlers_of_the_vllm_logger():
    logger = logging.getLogger(LAYERWISE_LOGGER)
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler, harmless = Collect(), HarmlessReloadWarnings({"RotaryEmbedding"})
    logger.addHandler(handler)
    logger.addFilter(harmless)
    try:
        logger.warning(FAILED_TO_LOAD, "RotaryEmbedding")
        logger.warning(FAILED_TO_LOAD, "RowParallelLinear")
    finally:
        logger.removeFilter(harmless)
        logger.removeHandler(handler)
    assert seen == ["RowParallelLinear: Failed to load weights"]


def test_vllm_still_logs_the_message_the_filter_matches():
    """A vLLM upgrade that rewords the warning would make the filter inert: fail here instead."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    source = pathlib.Path(spec.origin).parent / "model_executor" / "model_loader" / "reload" / "layerwise.py"
    assert f'logger.warning("{FAILED_TO_LOAD}", layer.__class__.__name__)' in source.read_text()


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
