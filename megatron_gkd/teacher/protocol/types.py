"""What the trainer sends to a teacher and what it gets back (docs/design.md, "Data contracts").

Row ``t`` of every per-response array predicts response token ``t``: it is the teacher's distribution
at position ``prompt_len + t - 1`` of ``prompt + response``. Everything here fails closed: a malformed
teacher answer raises :class:`TeacherOutputError` naming the sequence, it is never padded with 0.

A batch asks for one of two signals (docs/teacher_protocol.md "Choosing a signal"): ``topk`` (the
teacher's top-k log-probs per row) or ``hidden`` (the teacher's final hidden state per row, after its
last norm: the input of its output layer, from which the trainer recomputes the whole row of logits).
"""

from __future__ import annotations

import dataclasses
import enum
import math

import numpy as np

from megatron_gkd.registry import Choice


class Signal(Choice):
    """What a teacher sends per response token (``teacher.signal``, ``ScoreBatch.signal``)."""

    TOPK = "topk"
    """The teacher's top-k ids and log-probs (and, for TCAD, its log-probs at requested ids)."""
    HIDDEN = "hidden"
    """The teacher's final hidden states ``[T, h]``; the trainer makes the distribution with the teacher's head."""

    @property
    def sends_topk(self) -> bool:
        """The teacher's rows are its top-k, and it scores requested ids itself (TCAD)."""
        return self is Signal.TOPK

    @property
    def sends_hidden(self) -> bool:
        """The teacher's rows are hidden states (``TeacherOutput.hidden``; the cache stores them)."""
        return self is Signal.HIDDEN

    @property
    def needs_head(self) -> bool:
        """The trainer holds the teacher's output layer (``teacher.head_checkpoint``) to turn hidden states into
        log-probs, and checks it against the teacher's token log-probs."""
        return self is Signal.HIDDEN


# The dtypes hidden states may travel in.
TEACHER_SIGNALS = Signal.values()
HIDDEN_DTYPES = ("bfloat16", "float16", "float32")


class ErrorCode(str, enum.Enum):
    """Typed error codes carried in error replies (wire) and raised as :class:`TeacherError`."""

    BAD_FRAME = "bad_frame"  # not a message of this protocol (frame count, msgpack, sizes)
    BAD_VERSION = "bad_version"
    BAD_SIGNATURE = "bad_signature"  # HMAC missing or wrong
    TOO_LARGE = "too_large"
    BAD_REQUEST = "bad_request"  # a well-formed message whose content is invalid
    UNSUPPORTED = "unsupported"  # valid, but this backend cannot do it (e.g. requested ids on vLLM)
    BACKEND_FAILED = "backend_failed"
    UNAVAILABLE = "unavailable"  # no teacher answered before the deadline
    BAD_OUTPUT = "bad_output"  # the teacher answered, but the answer breaks the contract


class TeacherError(RuntimeError):
    """A teacher call failed; ``code`` says how (one of :class:`ErrorCode`)."""

    def __init__(self, code: ErrorCode | str, message: str):
        self.code = ErrorCode(code)
        super().__init__(f"[{self.code.value}] {message}")
        self.detail = message


