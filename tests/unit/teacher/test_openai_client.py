"""The ``openai`` client against real local HTTP servers that misbehave: drip, cut, malform, shift, redirect.

The servers speak HTTP on 127.0.0.1 from a thread; their answers follow vLLM's format (echoed
``logprobs.tokens`` as ``token_id:N``, ``top_logprobs`` with the top-k plus the scored token).
"""

import http.server
import json
import threading

import numpy as np
import pytest

from megatron_gkd.teacher import RetryPolicy, ScoreBatch, SequenceRequest, TeacherError, build_client
from megatron_gkd.teacher.protocol.types import ErrorCode

VOCAB, MAX_LOGPROBS = 8, 8
API_KEY = "sk-test-key-that-must-not-leak"


def _distribution(position: int) -> np.ndarray:
    logits = np.cos(np.arange(VOCAB) * (position + 1.7))
    return logits - np.log(np.exp(logits).sum())


def _echo(token_ids: list[int], k: int) -> dict:
    """vLLM's ``choices[i].logprobs`` for an echoed prompt plus one generated token."""
    tokens, top = [], []
    for position, token in enumerate([*token_ids, 0]):
        tokens.append(f"token_id:{token}")
        if position == 0:
            top.append(None)
            continue
        logprobs = _distribution(position)
        ids = [int(i) for i in np.argsort(-logprobs)[:k]]
        top.append({f"token_id:{i}": float(logprobs[i]) for i in [token, *ids]})
    return {"tokens": tokens, "top_logprobs": top}


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True


def _serve(handler_class) -> tuple[_Server, str]:
    server = _Server(("127.0.0.1", 0), handler_class)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


class TeacherHandler(http.server.BaseHTTPRequestHandler):
    """A well-behaved teacher; subclasses change ``completions``. ``seen`` records (path, auth)."""

    seen: list = []
    stop = threading.Event()

    def log_message(self, *args):  # keep the test output clean
        pass

    def _json(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.seen.append((self.path, self.headers.get("Authorization")))
        if self.path == "/health":
            self._json(200, {})
        elif self.path == "/v1/models":
            self._json(200, {"data": [{"id": "tiny"}]})
        else:
            self._json(404, {})

    def do_POST(self):
        self.seen.append((self.path, self.headers.get("Authorization")))
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if payload["logprobs"] > MAX_LOGPROBS:
            self._json(400, {"message": f"logprobs {payload['logprobs']}, max allowed: {MAX_LOGPROBS}"})
            return
        self.completions(payload)

    def completions(self, payload):
        self._json(200, {"choices": [{"index": i, "logprobs": _echo(prompt, payload["logprobs"])}
                                     for i, prompt in enumerate(payload["prompt"])]})


def _batch() -> ScoreBatch:
    return ScoreBatch(sequences=[SequenceRequest(token_ids=[1, 2, 3, 4, 5], response_start=2),
                                 SequenceRequest(token_ids=[7, 6], response_start=1)], top_k=3)


def _client(url: str, **retry):
    policy = dict(attempt_timeout_s=5, deadline_s=10, max_attempts=3, backoff_s=0.05)
    policy.update(retry)
    return build_client("openai", base_url=url, api_key=API_KEY, wait_ready_s=10,
                        retry=RetryPolicy(**policy))


@pytest.fixture()
def serve():
    servers = []

    def start(handler_class):
        handler_class.seen = []
        handler_class.stop = threading.Event()
        server, url = _serve(handler_class)
        servers.append((server, handler_class))
        return url

    yield start
    for server, handler_class in servers:
        handler_class.stop.set()
        server.shutdown()
        server.server_close()


def test_a_well_behaved_server_gives_validated_outputs(serve):
    with _client(serve(TeacherHandler)) as client:
        outputs = client.score(_batch())
    for output, sequence in zip(outputs, _batch().sequences, strict=True):
        for t, token in enumerate(sequence.response_ids):
            logprobs = _distribution(sequence.response_start + t)
            np.testing.assert_array_equal(output.topk_ids[t], np.argsort(-logprobs)[:3])
            assert output.token_logprobs[t] == pytest.approx(logprobs[token], abs=1e-6)


class DripBody(TeacherHandler):
    """Promises a large body and sends one byte every 0.2 s until the test ends."""

    def completions(self, payload):
        self.send_response(200)
        self.send_header("Content-Length", str(10**9))
        self.end_headers()
        while not self.stop.wait(0.2):
            self.wfile.write(b" ")
            self.wfile.flush()


class DripHeaders(TeacherHandler):
    """Sends the status line and headers one byte every 0.2 s, forever."""

    def completions(self, payload):
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10**6:
            if self.stop.wait(0.2):
                return
            self.wfile.write(bytes([byte]))
            self.wfile.flush()


@pytest.mark.parametrize("handler", [DripBody, DripHeaders])
def test_the_deadline_holds_against_a_server_that_drips_forever(serve, handler):
    client = _client(serve(handler), attempt_timeout_s=1, deadline_s=2, max_attempts=5)
    outcome = {}

    def call():
        try:
            client.score(_batch())
        except Exception as error:  # noqa: BLE001 - the test inspects it
            outcome["error"] = error

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    # Liveness, not speed: a drip that never ends must not hold the call 15 times its deadline.
    thread.join(timeout=30)
    assert not thread.is_alive(), "the call outlived its deadline by far: the drip holds it"
    assert isinstance(outcome["error"], TeacherError) and outcome["error"].code == ErrorCode.UNAVAILABLE
    client.close()


class CutOnce(TeacherHandler):
    """The first answer announces 1000 bytes and sends 10; later answers are complete."""

    calls = 0

    def completions(self, payload):
        type(self).calls += 1
        if type(self).calls == 1:
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b'{"choices":')
            self.close_connection = True
            return
        super().completions(payload)


