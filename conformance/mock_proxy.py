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
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Optional, Union

__all__ = ["MockProxy", "RecordedRequest"]

Reply = Dict[str, Any]
Script = Union[List[Reply], Callable[["RecordedRequest"], Reply]]


class RecordedRequest:
    """One request the proxy received."""

    __slots__ = ("method", "path", "kind", "name", "headers", "body", "json", "connection", "time", "reply_status")

    def __init__(self, method: str, path: str, kind: str, name: str, headers: Dict[str, str], body: bytes,
                 connection: int) -> None:
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
        self.time = time.monotonic()
        self.reply_status: Optional[int] = None

    @property
    def bearer(self) -> Optional[str]:
        auth = self.headers.get("authorization", "")
        return auth[7:] if auth.startswith("Bearer ") else None

    @property
    def idempotency_key(self) -> Optional[str]:
        return self.headers.get("idempotency-key")

    @property
    def actor(self) -> Optional[str]:
        return self.headers.get("x-pipelines-actor-id")

    def __repr__(self) -> str:
        return f"RecordedRequest({self.method} {self.path} conn={self.connection})"


class MockProxy:
    """A scriptable per-run proxy.  ``url`` is the base URL an envelope carries."""

    def __init__(
        self,
        *,
        tokens: Optional[List[str]] = None,
        base_path: str = "/api/odyssey-proxy/runs/mock",
        tls: Optional[ssl.SSLContext] = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.tokens = set(tokens or ["run-token-mock"])
        self.base_path = base_path.rstrip("/")
        self.requests: List[RecordedRequest] = []
        self.connections = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._scripts: Dict[str, Script] = {}
        self._replayed: Dict[str, Reply] = {}
        self._lock = threading.Lock()
        self._tls = tls
        self._host = host
        self._server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> "MockProxy":
        proxy = self

        class Handler(_Handler):
            owner = proxy

        server = _Server((self._host, 0), Handler)
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

    def __enter__(self) -> "MockProxy":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() the proxy first"
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://{self._host}:{self.port}{self.base_path}"

    @property
    def token(self) -> str:
        return next(iter(sorted(self.tokens)))

    # -- scripting --------------------------------------------------------------

    def script(self, name: str, replies: Script) -> None:
        """Replies for tool (or trace event type) ``name``: a list consumed in order
        (the last one repeats), or a function of the recorded request.  The name
        ``"*"`` answers every tool that has no script of its own."""
        with self._lock:
            self._scripts[name] = list(replies) if isinstance(replies, list) else replies

    def calls(self, name: Optional[str] = None, kind: str = "tools") -> List[RecordedRequest]:
        with self._lock:
            return [r for r in self.requests if r.kind == kind and (name is None or r.name == name)]

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self._scripts.clear()
            self._replayed.clear()

    # -- request handling ---------------------------------------------------------

    def _decide(self, request: RecordedRequest) -> Reply:
        if request.kind == "other":
            return {"status": 404, "json": {"detail": "Not Found"}}
        token = request.bearer or request.headers.get("x-pipelines-run-token")
        if token not in self.tokens:
            return {"status": 401, "error_class": "run_token_invalid", "message": "unknown run token"}
        key = request.idempotency_key
        with self._lock:
            if key and key in self._replayed:
                return dict(self._replayed[key], replayed=True)
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
            with self._lock:
                sequence = sum(1 for r in self.requests if r.kind == "traces")
            reply = {"json": {"accepted": True, "sequence": sequence}}
        if not reply:
            reply = {"response": {"tool": request.name, "args": request.json}}
        if key and reply.get("replay", 200 <= reply.get("status", 200) < 300) and not reply.get("drop"):
            with self._lock:
                self._replayed[key] = reply
        return reply

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
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        path = self.path.split("?", 1)[0]
        base = self.owner.base_path
        kind, name = "other", ""
        if path.startswith(base + "/"):
            rest = path[len(base) + 1:]
            first, _, name = rest.partition("/")
            if first in ("tools", "traces") and name and "/" not in name:
                kind = first
        headers = {k.lower(): v for k, v in self.headers.items()}
        request = RecordedRequest("POST", path, kind, name, headers, body, self.connection_id)
        self.owner._record(request)
        self.owner._enter()
        try:
            self._answer(request)
        finally:
            self.owner._leave()

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


def _render(reply: Reply, request: RecordedRequest) -> "tuple[int, Dict[str, str], bytes]":
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