class TeacherOutputError(TeacherError):
    """A teacher output breaks the TeacherOutput contract (missing row, NaN, bad shape, ...)."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.BAD_OUTPUT, message)


@dataclasses.dataclass(kw_only=True, slots=True)
class SequenceRequest:
    """One prompt+response to score.

    Attributes:
        token_ids: ``[prompt_len + T]`` int64, prompt followed by the response.
        response_start: ``prompt_len``, index of the first response token (>= 1: row 0 needs context).
        requested_ids: optional ``[T, m]`` int64 ids to score at every response row (TCAD).
    """

    token_ids: np.ndarray
    response_start: int
    requested_ids: np.ndarray | None = None

    def __post_init__(self):
        self.token_ids = np.ascontiguousarray(self.token_ids, dtype=np.int64)
        if self.token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {self.token_ids.shape}")
        if not 1 <= self.response_start < len(self.token_ids):
            raise ValueError(
                f"response_start={self.response_start} must satisfy 1 <= response_start < "
                f"len(token_ids)={len(self.token_ids)}: the prompt needs at least one token and the "
                "response at least one"
            )
        if self.requested_ids is not None:
            self.requested_ids = np.ascontiguousarray(self.requested_ids, dtype=np.int64)
            if self.requested_ids.ndim != 2 or self.requested_ids.shape[0] != self.num_response_tokens:
                raise ValueError(
                    f"requested_ids must be [T={self.num_response_tokens}, m], "
                    f"got {self.requested_ids.shape}"
                )

    @property
    def num_response_tokens(self) -> int:
        return len(self.token_ids) - self.response_start

    @property
    def response_ids(self) -> np.ndarray:
        return self.token_ids[self.response_start :]


@dataclasses.dataclass(kw_only=True, slots=True)
class ScoreBatch:
    """A batch of sequences scored with the same signal, top-k size and temperature.

    Attributes:
        sequences: the sequences, in the order their outputs come back.
        top_k: number of top entries per row (k); not read with ``signal="hidden"``.
        temperature: the teacher distribution is ``softmax(logits / temperature)``. With
            ``signal="hidden"`` it applies to ``token_logprobs`` only: hidden states have none.
        signal: a :class:`Signal` (``"topk"`` or ``"hidden"``: final hidden states; requested ids are refused);
            a string is converted.
        hidden_dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``: the dtype the hidden states
            travel in (clients always receive float32); not read with ``signal="topk"``.
    """

    sequences: list[SequenceRequest]
    top_k: int
    temperature: float = 1.0
    signal: Signal = Signal.TOPK
    hidden_dtype: str = "bfloat16"

    def __post_init__(self):
        if not self.sequences:
            raise ValueError("ScoreBatch.sequences is empty; send at least one sequence")
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"ScoreBatch.top_k={self.top_k!r} must be a positive int")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ValueError(f"ScoreBatch.temperature={self.temperature!r} must be finite and > 0")
        self.temperature = float(self.temperature)
        if self.signal not in TEACHER_SIGNALS:
            raise ValueError(f"ScoreBatch.signal={self.signal!r} must be one of {', '.join(TEACHER_SIGNALS)}")
        self.signal = Signal(self.signal)
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise ValueError(f"ScoreBatch.hidden_dtype={self.hidden_dtype!r} must be one of "
                             f"{', '.join(HIDDEN_DTYPES)}")
        if not self.signal.sends_topk and any(s.requested_ids is not None for s in self.sequences):
            raise ValueError("requested_ids are scored on the top-k signal only: with signal='hidden' the "
                             "trainer recomputes every id's logit itself; drop requested_ids")
        widths = {None if s.requested_ids is None else s.requested_ids.shape[1] for s in self.sequences}
        if len(widths) > 1:
            raise ValueError(
                f"requested_ids must be given for all sequences of a batch with one width m, or for "
                f"none; got widths {sorted(widths, key=str)}"
            )

    @property
    def is_hidden(self) -> bool:
        """Whether the batch asks for hidden states rather than the top-k."""
        return self.signal.sends_hidden

    @property
    def num_requested(self) -> int | None:
        """m, the number of requested ids per row, or None when none are requested."""
        first = self.sequences[0].requested_ids
        return None if first is None else first.shape[1]


@dataclasses.dataclass(kw_only=True, slots=True)
class TeacherOutput:
    """The teacher's answer for one response of ``T`` tokens.

    Attributes:
        topk_ids: ``[T, k]`` int64, the k most likely ids per row (``[T, 0]`` for the hidden signal).
        topk_logprobs: ``[T, k]`` float32, sorted descending, normalised over the full vocabulary;
            entries past the available ones are ``-inf`` (never 0). ``[T, 0]`` for the hidden signal.
        token_logprobs: ``[T]`` float32, log-prob of the response token itself (both signals).
        requested_logprobs: optional ``[T, m]`` float32, log-probs at the requested ids (TCAD).
        hidden: hidden signal only: ``[T, h]`` float32, the teacher's final hidden state (after its
            last norm, the input of its output layer) at the position that predicts response token t;
            the values of the wire dtype, widened. None for the top-k signal.
    """

    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    token_logprobs: np.ndarray
    requested_logprobs: np.ndarray | None = None
    hidden: np.ndarray | None = None

    def validate(self, num_tokens: int, top_k: int, num_requested: int | None = None,
                 name: str = "sequence", sequence: SequenceRequest | None = None,
                 hidden_size: int | None = None) -> "TeacherOutput":
        """Checks the contract and returns self; raises :class:`TeacherOutputError` naming ``name``.

        Args:
            num_tokens: expected T (response length).
            top_k: expected k (not read when ``hidden_size`` is given: the top-k is then ``[T, 0]``).
            num_requested: expected m, or None when no requested ids were sent.
            name: how errors name this sequence (e.g. ``"sequence 3 of request 17"``).
            sequence: the request these rows answer; when given, the log-prob of each response
                token (and of each requested id) must equal the top-k entry of the same id.
            hidden_size: h when the output answers a hidden-signal request (then ``hidden`` must be
                ``[T, h]`` float32 and finite), None for a top-k request (then it must be None).
        """
        def fail(what: str):
            raise TeacherOutputError(f"{name}: {what}")

        if hidden_size is not None:
            if num_requested is not None:
                fail("requested ids cannot be answered with the hidden signal")
            top_k = 0
            if self.hidden is None:
                fail("hidden missing although the hidden signal was requested")
        elif self.hidden is not None:
            fail("hidden present although the top-k signal was requested")
        arrays = {"topk_ids": (self.topk_ids, np.int64, (num_tokens, top_k)),
                  "topk_logprobs": (self.topk_logprobs, np.float32, (num_tokens, top_k)),
                  "token_logprobs": (self.token_logprobs, np.float32, (num_tokens,))}
        if num_requested is not None:
            if self.requested_logprobs is None:
                fail("requested_logprobs missing although requested ids were sent")
            arrays["requested_logprobs"] = (self.requested_logprobs, np.float32,
                                            (num_tokens, num_requested))
        elif self.requested_logprobs is not None:
            fail("requested_logprobs present although no ids were requested")
        if hidden_size is not None:
            arrays["hidden"] = (self.hidden, np.float32, (num_tokens, hidden_size))
        for key, (array, dtype, shape) in arrays.items():
            if not isinstance(array, np.ndarray) or array.dtype != dtype:
                fail(f"{key} must be a numpy {np.dtype(dtype).name} array, got "
                     f"{getattr(array, 'dtype', type(array).__name__)}")
            if array.shape != shape:
                fail(f"{key} has shape {array.shape}, expected {shape} (missing or extra rows?)")
        if hidden_size is not None and not np.isfinite(self.hidden).all():
            row = int(np.argwhere(~np.isfinite(self.hidden))[0][0])
            fail(f"hidden has a non-finite value (NaN or inf) at row {row}")
        for key in ("topk_logprobs", "token_logprobs", "requested_logprobs"):
            values = arrays.get(key, (None,))[0]
            if values is None:
                continue
            if np.isnan(values).any():
                row = int(np.argwhere(np.isnan(values))[0][0])
                fail(f"{key} has NaN at row {row}")
            if (values > 1e-4).any() or np.isposinf(values).any():
                fail(f"{key} has a positive log-prob (max {float(values.max())})")
        if np.isneginf(self.token_logprobs).any():
            fail("token_logprobs has -inf: the teacher gives the sampled token zero probability")
        if hidden_size is not None:
            return self  # no top-k entries: nothing below applies
        lp = self.topk_logprobs
        if num_tokens and top_k > 1 and (np.diff(lp, axis=1) > 1e-6).any():
            row = int(np.argwhere((np.diff(lp, axis=1) > 1e-6).any(axis=1))[0][0])
            fail(f"topk_logprobs row {row} is not sorted descending")
        if num_tokens and np.isneginf(lp[:, 0]).any():
            fail(f"row {int(np.argwhere(np.isneginf(lp[:, 0]))[0][0])} has no finite top-1 entry")
        if (self.topk_ids < 0).any():
            fail("topk_ids has negative ids")
        # Padding slots (-inf) may repeat a filler id; real entries must be distinct.
        real = np.where(np.isneginf(lp), -1 - np.arange(top_k), self.topk_ids)
        if top_k > 1 and (np.diff(np.sort(real, axis=1), axis=1) == 0).any():
            fail(f"topk_ids repeats an id in row "
                 f"{int(np.argwhere((np.diff(np.sort(real, axis=1), axis=1) == 0).any(axis=1))[0][0])}")
        if num_tokens:
            # The top-k is part of one distribution: its probabilities cannot sum past 1 (raw logits
            # or a wrong temperature would). float32 rounding over k entries stays far below this.
            top = lp[:, :1]  # the row's maximum (sorted, finite: checked above)
            # numpy sums rows pairwise: float32 rounding stays ~1e-6 here, far below the tolerance,
            # at a fifth of the cost of np.logaddexp.reduce.
            lse = top[:, 0] + np.log(np.exp(lp - top).sum(axis=1))
            if (lse > NORMALISATION_TOLERANCE).any():
                row = int(np.argmax(lse))
                fail(f"topk_logprobs row {row} is not normalised: its probabilities sum to "
                     f"{float(np.exp(lse[row])):.4f} > 1")
        if sequence is not None:
            _check_agreement(fail, real, lp, sequence.response_ids[:, None],
                             self.token_logprobs[:, None], "token_logprobs")
            if num_requested:
                _check_agreement(fail, real, lp, sequence.requested_ids, self.requested_logprobs,
                                 "requested_logprobs")
        return self


NORMALISATION_TOLERANCE = 1e-3  # nats: logsumexp of a row's top-k log-probs may exceed 0 by this much
AGREEMENT_TOLERANCE = 1e-4  # nats: the same id's log-prob reported twice in one row


def _check_agreement(fail, topk_ids: np.ndarray, topk_logprobs: np.ndarray, ids: np.ndarray,
                     logprobs: np.ndarray, key: str) -> None:
    """``logprobs[t, j]`` (of id ``ids[t, j]``) must equal the top-k entry of the same id in row t.

    An id outside the top-k must not be more likely than the k-th entry of a full row.
    """
    match = topk_ids[:, None, :] == ids[:, :, None]  # [T, m, k]; padding slots never match
    found = match.any(axis=2)
    listed = np.take_along_axis(topk_logprobs, match.argmax(axis=2), axis=1)  # [T, m]
    wrong = found & ~(np.abs(listed - logprobs) <= AGREEMENT_TOLERANCE)
    if wrong.any():
        row, column = (int(i) for i in np.argwhere(wrong)[0])
        fail(f"{key} row {row} gives id {int(ids[row, column])} log-prob {float(logprobs[row, column])}, "
             f"but its top-k entry says {float(listed[row, column])}")
    floor = np.where(np.isneginf(topk_logprobs[:, -1]), np.inf, topk_logprobs[:, -1])[:, None]
    above = ~found & (logprobs > floor + AGREEMENT_TOLERANCE)
    if above.any():
        row, column = (int(i) for i in np.argwhere(above)[0])
        fail(f"{key} row {row} gives id {int(ids[row, column])} log-prob {float(logprobs[row, column])}, "
             f"above the k-th top-k entry {float(floor[row, 0])}, yet the id is not in the top-k")


MAX_STOP_IDS = 64  # stop ids per generate request: end-of-turn tokens, never a list to scan at length


@dataclasses.dataclass(kw_only=True, slots=True)
class GenerateBatch:
    """Prompts the teacher answers with its own samples (sequence-level KD, GKD's teacher data).

    Every prompt gets ``num_samples`` responses, sampled from ``softmax(logits / temperature)`` of the
    teacher restricted by ``top_k`` and ``top_p``. A response ends with the first stop id it samples
    (kept: the student must learn to end) or after ``max_tokens`` tokens; it has at least one token.

    Attributes:
        prompts: ``[P_i]`` int64 token ids per prompt, in the teacher's (= the student's) vocabulary.
        num_samples: responses per prompt (``n``).
        temperature: sampling temperature; 0 samples greedily (the arg-max, ties to the lowest id).
        top_p: nucleus sampling: the smallest set of most likely ids whose probability reaches it (1: all).
        top_k: sample among the k most likely ids only (0: the whole vocabulary).
        max_tokens: longest response.
        stop_ids: ids that end a response (e.g. the tokenizer's end-of-sequence id); none: only
            ``max_tokens`` ends it.
        seed: makes a backend's samples repeat: the same request to the same teacher gives the same
            responses. Sample ``j`` of prompt ``i`` draws from its own stream, seeded with
            ``(seed, i, j)``, so it does not depend on how the backend groups rows. None: fresh entropy.
        score_top_k: also return each response's scored rows (k per row, as a :class:`ScoreBatch` of
            prompt + response would), in the same round trip; None: responses only.
        score_temperature: the temperature of those rows (the loss's teacher temperature, not the
            sampling one).
    """

    prompts: list[np.ndarray]
    num_samples: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop_ids: tuple[int, ...] = ()
    seed: int | None = None
    score_top_k: int | None = None
    score_temperature: float = 1.0

    def __post_init__(self):
        if not self.prompts:
            raise ValueError("GenerateBatch.prompts is empty; send at least one prompt")
        self.prompts = [np.ascontiguousarray(p, dtype=np.int64) for p in self.prompts]
        for index, prompt in enumerate(self.prompts):
            if prompt.ndim != 1 or len(prompt) < 1 or (prompt < 0).any():
                raise ValueError(f"GenerateBatch.prompts[{index}] must be 1-D, non-empty ids >= 0, got shape "
                                 f"{prompt.shape}")
        for name in ("num_samples", "max_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:  # type(): True is an int to Python
                raise ValueError(f"GenerateBatch.{name}={value!r} must be a positive int")
        if type(self.top_k) is not int or self.top_k < 0:
            raise ValueError(f"GenerateBatch.top_k={self.top_k!r} must be an int >= 0 (0: the whole vocabulary)")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"GenerateBatch.temperature={self.temperature!r} must be finite and >= 0 (0: greedy)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"GenerateBatch.top_p={self.top_p!r} must be in (0, 1]")
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        self.stop_ids = tuple(int(i) for i in self.stop_ids)
        if len(self.stop_ids) > MAX_STOP_IDS or any(i < 0 for i in self.stop_ids):
            raise ValueError(f"GenerateBatch.stop_ids={self.stop_ids!r} must be at most {MAX_STOP_IDS} ids >= 0")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < 2**63):
            raise ValueError(f"GenerateBatch.seed={self.seed!r} must be None or an int in [0, 2**63)")
        if self.score_top_k is not None and (type(self.score_top_k) is not int or self.score_top_k < 1):
            raise ValueError(f"GenerateBatch.score_top_k={self.score_top_k!r} must be None or a positive int")
        if not (isinstance(self.score_temperature, (int, float)) and math.isfinite(self.score_temperature)
                and self.score_temperature > 0):
            raise ValueError(f"GenerateBatch.score_temperature={self.score_temperature!r} must be finite and > 0")
        self.score_temperature = float(self.score_temperature)

    @property
    def num_responses(self) -> int:
        """Responses the teacher returns: ``len(prompts) * num_samples``."""
        return len(self.prompts) * self.num_samples

    def score_batch(self, samples: list["GeneratedSample"]) -> ScoreBatch:
        """The ScoreBatch of each sample's prompt + response, whose rows ``score_top_k`` asks for."""
        assert self.score_top_k is not None, "only a batch that asks for scored rows has a ScoreBatch"
        return ScoreBatch(sequences=[sample.sequence(self.prompts[sample.prompt_index]) for sample in samples],
                          top_k=self.score_top_k, temperature=self.score_temperature)


