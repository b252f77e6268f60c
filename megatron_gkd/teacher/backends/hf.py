"""``hf`` backend: a transformers causal LM scored in this process (tests and small teachers).

Scoring runs the model's decoder (``get_decoder()``) once and applies the output layer
(``get_output_embeddings()``) to the response rows only, a chunk of rows at a time (:data:`HEAD_CHUNK_BYTES` of
float32 logits): the working set is the hidden states and one chunk, not the ``[b, L, V]`` logits of every position
(5 GB for 8,192 tokens of a 151,936-token vocabulary). The hidden signal is that decoder output, the input of the
output layer: the final hidden state after the last norm, whatever the architecture names it. A model whose logits
are not its output layer on that state (a soft-capping or scaling after it, found by a probe at start-up) keeps the
whole-logits forward, the hidden state captured by a forward pre-hook on its output layer.

Generation is a sampling loop over the model's KV cache (:mod:`megatron_gkd.teacher.protocol.sampling` picks the
tokens), not ``model.generate``: the sampling parameters are exactly the request's, never defaults from
the checkpoint's ``generation_config``. Rows are left-padded with an attention mask and explicit
positions, grouped so that rows x (longest prompt + max_tokens) stays within ``max_batch_tokens``.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from megatron_gkd.data.tokenization import tokenizer_digest
from megatron_gkd.teacher.backends import BackendInfo, TeacherBackend
from megatron_gkd.teacher.backends.forward_groups import forward_groups
from megatron_gkd.teacher.protocol import sampling
from megatron_gkd.teacher.protocol.identity import checkpoint_fingerprint
from megatron_gkd.teacher.protocol.types import ErrorCode, GenerateBatch, GeneratedSample, ScoreBatch, TeacherError, TeacherOutput

logger = logging.getLogger(__name__)

HEAD_CHUNK_BYTES = 16 * 2**20
"""Float32 logits of one chunk of response rows (27 rows of a 151,936-token vocabulary)."""


class HFBackend(TeacherBackend):
    """Scores with ``AutoModelForCausalLM`` on the host; supports temperature, requested ids, both
    signals (top-k and hidden) and generation.

    Log-softmax runs over the tokenizer's ids only: rows of a padded embedding table past the
    tokenizer are not real tokens and get no probability.

    Args:
        model: path of a HF checkpoint directory (with its tokenizer).
        dtype: torch dtype name of the weights (``float32`` keeps alignment tests exact).
        max_top_k: largest k served.
        max_batch_tokens: padded tokens per forward pass (bounds the ``[b, L, V]`` logits; in generation,
            rows x (longest prompt + max_tokens) of one group, which bounds its KV cache).
    """

    def __init__(self, model: str, dtype: str = "float32", max_top_k: int = 4096,
                 max_batch_tokens: int = 8192):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
        self._model.eval()
        self._max_batch_tokens = max_batch_tokens
        tokenizer = AutoTokenizer.from_pretrained(model)
        self._head = self._model.get_output_embeddings()
        self._vocab_size, hidden_size = self._head.weight.shape
        self._tokenizer_size = len(tokenizer)
        self._info = BackendInfo(
            name="hf", vocab_size=self._vocab_size, tokenizer_size=self._tokenizer_size,
            tokenizer_digest=tokenizer_digest(tokenizer), max_top_k=min(max_top_k, self._tokenizer_size),
            supports_requested_ids=True, supports_temperature=True,
            max_sequence_length=getattr(self._model.config, "max_position_embeddings", None),
            hidden_size=int(hidden_size), signals=["topk", "hidden"],
            model_digest=checkpoint_fingerprint(model), dtype=dtype, supports_generate=True)
        self._rows_per_chunk = max(1, HEAD_CHUNK_BYTES // (4 * self._vocab_size))
        with torch.no_grad():
            self._head_last = self._head_is_last()
        if not self._head_last:
            logger.info("hf teacher: the model's logits are not its output layer on its decoder's last hidden state; "
                        "scoring computes the logits of every position (max_batch_tokens bounds them)")
        if self._vocab_size != self._tokenizer_size:
            logger.info("hf teacher: %d output rows, %d tokenizer ids; rows past the tokenizer are "
                        "ignored", self._vocab_size, self._tokenizer_size)

    def info(self) -> BackendInfo:
        return self._info

    @torch.no_grad()
    def score(self, batch: ScoreBatch) -> list[TeacherOutput]:
        if not batch.is_hidden and batch.top_k > self._info.max_top_k:
            raise TeacherError(ErrorCode.UNSUPPORTED,
                               f"top_k={batch.top_k} exceeds this teacher's max {self._info.max_top_k}")
        for sequence in batch.sequences:
            # One sequence is one forward pass at least: its [L, V] logits are what the bound is for.
            if len(sequence.token_ids) > self._max_batch_tokens:
                raise TeacherError(ErrorCode.TOO_LARGE, f"a sequence of {len(sequence.token_ids)} tokens "
                                   f"exceeds this backend's max_batch_tokens={self._max_batch_tokens}")
            self._check_ids(sequence.token_ids, "token id")
            if sequence.requested_ids is not None:
                self._check_ids(sequence.requested_ids, "requested id")
        outputs = []
        for group in forward_groups([len(sequence.token_ids) for sequence in batch.sequences], self._max_batch_tokens):
            outputs += self._score_group([batch.sequences[i] for i in group], batch)
        return outputs

    def _check_ids(self, ids: np.ndarray, what: str) -> None:
        if ids.size and (int(ids.max()) >= self._tokenizer_size or int(ids.min()) < 0):
            raise TeacherError(ErrorCode.BAD_REQUEST, f"{what} {int(ids.max())} is outside the "
                               f"teacher's vocabulary of {self._tokenizer_size}")

    def _head_is_last(self) -> bool:
        """The model's logits are its output layer applied to its decoder's last hidden state, nothing after (no
        logit soft-capping or scaling): checked on a probe, so a model that differs keeps the whole-logits path."""
        try:
            probe = torch.arange(1, 9).remainder(self._tokenizer_size)[None]
            hidden = self._model.get_decoder()(input_ids=probe).last_hidden_state
            return bool(torch.equal(self._head(hidden), self._model(input_ids=probe).logits))
        except (AttributeError, TypeError, ValueError):  # no get_decoder, or a decoder of another signature
            return False

    def _score_group(self, group, batch: ScoreBatch) -> list[TeacherOutput]:
        # Right padding needs no attention mask: under causal attention real positions never see
        # the pad tokens that follow them.
        longest = max(len(s.token_ids) for s in group)
        input_ids = torch.zeros(len(group), longest, dtype=torch.long)
        for row, sequence in enumerate(group):
            input_ids[row, :len(sequence.token_ids)] = torch.from_numpy(np.array(sequence.token_ids))
        if self._head_last:  # the output layer's input, [b, L, h]; logits only for response rows, a chunk at a time
            hidden = self._model.get_decoder()(input_ids=input_ids).last_hidden_state

            def logits_of(row: int, rows: slice) -> torch.Tensor:
                return self._head(hidden[row, rows])
        else:
            captured = []
            hook = (self._head.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
                    if batch.is_hidden else None)
            try:
                logits = self._model(input_ids=input_ids).logits  # [b, L, V]
            finally:
                if hook is not None:
                    hook.remove()
            hidden = captured[0] if captured else None

            def logits_of(row: int, rows: slice) -> torch.Tensor:
                return logits[row, rows]
        return [self._output(functools.partial(logits_of, row), None if hidden is None else hidden[row], sequence,
                             batch) for row, sequence in enumerate(group)]

    def _output(self, logits_of, hidden: torch.Tensor | None, sequence, batch: ScoreBatch) -> TeacherOutput:
        """One sequence's rows; ``logits_of(rows)`` gives the logits of a slice of its positions. Row t predicts
        response token t from position response_start + t - 1; the rows go through log-softmax in chunks of
        ``self._rows_per_chunk`` (a chunk of ``[rows, V]`` float32 logits at most :data:`HEAD_CHUNK_BYTES`)."""
        start, end = sequence.response_start, len(sequence.token_ids)
        response = torch.from_numpy(np.array(sequence.response_ids, dtype=np.int64))
        requested_ids = (None if sequence.requested_ids is None
                         else torch.from_numpy(np.array(sequence.requested_ids, dtype=np.int64)))
        token, top_values, top_ids, requested = [], [], [], []
        for first in range(0, end - start, self._rows_per_chunk):
            last = min(first + self._rows_per_chunk, end - start)
            rows = slice(start - 1 + first, start - 1 + last)
            logits = logits_of(rows)[:, :self._tokenizer_size].float() / batch.temperature
            logprobs = torch.log_softmax(logits, dim=-1)  # [rows, V]
            token.append(logprobs.gather(1, response[first:last, None])[:, 0])
            if not batch.is_hidden:
                topk = torch.topk(logprobs, batch.top_k, dim=-1, sorted=True)
                top_values.append(topk.values)
                top_ids.append(topk.indices)
                if requested_ids is not None:
                    requested.append(logprobs.gather(1, requested_ids[first:last]))
        token_logprobs = torch.cat(token).numpy()
        if batch.is_hidden:
            rows = len(token_logprobs)
            return TeacherOutput(topk_ids=np.empty((rows, 0), np.int64),
                                 topk_logprobs=np.empty((rows, 0), np.float32),
                                 token_logprobs=token_logprobs,
                                 hidden=hidden[start - 1:end - 1].float().clone().numpy())
        return TeacherOutput(topk_ids=torch.cat(top_ids).numpy().astype(np.int64),
                             topk_logprobs=torch.cat(top_values).numpy(), token_logprobs=token_logprobs,
                             requested_logprobs=None if requested_ids is None else torch.cat(requested).numpy())

    @torch.no_grad()
    def generate(self, batch: GenerateBatch) -> list[GeneratedSample]:
        longest = max(len(p) for p in batch.prompts) + batch.max_tokens
        if longest > self._max_batch_tokens:
            raise TeacherError(ErrorCode.TOO_LARGE, f"a prompt plus max_tokens={batch.max_tokens} makes {longest} "
                               f"tokens, over this backend's max_batch_tokens={self._max_batch_tokens}")
        for prompt in batch.prompts:
            self._check_ids(prompt, "prompt id")
        rows = [(prompt, sample) for prompt in range(len(batch.prompts)) for sample in range(batch.num_samples)]
        uniforms = sampling.row_uniforms(batch)  # [response, token]
        samples = []
        for group in forward_groups([len(batch.prompts[prompt]) + batch.max_tokens for prompt, _ in rows],
                                    self._max_batch_tokens):
            responses = self._generate_group([batch.prompts[rows[r][0]] for r in group], batch,
                                             uniforms[group])
            samples += [GeneratedSample(prompt_index=rows[r][0], response_ids=ids) for r, ids in zip(group, responses)]
        return samples

    def _generate_group(self, prompts, batch: GenerateBatch, uniforms: torch.Tensor) -> list[np.ndarray]:
        """Response ids of each prompt (one row each), sampled over the KV cache."""
        rows, longest = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.zeros(rows, longest, dtype=torch.long)
        mask = torch.zeros(rows, longest, dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: every row's next token is the last column
            input_ids[row, longest - len(prompt):] = torch.from_numpy(prompt)
            mask[row, longest - len(prompt):] = 1
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        out = self._model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                          logits_to_keep=1)
        stops = torch.tensor(batch.stop_ids, dtype=torch.long)
        tokens = torch.zeros(rows, batch.max_tokens, dtype=torch.long)
        lengths = torch.full((rows,), batch.max_tokens)
        done = torch.zeros(rows, dtype=torch.bool)
        position = positions[:, -1:]
        for step in range(batch.max_tokens):
            # Rows past the tokenizer (a padded embedding table) are not tokens: never sampled.
            picked = sampling.sample_next(out.logits[:, -1, :self._tokenizer_size], batch, uniforms[:, step])
            tokens[:, step] = picked
            stopped = ~done & torch.isin(picked, stops)
            lengths[stopped], done = step + 1, done | stopped
            if done.all() or step + 1 == batch.max_tokens:
                break
            mask, position = torch.cat([mask, torch.ones(rows, 1, dtype=torch.long)], dim=1), position + 1
            out = self._model(input_ids=picked[:, None], attention_mask=mask, position_ids=position,
                              past_key_values=out.past_key_values, use_cache=True)
        return [tokens[row, :lengths[row]].numpy().astype(np.int64) for row in range(rows)]
