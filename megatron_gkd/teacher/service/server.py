"""The teacher service: a proxy (proxy.py) in front of any number of scoring workers.

Clients (DEALER) connect to the proxy's frontend; workers (DEALER) connect to its backend, possibly
from other hosts, register by answering the proxy's challenge, and then get one request at a time.
A worker checks every request again, bounds the work it asks for before computing anything, and
answers with a result or a typed error. ``launch/teacher_server.py`` is the command line.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading

import numpy as np
import zmq

from megatron_gkd.teacher.backends import BackendInfo, TeacherBackend
from megatron_gkd.teacher.protocol import codec, wire
from megatron_gkd.teacher.protocol.security import RefusalLog, check_exposure, is_loopback  # noqa: F401 - re-exported
from megatron_gkd.teacher.protocol.types import ErrorCode, GenerateBatch, ScoreBatch, SequenceRequest, TeacherError, check_generated
from megatron_gkd.teacher.service.proxy import Proxy  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often the loop looks at its stop flag
_RESULT_OVERHEAD = 4096  # bytes of a result besides its rows: MAC, msgpack header, num_rows slack
# What a generate request holds on the worker's host per response and per token of ``max_tokens``, besides the
# model's activations (bounded by the backend's own batch limit) and the reply. Measured on the hf backend
# (issue #48): 1.7 KB a response (its seed, row bookkeeping, the response's array and sample, the allocator's
# share), rounded up; a token is its float64 uniform, the sampled id and the response's int64 id, with slack.
GENERATE_RESPONSE_BYTES = 2048
GENERATE_TOKEN_BYTES = 32


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class WorkLimits:
    """Bounds on the work one request may ask of a worker, checked before any compute.

    The sequence length (the model's context), k (``max_top_k``) and the reply size (the wire's
    ``max_message_bytes``) are bounded too; those limits come from the backend and the wire.

    Attributes:
        max_request_tokens: tokens (prompt + response) of all sequences of one request; for a generate
            request every response counts as its prompt plus ``max_tokens``.
        max_generate_prompts: prompts of one generate request.
        max_new_tokens: ``max_tokens`` (the longest response) a generate request may ask for.
        max_generate_bytes: host memory a generate request may hold, as :func:`generate_bytes` estimates it
            (its responses' bookkeeping, one token's worth per ``max_tokens`` of each, and the reply). The token
            bound alone let 1,024 prompts x 1,024 one-token samples hold 3.3 GB (issue #48): a million
            responses cost far more than their two million tokens.
    """

    max_request_tokens: int = 2**21
    max_generate_prompts: int = 4096
    max_new_tokens: int = 8192
    max_generate_bytes: int = 2**30

    def __post_init__(self):
        if self.max_request_tokens < 2:
            raise ValueError(f"WorkLimits.max_request_tokens={self.max_request_tokens} must be >= 2")
        if self.max_generate_prompts < 1 or self.max_new_tokens < 1:
            raise ValueError(f"WorkLimits.max_generate_prompts={self.max_generate_prompts} and max_new_tokens="
                             f"{self.max_new_tokens} must be >= 1")
        if self.max_generate_bytes < 2**20:
            raise ValueError(f"WorkLimits.max_generate_bytes={self.max_generate_bytes} must be >= 1 MiB")


def result_bytes(batch: ScoreBatch, hidden_size: int | None = None) -> int:
    """Upper bound of the size of the RESULT message answering ``batch`` (``hidden_size``: the
    backend's h, for the hidden signal)."""
    rows = sum(s.num_response_tokens for s in batch.sequences)
    return rows * codec.result_row_bytes(batch, hidden_size) + 8 * len(batch.sequences) + _RESULT_OVERHEAD


def generate_bytes(batch: GenerateBatch, reply_bytes: int) -> int:
    """Estimated host memory a worker holds for ``batch`` (see ``GENERATE_RESPONSE_BYTES``), ``reply_bytes``
    being the bound of its reply."""
    return batch.num_responses * (GENERATE_RESPONSE_BYTES + batch.max_tokens * GENERATE_TOKEN_BYTES) + reply_bytes


def check_work(batch: ScoreBatch, info: BackendInfo, work: WorkLimits, limits: wire.Limits) -> None:
    """Refuses, with a typed TeacherError, a request whose work or answer would pass a bound."""
    if batch.num_requested is not None and not info.supports_requested_ids:
        raise TeacherError(ErrorCode.UNSUPPORTED, f"the {info.name} backend cannot score "
                           "requested ids (TCAD); use the hf or megatron backend")
    if batch.temperature != 1.0 and not info.supports_temperature:
        raise TeacherError(ErrorCode.UNSUPPORTED, f"the {info.name} backend scores at temperature 1.0 "
                           f"only, got {batch.temperature}; set teacher.temperature=1.0, or serve this "
                           "teacher with the hf or megatron backend")
    if batch.signal not in info.signals:
        raise TeacherError(ErrorCode.UNSUPPORTED, f"the {info.name} backend serves the signals {info.signals}, "
                           f"not {batch.signal!r}; use the hf or megatron backend for hidden states")
    if not batch.is_hidden and batch.top_k > info.max_top_k:
        raise TeacherError(ErrorCode.UNSUPPORTED, f"top_k={batch.top_k} exceeds this teacher's max "
                           f"{info.max_top_k}")
    longest = max(len(s.token_ids) for s in batch.sequences)
    if info.max_sequence_length is not None and longest > info.max_sequence_length:
        raise TeacherError(ErrorCode.BAD_REQUEST, f"a sequence of {longest} tokens is longer than the "
                           f"teacher's context of {info.max_sequence_length} tokens")
    tokens = sum(len(s.token_ids) for s in batch.sequences)
    if tokens > work.max_request_tokens:
        raise TeacherError(ErrorCode.TOO_LARGE, f"the request holds {tokens} tokens, over this worker's "
                           f"max_request_tokens={work.max_request_tokens}; send smaller batches")
    size = result_bytes(batch, info.hidden_size)
    if size > limits.max_message_bytes:
        raise TeacherError(ErrorCode.TOO_LARGE, f"the result would have {size} bytes, over the limit "
                           f"of {limits.max_message_bytes}; send smaller batches")


def check_generate_work(batch: GenerateBatch, info: BackendInfo, work: WorkLimits, limits: wire.Limits) -> None:
    """Refuses, with a typed TeacherError, a generate request whose work or answer would pass a bound
    (before any token is sampled): too many prompts, too long responses, more tokens than a request may
    hold, longer than the context, ids outside the vocabulary, a reply over the message limit, more host memory
    than ``max_generate_bytes``, or scored rows the backend cannot give."""
    if not info.supports_generate:
        raise TeacherError(ErrorCode.UNSUPPORTED, f"the {info.name} teacher backend cannot generate; serve the "
                           "teacher with the hf, vllm or megatron backend")
    if len(batch.prompts) > work.max_generate_prompts:
        raise TeacherError(ErrorCode.TOO_LARGE, f"the request holds {len(batch.prompts)} prompts, over this "
                           f"worker's max_generate_prompts={work.max_generate_prompts}; send fewer prompts")
    if batch.max_tokens > work.max_new_tokens:
        raise TeacherError(ErrorCode.TOO_LARGE, f"max_tokens={batch.max_tokens} is over this worker's "
                           f"max_new_tokens={work.max_new_tokens}")
    longest = max(len(p) for p in batch.prompts) + batch.max_tokens
    if info.max_sequence_length is not None and longest > info.max_sequence_length:
        raise TeacherError(ErrorCode.BAD_REQUEST, f"a prompt plus max_tokens={batch.max_tokens} makes {longest} "
                           f"tokens, longer than the teacher's context of {info.max_sequence_length} tokens")
    tokens = batch.num_samples * (sum(len(p) for p in batch.prompts) + len(batch.prompts) * batch.max_tokens)
    if tokens > work.max_request_tokens:
        raise TeacherError(ErrorCode.TOO_LARGE, f"the request may hold {tokens} tokens (num_samples="
                           f"{batch.num_samples} x (prompts + max_tokens={batch.max_tokens} each)), over this "
                           f"worker's max_request_tokens={work.max_request_tokens}; send smaller batches")
    for what, ids in (("prompt", np.concatenate(batch.prompts)), ("stop", np.array(batch.stop_ids, np.int64))):
        if ids.size and int(ids.max()) >= info.tokenizer_size:
            raise TeacherError(ErrorCode.BAD_REQUEST, f"{what} id {int(ids.max())} is outside the teacher's "
                               f"vocabulary of {info.tokenizer_size}")
    row_bytes = 4  # the response id
    if batch.score_top_k is not None:
        scored = ScoreBatch(sequences=[SequenceRequest(token_ids=[0, 0], response_start=1)],
                            top_k=batch.score_top_k, temperature=batch.score_temperature)
        check_work(scored, info, work, limits)  # what the backend can score (k, temperature)
        row_bytes += codec.result_row_bytes(scored)
    size = batch.num_responses * (batch.max_tokens * row_bytes + 8) + _RESULT_OVERHEAD
    if size > limits.max_message_bytes:
        raise TeacherError(ErrorCode.TOO_LARGE, f"the reply may have {size} bytes, over the limit of "
                           f"{limits.max_message_bytes}; send fewer prompts or a smaller max_tokens")
    memory = generate_bytes(batch, size)
    if memory > work.max_generate_bytes:
        raise TeacherError(ErrorCode.TOO_LARGE, f"the request may hold {memory} bytes ({batch.num_responses} "
                           f"responses of up to {batch.max_tokens} tokens), over this worker's max_generate_bytes="
                           f"{work.max_generate_bytes}; send fewer prompts or samples")


class Worker:
    """Connects to a proxy's backend, registers, and answers requests with ``backend``.

    Args:
        connect: the proxy's backend address.
        backend: the scoring backend.
        secret: shared secret (must match the proxy's and the clients').
        insecure: allow a non-loopback address without a secret.
        limits: size limits of messages.
        work: bounds on the work of one request.
    """

    def __init__(self, connect: str, backend: TeacherBackend, secret: bytes | None = None,
                 insecure: bool = False, limits: wire.Limits = wire.Limits(),  # noqa: B008 - frozen
                 work: WorkLimits = WorkLimits()):
        check_exposure(connect, secret, insecure)
        self._backend, self._secret, self._limits, self._work = backend, secret, limits, work
        self._name = f"{socket.gethostname()}:{id(self):x}"
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
        self._socket.connect(connect)
        self._refusals = RefusalLog(logger, "messages")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_answered = 0
        self.refused: str | None = None  # why the proxy refused this worker, which then stopped
        if backend.info().max_sequence_length is None:
            logger.warning("the %s backend does not report its context length; sequence lengths are "
                           "bounded by max_request_tokens only", backend.info().name)

    def serve_forever(self) -> None:
        """Answers messages until :meth:`close` (or the process ends)."""
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(POLL_MS):
                self._handle(self._socket.recv_multipart(copy=True))
        self._socket.close()

    def start(self) -> "Worker":
        """Serves in a background thread (in-process workers, tests)."""
        self._thread = threading.Thread(target=self.serve_forever, name="teacher-worker", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._refusals.flush()

    def _handle(self, frames: list[bytes]) -> None:
        # The proxy sends [route, empty, message]; the reply goes back under the same route.
        if len(frames) < 3 or frames[1] != b"":
            self._refusals.refused("a message without routing envelope (%d frames)", len(frames))
            return
        envelope, body = frames[:2], frames[2:]
        try:
            message = wire.decode(body, self._limits, self._secret,
                                  expect=(*wire.REQUEST_TYPES, wire.CHALLENGE, wire.ERROR))
        except wire.WireError as error:
            kind = wire.peek_type(body)
            if kind in (wire.CHALLENGE, wire.ERROR):  # the proxy's own messages: never answered
                self._refusals.refused("the proxy's %s (%s); do proxy and worker share the secret?",
                                       kind, wire.peek_meta(body).get("message", error.detail))
                return
            self._refusals.refused("client message (%s)", error)
            self._send(envelope, wire.refusal_frames(error, body, self._secret))
            return
        if message.type == wire.ERROR:  # the proxy's, signed: a refused registration ends this worker
            if message.request_id != "register":
                self._refusals.refused("the proxy's error (%s)", message.meta.get("message"))
                return
            self.refused = str(message.meta.get("message", "the proxy refused this worker"))
            logger.error("teacher worker stops: %s", self.refused)
            self._stop.set()
            return
        if message.type == wire.CHALLENGE:
            # With its INFO: the proxy refuses a replica of another model than its first worker's.
            self._send(envelope, wire.encode(wire.REGISTER, "register", {
                "nonce": message.meta.get("nonce"), "name": self._name, "info": self._backend.info().to_dict()},
                secret=self._secret))
            return
        try:
            reply = self._answer(message)
        except TeacherError as error:
            self._refusals.refused("request %s (%s)", message.request_id, error)
            reply = wire.error_frames(message.request_id, error.code, error.detail, self._secret)
        except Exception as error:  # noqa: BLE001 - a backend bug must not kill the worker
            logger.exception("teacher backend failed")
            reply = wire.error_frames(message.request_id, ErrorCode.BACKEND_FAILED,
                                      f"{type(error).__name__}: {error}", self._secret)
        size = sum(len(frame) for frame in reply)
        if size > self._limits.max_message_bytes:
            # Sent anyway, the proxy would cut this worker off.
            reply = wire.error_frames(message.request_id, ErrorCode.TOO_LARGE,
                                      f"the result has {size} bytes, over the limit of "
                                      f"{self._limits.max_message_bytes}; send smaller batches",
                                      self._secret)
        self.num_answered += 1  # before the send: whoever holds the answer sees it counted
        self._send(envelope, reply)

    def _send(self, envelope: list[bytes], frames: list[bytes]) -> None:
        self._socket.send_multipart(envelope + frames, copy=False)

    def _answer(self, message: wire.Message) -> list[bytes]:
        if message.type == wire.INFO:
            return wire.encode(wire.INFO_RESULT, message.request_id, self._backend.info().to_dict(),
                               secret=self._secret)
        if message.type == wire.GENERATE:
            return self._generate(message)
        batch = codec.decode_request(message)
        outputs = self._score(batch, message.request_id)
        return codec.encode_result(message.request_id, outputs, self._secret, batch.hidden_dtype)

    def _score(self, batch: ScoreBatch, request_id: str) -> list:
        info = self._backend.info()
        check_work(batch, info, self._work, self._limits)
        outputs = self._backend.score(batch)
        hidden_size = info.hidden_size if batch.is_hidden else None
        for index, (output, sequence) in enumerate(zip(outputs, batch.sequences, strict=True)):
            output.validate(sequence.num_response_tokens, batch.top_k, batch.num_requested,
                            name=f"sequence {index} of request {request_id}", sequence=sequence,
                            hidden_size=hidden_size)
        return outputs

    def _generate(self, message: wire.Message) -> list[bytes]:
        """Samples the responses and, when asked, scores them in the same request (one round trip)."""
        batch = codec.decode_generate_request(message)
        info = self._backend.info()
        check_generate_work(batch, info, self._work, self._limits)
        samples = self._backend.generate(batch)
        if batch.score_top_k is not None:
            outputs = self._score(batch.score_batch(samples), message.request_id)
            samples = [dataclasses.replace(s, output=o) for s, o in zip(samples, outputs, strict=True)]
        # A backend that breaks the contract is a bug here, not the client's to find.
        check_generated(samples, batch, info.tokenizer_size, name=f"generate request {message.request_id}")
        return codec.encode_generated(message.request_id, samples, self._secret)
