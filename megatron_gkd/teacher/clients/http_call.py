"""One HTTP request whose deadline covers the whole exchange, for the ``openai`` client.

``urllib``'s timeout bounds each socket operation, not the call: a server that sends a byte every
half second keeps a call alive forever, in the status line, the headers or the body. Here a watchdog
timer shuts the socket down when the deadline passes, which wakes the blocked read wherever it is.
Redirects are never followed (``http.client`` does not), so headers such as the API key only ever go
to the configured address. The body is read up to a size bound, and a body shorter than its
``Content-Length`` is an error: ``http.client`` returns a cut body without complaint when the server
closes early or the watchdog shuts the socket mid-body.
"""

from __future__ import annotations

import dataclasses
import http.client
import socket
import threading
from urllib.parse import urlsplit

_READ_CHUNK = 1 << 20


class DeadlineExceeded(TimeoutError):
    """The server did not finish its answer before the deadline."""


class ResponseTooLarge(OSError):
    """The answer is larger than the client accepts."""


class IncompleteBody(OSError):
    """The body ended before the length its ``Content-Length`` announced (a transport error)."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Response:
    """A complete HTTP answer."""

    status: int
    location: str | None
    body: bytes


class HttpEndpoint:
    """Requests against one ``http://`` or ``https://`` base URL.

    Args:
        base_url: scheme, host, port and an optional path prefix.
        headers: sent with every request (e.g. ``Authorization``).
        max_response_bytes: longest body accepted.
    """

    def __init__(self, base_url: str, headers: dict[str, str], max_response_bytes: int):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url={base_url!r} must look like http://host:port or https://host:port")
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/")
        self._headers = dict(headers)
        self._max_response_bytes = max_response_bytes

    def request(self, method: str, path: str, body: bytes | None, timeout_s: float) -> Response:
        """Sends one request and reads the whole answer within ``timeout_s`` seconds.

        Raises:
            DeadlineExceeded: the answer was not complete in time.
            ResponseTooLarge: the body exceeds ``max_response_bytes``.
            IncompleteBody: the server closed before the whole body announced had arrived.
            OSError, http.client.HTTPException: the connection failed or the answer is broken
                (e.g. ``IncompleteRead`` in a chunked body).
        """
        connection_class = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        connection = connection_class(self._host, self._port, timeout=timeout_s)
        watchdog = _Watchdog(timeout_s)
        try:
            connection.connect()
            # The response may take the socket over from the connection (HTTP/1.0, "Connection:
            # close"), so the watchdog holds the socket itself.
            watchdog.arm(connection.sock)
            connection.request(method, self._prefix + path, body=body, headers=self._headers)
            response = connection.getresponse()
            return Response(status=response.status, location=response.getheader("Location"),
                            body=self._read_body(response))
        except (OSError, http.client.HTTPException) as error:
            if watchdog.expired:
                raise DeadlineExceeded(f"no complete answer within {timeout_s:.1f} s ({error})") from error
            raise
        finally:
            watchdog.cancel()
            connection.close()

    def _read_body(self, response: http.client.HTTPResponse) -> bytes:
        length = response.getheader("Content-Length")
        # What http.client will read: the Content-Length, 0 for answers without a body (HEAD, 204,
        # 304), None when chunked or read to the close.
        announced = response.length
        if length is not None and length.isdigit() and int(length) > self._max_response_bytes:
            raise ResponseTooLarge(f"the server announces {length} bytes, over the limit of "
                                   f"{self._max_response_bytes}")
        parts, total = [], 0
        while chunk := response.read(_READ_CHUNK):
            total += len(chunk)
            if total > self._max_response_bytes:
                raise ResponseTooLarge(f"the answer exceeds the limit of {self._max_response_bytes} bytes")
            parts.append(chunk)
        # read(amt) returns b"" at an early EOF instead of raising IncompleteRead, so the length is
        # checked here. A chunked body (no Content-Length) raises IncompleteRead itself when cut.
        if announced is not None and total < announced:
            raise IncompleteBody(f"the answer body has {total} of the {announced} bytes its "
                                 "Content-Length announced; the connection ended early")
        return b"".join(parts)


class _Watchdog:
    """Shuts a socket down (waking any blocked read or write) once ``timeout_s`` has passed."""

    def __init__(self, timeout_s: float):
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.expired = False
        self._timer = threading.Timer(timeout_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def arm(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            if self.expired:  # the deadline passed while connecting
                self._shut()

    def cancel(self) -> None:
        self._timer.cancel()

    def _fire(self) -> None:
        with self._lock:
            self.expired = True
            self._shut()

    def _shut(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
