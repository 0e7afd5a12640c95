"""A mock per-run proxy (CONTRACT §3) on 127.0.0.1, standard library only.

It answers ``POST {base}/tools/{name}`` and ``POST {base}/traces/{event_type}``
like the platform's proxy: trace envelopes, error bodies with ``error_class``,
429 with ``Retry-After``, ``Idempotency-Key`` replay, and scripted misbehaviour
(slow, oversized, non-JSON, dropped connections).  Every request is recorded.

    with MockProxy() as proxy:
        proxy.script("get_order", [{"status": 429, "headers": {"Retry-After": "0"}},
                                   {"response": {"status": "shipped"}}])
        ... point the agent at proxy.url with run token proxy.token ...
        assert [r.path for r in proxy.requests] == [...]

One server can stand in for many runs, as the platform's does: ``proxy.new_run()``
gives a :class:`ProxyRun` with its own base path, run token, scripts, replay
memory and recorded requests (``proxy`` itself is the default run).

A reply spec is a dict with any of:

- ``response``: the tool result, wrapped in a trace envelope (``source`` defaults to ``odyssey``)
- ``status`` (default 200), ``headers`` (dict), ``json`` (body as JSON), ``body`` (raw str/bytes)
- ``error_class`` + ``message``: a FastAPI-shaped error body ``{"detail": {...}}``
- ``delay_s``: wait before answering; ``drop``: close the connection without answering
- ``close_after``: close the connection after answering, without telling the client
- ``chunked``: send the body with chunked transfer encoding
- ``source``, ``matched_rule_index``: envelope fields
- ``replay`` (default True for 2xx): remember the reply for its Idempotency-Key

``script("*", fn)`` answers every tool without a script of its own (a simulator
plugs in here).  With no script at all for a tool the proxy echoes: ``{"response": {"tool": name, "args": args}}``.

Before any script, a request is checked as the platform checks it, in this
order: a path that is not ``/tools/{name}`` or ``/traces/{type}`` under a run's
base path is 404; a run token that is not the run's is 401
``run_token_invalid`` (it may come as ``Authorization: Bearer <t>``, any case
of ``Bearer``, or as ``X-Pipelines-Run-Token: <t>``; both at once must agree;
the refused request's ``refusal`` says why in words); a tool name
(percent-decoded) outside §3.1's pattern is 404 ``unknown_tool``; a trace
event type outside §3.4's list is 404 ``unknown_event_type``; a body over
1 MiB is 413 ``payload_too_large``; a body that is not a JSON object is 422
(FastAPI's validation shape); a malformed ``X-Pipelines-Actor-Id`` (§3.5) is
400 ``actor_id_invalid``; with ``rate_limit=N``, the N+1st request of a token
within 60 s is 429 ``rate_limited`` with ``Retry-After``.  Then a
repeated ``Idempotency-Key`` replays its original reply; a repeat that arrives while the original is
still being answered (a client's retry after its timeout) waits for it, so the tool never runs twice.

Request bodies may come with ``Content-Length`` or in chunked transfer coding.
A chunked body is read only up to the 1 MiB cap plus a margin: past that (or
when its framing is broken) the proxy answers 413 (or 400), drops a bounded
amount of what still arrives unread, and closes the connection.
"""

from __future__ import annotations

import collections
import json
import math
import re
import secrets
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple, Union
from urllib.parse import unquote

__all__ = ["MockProxy", "ProxyRun", "RecordedRequest"]

Reply = Dict[str, Any]
Script = Union[List[Reply], Callable[["RecordedRequest"], Reply]]

MAX_BODY_BYTES = 1 << 20  # §3.1 request cap
CHUNKED_READ_LIMIT = MAX_BODY_BYTES + (64 << 10)  # a chunked body is read this far, then refused unread
RUNS_PATH = "/api/odyssey-proxy/runs"
_ACTOR_SEGMENT = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,127}")
TRACE_EVENT_TYPES = frozenset({"assistant_message", "thinking", "system_prompt", "custom", "llm_payload", "handoff",
                               "subagent_message", "subagent_final"})  # §3.4


