"""Regressions from the review of pipelines_port.py: deadlocks, leaks, hangs, and framing edge cases."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Any, Dict, List

import pytest

import pipelines_port as pp
from conformance.harness.mock_proxy import MockProxy
from tests.test_server import AGENT_TOKEN, AUTH, asgi_call, dispatch_body, http_call, raw_request, run_headers

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def quick_client() -> Iterator[None]:
    previous = pp.set_default_client(pp.ProxyClient(rate_per_minute=0, timeout=20))
    yield
    pp.set_default_client(previous)


@pytest.fixture
def proxy() -> Any:
    with MockProxy(tokens=["run-token-0f0f0f0f"]) as p:
        yield p


# -- the ASGI adapter never starves its own proxy calls ---------------------------------------


def test_asgi_serves_more_async_dispatches_than_the_proxy_pool_has_threads(proxy: MockProxy) -> None:
    async def agent(env: pp.Envelope) -> str:
        await asyncio.sleep(0.1)
        return str(await pp.aproxy_call("get_order", {}))

    app = pp.DispatchApp(agent, token=AGENT_TOKEN, run_timeout_s=60)
    body = json.dumps(dispatch_body(proxy)).encode()
    headers = {**run_headers(), "Content-Type": "application/json", "Content-Length": str(len(body))}

    async def main() -> List[int]:
        loop = asyncio.get_running_loop()
        # 80 dispatches at once: more than the 64 threads aproxy_call runs on.
        return await asyncio.gather(*(loop.run_in_executor(None, lambda: asgi_call(app, "POST", "/dispatch", headers,
                                                                                      body)[0]) for _ in range(80)))

    with __import__("concurrent.futures").futures.ThreadPoolExecutor(max_workers=80) as pool:
        async def run() -> List[int]:
            asyncio.get_running_loop().set_default_executor(pool)
            return await main()
        statuses = asyncio.run(run())
    assert statuses == [200] * 80


# -- secrets in header values never reach a message ---------------------------------------------


def test_a_header_value_with_a_newline_is_refused_without_showing_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="pipelines_port")
    with pytest.raises(ValueError) as info:
        pp.post_json("http://127.0.0.1:9/v1/x", {}, headers={"Authorization": "Bearer sk-live-SECRET\n"})
    assert "line break" in str(info.value) and "Authorization" in str(info.value)
    assert "sk-live-SECRET" not in str(info.value)
    assert all("sk-live-SECRET" not in r.getMessage() for r in caplog.records)


def test_an_agent_sending_a_bad_key_gets_a_500_without_the_key(proxy: MockProxy) -> None:
    def agent(env: pp.Envelope) -> str:
        pp.post_json("http://127.0.0.1:9/v1/x", {}, headers={"Authorization": "Bearer sk-live-SECRET\n"})
        return "unreachable"

    server = pp.start_server(agent, token=AGENT_TOKEN)
    try:
        status, _, body = http_call(server.url, "POST", "/dispatch", run_headers(), json.dumps(dispatch_body(proxy)).encode())
    finally:
        server.close(1)
    assert status == 500 and b"line break" in body and b"sk-live-SECRET" not in body


def test_userinfo_and_query_never_reach_messages_or_debug_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="pipelines_port")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(pp.HTTPStatusError) as info:
        pp.post_json(f"http://user:sk-PASS@127.0.0.1:{port}/v1/x?key=AIza-SECRET", {},
                     retry=pp.RetryPolicy(transport_retries=0))
    text = str(info.value) + " ".join(r.getMessage() for r in caplog.records)
    assert "sk-PASS" not in text and "AIza-SECRET" not in text and "127.0.0.1" in text


# -- a slow peer cannot stretch a call past its timeout ------------------------------------------


def dripping_server(total_s: float) -> Any:
    """An HTTP server that sends a valid 200 reply one byte every 0.2 s."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    reply = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{"response": 1}'
    step = total_s / len(reply)

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        try:
            for byte in reply:
                conn.sendall(bytes([byte]))
                time.sleep(step)
        except OSError:
            pass
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener


