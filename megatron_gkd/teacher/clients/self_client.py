"""``self`` client: the student's own model as its teacher, reading privileged context (issue #50 item 1, OPSD).

The teacher is the student's model chunks on this rank, with their current weights, on the trainer's own shards and
process groups: no copy, no service, no gather of the vocabulary. Each sequence's prompt is replaced by its
privileged prompt (:class:`~megatron_gkd.teacher.clients.privileged.PrivilegedPrompts`; the response ids are unchanged) and
scored by the same per-rank function as the ``local`` client and the ``megatron`` backend
(:class:`~megatron_gkd.teacher.backends.megatron_scoring.MegatronScorer`: log-partition and top-k vocab-parallel over TP,
through the model's own pipeline schedule), without gradient and in eval mode (the chunks' modes are restored after).

``score`` is a collective, as the ``local`` client's: every rank of a model-parallel group calls it with the same
batch and every one of them gets the outputs. The teacher serves the top-k signal; k may be the whole vocabulary
(the student's own log-probs are exact, so the top-V is the full distribution). The hidden signal is refused: the
teacher's head would be the student's own output layer, which moves with every step.
"""

from __future__ import annotations

import logging

import torch

from megatron_gkd import platform
from megatron_gkd.teacher.backends.megatron_scoring import MegatronScorer, TeacherVocab
from megatron_gkd.teacher.clients import CollectiveTeacherClient, TeacherInfo
from megatron_gkd.teacher.clients.privileged import PrivilegedPrompts, learn_privileged
from megatron_gkd.teacher.protocol.types import ErrorCode, ScoreBatch, Signal, TeacherError, TeacherOutput

logger = logging.getLogger(__name__)


class SelfTeacherClient(CollectiveTeacherClient):
    """Scores with the student's own chunks (current weights, no gradient) on privileged prompts.

    Args:
        chunks: the student's model chunks on this rank (wrapped or not), as the trainer trains them.
        vocab: the student's vocabulary sizes (its output rows, its tokenizer's size and digest).
        prompts: the privileged prompt of each student prompt.
    """

    @classmethod
    def from_config(cls, config, secret: bytes | None = None, *, state, student):
        """Built from the ``teacher`` section on the student's ``(chunks, vocab)`` (``state``: the trainer's, which the
        chunks were built on); the privileged prompts are learnt after (:meth:`learn`)."""
        chunks, vocab = student
        return cls(chunks, vocab, PrivilegedPrompts(), template=config.privileged_template)

    def __init__(self, chunks: list[torch.nn.Module], vocab: TeacherVocab, prompts: PrivilegedPrompts,
                 template: str | None = None):
        super().__init__(max_inflight=1)
        self._chunks, self._prompts, self._template = chunks, prompts, template
        self._scorer = MegatronScorer(chunks, vocab, platform.device())

    def learn(self, records, tokenizer, chat_template: str | None) -> None:
        """Learns the privileged prompt of each of ``records`` (loaded with ``keep_conversations``) with this client's
        template (:func:`~megatron_gkd.teacher.clients.privileged.learn_privileged`)."""
        assert self._template is not None, "a self teacher built without teacher.privileged_template"
        records = list(records)
        learn_privileged(self._prompts, records, self._template, tokenizer, chat_template)
        logger.info("self teacher: %d privileged prompts learnt from %d records (%s)", len(self._prompts), len(records),
                    "through the chat template" if chat_template is not None else "raw text")

    def info(self) -> TeacherInfo:
        vocab = self._scorer.vocab
        return TeacherInfo(vocab_size=vocab.vocab_size, tokenizer_size=vocab.tokenizer_size,
                           tokenizer_digest=vocab.tokenizer_digest, max_top_k=vocab.tokenizer_size,
                           supports_requested_ids=True, supports_temperature=True, signals=[Signal.TOPK.value])

    def _score(self, batch: ScoreBatch) -> list[TeacherOutput]:
        if batch.is_hidden:
            raise TeacherError(ErrorCode.UNSUPPORTED, "the self teacher serves the top-k signal only (its head would be "
                               "the student's own, moving output layer); set teacher.signal=topk")
        try:
            privileged = [self._prompts.sequence(sequence) for sequence in batch.sequences]
        except KeyError as error:
            raise TeacherError(ErrorCode.BAD_REQUEST, str(error.args[0])) from error
        asked = ScoreBatch(sequences=privileged, top_k=batch.top_k, temperature=batch.temperature)
        self._scorer.check(asked, self._scorer.vocab.tokenizer_size)
        modes = [chunk.training for chunk in self._chunks]
        try:
            for chunk in self._chunks:
                chunk.eval()
            outputs = self._scorer.score(asked)  # under torch.no_grad
        finally:
            for chunk, mode in zip(self._chunks, modes, strict=True):
                chunk.train(mode)
        for index, (output, sequence) in enumerate(zip(outputs, batch.sequences, strict=True)):
            output.validate(sequence.num_response_tokens, batch.top_k, batch.num_requested,
                            name=f"sequence {index} (self teacher)", sequence=sequence)
        return outputs
