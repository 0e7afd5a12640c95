"""Post dispatches to an agent endpoint exactly as the platform does (CONTRACT §2).

    dispatcher = Dispatcher("http://127.0.0.1:8080/dispatch", token="secret")
    run = Run(run_token="tok-1", proxy_url="http://127.0.0.1:9001/api/odyssey-proxy/runs/r1", run_id=17)
    reply = dispatcher.dispatch(run, user_instruction="hello")
    reply.status, reply.json

Every request carries ``Content-Type: application/json``, a ``Content-Length``
and the registered auth header (``Authorization: Bearer <token>``, or a custom
header with the raw value).  A dispatch adds the ``X-Pipelines-*`` headers and
the body of §2.  Connections are kept alive (one per thread) and every request
has a timeout.  Standard library only.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple
from urllib.parse import urlsplit

__all__ = ["Dispatcher", "DispatchError", "Reply", "Run", "envelope_body", "envelope_headers", "HEADER_FIELDS"]

# The body fields an edge proxy may strip, each with the header it falls back to (§2).
HEADER_FIELDS = (
    ("odyssey_proxy_url", "X-Pipelines-Odyssey-Proxy-Url"),
    ("run_id", "X-Pipelines-Run-Id"),
    ("task_id", "X-Pipelines-Task-Id"),
    ("run_token_jti", "X-Pipelines-Run-Token-Jti"),
)


class DispatchError(Exception):
    """No usable reply: the endpoint is unreachable, timed out or hung up.  One readable line."""


class Reply:
    """One HTTP reply: status, lower-case headers, raw body, and the body as JSON when it is JSON."""

    __slots__ = ("status", "headers", "body", "json")

    def __init__(self, status: int, headers: Dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        try:
            self.json: Any = json.loads(body) if body else None
        except ValueError:
            self.json = None

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def __repr__(self) -> str:
        return f"Reply({self.status}, {len(self.body)} bytes)"


class Run(NamedTuple):
    """What the platform knows about one run; ids keep their native type (int or str)."""

    run_token: str
    proxy_url: str
    run_id: Any = None
    task_id: Any = None
    agent_id: Any = None
    run_token_jti: Optional[str] = None


def envelope_body(run: Run, *, user_instruction: Optional[str] = None, task_input: Any = None,
                  header_only: bool = False, **extra: Any) -> Dict[str, Any]:
    """The dispatch body of §2: ids, ``input{task_id, user_instruction, input}``, proxy URL, jti.

    ``header_only`` strips what an edge proxy may strip (the proxy URL, ids and
    jti, ``input.task_id`` too), so the port must read them from the headers.
    ``extra`` adds top-level fields (``tools_schema``, ``sub_agents``, unknown ones).
    """
    task: Dict[str, Any] = {}
    if run.task_id is not None and not header_only:
        task["task_id"] = run.task_id
    if user_instruction is not None:
        task["user_instruction"] = user_instruction
    task["input"] = {} if task_input is None else task_input
    body: Dict[str, Any] = {}
    for key, value in (("task_id", run.task_id), ("run_id", run.run_id)):
        if value is not None and not header_only:
            body[key] = value
    if run.agent_id is not None:
        body["agent_id"] = run.agent_id  # no header carries it
    body["input"] = task
    if not header_only:
        body["odyssey_proxy_url"] = run.proxy_url
        if run.run_token_jti is not None:
            body["run_token_jti"] = run.run_token_jti
    body.update(extra)
    return body


def envelope_headers(run: Run) -> Dict[str, str]:
    """The ``X-Pipelines-*`` headers of one dispatch (ids as decimal strings)."""
    headers = {"X-Pipelines-Run-Token": run.run_token, "X-Pipelines-Odyssey-Proxy-Url": run.proxy_url}
    for name, value in (("X-Pipelines-Run-Id", run.run_id), ("X-Pipelines-Task-Id", run.task_id),
                        ("X-Pipelines-Run-Token-Jti", run.run_token_jti)):
        if value is not None:
            headers[name] = str(value)
    return headers


class RawReply(NamedTuple):
    """What :meth:`Dispatcher.raw` read: the status (0: no status line), the bytes, whether the peer closed."""

    status: int
    data: bytes
    closed: bool


class Dispatcher:
    """Sends requests to one endpoint URL; safe to share between threads.

    ``token`` is the agent token (``None``: send no credential); ``auth_header``
    the registered header.
    """

    def __init__(
        self,
        url: str,
        *,
        token: Optional[str] = None,
        auth_header: str = "Authorization",
        timeout: float = 60.0,
        ssl_context: Optional[ssl.SSLContext] = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"endpoint URL must be http:// or https:// with a host, got {url!r}")
        try:
            self._port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise ValueError(f"endpoint URL has an invalid port: {url!r}") from None
        self.url = url
        self._scheme, self._host = parts.scheme, parts.hostname
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.token = token
        self.auth_header = auth_header
        self.timeout = timeout
        self._ssl_context = ssl_context
        self._local = threading.local()
        self._all: List[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    # -- what the platform sends ----------------------------------------------------

    def credential(self, token: Optional[str] = None) -> Dict[str, str]:
        """The registered auth header carrying ``token`` (default: the agent token); empty without one."""
        token = self.token if token is None else token
        if not token:
            return {}
        value = f"Bearer {token}" if self.auth_header.lower() == "authorization" else token
        return {self.auth_header: value}

    def ping(self, *, headers: Optional[Mapping[str, str]] = None) -> Reply:
        """The platform's "Test connection": ``{"ping": true}`` with the credential (or ``headers`` instead)."""
        return self.post({"ping": True}, headers=self.credential() if headers is None else headers)

    def dispatch(self, run: Run, *, user_instruction: Optional[str] = None, task_input: Any = None,
                 header_only: bool = False, body: Any = None, headers: Optional[Mapping[str, str]] = None,
                 **extra: Any) -> Reply:
        """One run's dispatch: §2 headers and body (``body`` replaces the built body; ``headers`` add to them)."""
        if body is None:
            body = envelope_body(run, user_instruction=user_instruction, task_input=task_input,
                                 header_only=header_only, **extra)
        sent = envelope_headers(run)
        sent.update(headers or {})
        sent.update(self.credential())
        return self.post(body, headers=sent)

    def connectivity_check(self, proxy_url: Optional[str]) -> Reply:
        """The SDK's connectivity check (§2 step 4), with the credential and no run token."""
        body: Dict[str, Any] = {"connectivity_check": True}
        if proxy_url is not None:
            body["odyssey_proxy_url"] = proxy_url
        return self.post(body, headers=self.credential())

    # -- the wire ---------------------------------------------------------------------

    def raw(self, data: bytes, wait_s: float = 5.0) -> RawReply:
        """Send ``data`` as is on a connection of its own and read until the endpoint closes it or ``wait_s``
        pass with nothing more after a whole reply; what came back, and whether the endpoint closed."""
        import time

        conn: Any = socket.create_connection((self._host, self._port), timeout=wait_s)
        if self._scheme == "https":
            conn = (self._ssl_context or ssl.create_default_context()).wrap_socket(conn, server_hostname=self._host)
        received, closed = b"", False
        deadline = time.monotonic() + wait_s
        with conn:
            conn.sendall(data)
            while time.monotonic() < deadline:
                try:
                    chunk = conn.recv(65536)
                except socket.timeout:
                    break
                except OSError:  # reset: closed, if rudely
                    closed = True
                    break
                if not chunk:
                    closed = True
                    break
                received += chunk
                if b"\r\n\r\n" in received:
                    conn.settimeout(1.0)  # a whole head is in: a closing endpoint closes at once
        status = 0
        if received.startswith(b"HTTP/1.") and received[8:9] == b" " and received[9:12].isdigit():
            status = int(received[9:12])
        return RawReply(status, received, closed)

    def post(self, body: Any, *, headers: Optional[Mapping[str, str]] = None,
             repeated: Sequence[Tuple[str, str]] = ()) -> Reply:
        """POST ``body`` (bytes as is, anything else as JSON) with exactly ``headers`` plus the framing.

        ``repeated`` adds header lines as they are, so a name may appear twice.
        """
        raw = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")
        sent = {"Content-Type": "application/json", "Accept": "application/json"}
        sent.update(headers or {})
        sent["Content-Length"] = str(len(raw))
        return self._exchange("POST", list(sent.items()) + list(repeated), raw)

    def _exchange(self, method: str, headers: List[Tuple[str, str]], body: bytes) -> Reply:
        for attempt in (1, 2):
            conn, reused = self._connection()
            try:
                conn.putrequest(method, self.path)
                for name, value in headers:
                    conn.putheader(name, value)
                conn.endheaders(body)
                response = conn.getresponse()
                payload = response.read()
            except (OSError, http.client.HTTPException) as exc:
                self._drop(conn)
                if reused and attempt == 1 and _stale(exc):
                    continue  # the endpoint closed the idle keep-alive connection: once more on a fresh one
                raise DispatchError(self._describe(exc)) from None
            reply = Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, payload)
            if response.will_close:
                self._drop(conn)
            return reply
        raise AssertionError("unreachable")

    def _connection(self) -> Tuple[http.client.HTTPConnection, bool]:
        conn = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None:
            return conn, True
        if self._scheme == "https":
            context = self._ssl_context or ssl.create_default_context()
            conn = http.client.HTTPSConnection(self._host, self._port, timeout=self.timeout, context=context)
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
        self._local.conn = conn
        with self._lock:
            self._all.append(conn)
        return conn, False

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None

    def _describe(self, exc: BaseException) -> str:
        where = f"{self._scheme}://{self._host}:{self._port}"
        if isinstance(exc, socket.timeout):
            return f"no reply from {where} within {self.timeout:g} s"
        if isinstance(exc, ConnectionRefusedError):
            return f"cannot reach {where}: connection refused (is the agent server running?)"
        if isinstance(exc, socket.gaierror):
            return f"cannot resolve {self._host!r}: {exc.strerror or exc}"
        if isinstance(exc, ssl.SSLError):
            return f"TLS failure talking to {where}: {exc.reason or exc}"
        reason = str(exc) or type(exc).__name__
        return f"{where} hung up without a reply: {type(exc).__name__}: {reason}"

    def close(self) -> None:
        """Close every connection this dispatcher opened, in any thread."""
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()


def _stale(exc: BaseException) -> bool:
    return isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError,
                            http.client.RemoteDisconnected, http.client.BadStatusLine))