def test_a_dripping_reply_times_out_as_a_whole() -> None:
    listener = dripping_server(total_s=20.0)  # each byte comes well within the timeout; the whole does not
    port = listener.getsockname()[1]
    env = pp.Envelope.from_dispatch({"odyssey_proxy_url": f"http://127.0.0.1:{port}/p"}, {"X-Pipelines-Run-Token": "t"})
    client = pp.ProxyClient(timeout=1.0, rate_per_minute=0, retry=pp.RetryPolicy(transport_retries=0))
    try:
        with pytest.raises(pp.ProxyTransportError, match="timed out"):
            client.call(env, "slow", {})
    finally:
        listener.close()


def test_timeouts_must_be_positive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINES_PROXY_TIMEOUT_S", "0")
    with pytest.raises(pp.PipelinesError, match="PIPELINES_PROXY_TIMEOUT_S must be a positive"):
        pp.ProxyClient()
    monkeypatch.delenv("PIPELINES_PROXY_TIMEOUT_S")
    with pytest.raises(pp.PipelinesError, match="positive"):
        pp.ProxyClient(timeout=0)


# -- the agent's own failures always get an answer ------------------------------------------------


@pytest.mark.parametrize("raised,name", [(SystemExit("bye"), "SystemExit"), (KeyboardInterrupt(), "KeyboardInterrupt"),
                                         (asyncio.CancelledError(), "CancelledError")])
def test_base_exceptions_from_the_agent_are_500s(proxy: MockProxy, raised: BaseException, name: str) -> None:
    def agent(env: pp.Envelope) -> str:
        raise raised

    server = pp.start_server(agent, token=AGENT_TOKEN)
    try:
        status, _, body = http_call(server.url, "POST", "/dispatch", run_headers(), json.dumps(dispatch_body(proxy)).encode())
    finally:
        server.close(1)
    assert status == 500 and json.loads(body)["detail"].startswith(name)


@pytest.mark.parametrize("raised,name", [(SystemExit("bye"), "SystemExit"), (KeyboardInterrupt(), "KeyboardInterrupt"),
                                         (asyncio.CancelledError(), "CancelledError")])
def test_base_exceptions_from_an_async_agent_are_500s_and_the_loop_serves_on(proxy: MockProxy, raised: BaseException,
                                                                              name: str) -> None:
    """An ``async def`` agent runs as a task of the server's loop: what it raises must not escape into the loop."""
    async def agent(env: pp.Envelope) -> str:
        if env.user_instruction == "fail":
            raise raised
        return "still serving"

    server = pp.start_server(agent, token=AGENT_TOKEN)
    try:
        failing, working = (json.dumps(dispatch_body(proxy, input={"user_instruction": text})).encode()
                            for text in ("fail", "ok"))
        status, _, body = http_call(server.url, "POST", "/dispatch", run_headers(), failing)
        assert status == 500 and json.loads(body)["detail"].startswith(name)
        status, _, body = http_call(server.url, "POST", "/dispatch", run_headers(), working)
        assert status == 200 and json.loads(body)["final_response"] == "still serving"
    finally:
        server.close(1)


def test_no_retry_reaches_the_proxy_after_the_504(proxy: MockProxy) -> None:
    finished = threading.Event()

    def agent(env: pp.Envelope) -> str:
        try:
            pp.proxy_call("busy", {})
        except pp.ProxyError:
            pass
        finished.set()
        return "late"

    # Attempts at 0 s and 1 s; the run is answered (504) at 1.5 s; the attempts due at 2 s and 3 s must not go out.
    proxy.script("busy", [{"status": 429, "headers": {"Retry-After": "1"}}])
    server = pp.start_server(agent, token=AGENT_TOKEN, run_timeout_s=1.5)
    try:
        status, _, _ = http_call(server.url, "POST", "/dispatch", run_headers(), json.dumps(dispatch_body(proxy)).encode())
        assert status == 504
        assert finished.wait(10)
    finally:
        server.close(1)
    assert len(proxy.calls("busy")) == 2


# -- host names that cannot be encoded --------------------------------------------------------------


def test_host_names_that_cannot_be_encoded() -> None:
    long_label = "a" * 64
    with pytest.raises(pp.EnvelopeError, match="host name"):
        pp.Envelope.from_dispatch({"odyssey_proxy_url": f"http://{long_label}.example.com/p"}, {"X-Pipelines-Run-Token": "t"})
    probe = pp.probe_proxy(f"http://{long_label}.example.com/p")  # never raises
    assert probe["reachable"] is False and "host name" in probe["error"]
    with pytest.raises(pp.HTTPStatusError):
        pp.post_json(f"http://{long_label}.example.com/v1", {}, retry=pp.RetryPolicy(transport_retries=0))


