"""Checks a real checkpoint needs, made by ``--dry-run`` and at the run's start (``config/checkpoints.py``).

The student is a tiny checkpoint of SmolLM2-135M-Instruct's odd shapes (``SMOLLM2_LIKE``: 9 query heads over 3
key/value heads, tied embeddings, 252 rows for a 250-id tokenizer) with SmolLM2's chat template. Before these
checks, TP=2 passed the dry run and the run failed after start-up (issue #45).
"""

import logging
import pathlib

import pytest

from megatron_gkd.config import load_config
from megatron_gkd.config.dry_run import layout_plan
from megatron_gkd.testing.hf_models import SMOLLM2_CHAT_TEMPLATE, SMOLLM2_LIKE, make_tiny_checkpoint, save_chat_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[3]
BASE = ROOT / "configs" / "cpu_tiny.yaml"
TP3 = ["parallel.tensor_model_parallel_size=3", "rollout.tensor_parallel_size=3"]
PP2 = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2", "rollout.layout=disaggregated",
       "weight_sync.transport=distributed", "rollout.tensor_parallel_size=1"]


def _checkpoint(path, template=SMOLLM2_CHAT_TEMPLATE, **overrides) -> pathlib.Path:
    make_tiny_checkpoint("LlamaForCausalLM", path, **{**SMOLLM2_LIKE, **overrides})
    save_chat_tokenizer(path, template)
    return path


@pytest.fixture(scope="module")
def smol(tmp_path_factory) -> pathlib.Path:
    return _checkpoint(tmp_path_factory.mktemp("smol"))


def _config(student, *overrides, teacher=None):
    return load_config(BASE, [f"student.checkpoint={student}", f"teacher.serve.model={teacher or student}", *overrides])


def test_heads_that_do_not_split_over_tp_are_refused_naming_the_sizes_that_do(smol):
    with pytest.raises(ValueError, match=r"the student \(LlamaForCausalLM\) has 9 attention heads and 3 key/value "
                                         r"heads, which do not split across parallel\.tensor_model_parallel_size=2 .*"
                                         r"set parallel\.tensor_model_parallel_size to 1 or 3"):
        layout_plan(_config(smol), 2)
    plan = layout_plan(_config(smol, *TP3), 3).splitlines()
    assert "student LlamaForCausalLM: 9 attention heads / 3 key/value heads -> 3 / 1 a TP rank; 2 layers -> 2 a " \
           "stage" in plan


def test_the_vocabulary_padding_is_stated_and_rows_that_do_not_split_are_refused(smol, tmp_path):
    plan = layout_plan(_config(smol, *TP3), 3).splitlines()
    assert ("vocabulary: 252 rows for 250 tokenizer ids (2 padding rows, ids 250-251: left out of the losses' softmax "
            "and never sampled) -> 84 a TP rank; the run splits the checkpoint's table as stored (no rows added)") in plan
    odd = _checkpoint(tmp_path / "odd", vocab_size=250)
    with pytest.raises(ValueError, match=r"has 250 vocabulary rows, which do not split across parallel\."
                                         r"tensor_model_parallel_size=3 .* set parallel\.tensor_model_parallel_size to "
                                         r"1, or pad .* pad_to_multiple_of=384"):
        layout_plan(_config(odd, *TP3), 3)
    short = _checkpoint(tmp_path / "short", vocab_size=240)
    with pytest.raises(ValueError, match=r"the student's tokenizer \(student\.checkpoint\) has 250 ids but "
                                         r"LlamaForCausalLM's table has 240 rows"):
        layout_plan(_config(short, *TP3), 3)


def test_tied_embeddings_over_two_stages_are_stated_with_their_embedding_groups(smol):
    plan = layout_plan(_config(smol, *PP2), 2)
    assert "tied embeddings over 2 stages: the last stage keeps its own copy of the embedding as its output layer " \
           "([252, 576] a TP rank" in plan
    assert "embedding groups (first-stage rank, last-stage rank): (0, 1)" in plan
    assert "tied embeddings" not in layout_plan(_config(smol, *TP3), 3)  # one stage holds both


def test_layers_that_do_not_split_over_the_chunks_are_refused(smol):
    with pytest.raises(ValueError, match=r"has 2 layers, which do not split into parallel\.pipeline_model_parallel_"
                                         r"size=2 x parallel\.virtual_pipeline_model_parallel_size=2 chunks"):
        layout_plan(_config(smol, *PP2, "parallel.virtual_pipeline_model_parallel_size=2"), 2)