def test_an_incomplete_body_is_retried(serve):
    CutOnce.calls = 0
    with _client(serve(CutOnce)) as client:
        outputs = client.score(_batch())
    assert CutOnce.calls == 2 and len(outputs) == 2


def _malform(kind: str, response: dict) -> dict:
    choice = response["choices"][0]
    top = choice["logprobs"]["top_logprobs"]
    if kind == "null_row":
        top[3] = None
    elif kind == "list_row":
        top[3] = [["token_id:4", -1.0]]
    elif kind == "bad_key":
        top[3] = {"token_id:x4": -1.0, **top[3]}
    elif kind == "string_value":
        top[3] = {key: "-1.0" for key in top[3]}
    elif kind == "null_value":
        top[3] = {key: None for key in top[3]}
    elif kind == "bool_value":
        top[3] = {key: False for key in top[3]}
    elif kind == "list_value":
        top[3] = {key: [-1.0] for key in top[3]}
    elif kind == "logprobs_list":
        choice["logprobs"] = [top]
    elif kind == "choice_list":
        response["choices"][0] = [choice]
    elif kind == "choices_dict":
        response["choices"] = {"0": choice}
    elif kind == "index_string":
        choice["index"] = "0"
    elif kind == "index_repeated":
        response["choices"][1]["index"] = 0
    elif kind == "response_list":
        return [response]
    elif kind == "tokens_missing":
        del choice["logprobs"]["tokens"]
    elif kind == "huge_id":
        top[3] = {f"token_id:{2**70}": -1.0, **top[3]}
    return response


MALFORMED = ["null_row", "list_row", "bad_key", "string_value", "null_value", "bool_value", "list_value",
             "logprobs_list", "choice_list", "choices_dict", "index_string", "index_repeated",
             "response_list", "tokens_missing", "huge_id"]


@pytest.mark.parametrize("kind", MALFORMED)
def test_malformed_entries_are_typed_errors(serve, kind):
    class Malformed(TeacherHandler):
        def completions(self, payload):
            good = {"choices": [{"index": i, "logprobs": _echo(prompt, payload["logprobs"])}
                                for i, prompt in enumerate(payload["prompt"])]}
            self._json(200, _malform(kind, good))

    with _client(serve(Malformed)) as client:
        with pytest.raises(TeacherError) as info:
            client.score(_batch())
    assert info.value.code == ErrorCode.BAD_OUTPUT


class PrependsBos(TeacherHandler):
    """Scores ``[BOS] + prompt``: every row is the distribution one position earlier than asked for.

    k equals the vocabulary, so every row holds every id and a parser that only looks for the row's
    own token cannot notice the shift.
    """

    def completions(self, payload):
        self._json(200, {"choices": [{"index": i, "logprobs": _echo([1, *prompt], payload["logprobs"])}
                                     for i, prompt in enumerate(payload["prompt"])]})


def test_echoed_tokens_must_equal_the_tokens_sent(serve):
    batch = ScoreBatch(sequences=_batch().sequences, top_k=VOCAB)
    with _client(serve(PrependsBos)) as client:
        with pytest.raises(TeacherError, match="echo") as info:
            client.score(batch)
    assert info.value.code == ErrorCode.BAD_OUTPUT


def test_redirects_are_not_followed_with_the_api_key(serve):
    elsewhere = serve(TeacherHandler)

    class Redirects(TeacherHandler):
        def completions(self, payload):
            self.send_response(302)
            self.send_header("Location", elsewhere + "/v1/completions")
            self.send_header("Content-Length", "0")
            self.end_headers()

    with _client(serve(Redirects)) as client:
        with pytest.raises(TeacherError, match="redirect") as info:
            client.score(_batch())
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert all(auth is None for _, auth in TeacherHandler.seen), "the API key reached another server"


def test_a_redirect_at_start_up_is_refused(serve):
    elsewhere = serve(TeacherHandler)

    class RedirectsModels(TeacherHandler):
        def do_GET(self):
            if self.path == "/v1/models":
                self.send_response(302)
                self.send_header("Location", elsewhere + "/v1/models")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            super().do_GET()

    with pytest.raises(TeacherError, match="redirect"):
        _client(serve(RedirectsModels))
    assert all(auth is None for _, auth in TeacherHandler.seen), "the API key reached another server"
