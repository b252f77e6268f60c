"""``hf`` backend: a transformers causal LM scored in this process (tests and small teachers)."""

from __future__ import annotations

import logging

import numpy as np
import torch

from megatron_gkd.teacher.backends import BackendInfo, TeacherBackend
from megatron_gkd.teacher.types import ErrorCode, ScoreBatch, TeacherError, TeacherOutput
from megatron_gkd.teacher.vocab import tokenizer_digest

logger = logging.getLogger(__name__)


class HFBackend(TeacherBackend):
    """Scores with ``AutoModelForCausalLM`` on the host; supports temperature and requested ids.

    Log-softmax runs over the tokenizer's ids only: rows of a padded embedding table past the
    tokenizer are not real tokens and get no probability.

    Args:
        model: path of a HF checkpoint directory (with its tokenizer).
        dtype: torch dtype name of the weights (``float32`` keeps alignment tests exact).
        max_top_k: largest k served.
    """

    def __init__(self, model: str, dtype: str = "float32", max_top_k: int = 4096):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
        self._model.eval()
        tokenizer = AutoTokenizer.from_pretrained(model)
        self._vocab_size = self._model.get_output_embeddings().weight.shape[0]
        self._tokenizer_size = len(tokenizer)
        self._info = BackendInfo(
            name="hf", vocab_size=self._vocab_size, tokenizer_size=self._tokenizer_size,
            tokenizer_digest=tokenizer_digest(tokenizer), max_top_k=min(max_top_k, self._tokenizer_size),
            supports_requested_ids=True, supports_temperature=True)
        if self._vocab_size != self._tokenizer_size:
            logger.info("hf teacher: %d output rows, %d tokenizer ids; rows past the tokenizer are "
                        "ignored", self._vocab_size, self._tokenizer_size)

    def info(self) -> BackendInfo:
        return self._info

    @torch.no_grad()
    def score(self, batch: ScoreBatch) -> list[TeacherOutput]:
        if batch.top_k > self._info.max_top_k:
            raise TeacherError(ErrorCode.UNSUPPORTED,
                               f"top_k={batch.top_k} exceeds this teacher's max {self._info.max_top_k}")
        return [self._score_one(sequence, batch) for sequence in batch.sequences]

    def _score_one(self, sequence, batch: ScoreBatch) -> TeacherOutput:
        token_ids = torch.from_numpy(np.array(sequence.token_ids, dtype=np.int64))
        if int(token_ids.max()) >= self._tokenizer_size:
            raise TeacherError(ErrorCode.BAD_REQUEST, f"token id {int(token_ids.max())} is outside "
                               f"the teacher's vocabulary of {self._tokenizer_size}")
        logits = self._model(input_ids=token_ids[None]).logits[0]  # [L, V]
        # Row t predicts response token t from position response_start + t - 1.
        start = sequence.response_start
        logits = logits[start - 1:-1, :self._tokenizer_size].float() / batch.temperature
        logprobs = torch.log_softmax(logits, dim=-1)  # [T, V]
        topk = torch.topk(logprobs, batch.top_k, dim=-1, sorted=True)
        response = token_ids[start:]
        requested = None
        if sequence.requested_ids is not None:
            ids = torch.from_numpy(np.array(sequence.requested_ids, dtype=np.int64))
            if ids.numel() and (int(ids.max()) >= self._tokenizer_size or int(ids.min()) < 0):
                raise TeacherError(ErrorCode.BAD_REQUEST, "requested ids must lie in "
                                   f"[0, {self._tokenizer_size})")
            requested = logprobs.gather(1, ids).numpy()
        return TeacherOutput(topk_ids=topk.indices.numpy().astype(np.int64),
                             topk_logprobs=topk.values.numpy(),
                             token_logprobs=logprobs.gather(1, response[:, None])[:, 0].numpy(),
                             requested_logprobs=requested)
