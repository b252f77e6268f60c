"""Who may talk to the teacher service: exposure checks, the shared secret, rate-limited refusal logs.

The threat model and the defaults are in ``SECURITY.md`` (teacher section) and
``docs/teacher_protocol.md``. In short: loopback and IPC addresses trust the local host; any other
address needs a shared secret of at least :data:`MIN_SECRET_BYTES` (kept in a file only its owner can
read) or an explicit ``insecure`` opt-out.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
import threading
import time
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

SECRET_ENV = "MEGATRON_GKD_TEACHER_SECRET"
MIN_SECRET_BYTES = 16  # 128 bits: HMAC-SHA256 with a shorter key is as weak as the key


def is_loopback(address: str) -> bool:
    """True for ``ipc://``/``inproc://`` and TCP addresses on 127.0.0.0/8, ::1 or localhost."""
    scheme = address.split("://", 1)[0]
    if scheme in ("ipc", "inproc"):
        return True
    host = urlsplit(address).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", interface names and host names may reach other machines


def check_exposure(address: str, secret: bytes | None, insecure: bool) -> None:
    """Refuses a non-loopback address without a strong shared secret unless ``insecure`` is set.

    Called before binding or connecting, so nothing is exposed on a refused configuration.

    Raises:
        ValueError: ``address`` leaves this host and no secret (or one shorter than
            :data:`MIN_SECRET_BYTES`) is given, without ``insecure``.
    """
    if is_loopback(address):
        return
    if secret:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"{address} is reachable from other hosts and the shared secret has {len(secret)} "
                f"bytes; use at least {MIN_SECRET_BYTES} random bytes (e.g. `openssl rand -hex 32 > "
                "FILE; chmod 600 FILE`)")
        return
    if not insecure:
        raise ValueError(
            f"{address} is reachable from other hosts; give a shared secret (--secret-file or "
            f"{SECRET_ENV}) so every message is HMAC-signed, or pass --insecure"
        )
    logger.warning("teacher service on %s WITHOUT authentication (--insecure): anyone who can reach "
                   "it can use the teacher", address)


def load_secret(secret_file: str | None = None) -> bytes | None:
    """The shared secret from ``secret_file`` or the MEGATRON_GKD_TEACHER_SECRET variable, else None.

    Raises:
        ValueError: the file is empty, or readable or writable by its group or others (as ssh refuses
            such private keys): the secret would not be secret.
    """
    if secret_file:
        mode = os.stat(secret_file).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"secret file {secret_file} has mode {stat.filemode(mode)}: other users "
                             f"can read it; run `chmod 600 {secret_file}`")
        with open(secret_file, "rb") as handle:
            secret = handle.read().strip()
        if not secret:
            raise ValueError(f"secret file {secret_file} is empty")
        return secret
    value = os.environ.get(SECRET_ENV, "")
    return value.encode() if value else None


class RefusalLog:
    """Logs refused messages at most ``burst`` times per ``interval_s``, then one summary line.

    A flood of malformed messages must not become a flood of log lines (disk, and the operator's
    attention), yet the first refusals of a misconfigured peer are what tells the operator why.

    Args:
        logger: where the lines go.
        what: how the summary names the refusals (e.g. ``"client messages"``).
        burst: lines logged per interval.
        interval_s: length of an interval.
    """

    def __init__(self, logger: logging.Logger, what: str, burst: int = 10, interval_s: float = 60.0):
        self._logger, self._what, self._burst, self._interval_s = logger, what, burst, interval_s
        self._lock = threading.Lock()
        self._window_start = time.monotonic()
        self._logged = self._suppressed = 0
        self.total = 0

    def refused(self, message: str, *args) -> None:
        """Counts one refusal and logs it (INFO) unless this interval's burst is spent."""
        with self._lock:
            self.total += 1
            now = time.monotonic()
            if now - self._window_start >= self._interval_s:
                self._summarise(now)
                self._window_start, self._logged = now, 0
            if self._logged >= self._burst:
                self._suppressed += 1
                return
            self._logged += 1
        self._logger.info("refused: " + message, *args)

    def flush(self) -> None:
        """Logs the count of refusals not logged one by one since the last summary."""
        with self._lock:
            self._summarise(time.monotonic())

    def _summarise(self, now: float) -> None:
        if self._suppressed:
            self._logger.warning("refused %d more %s in the last %.0f s (not logged one by one)",
                                 self._suppressed, self._what, now - self._window_start)
            self._suppressed = 0
