"""``openai`` client: any OpenAI-compatible ``/v1/completions`` server that returns prompt log-probs.

Tested against vLLM's server (``python -m vllm.entrypoints.openai.api_server --max-logprobs K``). One
request per batch: the prompts are the token ids of prompt+response, ``echo`` returns log-probs for the
prompt itself, ``return_tokens_as_token_ids`` names every entry ``token_id:N`` so no detokenisation is
involved, and ``max_tokens=1`` keeps generation to a single throw-away token. Position ``p`` of the
echoed ``logprobs.top_logprobs`` is the distribution that predicts token ``p``, so response row ``t`` is
position ``response_start + t``. Each position holds the top-k plus, when it is not among them, the
scored token; vLLM writes ``-inf`` as ``-9999.0``, which is turned back into ``-inf`` here.

``generate`` uses the same endpoint without echo: ``n`` samples per prompt with vLLM's extensions
(``top_k``, ``stop_token_ids``, ``ignore_eos`` so that only the request's stop ids end a response, and
``return_token_ids`` for the ids themselves, so no detokenisation is involved). Scored rows, when asked,
are the sampled tokens' ``logprobs`` (top-k, at temperature 1.0) of the same call. A seeded batch sends one
call per prompt, seeded from ``(seed, prompt, 0)`` (vLLM seeds sample j with that seed + j); an unseeded
one sends a single call. The ids are checked against the teacher's tokenizer, so ``teacher_tokenizer``
is required to generate.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import time

import numpy as np

from megatron_gkd.data.tokenization import load_tokenizer, tokenizer_digest
from megatron_gkd.teacher.clients import RetryPolicy, TeacherClient, TeacherInfo
from megatron_gkd.teacher.clients.http_call import DeadlineExceeded, HttpEndpoint, Response, ResponseTooLarge
from megatron_gkd.teacher.protocol import sampling
from megatron_gkd.teacher.protocol.types import (
    ErrorCode,
    GenerateBatch,
    GeneratedSample,
    ScoreBatch,
    SequenceRequest,
    TeacherError,
    TeacherOutput,
    TeacherOutputError,
    check_generated,
)

logger = logging.getLogger(__name__)

_NEG_INF_SENTINEL = -9999.0  # vLLM's JSON stand-in for -inf
_MAX_ALLOWED = re.compile(r"max allowed: (-?\d+)")
_TOKEN_KEY = re.compile(r"token_id:(\d{1,18})")  # 18 digits always fit in int64
_RETRIED = (OSError, http.client.HTTPException, json.JSONDecodeError)


class OpenAITeacherClient(TeacherClient):
    """Scores batches with an OpenAI-compatible completions server.

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (``/v1/completions`` is appended).
        model: model name the server serves (default: the first of ``/v1/models``).
        teacher_tokenizer: path or name of the teacher's HF tokenizer, for the vocabulary check
            (the API does not report one).
        retry: timeouts, deadline and backoff for each HTTP call; ``attempt_timeout_s`` bounds an
            attempt as a whole (connect, send, status line, headers and body).
        wait_ready_s: how long start-up waits for ``/health``.
        api_key: sent as ``Authorization: Bearer ...`` when the server wants one; only ever to
            ``base_url`` (redirects are refused, not followed).
        max_inflight: concurrent :meth:`score_async` batches.
        max_response_bytes: longest answer body read (JSON of the echoed log-probs).
    """

    @classmethod
    def from_config(cls, config, secret: bytes | None = None):
        """Built from the ``teacher`` section (:class:`~megatron_gkd.teacher.config.TeacherConfig`)."""
        return cls(base_url=config.base_url, model=config.model, teacher_tokenizer=config.teacher_tokenizer,
                   api_key=config.api_key, retry=config.retry(), max_inflight=config.max_inflight)

    def __init__(self, base_url: str, model: str | None = None, teacher_tokenizer: str | None = None,
                 retry: RetryPolicy | None = None, wait_ready_s: float = 60.0, api_key: str | None = None,
                 max_inflight: int = 2, max_response_bytes: int = 2**31):
        super().__init__(max_inflight=max_inflight)
        self.base_url = base_url.rstrip("/")
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = HttpEndpoint(self.base_url, headers, max_response_bytes)
        self._retry = retry or RetryPolicy()
        self._teacher_tokenizer = teacher_tokenizer
        self._vocab: int | None = None  # the tokenizer's size, read at the first generate
        self._wait_healthy(wait_ready_s)
        models = self._get("/v1/models")
        try:
            self.model = model or models["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise TeacherError(ErrorCode.BAD_OUTPUT, f"{self.base_url}/v1/models answered "
                               f"{str(models)[:200]!r}, not a model list; pass model=...") from None
        self.max_logprobs = self._discover_max_logprobs()

    # ---- HTTP -------------------------------------------------------------------------------
    def _call(self, path: str, payload: dict | None, timeout_s: float) -> Response:
        """One attempt; a redirect is an error (the API key must not follow it elsewhere)."""
        data = None if payload is None else json.dumps(payload).encode()
        response = self._http.request("GET" if data is None else "POST", path, data, timeout_s)
        if 300 <= response.status < 400:
            raise TeacherError(ErrorCode.BAD_REQUEST, f"{self.base_url}{path} answered a redirect "
                               f"({response.status}) to {response.location!r}; redirects are not followed "
                               "(the API key would go along): set base_url to the final address")
        return response

    def _get(self, path: str) -> dict:
        try:
            response = self._call(path, None, self._retry.attempt_timeout_s)
            return json.loads(response.body)
        except (*_RETRIED, ResponseTooLarge) as error:
            raise TeacherError(ErrorCode.UNAVAILABLE, f"GET {self.base_url}{path} failed: "
                               f"{type(error).__name__}: {error}") from None

    def _wait_healthy(self, wait_s: float) -> None:
        end = time.monotonic() + wait_s
        while True:
            try:
                if self._call("/health", None, min(5.0, max(0.1, end - time.monotonic()))).status == 200:
                    return
            except (OSError, http.client.HTTPException):
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
                response = self._call("/v1/completions", payload, min(policy.attempt_timeout_s, remaining))
                body = response.body.decode(errors="replace")
                if 400 <= response.status < 500:
                    raise TeacherError(ErrorCode.BAD_REQUEST, f"server said {response.status}: {body[:2000]}")
                if response.status == 200:
                    return json.loads(response.body)
                last = f"HTTP {response.status}: {body[:2000]}"
            except ResponseTooLarge as error:
                raise TeacherError(ErrorCode.TOO_LARGE, f"{error}; score smaller batches or raise "
                                   "max_response_bytes") from None
            except DeadlineExceeded as error:
                last = str(error)
            except _RETRIED as error:
                last = f"{type(error).__name__}: {error}"
            logger.warning("openai teacher attempt %d/%d failed: %s", attempt, policy.max_attempts, last)
            self._retried()
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
            tokenizer = load_tokenizer(self._teacher_tokenizer)  # a directory, a GGUF file or a Hub id
            digest, size = tokenizer_digest(tokenizer), len(tokenizer)
        # The API does not report the output-layer size; the tokenizer's is the real vocabulary.
        return TeacherInfo(vocab_size=size or 0, tokenizer_size=size, tokenizer_digest=digest,
                           max_top_k=self.max_logprobs or 0, supports_requested_ids=False,
                           supports_temperature=False, hidden_size=None, signals=["topk"],
                           supports_generate=self._teacher_tokenizer is not None)  # _generate checks ids against it

    def _score(self, batch: ScoreBatch) -> list[TeacherOutput]:
        if batch.is_hidden:
            # The completions API returns log-probs, never hidden states (docs/teacher_protocol.md).
            raise TeacherError(ErrorCode.UNSUPPORTED, "an OpenAI-compatible server serves the top-k signal "
                               "only; set teacher.signal=topk, or use teacher.client=zmq with "
                               "teacher.serve.backend=hf or megatron (or teacher.client=local) for hidden states")
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
        choices = _choices(self._post(self._payload(prompts, batch.top_k)), len(prompts))
        return [_parse_choice(choice, sequence, batch.top_k, f"sequence {i}").validate(
                    sequence.num_response_tokens, batch.top_k, None, name=f"sequence {i}", sequence=sequence)
                for i, (choice, sequence) in enumerate(zip(choices, batch.sequences))]

    def _generate(self, batch: GenerateBatch) -> list[GeneratedSample]:
        if self._teacher_tokenizer is None:
            raise ValueError("the openai client checks generated ids against the teacher's vocabulary: pass "
                             "teacher_tokenizer (teacher.teacher_tokenizer) to generate")
        if batch.score_top_k is not None and batch.score_temperature != 1.0:
            raise TeacherError(ErrorCode.UNSUPPORTED, "OpenAI-compatible log-probs are at temperature 1.0 only, got "
                               f"score_temperature={batch.score_temperature}")
        if batch.score_top_k is not None and self.max_logprobs is not None and batch.score_top_k > self.max_logprobs:
            raise TeacherError(ErrorCode.UNSUPPORTED, f"score_top_k={batch.score_top_k} exceeds the server's "
                               f"max_logprobs={self.max_logprobs}")
        if self._vocab is None:
            self._vocab = self.info().tokenizer_size
        vocab = self._vocab
        payload = {"model": self.model, "n": batch.num_samples, "temperature": batch.temperature,
                   "top_p": batch.top_p, "top_k": batch.top_k, "max_tokens": batch.max_tokens,
                   "stop_token_ids": list(batch.stop_ids), "ignore_eos": True, "return_token_ids": True}
        if batch.score_top_k is not None:
            payload |= {"logprobs": batch.score_top_k, "return_tokens_as_token_ids": True}
        prompts = [prompt.tolist() for prompt in batch.prompts]
        if batch.seed is None:
            choices = _choices(self._post(payload | {"prompt": prompts}), batch.num_responses)
        else:
            seeds = sampling.row_seeds(batch)[::batch.num_samples]  # sample 0 of each prompt
            choices = [choice for prompt, seed in zip(prompts, seeds)
                       for choice in _choices(self._post(payload | {"prompt": [prompt], "seed": seed}),
                                              batch.num_samples)]
        name = f"generate request to {self.base_url}"
        samples = [_parse_sample(choice, batch, index, f"{name}: response {index}")
                   for index, choice in enumerate(choices)]
        return check_generated(samples, batch, vocab, name=name)


def _choices(response, count: int) -> list[dict]:
    """``response["choices"]`` ordered by index; raises TeacherOutputError unless exactly 0..count-1."""
    choices = response.get("choices") if isinstance(response, dict) else None
    if not isinstance(choices, list) or len(choices) != count:
        raise TeacherOutputError(f"server returned {len(choices) if isinstance(choices, list) else 'no'} "
                                 f"choices for {count} prompts")
    by_index = {}
    for choice in choices:
        index = choice.get("index") if isinstance(choice, dict) else None
        if type(index) is not int or not 0 <= index < count or index in by_index:
            raise TeacherOutputError(f"choice indices must be 0..{count - 1}, each once; got "
                                     f"{str(choice)[:100]!r}")
        by_index[index] = choice
    return [by_index[i] for i in range(count)]


def _as_logprob(value, name: str) -> float:
    if type(value) not in (int, float):  # bool, None, strings and lists are not log-probs
        raise TeacherOutputError(f"{name}: log-prob {value!r} is not a number")
    return -np.inf if value <= _NEG_INF_SENTINEL else float(value)


def _echoed(choice: dict, sequence: SequenceRequest, name: str) -> list:
    """``top_logprobs`` of one choice after checking the echo is exactly the prompt that was sent.

    A server that adds a token (a BOS) or changes one would shift every row by a position; the
    rows would still look plausible, so the echoed tokens themselves are compared.
    """
    logprobs = choice.get("logprobs")
    top = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
    tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
    length = len(sequence.token_ids)
    if not isinstance(top, list) or not isinstance(tokens, list) or len(top) != len(tokens):
        raise TeacherOutputError(f"{name}: the answer lacks the echoed logprobs.tokens and "
                                 "top_logprobs of equal length; start the request with echo=true")
    if not length <= len(tokens) <= length + 1:  # the prompt, then at most max_tokens=1 generated
        raise TeacherOutputError(f"{name}: the server echoed {len(tokens)} positions for a prompt of "
                                 f"{length} tokens")
    sent = [f"token_id:{token}" for token in sequence.token_ids.tolist()]
    if tokens[:length] != sent:
        position = next(p for p, (a, b) in enumerate(zip(tokens, sent)) if a != b)
        raise TeacherOutputError(f"{name}: the echoed prompt differs from the tokens sent at position "
                                 f"{position} ({tokens[position]!r} != {sent[position]!r}); the server "
                                 "must score the ids as given (no added BOS, no re-tokenisation)")
    return top


def _parse_row(entries, position: int, name: str) -> dict[int, float]:
    if not isinstance(entries, dict) or not entries:
        raise TeacherOutputError(f"{name}: position {position} has no log-probs ({str(entries)[:80]!r})")
    parsed = {}
    for key, value in entries.items():
        match = _TOKEN_KEY.fullmatch(key) if isinstance(key, str) else None
        if match is None:
            raise TeacherOutputError(f"{name}: position {position} key {str(key)[:40]!r} is not "
                                     "'token_id:N'; start the request with return_tokens_as_token_ids")
        parsed[int(match.group(1))] = _as_logprob(value, f"{name} position {position}")
    return parsed


def _parse_choice(choice: dict, sequence: SequenceRequest, top_k: int, name: str) -> TeacherOutput:
    """TeacherOutput of one echoed prompt; raises TeacherOutputError naming ``name`` when malformed."""
    top = _echoed(choice, sequence, name)
    start = sequence.response_start
    return _parse_rows(top[start:start + sequence.num_response_tokens], sequence.response_ids, top_k, name, start)


def _parse_sample(choice: dict, batch: GenerateBatch, index: int, name: str) -> GeneratedSample:
    """The response (and its rows, when asked) of one generated choice; raises TeacherOutputError."""
    token_ids = choice.get("token_ids")
    if not (isinstance(token_ids, list) and all(type(t) is int and 0 <= t < 2**31 for t in token_ids)):
        raise TeacherOutputError(f"{name}: token_ids {str(token_ids)[:80]!r} are not a list of ids >= 0; the server "
                                 "must support return_token_ids (vLLM)")
    prompt_index = index // batch.num_samples
    if choice.get("prompt_token_ids") not in (None, batch.prompts[prompt_index].tolist()):
        raise TeacherOutputError(f"{name}: the server answered another prompt than the ids sent (an added BOS, or "
                                 "re-tokenisation?)")
    response = np.array(token_ids, dtype=np.int64)
    output = None
    if batch.score_top_k is not None:
        logprobs = choice.get("logprobs")
        top = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
        tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
        if not isinstance(top, list) or tokens != [f"token_id:{t}" for t in token_ids] or len(top) != len(token_ids):
            raise TeacherOutputError(f"{name}: logprobs.tokens and top_logprobs do not match the {len(token_ids)} "
                                     "response tokens")
        output = _parse_rows(top, response, batch.score_top_k, name, 0)
    return GeneratedSample(prompt_index=prompt_index, response_ids=response, output=output)


def _parse_rows(top: list, tokens: np.ndarray, top_k: int, name: str, first_position: int) -> TeacherOutput:
    """The rows of ``tokens``: ``top[t]`` is the top-k map of the position that predicts ``tokens[t]``."""
    rows = len(tokens)
    topk_ids = np.zeros((rows, top_k), dtype=np.int64)
    topk_logprobs = np.full((rows, top_k), -np.inf, dtype=np.float32)
    token_logprobs = np.zeros(rows, dtype=np.float32)
    for t in range(rows):
        position, token = first_position + t, int(tokens[t])
        parsed = _parse_row(top[t], position, f"{name} row {t}")
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
