"""``local`` client: a Megatron-Core teacher colocated on the training ranks.

The teacher is sharded with the trainer's own layout (the trainer's ``ParallelState``, which it is built with)
and scored by the same per-rank function as the ``megatron`` backend
(:class:`~megatron_gkd.teacher.backends.megatron_scoring.MegatronScorer`). ``score`` is a collective: every rank
of a model-parallel group calls it with the same batch (as the trainer's ranks hold the same data
within such a group), and every one of them gets the outputs.

With ``offload=True`` the teacher's weights live in host memory between calls and are copied to the
device for each batch, so the student's training step has the device memory to itself. On the ``cpu``
platform the weights are already in host memory: the option is accepted and inert (a warning says so).
"""

from __future__ import annotations

import logging

import torch

from megatron_gkd import platform
from megatron_gkd.teacher.backends.megatron_scoring import MAX_BATCH_TOKENS, MegatronScorer, load_teacher
from megatron_gkd.teacher.clients import CollectiveTeacherClient, TeacherInfo
from megatron_gkd.teacher.protocol import wire
from megatron_gkd.teacher.protocol.types import ScoreBatch, TeacherOutput

logger = logging.getLogger(__name__)


class WeightOffload:
    """Moves module parameters and buffers to host memory and back (pinned host copies).

    Args:
        modules: the modules whose tensors move.
        enabled: whether to offload at all; on the ``cpu`` platform this is inert and logs a warning.
    """

    def __init__(self, modules: list[torch.nn.Module], enabled: bool):
        self._modules = modules
        self._device = platform.device()
        self.active = enabled and self._device.type != "cpu"
        if enabled and not self.active:
            logger.warning("teacher offload has no effect on the %r platform: the teacher's weights "
                           "are already in host memory", platform.current().name)

    def _tensors(self):
        for module in self._modules:
            yield from module.parameters()
            yield from module.buffers()

    def to_host(self) -> None:
        """Copies every tensor to pinned host memory and frees its device memory."""
        if not self.active:
            return

        for tensor in self._tensors():
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            host.copy_(tensor.data, non_blocking=True)
            tensor.data = host
        platform.synchronize()  # the copies must land before the device memory is reused
        platform.empty_cache()

    def to_device(self) -> None:
        """Copies every tensor back to the device (asynchronously from pinned memory)."""
        if not self.active:
            return
        for tensor in self._tensors():
            tensor.data = tensor.data.to(self._device, non_blocking=True)


class LocalTeacherClient(CollectiveTeacherClient):
    """Scores with a colocated Megatron-Core teacher on this rank's share of the trainer's layout.

    Args:
        model: HF checkpoint directory of the teacher (with its tokenizer), loaded with ``load_hf``.
        state: the trainer's :class:`~megatron_gkd.parallel.ParallelState` (the teacher is sharded like the student;
            the trainer passes it). ``None``: the state ``parallel.initialize`` built in this process (scripts, tests).
        dtype: parameter dtype name.
        offload: keep the weights in host memory between calls (no-op with a warning on ``cpu``).
        max_top_k: largest k served.
        max_batch_tokens: padded tokens per micro-batch of a score (:class:`MegatronScorer`).
    """

    @classmethod
    def from_config(cls, config, secret: bytes | None = None, *, state):
        """Built from the ``teacher`` section (:class:`~megatron_gkd.teacher.config.TeacherConfig`) on the trainer's
        parallel state."""
        return cls(model=config.checkpoint, state=state, offload=config.offload)

    def __init__(self, model: str, dtype: str = "float32", offload: bool = False, max_top_k: int = 4096, *,
                 max_batch_tokens: int = MAX_BATCH_TOKENS, state=None):
        super().__init__(max_inflight=1)
        chunks, vocab = load_teacher(model, dtype, state=state)
        self._scorer = MegatronScorer(chunks, vocab, platform.device(), max_batch_tokens=max_batch_tokens)
        self._max_top_k = min(max_top_k, vocab.tokenizer_size)
        self._offload = WeightOffload(chunks, offload)
        self._offload.to_host()

    def info(self) -> TeacherInfo:
        vocab = self._scorer.vocab
        return TeacherInfo(vocab_size=vocab.vocab_size, tokenizer_size=vocab.tokenizer_size,
                           tokenizer_digest=vocab.tokenizer_digest, max_top_k=self._max_top_k,
                           supports_requested_ids=True, supports_temperature=True,
                           hidden_size=self._scorer.hidden_size, signals=["topk", "hidden"])

    def _score(self, batch: ScoreBatch) -> list[TeacherOutput]:
        self._scorer.check(batch, self._max_top_k)
        self._offload.to_device()
        try:
            outputs = self._scorer.score(batch)
        finally:
            self._offload.to_host()
        hidden_size = self._scorer.hidden_size if batch.is_hidden else None
        if batch.is_hidden:
            # Rounded to the requested dtype as the wire would: a run gets the same numbers whichever
            # client reaches the teacher.
            for output in outputs:
                output.hidden = wire.from_wire_float(wire.to_wire_float(output.hidden, batch.hidden_dtype))
        for index, (output, sequence) in enumerate(zip(outputs, batch.sequences, strict=True)):
            output.validate(sequence.num_response_tokens, batch.top_k, batch.num_requested,
                            name=f"sequence {index} (local teacher)", sequence=sequence,
                            hidden_size=hidden_size)
        return outputs