# -- inbound credential and framing ---------------------------------------------------------------------


def test_a_configured_token_with_surrounding_whitespace_still_matches() -> None:
    server = pp.start_server(lambda env: "ok", token=f"  {AGENT_TOKEN}\n")
    try:
        assert http_call(server.url, "POST", "/dispatch", AUTH, b'{"ping": true}')[0] == 200
    finally:
        server.close(1)


def test_a_non_ascii_token_matches_the_bytes_that_arrive() -> None:
    token = "pässwörd-✓"
    server = pp.start_server(lambda env: "ok", token=token)
    try:
        out = raw_request(server.server_address[1], b"POST /dispatch HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
                          token.encode("utf-8") + b"\r\nContent-Length: 14\r\nConnection: close\r\n\r\n{\"ping\": true}")
        assert out.startswith(b"HTTP/1.1 200")
    finally:
        server.close(1)


@pytest.mark.parametrize("length,status", [("\u00b2".encode("latin-1"), 400), (b"-1", 400), (b"12abc", 400),
                                           (b"9" * 5000, 413)])
def test_odd_content_lengths_get_a_reply_and_a_close_not_a_dropped_connection(length: bytes, status: int) -> None:
    """RFC 9112 §6.3: an invalid Content-Length is a 400 and the connection closes; one too long to read, 413."""
    server = pp.start_server(lambda env: "ok", token=AGENT_TOKEN)
    try:
        out = raw_request(server.server_address[1], b"POST /dispatch HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
                          AGENT_TOKEN.encode() + b"\r\nContent-Length: " + length + b"\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 %d" % status) and b"Connection: close" in out
    finally:
        server.close(1)
    app = pp.DispatchApp(lambda env: "ok", token=AGENT_TOKEN)
    got, _, _ = asgi_call(app, "POST", "/dispatch", {**AUTH, "Content-Length": length.decode("latin-1")}, b"")
    assert got == status


def test_transfer_encoding_with_content_length_closes_instead_of_desyncing() -> None:
    server = pp.start_server(lambda env: "ok", token=AGENT_TOKEN)
    smuggled = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    size_line = b"%x\r\n" % len(smuggled)
    chunked = size_line + smuggled + b"\r\n0\r\n\r\n"
    try:
        # Content-Length covers only the chunk-size line: a server that trusts it reads the rest as a new request.
        out = raw_request(server.server_address[1], b"POST /dispatch HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
                          AGENT_TOKEN.encode() + b"\r\nTransfer-Encoding: chunked\r\nContent-Length: " +
                          str(len(size_line)).encode() + b"\r\n\r\n" + chunked)
    finally:
        server.close(1)
    # RFC 9112 §6.3: refused (400) and closed; the hidden request is never answered
    assert out.startswith(b"HTTP/1.1 400") and out.count(b"HTTP/1.1 ") == 1


def test_a_body_dripped_slower_than_the_read_timeout_is_dropped() -> None:
    server = pp.make_server(lambda env: "ok", token=AGENT_TOKEN, host="127.0.0.1", port=0, read_timeout_s=0.5)
    server._thread = threading.Thread(target=server.serve_forever, daemon=True)
    server._thread.start()
    answers: List[bytes] = []
    try:
        with socket.create_connection(server.server_address, timeout=10) as s:
            s.sendall(b"POST /dispatch HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + AGENT_TOKEN.encode() +
                      b"\r\nContent-Length: 14\r\n\r\n")
            try:
                for byte in b'{"ping": true}':  # each byte well within 0.5 s, the whole over 4 s
                    s.sendall(bytes([byte]))
                    time.sleep(0.3)
                answers.append(s.recv(65536))
            except OSError:
                pass
    finally:
        server.close(1)
    assert not any(a.startswith(b"HTTP/1.1 200") for a in answers)


# -- code mode redacts like the server --------------------------------------------------------------------


def test_code_mode_redacts_the_run_token(proxy: MockProxy) -> None:
    token = "run-token-0f0f0f0f"
    body = pp.code_mode(lambda env: f"my token is {env.run_token}")({}, proxy_url=proxy.url, run_token=token)
    assert token not in json.dumps(body) and "[redacted]" in body["final_response"]

    def raising(env: pp.Envelope) -> str:
        raise RuntimeError(f"auth failed for {env.run_token}")

    with pytest.raises(pp.AgentError) as info:
        pp.code_mode(raising)({}, proxy_url=proxy.url, run_token=token)
    assert token not in str(info.value)