@dataclasses.dataclass(kw_only=True, slots=True)
class GeneratedSample:
    """One teacher response to one prompt of a :class:`GenerateBatch`.

    Responses come back prompt by prompt: ``num_samples`` for prompt 0, then for prompt 1, and so on.

    Attributes:
        prompt_index: which prompt of the batch it answers.
        response_ids: ``[T]`` int64, ``1 <= T <= max_tokens``; the last id is a stop id when the
            response stopped, and no earlier id is one.
        output: the scored rows of prompt + response (``[T, score_top_k]``) when the batch asked for
            them, else None.
    """

    prompt_index: int
    response_ids: np.ndarray
    output: TeacherOutput | None = None

    def sequence(self, prompt: np.ndarray) -> SequenceRequest:
        """Prompt + this response, as a sequence to score."""
        return SequenceRequest(token_ids=np.concatenate([prompt, self.response_ids]), response_start=len(prompt))

    def finish_reason(self, stop_ids: tuple[int, ...]) -> str:
        """``"stop"`` when the response ends with one of ``stop_ids``, else ``"length"``."""
        return "stop" if len(self.response_ids) and int(self.response_ids[-1]) in stop_ids else "length"


def check_generated(samples: list[GeneratedSample], batch: GenerateBatch, vocab_size: int,
                    name: str = "generate request") -> list[GeneratedSample]:
    """Checks teacher responses against the request; returns them, or raises naming what is wrong.

    Args:
        samples: the responses, in the order :class:`GeneratedSample` describes.
        batch: the request they answer.
        vocab_size: ids at or past it are not tokens (the teacher's tokenizer size).
        name: how errors name the request.

    Raises:
        TeacherOutputError: a response is missing or extra, out of order, empty, longer than
            ``max_tokens``, holds an id outside ``[0, vocab_size)``, goes on past a stop id, ends short of
            ``max_tokens`` without one, or its scored rows break the TeacherOutput contract.
    """
    if len(samples) != batch.num_responses:
        raise TeacherOutputError(f"{name}: {len(samples)} responses for {len(batch.prompts)} prompts x "
                                 f"num_samples={batch.num_samples}; expected {batch.num_responses}")
    stops = np.array(batch.stop_ids, dtype=np.int64)
    for index, sample in enumerate(samples):
        where = f"{name}: response {index} (prompt {index // batch.num_samples}, sample {index % batch.num_samples})"

        def fail(what: str):
            raise TeacherOutputError(f"{where}: {what}")

        if sample.prompt_index != index // batch.num_samples:
            fail(f"answers prompt {sample.prompt_index}: responses must come prompt by prompt")
        ids = sample.response_ids
        if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 1:
            fail(f"response_ids must be a 1-D int64 array, got {getattr(ids, 'dtype', type(ids).__name__)}")
        if not 1 <= len(ids) <= batch.max_tokens:
            fail(f"has {len(ids)} tokens; a response has 1..max_tokens={batch.max_tokens}")
        outside = (ids < 0) | (ids >= vocab_size)
        if outside.any():
            position = int(np.argmax(outside))
            fail(f"token {position} is id {int(ids[position])}, outside the teacher's vocabulary of {vocab_size} ids")
        stopped = np.isin(ids[:-1], stops)
        if stopped.any():
            fail(f"goes on after stop id {int(ids[int(np.argmax(stopped))])} at token {int(np.argmax(stopped))}")
        if sample.finish_reason(batch.stop_ids) == "length" and len(ids) != batch.max_tokens:
            fail(f"ends after {len(ids)} tokens without a stop id, short of max_tokens={batch.max_tokens}")
        if batch.score_top_k is None:
            if sample.output is not None:
                fail("carries scored rows although none were asked for")
        elif sample.output is None:
            fail(f"has no scored rows although score_top_k={batch.score_top_k} was asked for")
        else:
            sample.output.validate(len(ids), batch.score_top_k, name=where,
                                   sequence=sample.sequence(batch.prompts[sample.prompt_index]))
    return samples
