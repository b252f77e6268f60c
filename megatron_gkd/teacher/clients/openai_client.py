"""``openai`` client: any OpenAI-compatible ``/v1/completions`` server that returns prompt log-probs.

Tested against vLLM's server (``python -m vllm.entrypoints.openai.api_server --max-logprobs K``). One
request per batch: the prompts are the token ids of prompt+response, ``echo`` returns log-probs for the
prompt itself, ``return_tokens_as_token_ids`` names every entry ``token_id:N`` so no detokenisation is
involved, and ``max_tokens=1`` keeps generation to a single throw-away token. Position ``p`` of the
echoed ``logprobs.top_logprobs`` is the distribution that predicts token ``p``, so response row ``t`` is
position ``response_start + t``. Each position holds the top-k plus, when it is not among them, the
scored token; vLLM writes ``-inf`` as ``-9999.0``, which is turned back into ``-inf`` here.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.error
import urllib.request

import numpy as np

from megatron_gkd.teacher.clients import RetryPolicy, TeacherClient, TeacherInfo
from megatron_gkd.teacher.types import (ErrorCode, ScoreBatch, TeacherError, TeacherOutput,
                                        TeacherOutputError)
from megatron_gkd.teacher.vocab import tokenizer_digest

logger = logging.getLogger(__name__)

_NEG_INF_SENTINEL = -9999.0  # vLLM's JSON stand-in for -inf
_MAX_ALLOWED = re.compile(r"max allowed: (-?\d+)")


class OpenAITeacherClient(TeacherClient):
    """Scores batches with an OpenAI-compatible completions server.

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (``/v1/completions`` is appended).
        model: model name the server serves (default: the first of ``/v1/models``).
        teacher_tokenizer: path or name of the teacher's HF tokenizer, for the vocabulary check
            (the API does not report one).
        retry: timeouts, deadline and backoff for each HTTP call.
        wait_ready_s: how long start-up waits for ``/health``.
        api_key: sent as ``Authorization: Bearer ...`` when the server wants one.
        max_inflight: concurrent :meth:`score_async` batches.
    """

    def __init__(self, base_url: str, model: str | None = None, teacher_tokenizer: str | None = None,
                 retry: RetryPolicy | None = None, wait_ready_s: float = 60.0, api_key: str | None = None,
                 max_inflight: int = 2):
        super().__init__(max_inflight=max_inflight)
        self.base_url = base_url.rstrip("/")
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._retry = retry or RetryPolicy()
        self._teacher_tokenizer = teacher_tokenizer
        self._wait_healthy(wait_ready_s)
        self.model = model or self._get("/v1/models")["data"][0]["id"]
        self.max_logprobs = self._discover_max_logprobs()

    # ---- HTTP -------------------------------------------------------------------------------
    def _request(self, path: str, payload: dict | None, timeout_s: float) -> dict:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.base_url + path, data=data, headers=self._headers)
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())

    def _get(self, path: str) -> dict:
        return self._request(path, None, self._retry.attempt_timeout_s)

    def _wait_healthy(self, wait_s: float) -> None:
        end = time.monotonic() + wait_s
        while True:
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > end:
                raise TeacherError(ErrorCode.UNAVAILABLE, f"{self.base_url}/health did not answer 200 "
                                   f"within {wait_s:.0f} s; is the server running?")
            time.sleep(0.5)

    def _post(self, payload: dict) -> dict:
        """POST /v1/completions with bounded retries; 4xx is the caller's mistake and not retried."""
        policy = self._retry
        deadline, pause = time.monotonic() + policy.deadline_s, policy.backoff_s
        last = "no attempt"
        for attempt in range(1, policy.max_attempts + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                return self._request("/v1/completions", payload, min(policy.attempt_timeout_s, remaining))
            except urllib.error.HTTPError as error:
                body = error.read().decode(errors="replace")[:2000]
                if 400 <= error.code < 500:
                    raise TeacherError(ErrorCode.BAD_REQUEST, f"server said {error.code}: {body}") from None
                last = f"HTTP {error.code}: {body}"
            except (urllib.error.URLError, OSError, json.JSONDecodeError) as error:
                last = f"{type(error).__name__}: {error}"
            logger.warning("openai teacher attempt %d/%d failed: %s", attempt, policy.max_attempts, last)
            time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
            pause = min(pause * 2, policy.backoff_max_s)
        raise TeacherError(ErrorCode.UNAVAILABLE, f"teacher at {self.base_url} gave no answer within "
                           f"{policy.deadline_s:.0f} s ({policy.max_attempts} attempts); last: {last}")

    def _discover_max_logprobs(self) -> int | None:
        """The server's max_logprobs, read from its refusal of an absurd k (None if it does not say)."""
        try:
            self._post(self._payload([[0, 0]], 2**30))
        except TeacherError as error:
            match = _MAX_ALLOWED.search(error.detail)
            if match:
                return int(match.group(1))
        logger.warning("could not learn max_logprobs from %s; k is validated on first use", self.base_url)
        return None

    def _payload(self, prompts: list[list[int]], top_k: int) -> dict:
        return {"model": getattr(self, "model", None), "prompt": prompts, "echo": True,
                "max_tokens": 1, "logprobs": top_k, "prompt_logprobs": top_k,
                "return_tokens_as_token_ids": True, "temperature": 1.0}

    # ---- TeacherClient ------------------------------------------------------------------------
    def info(self) -> TeacherInfo:
        digest = size = None
        if self._teacher_tokenizer is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self._teacher_tokenizer)
            digest, size = tokenizer_digest(tokenizer), len(tokenizer)
        # The API does not report the output-layer size; the tokenizer's is the real vocabulary.
        return TeacherInfo(vocab_size=size or 0, tokenizer_size=size, tokenizer_digest=digest,
                           max_top_k=self.max_logprobs or 0, supports_requested_ids=False,
                           supports_temperature=False)

    def _score(self, batch: ScoreBatch) -> list[TeacherOutput]:
        if batch.num_requested is not None:
            raise TeacherError(ErrorCode.UNSUPPORTED, "the openai teacher client cannot score "
                               "requested ids (TCAD); use the zmq client with the hf backend")
        if batch.temperature != 1.0:
            raise TeacherError(ErrorCode.UNSUPPORTED, "OpenAI-compatible prompt log-probs are at "
                               f"temperature 1.0 only, got {batch.temperature}")
        if self.max_logprobs is not None and batch.top_k > self.max_logprobs:
            raise TeacherError(ErrorCode.UNSUPPORTED, f"top_k={batch.top_k} exceeds the server's "
                               f"max_logprobs={self.max_logprobs}; restart it with --max-logprobs "
                               f"{batch.top_k} or more")
        prompts = [s.token_ids.tolist() for s in batch.sequences]
        response = self._post(self._payload(prompts, batch.top_k))
        choices = sorted(response.get("choices", []), key=lambda c: c.get("index", 0))
        if len(choices) != len(prompts):
            raise TeacherOutputError(f"server returned {len(choices)} choices for {len(prompts)} prompts")
        return [_parse_choice(choice, sequence, batch.top_k, f"sequence {i}").validate(
                    sequence.num_response_tokens, batch.top_k, None, name=f"sequence {i}")
                for i, (choice, sequence) in enumerate(zip(choices, batch.sequences))]