class RecordedRequest:
    """One request the proxy received."""

    __slots__ = ("method", "path", "kind", "name", "headers", "body", "json", "connection", "time", "reply_status",
                 "replied", "run", "refusal")

    def __init__(self, method: str, path: str, kind: str, name: str, headers: Dict[str, str], body: bytes,
                 connection: int, run: Optional[ProxyRun] = None) -> None:
        self.method = method
        self.path = path
        self.kind = kind  # "tools", "traces" or "other"
        self.name = name
        self.headers = headers  # lower-case names
        self.body = body
        try:
            self.json: Any = json.loads(body) if body else None
        except ValueError:
            self.json = None
        self.connection = connection
        self.time = time.monotonic()  # when the request had arrived, body included
        self.reply_status: Optional[int] = None
        self.replied: Optional[float] = None  # when its reply had been written (None: not answered)
        self.run = run  # the ProxyRun whose base path it reached, if any
        self.refusal: Optional[str] = None  # why the run token was refused, in words (never the token)

    @property
    def bearer(self) -> Optional[str]:
        """The token of ``Authorization: Bearer <t>`` (the scheme in any case), else ``None``."""
        scheme, _, token = self.headers.get("authorization", "").partition(" ")
        token = token.strip()
        return token if scheme.lower() == "bearer" and token else None

    @property
    def run_token(self) -> Optional[str]:
        """The run token the request carries (§3.1): the bearer, else ``X-Pipelines-Run-Token``."""
        return self.bearer or self.headers.get("x-pipelines-run-token") or None

    @property
    def idempotency_key(self) -> Optional[str]:
        return self.headers.get("idempotency-key")

    @property
    def actor(self) -> Optional[str]:
        return self.headers.get("x-pipelines-actor-id")

    def __repr__(self) -> str:
        return f"RecordedRequest({self.method} {self.path} conn={self.connection})"


class ProxyRun:
    """One run's proxy: a base path, the run tokens it accepts, scripts, replay memory, requests.

    Made by :meth:`MockProxy.new_run`; the :class:`MockProxy` itself is the default run.
    """

    def __init__(self, owner: MockProxy, base_path: str, tokens: Set[str]) -> None:
        self._owner = owner
        self.base_path = base_path.rstrip("/")
        self.tokens = tokens
        self.requests: List[RecordedRequest] = []
        self._scripts: Dict[str, Script] = {}
        self._replayed: Dict[str, Reply] = {}
        self._answering: Set[str] = set()  # keys whose first request is being answered: a repeat waits for it

    def __repr__(self) -> str:
        return f"ProxyRun({self.base_path!r}, requests={len(self.requests)})"

    @property
    def url(self) -> str:
        """The base URL a dispatch envelope carries as ``odyssey_proxy_url``."""
        return self._owner.origin + self.base_path

    @property
    def token(self) -> str:
        return next(iter(sorted(self.tokens)))

    def script(self, name: str, replies: Script) -> None:
        """Replies for tool (or trace event type) ``name``: a list consumed in order
        (the last one repeats), or a function of the recorded request.  The name
        ``"*"`` answers every tool that has no script of its own."""
        with self._owner._lock:
            self._scripts[name] = list(replies) if isinstance(replies, list) else replies

    def calls(self, name: Optional[str] = None, kind: str = "tools") -> List[RecordedRequest]:
        with self._owner._lock:
            return [r for r in self.requests if r.kind == kind and (name is None or r.name == name)]

    def reset(self) -> None:
        with self._owner._lock:
            self._reset()

    def _reset(self) -> None:
        self.requests.clear()
        self._scripts.clear()
        self._replayed.clear()

    def _decide(self, request: RecordedRequest) -> Reply:
        """The reply to one routed request: the platform's checks, replay, then the script."""
        owner = self._owner
        token = request.run_token
        header = request.headers.get("x-pipelines-run-token")
        if token not in self.tokens or (request.bearer and header and header != request.bearer):
            request.refusal = _token_refusal(request, self.tokens)
            return {"status": 401, "error_class": "run_token_invalid", "message": "unknown run token"}
        if request.kind == "tools" and not _TOOL_NAME.fullmatch(request.name):
            return {"status": 404, "error_class": "unknown_tool",
                    "message": "no such tool: a tool name matches ^[A-Za-z_][A-Za-z0-9_-]{0,127}$"}
        if request.kind == "traces" and request.name not in TRACE_EVENT_TYPES:
            return {"status": 404, "error_class": "unknown_event_type",
                    "message": "no such trace event type: one of " + ", ".join(sorted(TRACE_EVENT_TYPES))}
        if len(request.body) > MAX_BODY_BYTES:
            return {"status": 413, "error_class": "payload_too_large",
                    "message": f"request body of {len(request.body)} bytes is over the {MAX_BODY_BYTES}-byte cap"}
        if not isinstance(request.json, dict):
            return {"status": 422, "json": {"detail": [{"loc": ["body"], "msg": "body must be a JSON object",
                                                        "type": "type_error.dict"}]}}
        if request.actor is not None and not _valid_actor_label(request.actor):
            return {"status": 400, "error_class": "actor_id_invalid",
                    "message": "X-Pipelines-Actor-Id must be 1-8 '/'-separated segments of [A-Za-z0-9_.:-]{1,64}"}
        wait = owner._rate_limited(token)
        if wait is not None:
            return {"status": 429, "error_class": "rate_limited", "message": "too many requests for this run token",
                    "headers": {"Retry-After": str(wait)}}
        key = request.idempotency_key
        with owner._lock:
            while key and key in self._answering:  # a retry while the original is still being answered
                owner._answered.wait()
            if key and key in self._replayed:
                return dict(self._replayed[key], replayed=True)
            if key:
                self._answering.add(key)
        try:
            return self._answer(request, key)
        finally:
            if key:
                with owner._lock:
                    self._answering.discard(key)
                    owner._answered.notify_all()

    def _answer(self, request: RecordedRequest, key: Optional[str]) -> Reply:
        """The script's reply (or the default one) to a request that is not a replay, kept for its key."""
        owner = self._owner
        with owner._lock:
            script = self._scripts.get(request.name)
            if script is None and request.kind == "tools":
                script = self._scripts.get("*")
            if callable(script):
                reply = None
            elif script:
                reply = script.pop(0) if len(script) > 1 else script[0]
            else:
                reply = {}
        if callable(script):
            reply = script(request)
        if request.kind == "traces" and not reply:
            with owner._lock:
                sequence = sum(1 for r in self.requests if r.kind == "traces")
            reply = {"json": {"accepted": True, "sequence": sequence}}
        if not reply:
            reply = {"response": {"tool": request.name, "args": request.json}}
        if key and reply.get("replay", 200 <= reply.get("status", 200) < 300) and not reply.get("drop"):
            with owner._lock:
                self._replayed[key] = reply
        return reply


