"""HTTP edges over raw sockets, against both built-in servers (asyncio, the default, and ``server="threads"``).

Each case is one class of request a front end and the kit could frame differently (request smuggling), or a
request line the kit cannot serve.  Every one must get a reply WITH a status line, a JSON ``detail`` naming
the cause, ``Connection: close``, and the connection closed; and what was smuggled inside it (a complete
second dispatch) must never run the agent or reach the proxy.  The RFC 9112 section each case enforces is
in its id.  Also: a drain whose grace runs out answers 503 under the threaded server too, and the proxy-host
allow-list (empty lists, ports, wildcards, what a connectivity check tells without a list).
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
from typing import Any, Dict, Iterator, List, NamedTuple, Tuple

import pytest

import pipelines_port as pp
from conformance.harness.dispatcher import Dispatcher
from conformance.harness.mock_proxy import MockProxy

AGENT_TOKEN = "agent-token-edges-0123456789"
RUN_TOKEN = "run-token-edges-0123456789"


class Raw(NamedTuple):
    status: int  # 0: no status line
    headers: Dict[str, str]
    body: bytes
    closed: bool  # the server closed the connection after its reply


def exchange(port: int, data: bytes, wait_s: float = 5.0) -> Raw:
    """Send ``data`` as is (the checker's :meth:`Dispatcher.raw`), read until the server closes or goes quiet."""
    reply = Dispatcher(f"http://127.0.0.1:{port}/dispatch").raw(data, wait_s)
    if not reply.data.startswith(b"HTTP/1."):
        return Raw(0, {}, reply.data, reply.closed)
    head, _, body = reply.data.partition(b"\r\n\r\n")
    return Raw(reply.status, dict(_fields(head)), body, reply.closed)


def _fields(head: bytes) -> List[Tuple[str, str]]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    return [(k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines)]


class Served(NamedTuple):
    port: int
    ran: List[Any]
    proxy: MockProxy


@pytest.fixture(params=pp.SERVERS)
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    ran: List[Any] = []

    def agent(env: pp.Envelope) -> str:
        ran.append(env.run_id)
        pp.proxy_call("get_order", {"run_id": env.run_id})
        return "ran"

    with MockProxy(tokens=[RUN_TOKEN]) as proxy:
        server = pp.start_server(agent, token=AGENT_TOKEN, server=request.param)
        try:
            yield Served(server.server_address[1], ran, proxy)
        finally:
            server.close(2)


def smuggled(proxy: MockProxy) -> bytes:
    """A whole second dispatch, as a front end would have forwarded it inside the first one's body."""
    body = json.dumps({"run_id": 666, "task_id": 1, "odyssey_proxy_url": proxy.url,
                       "input": {"user_instruction": "smuggled"}}).encode()
    return (b"POST /dispatch HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + AGENT_TOKEN.encode() +
            b"\r\nX-Pipelines-Run-Token: " + RUN_TOKEN.encode() + b"\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def head(*lines: bytes) -> bytes:
    return b"\r\n".join(lines) + b"\r\n\r\n"


AUTH = b"Authorization: Bearer " + AGENT_TOKEN.encode()

# id -> (request head fields between the request line and the blank line, status, words the detail must hold)
SMUGGLING: Dict[str, Tuple[List[bytes], int, str]] = {
    "space-before-colon-content-length (RFC 9112 5.1)": ([b"Host: x", AUTH, b"Content-Length : {n}"], 400,
                                                         "whitespace"),
    "tab-before-colon-transfer-encoding (RFC 9112 5.1)": ([b"Host: x", AUTH, b"Content-Length: {n}",
                                                           b"Transfer-Encoding\t: chunked"], 400, "whitespace"),
    "line-without-colon (RFC 9112 5.1)": ([b"Host: x", AUTH, b"NoColonHere", b"Content-Length: {n}"], 400,
                                          "colon"),
    "bare-cr-in-a-value (RFC 9112 2.2)": ([b"Host: x", AUTH, b"X-Foo: a\rContent-Length: {n}"], 400, "bare CR"),
    "obs-fold (RFC 9112 5.2)": ([b"Host: x", AUTH, b"X-Foo: a", b" Content-Length: {n}"], 400, "fold"),
    "two-different-content-lengths (RFC 9112 6.3)": ([b"Host: x", AUTH, b"Content-Length: {n}",
                                                      b"Content-Length: 0"], 400, "Content-Length"),
    "content-length-and-transfer-encoding (RFC 9112 6.1)": ([b"Host: x", AUTH, b"Content-Length: {n}",
                                                             b"Transfer-Encoding: chunked"], 400,
                                                            "Transfer-Encoding"),
    "identity-transfer-encoding-with-length (RFC 9112 6.1)": ([b"Host: x", AUTH, b"Content-Length: {n}",
                                                               b"Transfer-Encoding: identity"], 400,
                                                              "Transfer-Encoding"),
    "non-token-field-name (RFC 9110 5.1)": ([b"Host: x", AUTH, b"Bad[Name]: 1", b"Content-Length: {n}"], 400,
                                            "token"),
    "two-host-fields (RFC 9112 3.2)": ([b"Host: x", b"Host: y", AUTH, b"Content-Length: {n}"], 400, "Host"),
    "no-host-in-http-1.1 (RFC 9112 3.2)": ([AUTH, b"Content-Length: {n}"], 400, "Host"),
    "content-length-with-a-sign (RFC 9110 8.6)": ([b"Host: x", AUTH, b"Content-Length: +{n}"], 400,
                                                  "Content-Length"),
}


@pytest.mark.parametrize("case", list(SMUGGLING))
def test_a_head_a_front_end_could_frame_differently_is_refused_and_closed(served: Served, case: str) -> None:
    fields, status, words = SMUGGLING[case]
    inner = smuggled(served.proxy)
    lines = [f.replace(b"{n}", str(len(inner)).encode()) for f in fields]
    reply = exchange(served.port, head(b"POST /dispatch HTTP/1.1", *lines) + inner)
    assert reply.status == status, reply
    assert reply.headers.get("connection") == "close" and reply.closed, reply
    assert reply.headers.get("content-type") == "application/json"
    assert words.lower() in json.loads(reply.body)["detail"].lower(), reply.body
    assert served.ran == [] and served.proxy.calls() == []  # nothing smuggled ran


def test_lines_ended_by_a_bare_lf_are_refused_at_once(served: Served) -> None:
    """RFC 9112 2.2: a recipient may accept a bare LF; a server behind proxies that frame by CRLF must not."""
    reply = exchange(served.port, b"POST /dispatch HTTP/1.1\nHost: x\nContent-Length: 2\n\n{}", wait_s=5)
    assert reply.status == 400 and reply.closed and "LF" in json.loads(reply.body)["detail"]


@pytest.mark.parametrize("request_line,status", [
    (b"POST /dispatch HTTP/2.0", 505), (b"POST /dispatch HTTP/9.9", 505), (b"POST /dispatch HTTP/1.1x", 400),
    (b"POST /dispatch HTTP/1.1 extra", 400), (b"PRI * HTTP/2.0", 505), (b"POST  /dispatch HTTP/1.1", 400),
], ids=["http-2.0", "http-9.9", "http-1.1x", "extra-token", "http2-preface", "double-space"])
def test_a_request_line_the_server_cannot_serve_gets_a_status_line(served: Served, request_line: bytes,
                                                                   status: int) -> None:
    """RFC 9112 3 and 2.3: every refusal is a whole HTTP/1.1 reply (never a bare JSON body), then a close."""
    data = head(request_line, b"Host: x", AUTH, b"Content-Length: 2") + b"{}"
    if request_line.startswith(b"PRI"):
        data = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    reply = exchange(served.port, data)
    assert reply.status == status, reply
    assert reply.closed and reply.headers.get("connection") == "close"
    assert json.loads(reply.body)["detail"]


def test_too_long_and_too_many_are_414_and_431(served: Served) -> None:
    long_line = b"POST /" + b"a" * (pp.MAX_REQUEST_LINE_BYTES + 10) + b" HTTP/1.1"
    assert exchange(served.port, head(long_line, b"Host: x")).status == 414
    many = [b"X-F%d: 1" % i for i in range(pp.MAX_REQUEST_FIELDS + 5)]
    reply = exchange(served.port, head(b"GET /healthz HTTP/1.1", b"Host: x", *many))
    assert reply.status == 431 and reply.closed


def test_an_unsupported_transfer_coding_is_501_naming_it(served: Served) -> None:
    reply = exchange(served.port, head(b"POST /dispatch HTTP/1.1", b"Host: x", AUTH, b"Transfer-Encoding: gzip"))
    assert reply.status == 501 and reply.closed and "gzip" in json.loads(reply.body)["detail"]


def test_a_well_formed_request_after_the_refusals_still_works(served: Served) -> None:
    body = json.dumps({"run_id": 5, "task_id": 1, "odyssey_proxy_url": served.proxy.url,
                       "input": {"user_instruction": "fine"}}).encode()
    reply = exchange(served.port, head(b"POST /dispatch HTTP/1.1", b"Host: x", AUTH,
                                       b"X-Pipelines-Run-Token: " + RUN_TOKEN.encode(),
                                       b"Content-Length: %d" % len(body), b"Connection: close") + body)
    assert reply.status == 200 and json.loads(reply.body) == {"final_response": "ran"} and served.ran == [5]


def test_a_body_cut_short_by_the_clients_eof_still_gets_its_400(served: Served) -> None:
    """The client announces 100 bytes, sends 14 and shuts its side: the reply names the short body, then a close."""
    data = head(b"POST /dispatch HTTP/1.1", b"Host: x", AUTH, b"Content-Length: 100") + b'{"ping": true}'
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        received = b"".join(iter(lambda: sock.recv(65536), b""))
    (reply,) = _replies(received)
    assert reply.status == 400 and reply.headers["connection"] == "close"
    assert "truncated" in json.loads(reply.body)["detail"]


# -- shutdown under the threaded server (the asyncio one: tests/test_async_server.py) --------------------------


def test_threads_server_answers_503_to_each_dispatch_still_running_when_grace_runs_out(
        caplog: pytest.LogCaptureFixture) -> None:
    started = threading.Semaphore(0)
    release = threading.Event()

    def agent(env: pp.Envelope) -> str:
        started.release()
        release.wait(30)
        return "too late"

    caplog.set_level(logging.WARNING, logger="pipelines_port")
    with MockProxy(tokens=[RUN_TOKEN]) as proxy:
        server = pp.start_server(agent, token=AGENT_TOKEN, server="threads")
        port = server.server_address[1]
        replies: List[Raw] = []

        def client(run_id: int) -> None:
            body = json.dumps({"run_id": run_id, "task_id": 1, "odyssey_proxy_url": proxy.url,
                               "input": {"user_instruction": "slow"}}).encode()
            replies.append(exchange(port, head(b"POST /dispatch HTTP/1.1", b"Host: x", AUTH,
                                               b"X-Pipelines-Run-Token: " + RUN_TOKEN.encode(),
                                               b"Content-Length: %d" % len(body)) + body, wait_s=20))

        threads = [threading.Thread(target=client, args=(i,)) for i in (41, 42)]
        for t in threads:
            t.start()
        assert started.acquire(timeout=10) and started.acquire(timeout=10)
        finished = server.close(grace_s=0.3)
        for t in threads:
            t.join(20)
        release.set()
    assert finished is False and len(replies) == 2
    for reply in replies:
        assert reply.status == 503 and reply.closed and reply.headers.get("connection") == "close"
        assert "shut down before this dispatch finished" in json.loads(reply.body)["detail"]
    assert "run 41 was cut" in caplog.text and "run 42 was cut" in caplog.text
    assert RUN_TOKEN not in caplog.text


def test_threads_server_answers_each_connection_on_a_thread_of_its_own() -> None:
    """``server="threads"``: every request goes through the blocking ``DispatchApp.handle`` (the seam
    tests/broken_ports.py patches), on its connection's thread, never on the server's loop."""
    seen: List[Tuple[int, str]] = []

    class Recording(pp.DispatchApp):
        def handle(self, method: str, target: str, headers: Any, body: Any) -> pp.HttpReply:
            seen.append((int(headers["x-connection"]), threading.current_thread().name))
            return super().handle(method, target, headers, body)

    server = pp.start_server(Recording(lambda env: "ok", token=AGENT_TOKEN), server="threads")
    try:
        for connection in range(3):
            client = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
            for _ in range(2):  # keep-alive: a connection closed after the first would show as a second thread
                client.request("POST", "/dispatch", body=b'{"ping": true}',
                               headers={"Authorization": f"Bearer {AGENT_TOKEN}", "X-Connection": str(connection)})
                reply = client.getresponse()
                assert (reply.status, reply.read()) == (200, b'{"ok":true}')
            client.close()
    finally:
        server.close(2)
    assert [c for c, _ in seen] == [0, 0, 1, 1, 2, 2]
    threads = {c: {name for k, name in seen if k == c} for c in range(3)}
    assert all(len(names) == 1 for names in threads.values())  # one thread per connection, for all its requests
    assert len(set.union(*threads.values())) == 3 and "pipelines-server" not in set.union(*threads.values())


# -- what every reply carries, keep-alive and the connection limit (both servers) --------------------------


def _replies(data: bytes, *heads: int) -> List[Raw]:
    """Each reply in ``data`` (pipelined ones in turn), its body as long as its Content-Length says; none for
    the replies numbered in ``heads`` (to HEAD requests)."""
    out: List[Raw] = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        fields = dict(_fields(head))
        length = 0 if len(out) in heads else int(fields.get("content-length", "0"))
        out.append(Raw(int(head[9:12]), fields, rest[:length], False))
        data = rest[length:]
    return out


@pytest.mark.parametrize("kind", pp.SERVERS)
def test_head_gets_no_body_and_http_1_0_keeps_alive_only_when_asked(kind: str) -> None:
    """RFC 9110 9.3.2: a HEAD reply's Content-Length counts a body that is not sent; RFC 9112 9.3: an HTTP/1.0
    connection stays open only on ``Connection: keep-alive``, said back.  Every reply has Server and Date."""
    import email.utils
    import time

    server = pp.start_server(lambda env: "ok", token=AGENT_TOKEN, server=kind)
    try:
        reply = Dispatcher(f"http://127.0.0.1:{server.server_address[1]}/dispatch").raw(
            b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /healthz HTTP/1.0\r\n\r\n", 5)
    finally:
        server.close(2)
    head, kept, last = _replies(reply.data, 0)  # had the HEAD reply a body, it would be read as a reply
    assert head.status == 405 and int(head.headers["content-length"]) > 0
    assert "connection" not in head.headers  # HTTP/1.1: open by default
    assert kept.status == 200 and kept.headers["connection"] == "keep-alive" and json.loads(kept.body)["ok"] is True
    assert last.status == 200 and last.headers["connection"] == "close" and reply.closed
    for one in (head, kept, last):
        assert one.headers["server"] == f"pipelines-port/{pp.__version__}"
        assert abs(email.utils.parsedate_to_datetime(one.headers["date"]).timestamp() - time.time()) < 60


@pytest.mark.parametrize("kind", pp.SERVERS)
def test_past_max_connections_a_new_connection_gets_503_and_an_idle_one_closes_after_keepalive_s(kind: str) -> None:
    server = pp.start_server(lambda env: "ok", token=AGENT_TOKEN, server=kind, max_connections=2, keepalive_s=0.5)
    port = server.server_address[1]
    ping = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    try:
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        for sock in held:  # each answered, so each is open on the server's side
            sock.sendall(ping)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        over = exchange(port, ping)
        assert over.status == 503 and over.closed and over.headers["connection"] == "close"
        assert "limit of 2 open connections" in json.loads(over.body)["detail"]
        for sock in held:  # idle past keepalive_s: closed by the server, with no reply
            assert sock.recv(65536) == b""
            sock.close()
        assert exchange(port, ping).status == 200  # the two places are free again
    finally:
        server.close(2)


# -- the proxy-host allow-list -----------------------------------------------------------------------------


@pytest.mark.parametrize("hosts", ["", "  ", " , ", []], ids=["empty", "blank", "commas", "empty-list"])
def test_an_allow_list_set_but_empty_is_a_start_up_error(hosts: Any) -> None:
    with pytest.raises(ValueError, match="set but empty"):
        pp.DispatchApp(lambda env: "ok", token=AGENT_TOKEN, proxy_hosts=hosts)


def test_an_empty_allow_list_in_the_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pp.ENV_PROXY_ALLOWED_HOSTS, " ")
    with pytest.raises(ValueError, match=pp.ENV_PROXY_ALLOWED_HOSTS):
        pp.DispatchApp(lambda env: "ok", token=AGENT_TOKEN)


@pytest.mark.parametrize("entry", ["*", "a*.example.com", "*.", "https://x.example.com", "x.example.com/p",
                                   "x.example.com:99999", "x .example.com"])
def test_malformed_allow_list_entries_are_refused_at_start_up(entry: str) -> None:
    with pytest.raises(ValueError, match="must be a host name"):
        pp.parse_proxy_hosts(entry)


@pytest.mark.parametrize("url,allowed", [
    ("http://127.0.0.1:8080/p", True), ("http://127.0.0.1:8081/p", False), ("http://127.0.0.1/p", False),
    ("https://api.pipelines.tech/p", True), ("http://api.pipelines.tech/p", False),
    ("https://x.example.com:9443/p", True), ("https://example.com/p", True), ("https://badexample.com/p", False),
    ("http://[::1]:9000/p", True), ("http://[::1]:9001/p", False),
])
def test_allow_list_entries_may_carry_a_port_and_a_wildcard(url: str, allowed: bool) -> None:
    hosts = pp.parse_proxy_hosts("127.0.0.1:8080, api.pipelines.tech:443, *.example.com, [::1]:9000")
    assert hosts is not None and ".example.com" in hosts
    assert pp.proxy_host_allowed(url, hosts) is allowed


def test_a_dispatch_naming_another_port_of_an_allowed_host_never_connects() -> None:
    with MockProxy(tokens=[RUN_TOKEN]) as proxy:
        other = f"http://127.0.0.1:{proxy.port + 1 if proxy.port < 65535 else proxy.port - 1}/api/odyssey-proxy/runs/x"
        app = pp.DispatchApp(lambda env: "ran", token=AGENT_TOKEN, proxy_hosts=f"127.0.0.1:{proxy.port}")
        body = json.dumps({"run_id": 1, "odyssey_proxy_url": other, "input": {"user_instruction": "x"}}).encode()
        headers = {"authorization": f"Bearer {AGENT_TOKEN}", "x-pipelines-run-token": RUN_TOKEN,
                   "content-length": str(len(body))}
        refused = app.handle("POST", "/dispatch", headers, body)
        body_ok = body.replace(other.encode(), proxy.url.encode())
        accepted = app.handle("POST", "/dispatch", {**headers, "content-length": str(len(body_ok))}, body_ok)
    assert refused.status == 400 and "allow-list" in json.loads(refused.body)["detail"]
    assert accepted.status == 200


def test_without_an_allow_list_a_connectivity_check_tells_only_reachable_or_not() -> None:
    """A refused local port and a local non-proxy service look alike to a caller with no allow-list set."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    other_service = pp.start_server(lambda env: "x", no_auth=True)  # answers 404 to a proxy path
    try:
        open_url = f"http://127.0.0.1:{other_service.server_address[1]}/api/odyssey-proxy/runs/x"
        closed_url = f"http://127.0.0.1:{closed_port}/api/odyssey-proxy/runs/x"

        def check(app: pp.DispatchApp, url: str) -> Dict[str, Any]:
            body = json.dumps({"connectivity_check": True, "odyssey_proxy_url": url}).encode()
            reply = app.handle("POST", "/dispatch", {"authorization": f"Bearer {AGENT_TOKEN}",
                                                    "content-length": str(len(body))}, body)
            assert reply.status == 200
            return dict(json.loads(reply.body)["outbound"])

        open_app = pp.DispatchApp(lambda env: "ok", token=AGENT_TOKEN)
        answers = [check(open_app, open_url), check(open_app, closed_url)]
        listed = pp.DispatchApp(lambda env: "ok", token=AGENT_TOKEN, proxy_hosts="127.0.0.1")
        detailed = check(listed, closed_url)
        with MockProxy(tokens=[RUN_TOKEN]) as proxy:
            real = check(open_app, proxy.url)
    finally:
        other_service.close(1)
    assert answers[0] == answers[1]  # same keys, same words, no status code or latency to tell them apart
    assert answers[0]["reachable"] is False and answers[0]["status_code"] is None and answers[0]["latency_ms"] is None
    assert detailed["reachable"] is False and detailed["error"] != answers[1]["error"]  # with a list: the cause
    assert real["reachable"] is True and real["status_code"] == 401  # a real proxy is still reported as such
