"""Pruning on Megatron shards equals pruning the dense model: scores, kept indices and the written student.

One spawn of two gloo ranks runs three layouts in turn: TP=1 as two data-parallel replicas (each scores half the
sequences), TP=2 (each rank scores its heads and MLP channels) and PP=2 (each stage its layers). In each the
importance of tiny teachers is measured and compared here with float64 ``transformers`` references
(``megatron_gkd.testing.pruning``); a student is pruned (width and depth at TP=2, depth at PP=2), written, loaded back
by the Megatron loader under the same layout, and compared with the teacher cut by hand in ``transformers``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_gkd.prune import REPORT_FILE, Importance, KeptIndices, ModelSizes, PruneTargets, select_kept
from megatron_gkd.testing.distributed import run_distributed
from megatron_gkd.testing.hf_models import hf_logits, make_tiny_checkpoint, read_safetensors_dir
from megatron_gkd.testing.pruning import hf_importance, hf_skipped_losses, make_gqa_checkpoint, prune_by_hand

pytestmark = pytest.mark.distributed

# layout name -> (layout, [(teacher, depth metric)], [(teacher, targets)] pruned and written)
LAYOUTS = {
    "dp2": ({}, [("llama", "loss"), ("gqa", "cosine")], []),
    "tp2": ({"tensor_model_parallel_size": 2}, [("llama", "cosine"), ("qwen2", "cosine")],
            [("qwen2", PruneTargets(num_layers=3, hidden_size=96, ffn_hidden_size=0.5, num_attention_heads=2))]),
    "pp2": ({"pipeline_model_parallel_size": 2}, [("gqa", "loss")],
            [("gqa", PruneTargets(num_layers=2, num_attention_heads=6, hidden_size=108))]),
}
TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(11))


def _run_layouts(teachers: dict, out_root: str) -> list:
    """Rank body: ``(layout, teacher, metric, importance fields)`` and ``(layout, teacher, out, kept, logits)``."""
    from megatron_gkd import parallel
    from megatron_gkd.models import load_hf, read_hf_config
    from megatron_gkd.parallel import forward_logits
    from megatron_gkd.prune import measure_importance, prune_checkpoint

    scores, pruned = [], []
    for name, (layout, measured, written) in LAYOUTS.items():
        state = parallel.initialize(**layout)
        for teacher, metric in measured:
            chunks = load_hf(teachers[teacher], state=state, use_transformer_engine=False)
            sizes = ModelSizes.of(read_hf_config(teachers[teacher]))
            importance = measure_importance(chunks, TOKENS, state=state, sizes=sizes, depth_metric=metric,
                                            micro_batch_size=1 if name == "pp2" else 2)
            scores.append((name, teacher, metric, importance))
        for teacher, targets in written:
            out = os.path.join(out_root, f"{name}-{teacher}")
            result = prune_checkpoint(teachers[teacher], out, targets, TOKENS, state=state, depth_metric="cosine")
            logits = forward_logits(load_hf(out, state=state), TOKENS[:2])
            pruned.append((name, teacher, out, result.kept, logits))
        parallel.destroy()
    return [scores, pruned]


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    paths = {
        "llama": make_tiny_checkpoint("LlamaForCausalLM", root / "llama", seed=1),  # untied, 4 heads / 2 groups
        "qwen2": make_tiny_checkpoint("Qwen2ForCausalLM", root / "qwen2", seed=2),  # tied, q/k/v biases
        "gqa": make_gqa_checkpoint(root / "gqa", seed=3),  # SmolLM2's 9 heads / 3 groups, tied
    }
    for path in paths.values():  # tokenizer files the students must carry over
        (root / path / "tokenizer_config.json").write_text('{"model_max_length": 256}')
        (root / path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    return paths


@pytest.fixture(scope="module")
def ranks(teachers, tmp_path_factory):
    return run_distributed(_run_layouts, 2, args=(teachers, str(tmp_path_factory.mktemp("students"))), timeout=600)


@pytest.fixture(scope="module")
def references(teachers):
    return {name: hf_importance(path, TOKENS) for name, path in teachers.items()}


def _measured(ranks):
    """Every rank's measurements: each rank holds the whole model's scores after the reduction."""
    return [entry for scores, _ in ranks for entry in scores]


def test_scores_match_float64_transformers_in_every_layout(ranks, references):
    seen = set()
    for layout, teacher, metric, importance in _measured(ranks):
        reference = references[teacher]
        for field in ("heads", "ffn", "hidden", "final_hidden"):
            torch.testing.assert_close(getattr(importance, field), reference[field], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{layout} {teacher} {field}: {m}")
        assert importance.loss == pytest.approx(reference["loss"], rel=1e-6)
        if metric == "cosine":
            torch.testing.assert_close(importance.layers, 1.0 - reference["cosine"], rtol=1e-5, atol=1e-6)
        seen.add((layout, teacher))
    assert seen == {(layout, teacher) for layout, (_, measured, _) in LAYOUTS.items() for teacher, _ in measured}


def test_skipped_layer_losses_match_float64_transformers(ranks, teachers, references):
    checked = set()
    for layout, teacher, metric, importance in _measured(ranks):
        if metric == "loss":
            expected = hf_skipped_losses(teachers[teacher], TOKENS) - references[teacher]["loss"]
            torch.testing.assert_close(importance.layers, expected, rtol=1e-4, atol=1e-6)
            checked.add(layout)
    assert checked == {"dp2", "pp2"}


def test_the_students_equal_the_teachers_cut_by_hand(ranks, teachers, references):
    (_, pruned), (_, other_rank) = ranks
    last_stage_logits = {name: logits for name, _, _, _, logits in pruned + other_rank if logits is not None}
    assert len(pruned) == 2
    for layout, teacher, out, kept, _ in pruned:
        # The run keeps what the float64 reference scores select.
        hf_config = json.loads(open(os.path.join(teachers[teacher], "config.json")).read())
        sizes = ModelSizes.of(hf_config)
        targets = LAYOUTS[layout][2][0][1]
        reference = references[teacher]
        reference_importance = Importance(layers=1.0 - reference["cosine"], heads=reference["heads"], ffn=reference["ffn"],
                                          hidden=reference["hidden"], final_hidden=reference["final_hidden"],
                                          loss=reference["loss"], depth_metric="cosine")
        assert kept == select_kept(reference_importance, sizes, targets.resolve(sizes))
        expected = prune_by_hand(teachers[teacher], kept)(input_ids=TOKENS[:2]).logits.detach()
        torch.testing.assert_close(hf_logits(out, TOKENS[:2]), expected, rtol=0, atol=1e-5)
        # The Megatron loader reads the student back under the layout that wrote it.
        torch.testing.assert_close(last_stage_logits[layout], expected, rtol=1e-4, atol=1e-4)
        report = json.loads(open(os.path.join(out, REPORT_FILE)).read())
        assert KeptIndices.from_dict(report["kept"]) == kept and report["student_parameters"] < report["teacher_parameters"]


def test_tied_students_stay_tied_and_keep_the_tokenizer_files(ranks, teachers):
    (_, pruned), _ = ranks
    for _, teacher, out, _, _ in pruned:
        assert "lm_head.weight" not in read_safetensors_dir(out)
        assert json.loads(open(os.path.join(out, "config.json")).read())["tie_word_embeddings"] is True
        assert not os.path.exists(out + ".partial")
        for name in ("tokenizer_config.json", "chat_template.jinja"):
            assert open(os.path.join(out, name)).read() == open(os.path.join(teachers[teacher], name)).read()
