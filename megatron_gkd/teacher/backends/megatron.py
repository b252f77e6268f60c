"""``megatron`` backend: a Megatron-Core teacher sharded over the server's own torchrun ranks.

    torchrun --nproc_per_node 4 launch/teacher_server.py serve --backend megatron --model DIR \\
        --backend-arg tensor_model_parallel_size=2 --backend-arg pipeline_model_parallel_size=2

Rank 0 is the leader: it talks to the proxy as a worker and, for each batch, broadcasts the request
to the other ranks (the followers, which run :meth:`MegatronBackend.follow`); then every rank runs
the forward and the last pipeline stage computes the rows (:mod:`megatron_gkd.teacher.backends.megatron_scoring`).
The request crosses ranks as plain tensors (a fixed header, the token ids, the requested ids), never
as pickled objects. Requests the backend refuses are refused on rank 0 before the broadcast; a failure
inside the forward after it (e.g. out of memory on one rank) leaves the ranks out of step, and the
server must be restarted (clients retry on other workers meanwhile).

Generation is a simple loop on the leader: each step scores every unfinished response with one more
(placeholder) token through :meth:`MegatronBackend.score`, so the followers take part as in any score,
and samples the next token from that row's top ``max_top_k`` (:mod:`megatron_gkd.teacher.protocol.sampling`). It
runs a full forward per token (no KV cache): for tests and small teachers; serve large ones with vllm.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.distributed as dist

from megatron_gkd import parallel, platform
from megatron_gkd.teacher.backends import BackendInfo, TeacherBackend
from megatron_gkd.teacher.backends.megatron_scoring import MAX_BATCH_TOKENS, MegatronScorer, load_teacher
from megatron_gkd.teacher.protocol import sampling
from megatron_gkd.teacher.protocol.identity import checkpoint_fingerprint
from megatron_gkd.teacher.protocol.types import (
    TEACHER_SIGNALS,
    ErrorCode,
    GenerateBatch,
    GeneratedSample,
    ScoreBatch,
    SequenceRequest,
    TeacherError,
    TeacherOutput,
)

logger = logging.getLogger(__name__)

# Header: [command, num_sequences, num_tokens, top_k, num_requested (-1: none), temperature bits,
# signal (index in TEACHER_SIGNALS)].
_SCORE, _STOP = 1, 0
_HEADER = 7


class MegatronBackend(TeacherBackend):
    """Megatron-Core teacher loaded with ``megatron_gkd.models.load_hf`` (any registered architecture).

    Builds the model-parallel layout itself (``parallel.initialize``), on the default process group
    (initialised from the torchrun environment when needed). All ranks construct the backend; rank 0
    serves, the others call :meth:`follow` until the leader closes.

    Args:
        model: HF checkpoint directory (with its tokenizer).
        dtype: parameter dtype name; scoring is in float32 regardless.
        tensor_model_parallel_size: TP size.
        pipeline_model_parallel_size: PP size.
        virtual_pipeline_model_parallel_size: VPP size (chunks per pipeline rank).
        expert_model_parallel_size: EP size (MoE teachers).
        max_top_k: largest k served.
        max_batch_tokens: padded tokens per micro-batch of a score (:class:`MegatronScorer`).
    """

    def __init__(self, model: str, dtype: str = "float32", tensor_model_parallel_size: int = 1,
                 pipeline_model_parallel_size: int = 1, virtual_pipeline_model_parallel_size: int | None = None,
                 expert_model_parallel_size: int = 1, max_top_k: int = 4096, max_batch_tokens: int = MAX_BATCH_TOKENS):
        if not platform.is_set_up():  # the server process: before anything imports Megatron-Core
            platform.setup()

        state = parallel.initialize(tensor_model_parallel_size=tensor_model_parallel_size,
                                    pipeline_model_parallel_size=pipeline_model_parallel_size,
                                    virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
                                    expert_model_parallel_size=expert_model_parallel_size)
        self._device = platform.device()
        chunks, vocab = load_teacher(model, dtype, state=state)
        self._scorer = MegatronScorer(chunks, vocab, self._device, max_batch_tokens=max_batch_tokens)
        self._closed = False
        self._info = BackendInfo(
            name="megatron", vocab_size=vocab.vocab_size, tokenizer_size=vocab.tokenizer_size,
            tokenizer_digest=vocab.tokenizer_digest, max_top_k=min(max_top_k, vocab.tokenizer_size),
            supports_requested_ids=True, supports_temperature=True,
            max_sequence_length=getattr(chunks[0], "max_sequence_length", None),
            hidden_size=self._scorer.hidden_size, signals=["topk", "hidden"],
            model_digest=checkpoint_fingerprint(model), dtype=dtype, supports_generate=True)

    @property
    def is_leader(self) -> bool:
        return dist.get_rank() == 0

    def info(self) -> BackendInfo:
        return self._info

    def score(self, batch: ScoreBatch) -> list[TeacherOutput]:
        """Leader only: validates, sends the batch to the followers, scores it with them."""
        assert self.is_leader, "followers score through follow()"
        # Refused requests never reach the followers, so every rank stays in step.
        self._scorer.check(batch, self._info.max_top_k)
        self._send(batch)
        return self._scorer.score(batch)

    def generate(self, batch: GenerateBatch) -> list[GeneratedSample]:
        """Leader only: the simple loop of the module docstring."""
        width, vocab = self._info.max_top_k, self._info.tokenizer_size
        if batch.temperature == 0:
            width = 1
        elif 0 < batch.top_k <= width:
            width = batch.top_k
        elif width < vocab:
            raise TeacherError(ErrorCode.UNSUPPORTED, f"the megatron backend samples from the top max_top_k={width} "
                               f"ids of each row, fewer than the vocabulary of {vocab}: ask for top_k <= {width} or "
                               f"temperature 0, or restart it with --backend-arg max_top_k={vocab}")
        rows = [prompt for prompt in range(len(batch.prompts)) for _ in range(batch.num_samples)]
        uniforms = sampling.row_uniforms(batch)  # [response, token]
        responses: list[list[int]] = [[] for _ in rows]
        live = list(range(len(rows)))
        for step in range(batch.max_tokens):
            # Row 0 of prompt + response + [placeholder] is the distribution of the next token.
            sequences = []
            for r in live:
                prompt = batch.prompts[rows[r]]
                ids = np.concatenate([prompt, np.array(responses[r] + [0], dtype=np.int64)])
                sequences.append(SequenceRequest(token_ids=ids, response_start=len(prompt) + len(responses[r])))
            outputs = self.score(ScoreBatch(sequences=sequences, top_k=width))
            scores = torch.from_numpy(np.stack([output.topk_logprobs[0] for output in outputs]))  # [live, width]
            ids = torch.from_numpy(np.stack([output.topk_ids[0] for output in outputs]).astype(np.int64))
            columns = sampling.sample_next(scores, batch, uniforms[live, step], ids=ids, vocab=vocab)
            for r, picked in zip(live, ids.gather(1, columns[:, None])[:, 0].tolist()):
                responses[r].append(picked)
            live = [r for r in live if responses[r][-1] not in batch.stop_ids]
            if not live:
                break
        return [GeneratedSample(prompt_index=prompt, response_ids=np.array(ids, dtype=np.int64))
                for prompt, ids in zip(rows, responses)]

    def follow(self) -> None:
        """Followers: score every batch the leader sends until it closes."""
        assert not self.is_leader, "the leader serves requests; only other ranks follow"
        while (batch := self._receive()) is not None:
            self._scorer.score(batch)
        logger.info("megatron teacher rank %d: the leader closed", dist.get_rank())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.is_leader:
            self._broadcast(torch.tensor([_STOP] + [0] * (_HEADER - 1), dtype=torch.int64))
        parallel.destroy()

    # -- request transport between ranks (tensors only) ------------------------------------------

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(self._device)
        dist.broadcast(tensor, 0)
        return tensor.cpu()

    def _send(self, batch: ScoreBatch) -> None:
        m = batch.num_requested
        temperature = torch.tensor([batch.temperature], dtype=torch.float64).view(torch.int64)
        tokens = np.concatenate([s.token_ids for s in batch.sequences])
        self._broadcast(torch.tensor([_SCORE, len(batch.sequences), len(tokens), batch.top_k,
                                      -1 if m is None else m, int(temperature),
                                      TEACHER_SIGNALS.index(batch.signal)], dtype=torch.int64))
        starts = [[len(s.token_ids), s.response_start] for s in batch.sequences]
        self._broadcast(torch.tensor(starts, dtype=torch.int64))
        self._broadcast(torch.from_numpy(tokens))
        if m is not None:
            self._broadcast(torch.from_numpy(np.concatenate([s.requested_ids for s in batch.sequences])))

    def _receive(self) -> ScoreBatch | None:
        header = self._broadcast(torch.zeros(_HEADER, dtype=torch.int64)).tolist()
        command, num_sequences, num_tokens, top_k, m, temperature, signal = header
        if command == _STOP:
            return None
        temperature = float(torch.tensor([temperature], dtype=torch.int64).view(torch.float64))
        starts = self._broadcast(torch.zeros(num_sequences, 2, dtype=torch.int64)).tolist()
        tokens = self._broadcast(torch.zeros(num_tokens, dtype=torch.int64)).numpy()
        requested = None
        if m >= 0:
            num_rows = sum(length - start for length, start in starts)
            requested = self._broadcast(torch.zeros(num_rows, m, dtype=torch.int64)).numpy()
        sequences, offset, row = [], 0, 0
        for length, start in starts:
            ids = None if requested is None else requested[row:row + length - start]
            sequences.append(SequenceRequest(token_ids=tokens[offset:offset + length], response_start=start,
                                             requested_ids=ids))
            offset, row = offset + length, row + length - start
        # hidden_dtype is the leader's business (it encodes the result): followers keep the default.
        return ScoreBatch(sequences=sequences, top_k=top_k, temperature=temperature,
                          signal=TEACHER_SIGNALS[signal])
