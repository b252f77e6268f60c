"""``zmq`` client: talks to the teacher proxy, which spreads requests over its workers.

Each attempt uses a fresh DEALER socket: after a timeout the old socket may still hold a half-sent
request or a late reply for a dead worker, and a new identity guarantees the proxy cannot route stale
answers to the retry. On every connection the proxy first sends a challenge; the client answers it
(HELLO, signed) and sends its request right behind (see proxy.py for why). Attempts are bounded by
count and by a per-request deadline; a "busy" answer does not spend an attempt, it only makes the
client wait longer (doubling pauses up to ``backoff_max_s``) until the deadline. When the deadline
passes the client raises TeacherError(UNAVAILABLE) and returns nothing.

With ``split_requests=N`` a batch goes out as up to N sub-requests of contiguous sequences with about
equal tokens, all at once, so that N teacher replicas behind the proxy score it together; the outputs
are put back in the batch's order. Each sub-request retries on its own; if one still fails, the batch
fails and the other sub-requests' outputs are dropped: a step never trains on part of its teacher data.

``generate`` sends one GENERATE request (signed and retried like a score) and checks the reply against
the request and the teacher's vocabulary from its INFO, asked once.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid

import numpy as np
import zmq

from megatron_gkd.teacher.clients import RetryPolicy, TeacherClient, TeacherInfo
from megatron_gkd.teacher.protocol import codec, wire
from megatron_gkd.teacher.protocol.security import SECRET_ENV, check_exposure, load_secret  # noqa: F401 - re-exported
from megatron_gkd.teacher.protocol.types import ErrorCode, GenerateBatch, GeneratedSample, ScoreBatch, TeacherError, TeacherOutput

logger = logging.getLogger(__name__)

# Everything else would fail the same way again. UNAVAILABLE from the proxy means busy.
RETRYABLE = (ErrorCode.BACKEND_FAILED, ErrorCode.UNAVAILABLE)
BUSY = ErrorCode.UNAVAILABLE


class ZmqTeacherClient(TeacherClient):
    """Scores batches through a teacher proxy.

    Args:
        address: the proxy's frontend, e.g. ``tcp://127.0.0.1:5555``.
        secret: shared secret for HMAC (defaults to :func:`load_secret`).
        insecure: allow a non-loopback address without a secret.
        retry: timeouts, deadline and backoff.
        limits: size limits of received replies.
        max_inflight: concurrent :meth:`score_async` batches.
        split_requests: sub-requests per batch (see the module docstring); 1 sends each batch whole.
    """

    @classmethod
    def from_config(cls, config, secret: bytes | None = None):
        """Built from the ``teacher`` section (:class:`~megatron_gkd.teacher.config.TeacherConfig`)."""
        return cls(address=config.address, secret=secret if secret is not None else load_secret(config.secret_file),
                   insecure=config.insecure, retry=config.retry(), max_inflight=config.max_inflight,
                   split_requests=config.split_requests)

    def __init__(self, address: str, secret: bytes | None = None, insecure: bool = False,
                 retry: RetryPolicy | None = None, limits: wire.Limits | None = None,
                 max_inflight: int = 2, split_requests: int = 1):
        if split_requests < 1:
            raise ValueError(f"split_requests={split_requests} must be >= 1")
        super().__init__(max_inflight=max_inflight)
        self._split = split_requests
        # Sub-requests of every batch in flight; a pool apart from the batches' own, which wait on it.
        self._parts = (concurrent.futures.ThreadPoolExecutor(max_workers=split_requests * max_inflight,
                                                             thread_name_prefix="teacher-part")
                       if split_requests > 1 else None)
        self.address = address
        self._secret = secret if secret is not None else load_secret()
        check_exposure(address, self._secret, insecure)
        self._retry = retry or RetryPolicy()
        self._limits = limits or wire.Limits()
        self._context = zmq.Context.instance()
        self._info: TeacherInfo | None = None  # asked once, at the first hidden-signal or generate batch
        self._info_lock = threading.Lock()

    def info(self) -> TeacherInfo:
        request_id = uuid.uuid4().hex
        message = self._call(request_id, wire.encode(wire.INFO, request_id, secret=self._secret),
                             expect=wire.INFO_RESULT)
        meta = message.meta
        # Fields with defaults (hidden_size, signals) are absent from a server that predates them.
        fields = [f.name for f in dataclasses.fields(TeacherInfo)
                  if f.name in meta or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)]
        try:
            return TeacherInfo(**{name: meta[name] for name in fields})
        except (KeyError, TypeError, ValueError) as error:
            raise TeacherError(ErrorCode.BAD_OUTPUT, f"malformed teacher info: {error}") from None

    def _hidden_size(self, batch: ScoreBatch) -> int | None:
        """The teacher's h for a hidden-signal batch (from its INFO, asked once); None for top-k."""
        if not batch.is_hidden:
            return None
        info = self._cached_info()
        info.check_signal(batch, f"the teacher at {self.address}")
        return info.hidden_size

    def _cached_info(self) -> TeacherInfo:
        with self._info_lock:
            if self._info is None:
                self._info = self.info()
            return self._info

    def _generate(self, batch: GenerateBatch) -> list[GeneratedSample]:
        info = self._cached_info()
        if not info.supports_generate:
            raise TeacherError(ErrorCode.UNSUPPORTED, f"the teacher at {self.address} cannot generate (a backend "
                               "without sampling, or a server older than generate requests); serve it with the hf, "
                               "vllm or megatron backend")
        row_bytes = 4 + (0 if batch.score_top_k is None else 8 * batch.score_top_k + 4)
        reply_bytes = batch.num_responses * batch.max_tokens * row_bytes
        if reply_bytes > self._limits.max_message_bytes:
            raise ValueError(f"the teacher's answer to this generate batch may take {reply_bytes} bytes "
                             f"({batch.num_responses} responses of up to {batch.max_tokens} tokens), over the message "
                             f"limit of {self._limits.max_message_bytes}; send fewer prompts or a smaller max_tokens")
        request_id = uuid.uuid4().hex
        frames = codec.encode_generate_request(request_id, batch, self._secret)
        if (request_bytes := sum(len(frame) for frame in frames)) > self._limits.max_message_bytes:
            raise ValueError(f"this generate batch takes {request_bytes} bytes on the wire, over the message "
                             f"limit of {self._limits.max_message_bytes}; send fewer prompts")
        message = self._call(request_id, frames, expect=wire.GENERATED)
        vocab = info.tokenizer_size if info.tokenizer_size is not None else info.vocab_size
        return codec.decode_generated(message, batch, vocab)

    def close(self) -> None:
        super().close()
        if self._parts is not None:
            self._parts.shutdown(wait=True, cancel_futures=True)

    def _score(self, batch: ScoreBatch) -> list[TeacherOutput]:
        hidden_size = self._hidden_size(batch)
        blocks = split_sequences([len(s.token_ids) for s in batch.sequences], self._split)
        if len(blocks) == 1:
            return self._score_whole(batch, hidden_size)
        parts = [dataclasses.replace(batch, sequences=batch.sequences[block.start:block.stop]) for block in blocks]
        futures = [self._parts.submit(self._score_whole, part, hidden_size) for part in parts]
        done, pending = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        for future in futures:
            if future in done and future.exception() is not None:
                for other in pending:  # those still running end by their own deadline; dropped
                    other.cancel()
                raise future.exception()
        return [output for future in futures for output in future.result()]

    def _score_whole(self, batch: ScoreBatch, hidden_size: int | None) -> list[TeacherOutput]:
        rows = sum(s.num_response_tokens for s in batch.sequences)
        result_bytes = rows * codec.result_row_bytes(batch, hidden_size)
        if result_bytes > self._limits.max_message_bytes:
            per_row = f"h={hidden_size} in {batch.hidden_dtype}" if batch.is_hidden else f"k={batch.top_k}"
            raise ValueError(
                f"the teacher's answer to this batch would take {result_bytes} bytes ({rows} rows, "
                f"{per_row}), over the message limit of {self._limits.max_message_bytes}; "
                "score smaller batches or raise the limit on both sides (--max-message-mb)")
        request_id = uuid.uuid4().hex
        frames = codec.encode_request(request_id, batch, self._secret)
        request_bytes = sum(len(frame) for frame in frames)
        if request_bytes > self._limits.max_message_bytes:
            raise ValueError(f"this batch takes {request_bytes} bytes on the wire, over the message "
                             f"limit of {self._limits.max_message_bytes}; score smaller batches")
        message = self._call(request_id, frames, expect=wire.RESULT)
        return codec.decode_result(message, batch, hidden_size)

    def _call(self, request_id: str, frames: list[bytes], expect: str) -> wire.Message:
        policy = self._retry
        deadline = time.monotonic() + policy.deadline_s
        pause = policy.backoff_s
        untrusted: _Untrusted | None = None
        attempt = busy = 0
        while attempt < policy.max_attempts:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            message = self._attempt(request_id, frames, min(policy.attempt_timeout_s, remaining))
            if message is None:
                attempt += 1
                logger.warning("teacher request %s: no answer within %.1f s (attempt %d/%d); "
                               "retrying on a fresh socket", request_id, policy.attempt_timeout_s,
                               attempt, policy.max_attempts)
            elif isinstance(message, _Untrusted):
                attempt += 1
                untrusted = message
                logger.warning("teacher request %s: dropped a reply that failed authentication (%s; "
                               "attempt %d/%d); retrying", request_id, message.reason, attempt,
                               policy.max_attempts)
            elif message.type == wire.ERROR:
                code = ErrorCode(message.meta.get("code", ErrorCode.BACKEND_FAILED.value))
                error = TeacherError(code, f"teacher refused request {request_id}: "
                                           f"{message.meta.get('message', '')}")
                if code not in RETRYABLE:
                    raise error
                if code == BUSY:
                    # Answered at once, so not an attempt spent: the pause grows instead, and the
                    # deadline, not the attempt count, bounds how long a busy teacher is waited for.
                    busy += 1
                    log = logger.warning if busy == 1 or busy % 10 == 0 else logger.debug
                    log("%s (busy answer %d; next try in %.1f s)", error, busy, pause)
                else:
                    attempt += 1
                    logger.warning("%s (attempt %d/%d)", error, attempt, policy.max_attempts)
            elif message.type != expect:
                raise TeacherError(ErrorCode.BAD_OUTPUT, f"expected {expect}, got {message.type}")
            else:
                return message
            self._retried()
            time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
            pause = min(pause * 2, policy.backoff_max_s)
        if untrusted is not None and untrusted.code == ErrorCode.BAD_SIGNATURE:
            # Unsigned, so possibly forged, and never acted on before the attempts ran out; but the
            # likely cause is this client's own secret, which is what the user must check.
            raise TeacherError(ErrorCode.BAD_SIGNATURE, f"authentication between this client and the teacher "
                               f"failed ({untrusted.reason}); check that the client and the teacher share "
                               "the same secret")
        raise TeacherError(
            ErrorCode.UNAVAILABLE,
            f"teacher at {self.address} gave no usable answer to request {request_id} within "
            f"{policy.deadline_s:.0f} s ({policy.max_attempts} attempts of up to "
            f"{policy.attempt_timeout_s:.0f} s{f', and {busy} busy answers' if busy else ''}); is the teacher "
            "server running with workers connected?"
            + (f" The last reply failed authentication: {untrusted.reason}" if untrusted else ""))

    def _attempt(self, request_id: str, frames: list[bytes],
                 timeout_s: float) -> wire.Message | _Untrusted | None:
        """One send/receive on a fresh socket; None on timeout, _Untrusted for an unauthentic reply."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, self._limits.max_message_bytes)
        try:
            socket.connect(self.address)
            end = time.monotonic() + timeout_s
            while (left_ms := int((end - time.monotonic()) * 1000)) > 0:
                if not socket.poll(left_ms, zmq.POLLIN):
                    break
                message = self._decode_reply(socket.recv_multipart(copy=True))
                if isinstance(message, wire.Message) and message.type == wire.CHALLENGE:
                    # Again after a reconnection: the request is sent again on the new connection.
                    socket.send_multipart([b"", *wire.encode(wire.HELLO, "hello", {
                        "nonce": message.meta.get("nonce")}, secret=self._secret)])
                    socket.send_multipart([b"", *frames], copy=False)
                elif isinstance(message, _Untrusted) or (message is not None and message.request_id == request_id):
                    return message
            return None
        finally:
            socket.close()

    def _decode_reply(self, reply: list[bytes]) -> wire.Message | _Untrusted | None:
        if not reply or reply[0] != b"":
            logger.warning("dropped a teacher reply without delimiter")
            return None
        body = reply[1:]
        try:
            return wire.decode(body, self._limits, self._secret,
                               expect=(wire.RESULT, wire.GENERATED, wire.INFO_RESULT, wire.ERROR, wire.CHALLENGE))
        except wire.WireError as error:
            if error.authenticated:  # signed by the teacher, yet broken: a bug there, not noise
                raise TeacherError(error.code, f"malformed reply from the teacher: {error.detail}") from None
            if wire.peek_type(body) == wire.CHALLENGE:  # never answered: that would sign a stranger's nonce
                return _Untrusted(reason=f"the proxy's challenge failed authentication ({error.detail})",
                                  code=ErrorCode.BAD_SIGNATURE)
            # Never trusted: it may come from anyone who can reach this socket's peer. An unsigned
            # refusal is how the teacher tells a client whose signature it cannot verify, though.
            meta = wire.peek_meta(body)
            code = meta.get("code") if wire.peek_type(body) == wire.ERROR else None
            detail = f"unsigned refusal {code!r}: {meta.get('message')!r}" if code else error.detail
            return _Untrusted(reason=str(detail)[:300],
                              code=ErrorCode(code) if code in {c.value for c in ErrorCode} else None)


def split_sequences(lengths: list[int], num_parts: int) -> list[range]:
    """Contiguous, non-empty blocks of sequence indices with about equal total tokens each.

    Args:
        lengths: tokens of each sequence, in batch order.
        num_parts: blocks wanted; fewer come back when there are fewer sequences.
    """
    num_parts = max(1, min(num_parts, len(lengths)))
    ends = np.cumsum(lengths)  # tokens through sequence i
    bounds = [0]
    for part in range(1, num_parts):
        # The first sequence whose end reaches this part's share, kept so every block is non-empty.
        cut = int(np.searchsorted(ends, ends[-1] * part / num_parts)) + 1
        bounds.append(min(max(cut, bounds[-1] + 1), len(lengths) - (num_parts - part)))
    bounds.append(len(lengths))
    return [range(start, stop) for start, stop in zip(bounds, bounds[1:])]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class _Untrusted:
    """A reply that failed authentication: a reason for the logs, and the refusal code it claims."""

    reason: str
    code: ErrorCode | None