def _as_logprob(value: float) -> float:
    return -np.inf if value <= _NEG_INF_SENTINEL else value


def _parse_choice(choice: dict, sequence, top_k: int, name: str) -> TeacherOutput:
    """TeacherOutput of one echoed prompt; raises TeacherOutputError naming ``name`` when malformed."""
    top = (choice.get("logprobs") or {}).get("top_logprobs")
    length, start = len(sequence.token_ids), sequence.response_start
    if not isinstance(top, list) or len(top) < length:
        raise TeacherOutputError(f"{name}: echoed top_logprobs has "
                                 f"{len(top) if isinstance(top, list) else 'no'} positions, need {length}")
    rows = sequence.num_response_tokens
    topk_ids = np.zeros((rows, top_k), dtype=np.int64)
    topk_logprobs = np.full((rows, top_k), -np.inf, dtype=np.float32)
    token_logprobs = np.zeros(rows, dtype=np.float32)
    for t in range(rows):
        position, token = start + t, int(sequence.token_ids[start + t])
        entries = top[position]
        if not entries:
            raise TeacherOutputError(f"{name}: row {t} (position {position}) has no log-probs")
        parsed = {}
        for key, value in entries.items():
            if not key.startswith("token_id:"):
                raise TeacherOutputError(f"{name}: row {t} key {key!r} is not 'token_id:N'; start the "
                                         "request with return_tokens_as_token_ids")
            parsed[int(key[len("token_id:"):])] = _as_logprob(float(value))
        if token not in parsed:
            raise TeacherOutputError(f"{name}: row {t} lacks the log-prob of its own token {token}")
        token_logprobs[t] = parsed[token]
        if len(parsed) > top_k:  # k+1 distinct ids: the scored token was outside the top-k
            del parsed[token]
        if len(parsed) != top_k:
            raise TeacherOutputError(f"{name}: row {t} has {len(parsed)} top entries, expected {top_k}")
        ranked = sorted(parsed.items(), key=lambda item: -item[1])
        topk_ids[t] = [i for i, _ in ranked]
        topk_logprobs[t] = [lp for _, lp in ranked]
    return TeacherOutput(topk_ids=topk_ids, topk_logprobs=topk_logprobs, token_logprobs=token_logprobs)
