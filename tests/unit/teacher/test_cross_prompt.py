"""The prompt a teacher of another tokenizer reads (megatron_gkd/teacher/clients/cross_prompt.py, issue #45 item 8): the
conversation through the teacher's own chat template, special ids included; the student's rendering with its special
tokens kept where only ids exist; and a teacher that is the same function of text as the student's (a permuted
vocabulary) scores a chat prompt exactly as the same-tokenizer teacher does."""

import json

import numpy as np
import pytest

from megatron_gkd.data import DataConfig, load_prompts
from megatron_gkd.recipes.tiny import CHAT_TEMPLATE, build_checkpoint, build_cross_teachers, build_tokenizer
from megatron_gkd.teacher.clients.cross_prompt import prompt_rule
from megatron_gkd.teacher.clients.cross_request import CrossTokenizer
from megatron_gkd.teacher.protocol.types import ScoreBatch, SequenceRequest
from megatron_gkd.xtok.align import Kind
from megatron_gkd.xtok.config import CrossTokenizerConfig

VOCAB = 64
# Another family's markup: its own special tokens, ending in one, and it refuses a system turn (as Gemma's does).
FOREIGN_SPECIALS = ["<unk>", "<|begin|>", "<|eot|>", "[INST]", "[/INST]"]
FOREIGN_TEMPLATE = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turn') }}{% endif %}"
                    "<|begin|>{% for message in messages %}[INST] {{ message['content'] }} [/INST] {% endfor %}")
CONVERSATIONS = [[{"role": "user", "content": "w3 w4"}],
                 [{"role": "user", "content": "w7"}, {"role": "assistant", "content": "w8 w9"},
                  {"role": "user", "content": "w10 w11 w12"}]]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The tiny student's tokenizer with a chat template that ends in a special token, a one-layer teacher on it, its
    permuted-vocabulary copy (the same template), a teacher of another family, and the conversations as a dataset."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("cross_prompt")
    for name in ("student", "teacher"):
        build_checkpoint(root / "assets" / name, vocab_size=VOCAB, hidden_size=64, num_layers=1, num_heads=1, num_kv_heads=1,
                         intermediate_size=64, seed=7)
        build_tokenizer(root / "assets" / name, VOCAB, chat_template=CHAT_TEMPLATE)
    cross = build_cross_teachers(root / "assets", root / "cross")
    words = [f"w{i}" for i in range(VOCAB - 3)][::-1]  # the same words, numbered the other way round
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(FOREIGN_SPECIALS + words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    foreign = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<|begin|>",
                                      eos_token="<|eot|>", pad_token="<unk>")
    foreign.add_special_tokens({"additional_special_tokens": ["[INST]", "[/INST]"]})
    foreign.chat_template = FOREIGN_TEMPLATE
    foreign.save_pretrained(root / "foreign")
    path = root / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m, "response": "w20 w21"}) + "\n" for m in CONVERSATIONS))
    student = AutoTokenizer.from_pretrained(root / "assets" / "student")
    dataset = load_prompts(str(path), DataConfig(train_path=str(path)), student, keep_conversations=True)
    return dict(root=root, student=student, permuted=AutoTokenizer.from_pretrained(cross / "permuted"),
                foreign=AutoTokenizer.from_pretrained(root / "foreign"), dataset=dataset,
                teacher_dir=root / "assets" / "teacher", permuted_dir=cross / "permuted")


def _cross(assets, teacher: str, **config) -> CrossTokenizer:
    cross = CrossTokenizer(CrossTokenizerConfig(method="projected", **config), assets["student"], assets[teacher],
                           student_vocab_size=VOCAB)
    cross.prompts.learn(assets["dataset"])
    return cross


def _translate(cross, record):
    tokens = np.asarray(record.prompt_ids + record.response_ids)
    return cross.translate(tokens, len(record.prompt_ids))


@pytest.mark.parametrize("teacher", ["permuted", "foreign"])
def test_the_teacher_reads_the_conversation_through_its_own_chat_template(assets, teacher):
    tokenizer, cross = assets[teacher], _cross(assets, teacher)
    for record in assets["dataset"]:
        translated = _translate(cross, record)
        sequence = translated.sequence
        prompt = sequence.token_ids[:sequence.response_start].tolist()
        own = tokenizer.apply_chat_template(record.conversation, add_generation_prompt=True, tokenize=True)
        assert prompt == own["input_ids"]
        # The template's special tokens are the teacher's own special ids, the last one too (before issue #45 the
        # prompt was decoded without them: "w3 w4" alone).
        specials = [i for i in prompt if i in tokenizer.all_special_ids]
        assert prompt[-1] in tokenizer.all_special_ids and len(specials) >= 3
        # Only the response is aligned, whatever the prompts look like.
        response = sequence.token_ids[sequence.response_start:].tolist()
        assert tokenizer.convert_ids_to_tokens(response[:-1]) == ["w20", "w21"]
        assert translated.alignment.kind.tolist() == [Kind.ONE_TO_ONE] * 2 + [Kind.SPECIAL]
    assert cross.prompts.num_missed == 0
    assert cross.prompts.description == prompt_rule(CrossTokenizerConfig(method="projected"), tokenizer)
    assert cross.prompts.description.startswith("template:")