def test_a_colocated_teacher_is_checked_in_the_trainers_layout(smol, tmp_path):
    eight = _checkpoint(tmp_path / "eight", num_attention_heads=8, num_key_value_heads=2, vocab_size=256)
    local = ["teacher.client=local", "teacher.serve.model=null", f"teacher.checkpoint={smol}",
             "parallel.tensor_model_parallel_size=2"]
    with pytest.raises(ValueError, match=r"teacher 'teacher' \(LlamaForCausalLM, teacher\.checkpoint\) has 9 attention "
                                         r"heads and 3 key/value heads, which do not split across parallel\."):
        layout_plan(load_config(BASE, [f"student.checkpoint={eight}", *local]), 2)


# Same vocabulary, SmolLM2's template against a teacher's: (teacher's template, what the run says)
NO_SYSTEM = SMOLLM2_CHAT_TEMPLATE.replace("{% if loop.first and messages[0]['role'] != 'system' %}", "{% if false %}")
THINKING = SMOLLM2_CHAT_TEMPLATE.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")
OTHER_END = SMOLLM2_CHAT_TEMPLATE.replace("+ '<|im_end|>' +", "+ (message['role'] == 'assistant' and '<|endoftext|>' or "
                                                              "'<|im_end|>') +")


def test_a_teacher_that_renders_alike_is_stated(smol):
    assert "chat template: teacher 'teacher' renders the sample conversations as the student does" in \
        layout_plan(_config(smol, *TP3), 3).splitlines()


def test_a_teacher_template_that_differs_only_before_the_turn_is_a_warning_with_both_renderings(smol, tmp_path, caplog):
    teacher = _checkpoint(tmp_path / "teacher", NO_SYSTEM)
    with caplog.at_level(logging.WARNING):
        plan = layout_plan(_config(smol, *TP3, teacher=teacher), 3)
    assert "chat template: teacher 'teacher' renders the sample conversations otherwise (warned)" in plan
    assert "teacher 'teacher' (teacher.serve.model) renders the sample conversation otherwise than the student" in \
        caplog.text
    assert "You are a helpful AI assistant named SmolLM" in caplog.text  # the student's rendering
    assert "'<|im_start|>user\\nWhat is 2 + 3?<|im_end|>\\n<|im_start|>assistant\\n'" in caplog.text  # the teacher's


def test_a_teacher_template_that_refuses_a_system_message_is_compared_on_the_rest(smol, tmp_path, caplog):
    # Gemma's template raises on a system message: not a broken template, and no reason to stop the run.
    refuses = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
               "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    teacher = _checkpoint(tmp_path / "teacher", refuses)
    with caplog.at_level(logging.WARNING):
        plan = layout_plan(_config(smol, *TP3, teacher=teacher), 3)
    assert "chat template: teacher 'teacher' renders the sample conversations otherwise (warned)" in plan


@pytest.mark.parametrize("template, part", [(THINKING, "opens the assistant's turn with"),
                                            (OTHER_END, "ends the assistant's turn with")], ids=["opening", "end"])
def test_a_teacher_of_the_same_tokenizer_that_would_misalign_the_response_is_refused(smol, tmp_path, template, part):
    teacher = _checkpoint(tmp_path / "teacher", template)
    with pytest.raises(ValueError, match=rf"teacher 'teacher' \(teacher\.serve\.model\) shares the student's tokenizer "
                                         rf"but {part} .*set data\.chat_template="):
        layout_plan(_config(smol, *TP3, teacher=teacher), 3)


def test_a_teacher_of_another_tokenizer_gets_a_warning(smol, tmp_path, caplog):
    teacher = tmp_path / "teacher"
    make_tiny_checkpoint("LlamaForCausalLM", teacher, **SMOLLM2_LIKE)
    save_chat_tokenizer(teacher, THINKING, word="v")
    with caplog.at_level(logging.WARNING):
        layout_plan(_config(smol, *TP3, "teacher.cross_tokenizer.method=projected", teacher=teacher), 3)
    assert "teacher 'teacher' (teacher.serve.model) renders the sample conversation otherwise" in caplog.text
    assert "<think>" in caplog.text


def test_checkpoints_that_are_not_on_this_machine_are_named_not_checked(tmp_path):
    # A dry run plans for another machine: the checks it cannot make are named, not failed.
    plan = layout_plan(_config(tmp_path / "absent"), 2).splitlines()
    assert f"student: not checked (no HF config at {tmp_path / 'absent' / 'config.json'})" in plan