def _token_refusal(request: RecordedRequest, tokens: Set[str]) -> str:
    """Why a request's run token was refused, in words a port author can act on."""
    auth = request.headers.get("authorization")
    header = request.headers.get("x-pipelines-run-token")
    if auth is None and header is None:
        return "no run token: neither Authorization: Bearer <t> nor X-Pipelines-Run-Token was sent"
    if auth is not None and request.bearer is None and header is None:
        return "an Authorization header that is not 'Bearer <run token>'"
    if request.bearer and header and header != request.bearer:
        return ("two run-token headers that disagree: Authorization: Bearer and X-Pipelines-Run-Token carry "
                "different values (send the run token in one header only)")
    return "a run token this run did not issue (another run's token, or a changed one)"


def _valid_actor_label(label: str) -> bool:
    """§3.5: 1-8 ``/``-separated segments of ``[A-Za-z0-9_.:-]{1,64}``, at most 256 characters."""
    label = label.strip()
    segments = label.split("/")
    return (0 < len(label) <= 256 and len(segments) <= 8
            and all(_ACTOR_SEGMENT.fullmatch(segment) for segment in segments))


class MockProxy:
    """A scriptable per-run proxy.  ``url`` is the base URL an envelope carries."""

    def __init__(
        self,
        *,
        tokens: Optional[List[str]] = None,
        base_path: str = RUNS_PATH + "/mock",
        tls: Optional[ssl.SSLContext] = None,
        host: str = "127.0.0.1",
        rate_limit: Optional[int] = None,
        port: int = 0,
    ) -> None:
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)  # a key's first request was answered
        self._port = port
        self._default = ProxyRun(self, base_path, set(tokens or ["run-token-mock"]))
        self._runs: List[ProxyRun] = [self._default]
        self.requests: List[RecordedRequest] = []  # every request, whichever run it reached
        self.connections = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.rate_limit = rate_limit
        self._sent: Dict[str, Deque[float]] = {}
        self._tls = tls
        self._host = host
        self._server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> MockProxy:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        server = _Server((self._host, self._port), Handler)
        if self._tls is not None:
            server.socket = self._tls.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> MockProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() the proxy first"
        return self._server.server_address[1]

    @property
    def origin(self) -> str:
        """``scheme://host:port``, without a path."""
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://{self._host}:{self.port}"

    # -- the default run ---------------------------------------------------------

    @property
    def url(self) -> str:
        return self._default.url

    @property
    def base_path(self) -> str:
        return self._default.base_path

    @property
    def tokens(self) -> Set[str]:
        return self._default.tokens

    @property
    def token(self) -> str:
        return self._default.token

    def script(self, name: str, replies: Script) -> None:
        """Script the default run; see :meth:`ProxyRun.script`."""
        self._default.script(name, replies)

    def calls(self, name: Optional[str] = None, kind: str = "tools") -> List[RecordedRequest]:
        """The default run's requests of ``kind`` (to tool or event type ``name``)."""
        return self._default.calls(name, kind)

    def reset(self) -> None:
        """Forget every request, script and replayable reply, of every run."""
        with self._lock:
            self.requests.clear()
            for run in self._runs:
                run._reset()
            self._sent.clear()

    # -- more runs -----------------------------------------------------------------

    def new_run(self, token: Optional[str] = None, *, name: Optional[str] = None) -> ProxyRun:
        """A run of its own at ``/api/odyssey-proxy/runs/{name}``, accepting only ``token``.

        Both default to fresh random values.
        """
        name = name or "run-" + secrets.token_hex(6)
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"run name must be URL-safe, got {name!r}")
        run = ProxyRun(self, f"{RUNS_PATH}/{name}", {token or "run-token-" + secrets.token_hex(16)})
        with self._lock:
            if any(r.base_path == run.base_path for r in self._runs):
                raise ValueError(f"a run named {name!r} exists already")
            self._runs.append(run)
        return run

    @property
    def runs(self) -> List[ProxyRun]:
        with self._lock:
            return list(self._runs)

    # -- request handling ---------------------------------------------------------

    def _route(self, path: str) -> Tuple[Optional[ProxyRun], str, str]:
        """``(run, kind, name)`` of a request path; kind ``"other"`` when it is no tool or trace path."""
        with self._lock:
            runs = sorted(self._runs, key=lambda r: len(r.base_path), reverse=True)
        for run in runs:
            if path.startswith(run.base_path + "/"):
                first, _, name = path[len(run.base_path) + 1:].partition("/")
                if first in ("tools", "traces") and name and "/" not in name:
                    return run, first, unquote(name)
                return run, "other", ""
        return None, "other", ""

    def _decide(self, request: RecordedRequest) -> Reply:
        if request.kind == "other" or request.run is None:
            return {"status": 404, "json": {"detail": "Not Found"}}
        return request.run._decide(request)

    def _rate_limited(self, token: str) -> Optional[int]:
        """Seconds to wait when ``token`` is over ``rate_limit`` requests in 60 s, else ``None`` (and counted)."""
        if not self.rate_limit:
            return None
        now = time.monotonic()
        with self._lock:
            sent = self._sent.setdefault(token, collections.deque())
            while sent and now - sent[0] >= 60.0:
                sent.popleft()
            if len(sent) >= self.rate_limit:
                return max(1, math.ceil(sent[0] + 60.0 - now))
            sent.append(now)
        return None

    def _count_connection(self) -> int:
        with self._lock:
            self.connections += 1
            return self.connections

    def _enter(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def _record(self, request: RecordedRequest) -> None:
        with self._lock:
            self.requests.append(request)
            if request.run is not None:
                request.run.requests.append(request)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # dropped and reset connections are part of the script


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: MockProxy
    timeout = 30

    def setup(self) -> None:
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connection_id = self.owner._count_connection()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._send(404, {}, json.dumps({"detail": "Not Found"}).encode(), chunked=False)

    def do_POST(self) -> None:
        body, refusal = self._read_body()
        path = self.path.split("?", 1)[0]
        run, kind, name = self.owner._route(path)
        headers = {k.lower(): v for k, v in self.headers.items()}
        request = RecordedRequest("POST", path, kind, name, headers, body, self.connection_id, run)
        self.owner._record(request)
        self.owner._enter()
        try:
            if refusal is not None:  # the body was not read to its end: answer, then drop the connection
                request.reply_status = refusal["status"]
                self._send(*_render(refusal, request), chunked=False)
                self.close_connection = True
                self._discard_input()
            else:
                self._answer(request)
        finally:
            self.owner._leave()

    def _discard_input(self, limit: int = 8 << 20, seconds: float = 2.0) -> None:
        """Drop what the client still sends (bounded), so closing does not reset the connection under our reply.

        Closing a socket with unread input sends a TCP reset, and a client may
        then lose the reply before it reads it.
        """
        deadline = time.monotonic() + seconds
        try:
            self.connection.shutdown(socket.SHUT_WR)
            while limit > 0 and time.monotonic() < deadline:
                self.connection.settimeout(max(0.01, deadline - time.monotonic()))
                data = self.connection.recv(min(limit, 65536))
                if not data:
                    break
                limit -= len(data)
        except OSError:
            pass

    def _read_body(self) -> Tuple[bytes, Optional[Reply]]:
        """The request body (``Content-Length`` or chunked), and a refusal when it could not be read whole."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked()
        length = int(self.headers.get("Content-Length") or 0)
        return (self.rfile.read(length) if length else b""), None

    def _read_chunked(self) -> Tuple[bytes, Optional[Reply]]:
        """A chunked body (RFC 9112 §7.1), read no further than :data:`CHUNKED_READ_LIMIT` bytes."""
        parts: List[bytes] = []
        size = 0
        while True:
            line = self.rfile.readline(1026)
            try:
                chunk = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                chunk = -1
            if chunk < 0 or not line.endswith(b"\n"):
                return b"".join(parts), {"status": 400, "error_class": "bad_request",
                                         "message": "malformed chunked request body"}
            if chunk == 0:
                break
            if size + chunk > CHUNKED_READ_LIMIT:
                return b"".join(parts), {
                    "status": 413, "error_class": "payload_too_large",
                    "message": f"chunked request body is over the {MAX_BODY_BYTES}-byte cap"}
            data = self.rfile.read(chunk)
            if len(data) < chunk or self.rfile.readline(3).strip():
                return b"".join(parts) + data, {"status": 400, "error_class": "bad_request",
                                                "message": "malformed chunked request body"}
            parts.append(data)
            size += chunk
        for _ in range(100):  # trailer fields, up to the empty line
            if not self.rfile.readline(8194).strip():
                return b"".join(parts), None
        return b"".join(parts), {"status": 400, "error_class": "bad_request", "message": "too many trailer fields"}

    def _answer(self, request: RecordedRequest) -> None:
        reply = self.owner._decide(request)
        if reply.get("delay_s"):
            time.sleep(reply["delay_s"])
        if reply.get("drop"):
            request.reply_status = None
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        status, reply_headers, payload = _render(reply, request)
        request.reply_status = status
        self._send(status, reply_headers, payload, chunked=bool(reply.get("chunked")))
        request.replied = time.monotonic()
        if reply.get("close_after"):
            self.close_connection = True

    def _send(self, status: int, headers: Dict[str, str], payload: bytes, *, chunked: bool) -> None:
        self.send_response_only(status)
        self.send_header("Date", self.date_time_string())
        names = {k.lower() for k in headers}
        if "content-type" not in names:
            self.send_header("Content-Type", "application/json")
        for k, v in headers.items():
            self.send_header(k, v)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        elif "content-length" not in names:
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        try:
            if chunked:
                for i in range(0, len(payload), 65536):
                    part = payload[i:i + 65536]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.wfile.write(payload)
            self.wfile.flush()
        except OSError:
            self.close_connection = True


def _render(reply: Reply, request: RecordedRequest) -> Tuple[int, Dict[str, str], bytes]:
    status = int(reply.get("status", 200))
    headers = dict(reply.get("headers") or {})
    if "body" in reply:
        body = reply["body"]
        payload = body.encode("utf-8") if isinstance(body, str) else bytes(body)
        if "content-type" not in {k.lower() for k in headers}:
            headers["Content-Type"] = "text/plain; charset=utf-8"
    elif "json" in reply:
        payload = json.dumps(reply["json"]).encode()
    elif "error_class" in reply or "message" in reply:
        detail = {"error_class": reply.get("error_class"), "message": reply.get("message", "")}
        payload = json.dumps({"detail": detail}).encode()
    elif "response" in reply:
        source = reply.get("source", "odyssey")
        envelope: Dict[str, Any] = {
            "tool_name": request.name,
            "response": reply["response"],
            "source": source,
            "latency_ms": int(reply.get("latency_ms", 3)),
            "matched_rule_index": reply.get("matched_rule_index"),
        }
        if source == "odyssey":
            envelope["validation"] = {"ok": True}
        payload = json.dumps(envelope).encode()
    else:
        payload = b""
    return status, headers, payload
