"""The teacher's output layer on the student's TP ranks: the right rows, zeros elsewhere, nothing else read."""

from __future__ import annotations

import json

import pytest
import safetensors
import torch
from safetensors.torch import save_file

from megatron_gkd.models.teacher_head import load_teacher_head, output_layer_name, teacher_head_shape

HIDDEN = 8


def _config(vocab_size: int, tied: bool) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size, "hidden_size": HIDDEN,
            "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1, "intermediate_size": 16,
            "tie_word_embeddings": tied}


def _write(path, vocab_size: int, *, tied: bool = False, sharded: bool = False, seed: int = 0) -> torch.Tensor:
    """A teacher checkpoint at ``path``; returns its output layer (float32, distinct rows)."""
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    embed = torch.randn(vocab_size, HIDDEN, generator=generator)
    head = embed if tied else torch.randn(vocab_size, HIDDEN, generator=generator)
    norm = torch.ones(HIDDEN)
    files = {"a.safetensors": {"model.embed_tokens.weight": embed}, "b.safetensors": {"model.norm.weight": norm}}
    if not tied:
        files["b.safetensors"]["lm_head.weight"] = head
    if not sharded:
        files = {"model.safetensors": {name: t for tensors in files.values() for name, t in tensors.items()}}
    for file, tensors in files.items():
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / file))
    if sharded:
        weight_map = {name: file for file, tensors in files.items() for name in tensors}
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(_config(vocab_size, tied)))
    return head


def _expected(table: torch.Tensor, student_vocab: int, real_vocab: int) -> torch.Tensor:
    """The student-sized table the shards concatenate to: teacher rows below the real vocabulary, else 0."""
    full = torch.zeros(student_vocab, HIDDEN)
    rows = min(real_vocab, table.shape[0], student_vocab)
    full[:rows] = table[:rows]
    return full


def _shards(path, student_vocab, real_vocab, tp, dtype=torch.float32):
    return [load_teacher_head(path, student_vocab_size=student_vocab, tp_rank=rank, tp_size=tp,
                              real_vocab_size=real_vocab, dtype=dtype) for rank in range(tp)]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(
    "teacher_vocab, student_vocab, real_vocab",
    [(24, 24, 24), (24, 24, 18), (20, 24, 18), (28, 24, 18), (28, 24, 24), (20, 24, 20)],
    ids=["equal", "equal-padded", "shorter-teacher", "longer-teacher", "longer-teacher-full", "teacher-ends-at-real"],
)
def test_shards_are_the_rows_of_the_student_split(tmp_path, tp, teacher_vocab, student_vocab, real_vocab):
    table = _write(tmp_path, teacher_vocab)
    shards = _shards(tmp_path, student_vocab, real_vocab, tp)
    expected = _expected(table, student_vocab, real_vocab)
    rows = student_vocab // tp
    for rank, shard in enumerate(shards):
        assert shard.shape == (rows, HIDDEN) and not shard.requires_grad
        assert torch.equal(shard, expected[rank * rows:(rank + 1) * rows])
    # Rows past the real vocabulary or the teacher's table are zeros, the others are the teacher's own.
    full = torch.cat(shards)
    assert torch.equal(full[real_vocab:], torch.zeros(student_vocab - real_vocab, HIDDEN))
    assert torch.equal(full[:real_vocab], table[:real_vocab])


def test_tied_embeddings_read_the_embedding(tmp_path):
    table = _write(tmp_path, 24, tied=True)
    assert output_layer_name(_config(24, True)) == "model.embed_tokens.weight"
    assert output_layer_name(_config(24, False)) == "lm_head.weight"
    assert torch.equal(torch.cat(_shards(tmp_path, 24, 24, 2)), table)


def test_sharded_checkpoint_with_an_index(tmp_path):
    table = _write(tmp_path, 28, sharded=True)
    assert (tmp_path / "model.safetensors.index.json").exists() and not (tmp_path / "model.safetensors").exists()
    assert torch.equal(torch.cat(_shards(tmp_path, 24, 22, 2)), _expected(table, 24, 22))


