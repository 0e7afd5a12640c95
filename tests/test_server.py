"""The dispatch server (§2): one core, three adapters (http.server, WSGI, ASGI), over 127.0.0.1."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest

import pipelines_port as pp
from conformance.harness.mock_proxy import MockProxy
from tests.conftest import Together

AGENT_TOKEN = "agent-token-5a5a5a"
RUN_TOKEN = "run-token-0f0f0f0f"
Reply = Tuple[int, Dict[str, str], bytes]


# -- adapters: one way to call each ------------------------------------------------------


class QuietWSGIHandler(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


def http_call(url: str, method: str, path: str, headers: Dict[str, str], body: bytes) -> Reply:
    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body if body or method == "POST" else None, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def asgi_call(app: pp.DispatchApp, method: str, path: str, headers: Dict[str, str], body: bytes,
              chunk_size: int = 7) -> Reply:
    scope = {"type": "http", "method": method, "path": path,
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]}
    chunks = [body[i:i + chunk_size] for i in range(0, len(body), chunk_size)] or [b""]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: List[Dict[str, Any]] = []

    async def receive() -> Dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app.asgi(scope, receive, send))
    start, rest = sent[0], sent[1:]
    assert start["type"] == "http.response.start"
    return (start["status"], {k.decode(): v.decode() for k, v in start["headers"]},
            b"".join(m.get("body", b"") for m in rest))


class Endpoint:
    """One DispatchApp behind one adapter; ``call`` sends a request and returns (status, headers, body)."""

    def __init__(self, kind: str, app: pp.DispatchApp) -> None:
        self.kind, self.app = kind, app
        self._close: Callable[[], None] = lambda: None
        if kind == "http":
            server = pp.start_server(app)
            self.url = server.url
            self._close = lambda: server.close(1)
        elif kind == "wsgi":
            server = make_server("127.0.0.1", 0, app.wsgi, handler_class=QuietWSGIHandler)
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
            self.url = f"http://127.0.0.1:{server.server_address[1]}{app.path}"

            def close() -> None:
                server.shutdown()
                server.server_close()
            self._close = close

    def call(self, method: str = "POST", path: Optional[str] = None, headers: Optional[Dict[str, str]] = None,
             body: Any = b"") -> Reply:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        if method == "POST":
            hdrs.setdefault("Content-Length", str(len(raw)))
        path = path or self.app.path
        if self.kind == "asgi":
            return asgi_call(self.app, method, path, hdrs, raw)
        return http_call(self.url, method, path, hdrs, raw)

    def close(self) -> None:
        self._close()


ADAPTERS = ["http", "wsgi", "asgi"]


@pytest.fixture
def proxy() -> Iterator[MockProxy]:
    tokens = [RUN_TOKEN] + [f"run-token-{i:03d}-xxxxxxxx" for i in range(100)]
    with MockProxy(tokens=tokens) as p:
        yield p


@pytest.fixture(autouse=True)
def quick_client() -> Iterator[None]:
    """The module-level client without pacing, so many dispatches do not wait on the rate limit."""
    previous = pp.set_default_client(pp.ProxyClient(rate_per_minute=0, timeout=20))
    yield
    pp.set_default_client(previous)


@pytest.fixture
def endpoints() -> Iterator[Callable[..., Endpoint]]:
    made: List[Endpoint] = []

    def make(kind: str, agent: Callable[..., Any] = lambda env: "ok", **options: Any) -> Endpoint:
        options.setdefault("token", AGENT_TOKEN)
        ep = Endpoint(kind, pp.DispatchApp(agent, **options))
        made.append(ep)
        return ep

    yield make
    for ep in made:
        ep.close()


AUTH = {"Authorization": f"Bearer {AGENT_TOKEN}"}


def dispatch_body(proxy: MockProxy, **extra: Any) -> Dict[str, Any]:
    body = {"task_id": 42, "run_id": 17, "agent_id": 8, "run_token_jti": "jti-17",
            "input": {"task_id": 42, "user_instruction": "Refund order #4521", "input": {"order_id": "4521"}},
            "odyssey_proxy_url": proxy.url}
    body.update(extra)
    return body


def run_headers(token: str = RUN_TOKEN) -> Dict[str, str]:
    return {**AUTH, "X-Pipelines-Run-Token": token, "X-Pipelines-Run-Id": "17", "X-Pipelines-Task-Id": "42"}


def detail(body: bytes) -> str:
    return json.loads(body)["detail"]


# -- §2 order, through every adapter ------------------------------------------------------------


@pytest.mark.parametrize("kind", ADAPTERS)
def test_auth_runs_before_ping(endpoints: Callable[..., Endpoint], kind: str) -> None:
    ep = endpoints(kind)
    assert ep.call(body={"ping": True}, headers={"Authorization": "Bearer wrong"})[0] == 401
    status, _, body = ep.call(body={"ping": True})
    assert status == 401 and AGENT_TOKEN not in body.decode()
    status, _, body = ep.call(body={"ping": True}, headers=AUTH)
    assert (status, json.loads(body)) == (200, {"ok": True})


@pytest.mark.parametrize("kind", ADAPTERS)
def test_401_never_echoes_the_credential(endpoints: Callable[..., Endpoint], kind: str) -> None:
    status, headers, body = endpoints(kind).call(body={"ping": True}, headers={"Authorization": "Bearer guess-123"})
    assert status == 401 and "guess-123" not in body.decode() and "Authorization" in detail(body)
    assert headers["content-type"] == "application/json"


@pytest.mark.parametrize("kind", ADAPTERS)
def test_unset_token_env_is_503_and_no_auth_is_explicit(endpoints: Callable[..., Endpoint], kind: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIPELINES_TEST_TOKEN", raising=False)
    ep = endpoints(kind, token=None, token_env="PIPELINES_TEST_TOKEN")
    status, _, body = ep.call(body={"ping": True}, headers=AUTH)
    assert status == 503 and "PIPELINES_TEST_TOKEN" in detail(body)
    monkeypatch.setenv("PIPELINES_TEST_TOKEN", "from-env")
    assert ep.call(body={"ping": True}, headers={"Authorization": "Bearer from-env"})[0] == 200
    open_ep = endpoints(kind, token=None, no_auth=True)
    assert open_ep.call(body={"ping": True})[0] == 200
    with pytest.raises(ValueError, match="no_auth"):
        pp.DispatchApp(lambda e: "x", token=None, token_env=None)


@pytest.mark.parametrize("kind", ADAPTERS)
def test_custom_auth_header_carries_the_raw_value(endpoints: Callable[..., Endpoint], kind: str) -> None:
    ep = endpoints(kind, auth_header="X-API-Key")
    assert ep.call(body={"ping": True}, headers={"X-API-Key": AGENT_TOKEN})[0] == 200
    assert ep.call(body={"ping": True}, headers={"X-API-Key": f"Bearer {AGENT_TOKEN}"})[0] == 401
    assert ep.call(body={"ping": True}, headers=AUTH)[0] == 401


@pytest.mark.parametrize("kind", ADAPTERS)
def test_json_errors_and_strict_ping(endpoints: Callable[..., Endpoint], kind: str, proxy: MockProxy) -> None:
    ep = endpoints(kind)
    status, _, body = ep.call(body=b"{not json", headers=AUTH)
    assert status == 400 and "not valid JSON" in detail(body)
    status, _, body = ep.call(body=[1, 2], headers=AUTH)
    assert status == 400 and "JSON object" in detail(body)
    for shaped in ({"ping": True, "extra": 1}, {"ping": 1}, {"ping": "true"}):
        status, _, body = ep.call(body=shaped, headers=AUTH)  # treated as a dispatch: no proxy URL, no token
        assert status == 400 and "proxy URL" in detail(body) and "run token" in detail(body)


@pytest.mark.parametrize("kind", ADAPTERS)
def test_missing_proxy_url_or_run_token_are_named(endpoints: Callable[..., Endpoint], kind: str,
                                                 proxy: MockProxy) -> None:
    ep = endpoints(kind)
    status, _, body = ep.call(body=dispatch_body(proxy), headers=AUTH)
    assert status == 400 and "X-Pipelines-Run-Token" in detail(body) and "proxy URL" not in detail(body)
    no_url = dispatch_body(proxy)
    del no_url["odyssey_proxy_url"]
    status, _, body = ep.call(body=no_url, headers=run_headers())
    assert status == 400 and "odyssey_proxy_url" in detail(body) and RUN_TOKEN not in body.decode()
    status, _, body = ep.call(body=dispatch_body(proxy, odyssey_proxy_url="file:///etc/passwd"), headers=run_headers())
    assert status == 400 and "http" in detail(body)


@pytest.mark.parametrize("kind", ADAPTERS)
def test_routes_methods_and_body_framing(endpoints: Callable[..., Endpoint], kind: str) -> None:
    ep = endpoints(kind, max_body=1000)
    status, _, body = ep.call(path="/elsewhere", body={"ping": True}, headers=AUTH)
    assert status == 404 and "/dispatch" in detail(body)
    status, headers, _ = ep.call(method="GET", headers=AUTH)
    assert status == 405 and headers["allow"] == "POST"
    status, _, body = ep.call(body=b"x" * 1001, headers=AUTH)
    assert status == 413 and "1000" in detail(body)
    assert ep.call(body={"ping": True, "pad": "x" * 900}, headers=AUTH)[0] == 400  # under the cap: read, parsed
    status, _, body = ep.call(method="GET", path="/healthz")
    assert status == 200 and json.loads(body)["ok"] is True
    assert ep.call(method="GET", path="/tools_schema", headers=AUTH)[0] == 404  # no tools declared


@pytest.mark.parametrize("kind", ADAPTERS)
def test_tools_schema_route_when_tools_are_declared(endpoints: Callable[..., Endpoint], kind: str) -> None:
    tools = [{"name": "get_order", "description": "d", "input_schema": {"type": "object"}}]
    ep = endpoints(kind, tools_schema=tools)
    for headers in ({}, AUTH):  # open, as the platform's tooling reads it without a credential (kit-routes)
        status, _, body = ep.call(method="GET", path="/tools_schema", headers=headers)
        assert status == 200 and json.loads(body) == {"tools_schema": tools}


def order_agent(env: pp.Envelope) -> Dict[str, Any]:
    order = pp.proxy_call("get_order", {"order_id": env.task_input["order_id"]})
    return {"final_response": f"{env.user_instruction}: {order}",
            "messages": [{"role": "user", "content": env.user_instruction}],
            "metadata": {"model": "none", "total_input_tokens": 1}}


async def async_order_agent(env: pp.Envelope) -> str:
    order = await pp.aproxy_call("get_order", {"order_id": env.task_input["order_id"]})
    await asyncio.sleep(0)
    return f"async {env.run_id}: {order['status']}"


@pytest.mark.parametrize("kind", ADAPTERS)
def test_dispatch_runs_sync_and_async_agents(endpoints: Callable[..., Endpoint], kind: str, proxy: MockProxy) -> None:
    proxy.script("get_order", [{"response": {"status": "shipped"}}])
    status, _, body = endpoints(kind, order_agent).call(body=dispatch_body(proxy), headers=run_headers())
    assert status == 200
    reply = json.loads(body)
    assert reply["final_response"] == "Refund order #4521: {'status': 'shipped'}"
    assert reply["metadata"] == {"model": "none", "total_input_tokens": 1}
    status, _, body = endpoints(kind, async_order_agent).call(body=dispatch_body(proxy), headers=run_headers())
    assert (status, json.loads(body)) == (200, {"final_response": "async 17: shipped"})
    calls = proxy.calls("get_order")
    assert len(calls) == 2 and all(c.bearer == RUN_TOKEN and c.json == {"order_id": "4521"} for c in calls)


@pytest.mark.parametrize("kind", ADAPTERS)
def test_header_fallbacks_reach_the_agent(endpoints: Callable[..., Endpoint], kind: str, proxy: MockProxy) -> None:
    seen: List[pp.Envelope] = []

    def agent(env: pp.Envelope) -> str:
        seen.append(env)
        return "ok"

    headers = {**AUTH, "X-Pipelines-Run-Token": RUN_TOKEN, "X-Pipelines-Odyssey-Proxy-Url": proxy.url,
               "X-Pipelines-Run-Id": "77", "X-Pipelines-Task-Id": "88", "X-Pipelines-Run-Token-Jti": "jti-h"}
    status, _, _ = endpoints(kind, agent).call(body={"input": {"user_instruction": "hi"}}, headers=headers)
    assert status == 200
    (env,) = seen
    assert (env.proxy_url, env.run_id, env.task_id, env.run_token_jti) == (proxy.url, "77", "88", "jti-h")


@pytest.mark.parametrize("kind", ADAPTERS)
def test_agent_failure_is_500_with_a_short_secret_free_detail(endpoints: Callable[..., Endpoint], kind: str,
                                                              proxy: MockProxy, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pipelines_port")

    def agent(env: pp.Envelope) -> str:
        raise ValueError(f"bad order with token {env.run_token} and agent token {AGENT_TOKEN} " + "x" * 900)

    status, _, body = endpoints(kind, agent).call(body=dispatch_body(proxy), headers=run_headers())
    assert status == 500
    text = detail(body)
    assert text.startswith("ValueError: bad order") and len(text) <= 500
    assert RUN_TOKEN not in body.decode() and AGENT_TOKEN not in body.decode()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "Traceback" in logged and "in agent" in logged
    assert RUN_TOKEN not in logged and AGENT_TOKEN not in logged


@pytest.mark.parametrize("kind", ADAPTERS)
def test_unusable_agent_results_are_500(endpoints: Callable[..., Endpoint], kind: str, proxy: MockProxy) -> None:
    for result, needle in (("", "final_response"), (None, "final_response"), (12, "cannot build")):
        status, _, body = endpoints(kind, lambda env, r=result: r).call(body=dispatch_body(proxy), headers=run_headers())
        assert status == 500 and needle in detail(body), (result, body)


@pytest.mark.parametrize("kind", ADAPTERS)
def test_a_malformed_transcript_is_dropped_by_default_and_refused_when_strict(
        endpoints: Callable[..., Endpoint], kind: str, proxy: MockProxy, caplog: pytest.LogCaptureFixture) -> None:
    """Lenient: the platform grades final_response and drops a malformed transcript; so do we, with a warning."""
    result = {"final_response": "x", "messages": [{"role": "bot"}], "metadata": {"model": "m"}}
    caplog.set_level(logging.WARNING, logger="pipelines_port")
    status, _, body = endpoints(kind, lambda env: result).call(body=dispatch_body(proxy), headers=run_headers())
    assert status == 200 and json.loads(body) == {"final_response": "x", "metadata": {"model": "m"}}
    assert any("messages[0].role" in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records)
    status, _, body = endpoints(kind, lambda env: result, strict=True).call(
        body=dispatch_body(proxy), headers=run_headers())
    assert status == 500 and "messages[0].role" in detail(body)


@pytest.mark.parametrize("kind", ADAPTERS)
def test_run_token_in_a_response_is_redacted(endpoints: Callable[..., Endpoint], kind: str, proxy: MockProxy) -> None:
    status, _, body = endpoints(kind, lambda env: f"my token is {env.run_token}").call(
        body=dispatch_body(proxy), headers=run_headers())
    assert status == 200 and RUN_TOKEN not in body.decode() and "[redacted]" in json.loads(body)["final_response"]


@pytest.mark.parametrize("kind", ADAPTERS)
def test_connectivity_check_probes_without_running_the_agent(endpoints: Callable[..., Endpoint], kind: str,
                                                             proxy: MockProxy) -> None:
    def agent(env: pp.Envelope) -> str:
        raise AssertionError("user code must not run")

    ep = endpoints(kind, agent)
    status, _, body = ep.call(body={"connectivity_check": True, "odyssey_proxy_url": proxy.url}, headers=AUTH)
    reply = json.loads(body)
    assert status == 200 and reply["ok"] is True
    assert reply["outbound"]["reachable"] is True and reply["outbound"]["status_code"] == 401
    assert proxy.requests[-1].name == "__reachability_probe__" and proxy.requests[-1].bearer == "fake-token"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/p"
    status, _, body = ep.call(body={"connectivity_check": True, "odyssey_proxy_url": dead}, headers=AUTH)
    out = json.loads(body)["outbound"]
    assert status == 200 and out["reachable"] is False and out["status_code"] is None and out["error"]
    status, _, body = ep.call(body={"connectivity_check": True}, headers=AUTH)
    assert status == 400 and "proxy URL" in detail(body)
    assert ep.call(body={"connectivity_check": True, "odyssey_proxy_url": proxy.url})[0] == 401  # auth first


@pytest.mark.parametrize("kind", ADAPTERS)
def test_run_timeout_answers_504_and_stops_further_proxy_calls(endpoints: Callable[..., Endpoint], kind: str,
                                                               proxy: MockProxy) -> None:
    finished = threading.Event()
    outcome: List[str] = []

    def slow_agent(env: pp.Envelope) -> str:
        time.sleep(0.6)
        try:
            pp.proxy_call("late_call", {})
            outcome.append("sent")
        except pp.ProxyError as exc:
            outcome.append(str(exc))
        finished.set()
        return "too late"

    status, _, body = endpoints(kind, slow_agent, run_timeout_s=0.2).call(body=dispatch_body(proxy),
                                                                         headers=run_headers())
    assert status == 504 and "run_timeout_s=0.2" in detail(body)
    assert finished.wait(10)
    assert "overran its run_timeout_s" in outcome[0] and proxy.calls("late_call") == []
    with pytest.raises(ValueError, match="1800"):
        pp.DispatchApp(slow_agent, token="t", run_timeout_s=1801)


# -- http.server adapter ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", pp.SERVERS)
def test_hundred_concurrent_dispatches_never_cross_tokens(proxy: MockProxy, kind: str) -> None:
    tokens = {i: f"run-token-{i:03d}-xxxxxxxx" for i in range(100)}

    def agent(env: pp.Envelope) -> str:
        got = [pp.proxy_call("whoami", {"run_id": env.run_id, "step": step}) for step in range(2)]
        assert all(g["args"]["run_id"] == env.run_id for g in got)
        return f"run {env.run_id} done"

    proxy.script("whoami", Together(20)(lambda r: {"response": {"args": r.json}}))
    server = pp.start_server(agent, token=AGENT_TOKEN, server=kind)
    results: Dict[int, Reply] = {}

    def one(i: int) -> None:
        results[i] = http_call(server.url, "POST", "/dispatch", {**run_headers(tokens[i]), "Content-Type": "application/json"},
                               json.dumps(dispatch_body(proxy, run_id=i)).encode())

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(100)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        server.close(5)
    assert all(results[i][0] == 200 and json.loads(results[i][2]) == {"final_response": f"run {i} done"}
               for i in range(100))
    calls = proxy.calls("whoami")
    assert len(calls) == 200
    assert all(c.bearer == tokens[c.json["run_id"]] for c in calls)
    assert proxy.max_in_flight >= 20  # they really ran at the same time


def test_keep_alive_serves_many_requests_on_one_connection() -> None:
    server = pp.start_server(lambda env: "ok", token=AGENT_TOKEN)
    try:
        host, port = server.server_address
        conn = http.client.HTTPConnection(host, port, timeout=10)
        socks = set()
        for i in range(5):
            conn.request("POST", "/dispatch", body=b'{"ping": true}', headers=AUTH)
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read() == b'{"ok":true}'
            socks.add(id(conn.sock))
        # A refused request with a small body keeps the connection too.
        conn.request("POST", "/dispatch", body=b'{"ping": true}', headers={"Authorization": "Bearer no"})
        resp = conn.getresponse()
        assert resp.status == 401 and resp.getheader("Connection") != "close"
        resp.read()
        conn.request("POST", "/dispatch", body=b'{"ping": true}', headers=AUTH)
        assert conn.getresponse().status == 200
        socks.add(id(conn.sock))
        assert len(socks) == 1
        conn.close()
    finally:
        server.close(1)


def raw_request(port: int, data: bytes, timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def test_chunked_length_less_and_oversized_bodies_are_refused_without_reading() -> None:
    server = pp.start_server(lambda env: "ok", token=AGENT_TOKEN, max_body=100)
    port = server.server_address[1]
    auth = f"Authorization: Bearer {AGENT_TOKEN}\r\n".encode()
    try:
        out = raw_request(port, b"POST /dispatch HTTP/1.1\r\nHost: x\r\n" + auth +
                          b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 411") and b"chunked" in out
        out = raw_request(port, b"POST /dispatch HTTP/1.1\r\nHost: x\r\n" + auth + b"Connection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 411") and b"Content-Length" in out
        # 10 MB announced, nothing sent: the answer comes at once and the connection closes.
        out = raw_request(port, b"POST /dispatch HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 10000000\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 413") and b"Connection: close" in out
    finally:
        server.close(1)


@pytest.mark.parametrize("kind", pp.SERVERS)
def test_slow_and_truncated_clients_do_not_hold_a_worker(kind: str) -> None:
    server = pp.make_server(lambda env: "ok", token=AGENT_TOKEN, host="127.0.0.1", port=0, read_timeout_s=0.5,
                            server=kind)
    server._thread = threading.Thread(target=server.serve_forever, daemon=True)
    server._thread.start()
    port = server.server_address[1]
    auth = f"Authorization: Bearer {AGENT_TOKEN}\r\n".encode()
    try:
        # Announces 100 bytes, sends 10, then stalls: the server gives up and closes the connection.
        out = raw_request(port, b"POST /dispatch HTTP/1.1\r\nHost: x\r\n" + auth +
                          b"Content-Length: 100\r\n\r\n{\"ping\": t")
        assert b"200" not in out.split(b"\r\n", 1)[0]
        # A client that sends half a request line and hangs up does no harm either.
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /disp")
        # The server still answers.
        status, _, body = http_call(server.url, "POST", "/dispatch", AUTH, b'{"ping": true}')
        assert (status, body) == (200, b'{"ok":true}')
        deadline = time.monotonic() + 10  # the handler leaves just after sending: wait for it, bounded
        while server.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.in_flight == 0
    finally:
        server.close(1)


def test_graceful_close_finishes_in_flight_dispatches_and_refuses_new_ones(proxy: MockProxy) -> None:
    started = threading.Event()

    def agent(env: pp.Envelope) -> str:
        started.set()
        time.sleep(0.5)
        return "finished in time"

    server = pp.start_server(agent, token=AGENT_TOKEN)
    result: List[Reply] = []
    t = threading.Thread(target=lambda: result.append(
        http_call(server.url, "POST", "/dispatch", run_headers(), json.dumps(dispatch_body(proxy)).encode())))
    t.start()
    assert started.wait(10)
    assert server.close(grace_s=10) is True
    t.join(10)
    assert result[0][0] == 200 and json.loads(result[0][2])["final_response"] == "finished in time"
    with pytest.raises(OSError):
        http_call(server.url, "POST", "/dispatch", AUTH, b'{"ping": true}')


# -- ASGI lifespan and WSGI environ details -----------------------------------------------------------


def test_asgi_lifespan_and_truncated_body() -> None:
    app = pp.DispatchApp(lambda env: "ok", token=AGENT_TOKEN)
    sent: List[Dict[str, Any]] = []
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive() -> Dict[str, Any]:
        return incoming.pop(0)

    async def send(message: Dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app.asgi({"type": "lifespan"}, receive, send))
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    # The client announces 50 bytes and disconnects after 10: nothing is answered, nothing runs.
    sent.clear()
    body = [{"type": "http.request", "body": b"x" * 10, "more_body": True}, {"type": "http.disconnect"}]

    async def receive_body() -> Dict[str, Any]:
        return body.pop(0)

    scope = {"type": "http", "method": "POST", "path": "/dispatch",
             "headers": [(b"authorization", f"Bearer {AGENT_TOKEN}".encode()), (b"content-length", b"50")]}
    asyncio.run(app.asgi(scope, receive_body, send))
    assert sent == []


def test_subprocess_env_helper_is_built_per_dispatch(endpoints: Callable[..., Endpoint], proxy: MockProxy) -> None:
    import os

    envs: List[Dict[str, str]] = []
    status, _, _ = endpoints("http", lambda env: envs.append(env.child_env()) or "ok").call(
        body=dispatch_body(proxy), headers=run_headers())
    assert status == 200 and envs[0]["PIPELINES_RUN_TOKEN"] == RUN_TOKEN
    assert "PIPELINES_RUN_TOKEN" not in os.environ


def test_proxy_connections_are_reused_across_dispatches(proxy: MockProxy) -> None:
    """Each agent runs on a thread of its own; the pool is shared, so the second dispatch reuses the first's connection."""
    server = pp.start_server(order_agent, token=AGENT_TOKEN)
    try:
        for _ in range(5):
            status, _, _ = http_call(server.url, "POST", "/dispatch", {**run_headers(), "Content-Type": "application/json"},
                                     json.dumps(dispatch_body(proxy)).encode())
            assert status == 200
    finally:
        server.close(1)
    assert len(proxy.calls("get_order")) == 5 and proxy.connections == 1


def test_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    server = pp.start_server(lambda env: "ok", token=AGENT_TOKEN)
    try:
        with socket.create_connection(server.server_address, timeout=5) as s:
            s.sendall(b"POST /dispatch HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + AGENT_TOKEN.encode() +
                      b"\r\nContent-Length: 14\r\nExpect: 100-continue\r\n\r\n")
            interim = s.recv(4096)  # a buffered 100 Continue would never come: the recv would time out
            assert interim.startswith(b"HTTP/1.1 100 Continue")
            s.sendall(b'{"ping": true}')
            final = s.recv(4096)
            assert final.startswith(b"HTTP/1.1 200") and final.endswith(b'{"ok":true}')
    finally:
        server.close(1)