# -- the command line ------------------------------------------------------------------------------------


def test_sigterm_exits_after_the_grace_period_even_with_async_proxy_calls_in_flight(tmp_path: Path) -> None:
    agent = tmp_path / "stuck.py"
    agent.write_text("import pipelines_port as pp\n\nasync def agent(env):\n"
                     "    return str(await pp.aproxy_call('slow', {}))\n")
    with MockProxy(tokens=["run-token-0f0f0f0f"]) as proxy:
        proxy.script("slow", [{"response": "late", "delay_s": 30}])
        proc = subprocess.Popen([sys.executable, str(ROOT / "pipelines_port.py"), "serve", f"{agent}:agent", "--port", "0",
                                 "--no-auth", "--grace", "0.5"], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "PIPELINES_PROXY_RATE_PER_MINUTE": "0"})
        try:
            url = re.search(r"listening on (http://\S+)", proc.stdout.readline()).group(1)
            def dispatch() -> None:
                try:
                    http_call(url, "POST", "/dispatch", {"X-Pipelines-Run-Token": "run-token-0f0f0f0f"},
                              json.dumps(dispatch_body(proxy)).encode())
                except OSError:
                    pass  # the server exits under it: that is the point

            threading.Thread(target=dispatch, daemon=True).start()
            for _ in range(500):
                if proxy.calls("slow"):
                    break
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=15)  # well before the 30 s proxy call ends
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 1 and "grace period over" in err


@pytest.mark.parametrize("args,needle", [
    (["serve", "x.py:agent", "--port", "99999"], "0 to 65535"),
    (["doctor", "--url", "127.0.0.1:8080/dispatch"], "must be an http:// or https:// URL"),
    (["doctor", "--url", "http://127.0.0.1:1/d", "--proxy-url", "http://" + "a" * 64 + ".com/p"], "host name"),
])
def test_cli_usage_errors_are_one_line(args: List[str], needle: str) -> None:
    command = [sys.executable, str(ROOT / "pipelines_port.py")] if args[0] == "serve" else [sys.executable, "-m",
                                                                                             "conformance"]
    out = subprocess.run(command + args, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("args", [["--help"], ["check", "--list"], ["init", "--list"]])
def test_the_kit_command_into_a_closed_pipe_ends_quietly(args: List[str]) -> None:
    """``pipelines-port --help | head -1``: the reader has gone when the command writes; no traceback, no
    "Exception ignored" from the flush at exit."""
    proc = subprocess.Popen([sys.executable, "-m", "conformance", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command writes anything: its first write meets a closed pipe
    err = proc.stderr.read()
    assert proc.wait(60) == 1 and err == b"", err.decode(errors="replace")[-2000:]


def test_doctor_finds_tools_schema_at_the_root_whatever_the_dispatch_path(tmp_path: Path, proxy: MockProxy) -> None:
    tools = [{"name": "get_order", "description": "", "input_schema": {"type": "object"}}]
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    server = pp.start_server(lambda env: "ok", token=AGENT_TOKEN, path="/agents/x/dispatch", tools_schema=tools)
    try:
        out = subprocess.run([sys.executable, "-m", "conformance", "doctor", "--url", server.url,
                              "--tools-schema", str(tmp_path / "tools.json"), "--proxy-url", proxy.url],
                             cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "AGENT_TOKEN": AGENT_TOKEN})
    finally:
        server.close(1)
    assert "✓ tools_schema matches the app" in out.stdout, out.stdout


def test_a_token_where_the_500_detail_is_cut_is_redacted_before_the_cut() -> None:
    """describe_error redacts the whole text, then shortens it: no part of a token survives the cut."""
    token = "run-token-" + "0123456789abcdef" * 2
    for filler in range(430, 500, 7):
        detail = pp.describe_error(RuntimeError("x" * filler + token * 3), pp.DETAIL_LIMIT, token)
        assert len(detail) <= pp.DETAIL_LIMIT and detail.startswith("RuntimeError: xxx")
        assert not any(token[i:i + 8] in detail for i in range(10, len(token) - 7)), detail[-60:]