def test_dtype_and_device(tmp_path):
    table = _write(tmp_path, 24)
    [shard] = _shards(tmp_path, 24, 24, 1, dtype=torch.bfloat16)
    assert shard.dtype == torch.bfloat16 and shard.device.type == "cpu"
    assert torch.equal(shard, table.to(torch.bfloat16))


class _RecordingOpen:
    """``safetensors.safe_open`` that records every tensor access: which tensor, which index."""

    def __init__(self, log: list, real):
        self._log, self._real = log, real

    def __call__(self, filename, framework, device="cpu"):
        handle = self._real(filename, framework=framework, device=device)
        log = self._log

        class Handle:
            def keys(self):
                return handle.keys()

            def get_tensor(self, name):
                log.append((name, "whole tensor"))
                return handle.get_tensor(name)

            def get_slice(self, name):
                piece = handle.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return piece.get_shape()

                    def get_dtype(self):
                        return piece.get_dtype()

                    def __getitem__(self, index):
                        log.append((name, index))
                        return piece[index]

                return Slice()

        return Handle()


@pytest.mark.parametrize("sharded", [False, True])
def test_only_the_shard_rows_are_read(tmp_path, monkeypatch, sharded):
    table = _write(tmp_path, 28, sharded=sharded)
    reads: list = []
    monkeypatch.setattr(safetensors, "safe_open", _RecordingOpen(reads, safetensors.safe_open))
    shard = load_teacher_head(tmp_path, student_vocab_size=24, tp_rank=1, tp_size=2, real_vocab_size=20,
                              dtype=torch.float32)
    # Rank 1 holds student rows 12-23; 20-23 are padding, so rows 12-19 are the only bytes read.
    assert reads == [("lm_head.weight", (slice(12, 20), slice(None)))]
    assert torch.equal(shard[:8], table[12:20]) and not shard[8:].any()


def test_a_rank_of_padding_only_reads_nothing(tmp_path, monkeypatch):
    _write(tmp_path, 24)
    reads: list = []
    monkeypatch.setattr(safetensors, "safe_open", _RecordingOpen(reads, safetensors.safe_open))
    shard = load_teacher_head(tmp_path, student_vocab_size=24, tp_rank=1, tp_size=2, real_vocab_size=10,
                              dtype=torch.float32)
    assert reads == [] and shard.shape == (12, HIDDEN) and not shard.any()


def test_a_teacher_table_smaller_than_the_tokenizer_is_refused(tmp_path):
    _write(tmp_path, 20)
    with pytest.raises(ValueError, match="has 20 rows, fewer than the 22 entries of the tokenizer"):
        _shards(tmp_path, 24, 22, 2)


def test_inconsistent_inputs_are_refused(tmp_path):
    _write(tmp_path, 24)
    with pytest.raises(ValueError, match="does not split over tensor_model_parallel_size=5"):
        _shards(tmp_path, 24, 24, 5)
    with pytest.raises(ValueError, match="real_vocab_size=25"):
        _shards(tmp_path, 24, 25, 2)
    with pytest.raises(ValueError, match="tp_rank=2"):
        load_teacher_head(tmp_path, student_vocab_size=24, tp_rank=2, tp_size=2, real_vocab_size=24,
                          dtype=torch.float32)
    (tmp_path / "config.json").write_text(json.dumps(_config(28, False)))
    with pytest.raises(ValueError, match="declares a 28 x 8 output layer but lm_head.weight is 24 x 8"):
        _shards(tmp_path, 24, 24, 2)


def test_shape_comes_from_the_config_alone(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_config(129280, False) | {"hidden_size": 7168}))
    vocab_size, hidden_size, tied = teacher_head_shape(tmp_path)
    assert (vocab_size, hidden_size, tied) == (129280, 7168, False)
    assert teacher_head_shape(tmp_path / "config.json").tied is False
    with pytest.raises(FileNotFoundError):
        teacher_head_shape(tmp_path / "missing")
