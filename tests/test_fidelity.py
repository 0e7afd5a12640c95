"""Hostile input and the proxy host allow-list (issue: platform fidelity), over real sockets on 127.0.0.1.

Each case here failed on the kit before: a deep JSON body closed the connection with no reply,
conflicting Content-Length headers desynchronised the stream, a repeated Authorization header was
decided by order, http.server's own refusals were HTML, ``{"ping": false, "ping": true}`` passed as a
ping, a draining server let new connections hang, and any proxy host was accepted.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

import pipelines_port as pp
from conformance.harness.mock_proxy import MockProxy

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "agent-token-fidelity"
AUTH = f"Authorization: Bearer {TOKEN}\r\n"


@pytest.fixture
def server() -> Iterator[Any]:
    s = pp.start_server(lambda env: "ok", token=TOKEN)
    try:
        yield s
    finally:
        s.close(1)


def exchange(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send raw bytes, read until the server closes (or the timeout): every reply on the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
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


def replies(raw: bytes) -> List[Tuple[int, Dict[str, Any]]]:
    """(status, JSON body) of each HTTP/1.1 reply in ``raw``."""
    out = []
    while raw.startswith(b"HTTP/1."):
        head, _, rest = raw.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
        out.append((status, json.loads(rest[:length])))
        raw = rest[length:]
    return out


def post(body: bytes, extra: str = "") -> bytes:
    return (f"POST /dispatch HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def test_a_deeply_nested_body_gets_a_400_and_the_server_stays_up(server: Any) -> None:
    port = server.server_address[1]
    deep_envelope = (b'{"odyssey_proxy_url": "http://127.0.0.1:9/p", "input": ' + b'{"a": ' * 900 + b"1"
                     + b"}" * 901)
    for body in (b"[" * 1000 + b"]" * 1000, deep_envelope):
        got = replies(exchange(port, post(body, "X-Pipelines-Run-Token: rt-deep\r\n")))
        assert got[0][0] == 400 and "nested too deeply" in got[0][1]["detail"]
    assert replies(exchange(port, post(b'{"ping": true}')))[0] == (200, {"ok": True})


def test_conflicting_content_lengths_are_refused_not_parsed_as_a_second_request(server: Any) -> None:
    smuggled = b'{"ping": true}' + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    raw = (f"POST /dispatch HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: 14\r\nContent-Length: {len(smuggled)}\r\n\r\n"
           ).encode() + smuggled
    got = replies(exchange(server.server_address[1], raw))
    assert len(got) == 1 and got[0][0] == 400 and "Content-Length" in got[0][1]["detail"]


def test_identical_repeated_content_lengths_are_one(server: Any) -> None:
    raw = f"POST /dispatch HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: 14\r\nContent-Length: 14\r\n\r\n".encode()
    assert replies(exchange(server.server_address[1], raw + b'{"ping": true}'))[0] == (200, {"ok": True})


@pytest.mark.parametrize("order", ["right first", "wrong first"])
def test_a_repeated_credential_is_refused_whatever_the_order(server: Any, order: str) -> None:
    right, wrong = f"Authorization: Bearer {TOKEN}\r\n", "Authorization: Bearer not-it\r\n"
    pair = right + wrong if order == "right first" else wrong + right
    raw = f"POST /dispatch HTTP/1.1\r\nHost: x\r\n{pair}Content-Length: 14\r\n\r\n".encode() + b'{"ping": true}'
    status, body = replies(exchange(server.server_address[1], raw))[0]
    assert status == 401 and "more than once" in body["detail"] and TOKEN not in body["detail"]


def test_duplicate_ping_keys_are_not_a_ping(server: Any) -> None:
    status, body = replies(exchange(server.server_address[1], post(b'{"ping": false, "ping": true}')))[0]
    assert status == 400 and "twice" in body["detail"]


@pytest.mark.parametrize("request_line,status", [
    ("OPTIONS /dispatch HTTP/1.1", 405),
    ("TRACE /dispatch HTTP/1.1", 405),
    ("BREW /dispatch HTTP/1.1", 501),
    ("GET /" + "a" * 70000 + " HTTP/1.1", 414),
])
def test_http_servers_own_refusals_are_json(server: Any, request_line: str, status: int) -> None:
    raw = exchange(server.server_address[1], f"{request_line}\r\nHost: x\r\n\r\n".encode())
    got = replies(raw)
    assert got and got[0][0] == status and isinstance(got[0][1]["detail"], str), raw[:300]


def test_too_many_headers_is_a_json_431(server: Any) -> None:
    headers = "".join(f"X-H{i}: v\r\n" for i in range(150))
    got = replies(exchange(server.server_address[1], f"GET /healthz HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode()))
    assert got and got[0][0] == 431 and "detail" in got[0][1]


def test_a_draining_server_refuses_new_connections_at_once() -> None:
    release = threading.Event()

    def slow(env: pp.Envelope) -> str:
        release.wait(10)
        return "done"

    with MockProxy(tokens=["rt-drain"]) as proxy:
        server = pp.start_server(slow, token=TOKEN)
        port = server.server_address[1]
        body = json.dumps({"odyssey_proxy_url": proxy.url_for("rt-drain") if hasattr(proxy, "url_for") else proxy.url,
                           "input": {}}).encode()
        raw = post(body, "X-Pipelines-Run-Token: rt-drain\r\n")
        in_flight = threading.Thread(target=exchange, args=(port, raw, 15), daemon=True)
        in_flight.start()
        time.sleep(0.3)
        closer = threading.Thread(target=server.close, args=(10,), daemon=True)
        closer.start()
        time.sleep(0.5)  # the listener is closed well before the 10 s grace ends
        started = time.monotonic()
        with pytest.raises(OSError):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                if not s.recv(1024):
                    raise ConnectionResetError("closed without a reply")
        assert time.monotonic() - started < 2
        release.set()
        closer.join(10)


# -- the proxy host allow-list ---------------------------------------------------------------------


def dispatch(port: int, proxy_url: str, connectivity: bool = False) -> Tuple[int, Dict[str, Any]]:
    payload: Dict[str, Any] = {"odyssey_proxy_url": proxy_url, "input": {}}
    if connectivity:
        payload["connectivity_check"] = True
    return replies(exchange(port, post(json.dumps(payload).encode(), "X-Pipelines-Run-Token: rt-allow\r\n")))[0]


def test_a_proxy_host_off_the_allow_list_is_refused_before_any_connection() -> None:
    ran: List[pp.Envelope] = []
    server = pp.start_server(lambda env: ran.append(env) or "ran", token=TOKEN, proxy_hosts=["127.0.0.1", ".pipelines.tech"])
    try:
        port = server.server_address[1]
        # 10.0.0.1 is never contacted: the refusal comes from decide(), before the agent or a probe runs.
        for connectivity in (False, True):
            status, body = dispatch(port, "http://10.0.0.1:8080/api/odyssey-proxy/runs/1", connectivity)
            assert status == 400 and "allow-list" in body["detail"] and "10.0.0.1" in body["detail"]
        assert ran == []
        status, body = dispatch(port, f"http://127.0.0.1:{port}/api/odyssey-proxy/runs/1")
        assert status == 200 and body["final_response"] == "ran" and len(ran) == 1
    finally:
        server.close(1)


def test_the_allow_list_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINES_PROXY_ALLOWED_HOSTS", "api.pipelines.tech, .example.com")
    app = pp.DispatchApp(lambda env: "ok", token=TOKEN)
    assert app.endpoint.proxy_hosts == ("api.pipelines.tech", ".example.com")
    assert "api.pipelines.tech" in app.describe_proxy_hosts()
    monkeypatch.delenv("PIPELINES_PROXY_ALLOWED_HOSTS")
    assert "no allow-list" in pp.DispatchApp(lambda env: "ok", token=TOKEN).describe_proxy_hosts()
    with pytest.raises(ValueError, match="without scheme"):
        pp.DispatchApp(lambda env: "ok", token=TOKEN, proxy_hosts="https://api.pipelines.tech")


@pytest.mark.parametrize("url,allowed", [
    ("https://api.pipelines.tech/x", True), ("https://API.Pipelines.Tech./x", True), ("https://pipelines.tech/x", True),
    ("https://evil-pipelines.tech/x", False), ("https://pipelines.tech.evil.com/x", False),
    ("http://127.0.0.1:9/p", True), ("http://127.0.0.2/p", False), ("http://[::1]:9/p", True),
])
def test_proxy_host_matching(url: str, allowed: bool) -> None:
    assert pp.proxy_host_allowed(url, (".pipelines.tech", "127.0.0.1", "::1")) is allowed
    assert pp.proxy_host_allowed(url, None) is True


def test_serve_prints_the_allow_list_or_warns_without_one(tmp_path: Path) -> None:
    agent = tmp_path / "agent.py"
    agent.write_text("def agent(envelope):\n    return 'ok'\n")
    env = {**os.environ, "AGENT_TOKEN": TOKEN}
    env.pop("PIPELINES_PROXY_ALLOWED_HOSTS", None)
    for extra, needle in (([], "no allow-list"), (["--proxy-hosts", ".pipelines.tech"], "proxy hosts: .pipelines.tech")):
        proc = subprocess.Popen([sys.executable, "-m", "pipelines_port", "serve", f"{agent}:agent", "--port", "0",
                                 *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            lines = [proc.stdout.readline() for _ in range(3)] if proc.stdout else []
        finally:
            proc.terminate()
            proc.communicate(timeout=10)
        assert any(needle in line for line in lines), lines


def test_an_abort_in_the_waiting_thread_is_not_blamed_on_the_agent() -> None:
    """A host aborting its worker (gunicorn's sync-worker timeout raises SystemExit in the thread waiting for
    the agent) must end the request as the host intends, not as a 500 ``SystemExit: 1`` from the agent."""
    import signal

    release = threading.Event()
    app = pp.DispatchApp(lambda env: release.wait(10) and "late", token=TOKEN, run_timeout_s=30)
    body = json.dumps({"odyssey_proxy_url": "http://127.0.0.1:9/p", "input": {}}).encode()
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Length": str(len(body)), "X-Pipelines-Run-Token": "rt"}

    def abort(signum: int, frame: Any) -> None:
        raise SystemExit(1)

    previous = signal.signal(signal.SIGALRM, abort)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with pytest.raises(SystemExit):
            app.handle("POST", "/dispatch", headers, body)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        release.set()
    # The agent's own SystemExit is still the agent's: a 500 naming it.
    reply = pp.DispatchApp(lambda env: (_ for _ in ()).throw(SystemExit(3)), token=TOKEN).handle(
        "POST", "/dispatch", headers, body)
    assert reply.status == 500 and json.loads(reply.body)["detail"].startswith("SystemExit")