def test_the_text_rule_keeps_the_closing_special_token_as_the_teachers_own_id(assets):
    """prompt=text, and any prompt of no loaded record: the student's rendering (``<s> w3 w4 </s> <s>``: its template
    ends in a special token) with its special tokens kept, each the teacher's id of the same string."""
    student, permuted = assets["student"], assets["permuted"]
    record = assets["dataset"][0]
    for cross in (_cross(assets, "permuted", prompt="text"), _cross(assets, "permuted")):
        unknown = np.asarray(student.apply_chat_template([{"role": "user", "content": "w30"}], tokenize=True,
                                                         add_generation_prompt=True)["input_ids"])
        for prompt in (np.asarray(record.prompt_ids), unknown):
            ids = cross.prompts(prompt)
            assert permuted.convert_ids_to_tokens(ids.tolist()) == student.convert_ids_to_tokens(prompt.tolist())
            assert ids[-1] == permuted.convert_tokens_to_ids("<s>")
    assert cross.prompts.num_missed == 1  # the template rule counts the prompt it had not learnt
    assert prompt_rule(CrossTokenizerConfig(method="projected", prompt="text"), permuted) == "text"


def test_a_conversation_the_teachers_template_refuses_names_the_fix(assets, tmp_path):
    path = tmp_path / "system.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "system", "content": "w1"},
                                             {"role": "user", "content": "w2"}]}) + "\n")
    dataset = load_prompts(str(path), DataConfig(train_path=str(path)), assets["student"], keep_conversations=True)
    cross = CrossTokenizer(CrossTokenizerConfig(method="projected"), assets["student"], assets["foreign"],
                           student_vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"cannot render 1 of 1 .*no system turn.*cross_tokenizer\.prompt=text"):
        cross.prompts.learn(dataset)
    text = CrossTokenizer(CrossTokenizerConfig(method="projected", prompt="text"), assets["student"],
                          assets["foreign"], student_vocab_size=VOCAB)
    text.prompts.learn(dataset)  # the text rule renders nothing: it reads the ids


def test_a_permuted_vocabulary_teacher_scores_a_chat_prompt_as_the_same_tokenizer_teacher(assets):
    """The same function of text behind permuted ids: every row equals the same-tokenizer teacher's, ids mapped
    through the permutation, on prompts whose chat template ends in a special token."""
    from megatron_gkd.teacher.backends.hf import HFBackend

    student, permuted = assets["student"], assets["permuted"]
    same, other = HFBackend(str(assets["teacher_dir"])), HFBackend(str(assets["permuted_dir"]))
    to_student = np.asarray(student.convert_tokens_to_ids(permuted.convert_ids_to_tokens(list(range(len(permuted))))))
    cross = _cross(assets, "permuted")
    for record in assets["dataset"]:
        tokens = np.asarray(record.prompt_ids + record.response_ids)
        asked = SequenceRequest(token_ids=tokens, response_start=len(record.prompt_ids))
        reference, = same.score(ScoreBatch(sequences=[asked], top_k=8))
        translated = _translate(cross, record)
        output, = other.score(ScoreBatch(sequences=[translated.sequence], top_k=8))
        moved = cross.student_output(output, translated)
        np.testing.assert_array_equal(to_student[moved.topk_ids], reference.topk_ids)
        # The logits are the same numbers in another order; only the log-partition's float32 sum runs in that order
        # too (one ulp). The prompt as it was sent before issue #45 (special tokens dropped) is far outside that.
        np.testing.assert_allclose(moved.topk_logprobs, reference.topk_logprobs, rtol=0, atol=1e-6)
        np.testing.assert_allclose(moved.token_logprobs, reference.token_logprobs, rtol=0, atol=1e-6)
        text = student.decode(list(record.prompt_ids), skip_special_tokens=True)
        dropped = np.asarray(permuted(text)["input_ids"] + translated.sequence.response_ids.tolist())
        old, = other.score(ScoreBatch(sequences=[SequenceRequest(token_ids=dropped, response_start=len(dropped) - 3)],
                                      top_k=8))
        assert np.abs(old.token_logprobs - reference.token_logprobs).max() > 1e-2
