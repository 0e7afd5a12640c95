"""The TypeScript port (conformance/ports/typescript/): its build, its vectors, and its dispatch server over 127.0.0.1.

``dist/`` is the port compiled by ``tsc`` and committed, so these tests need only
``node``: the server runs as a subprocess serving the conformance agent, whose
tool calls go to a MockProxy.  Skipped when ``node`` is not on PATH.  The tests
that need the compiler (dist/ is exactly tsc's output of src/) get it from the
``tsc`` fixture: ``npm ci`` in the port, once (``tests/registries.py``).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

import pipelines_port as pp
from conformance.harness.mock_proxy import MockProxy
from tests.port_process import PortServer, assert_sigterm_lets_a_dispatch_finish, platform_dispatch, post

ROOT = pathlib.Path(__file__).resolve().parent.parent
PORT_DIR = ROOT / "conformance" / "ports" / "typescript"
SERVER = PORT_DIR / "dist" / "server.js"
NODE = shutil.which("node")
AGENT_TOKEN = "node-agent-token-7e7e7e"
RUN_TOKEN = "node-run-token-3c3c3c3c"

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not on PATH: the TypeScript port cannot run")


class TsServer(PortServer):
    """``node dist/server.js --port 0 ...`` as a subprocess; ``url`` is its dispatch URL."""

    def __init__(self, *args: str, env: Optional[Dict[str, str]] = None) -> None:
        super().__init__([str(NODE), str(SERVER)], *args, agent_token=AGENT_TOKEN, env=env)


@pytest.fixture(scope="module")
def server() -> Iterator[TsServer]:
    node = TsServer()
    yield node
    assert node.stop() == 0


@pytest.fixture
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[RUN_TOKEN] + [f"node-run-token-{i:03d}" for i in range(20)]) as p:
        yield p


AUTH = {"Authorization": f"Bearer {AGENT_TOKEN}"}


def dispatch(server: TsServer, proxy: MockProxy, instruction: Any, *, token: str = RUN_TOKEN,
             **body: Any) -> Tuple[int, Dict[str, Any]]:
    return platform_dispatch(server, proxy, instruction, agent_token=AGENT_TOKEN, run_token=token, **body)


def results(reply: Dict[str, Any]) -> List[Any]:
    return json.loads(reply["final_response"])["results"]


def raw_request(server: TsServer, data: bytes) -> bytes:
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(data)
        chunks = []
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


# -- the build and the vectors, in the port's own test runner ----------------------------------------------


def test_the_port_passes_every_json_vector_under_node_test() -> None:
    done = subprocess.run([NODE, "--test", "dist/"], cwd=PORT_DIR, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    counts = dict(line[2:].split(" ", 1) for line in done.stdout.splitlines() if line.startswith("# ") and " " in line[2:])
    assert int(counts["pass"]) > 200 and counts["fail"] == "0" and int(counts["skipped"]) <= 12, counts


def test_dist_is_exactly_what_tsc_makes_of_src(tmp_path: pathlib.Path, tsc: pathlib.Path) -> None:
    """One source of truth: the committed JavaScript is the TypeScript compiled, nothing edited by hand."""
    done = subprocess.run([str(tsc), "-p", str(PORT_DIR), "--outDir", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr  # strict mode: a type error fails here
    made = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    committed = sorted(p.relative_to(PORT_DIR / "dist").as_posix() for p in (PORT_DIR / "dist").rglob("*") if p.is_file())
    assert made == committed
    stale = [name for name in made if (tmp_path / name).read_bytes() != (PORT_DIR / "dist" / name).read_bytes()]
    assert not stale, f"dist/ is out of date for {stale}: run `npm run build` in {PORT_DIR}"


def test_the_readme_quick_start_type_checks_and_serves(tmp_path: pathlib.Path, tsc: pathlib.Path) -> None:
    """The README's TypeScript quick start, as printed, compiles against the port in strict mode and serves."""
    readme = (PORT_DIR / "README.md").read_text()
    quick = re.search(r"## Quick start\n\n```ts\n(.*?)```", readme, re.S)
    assert quick is not None and len(quick.group(1).splitlines()) <= 30
    (tmp_path / "src").mkdir()
    shutil.copy(PORT_DIR / "src" / "pipelines_port.ts", tmp_path / "src" / "pipelines_port.ts")
    os.symlink(PORT_DIR / "node_modules", tmp_path / "node_modules")  # typescript and @types/node, as npm ci left them
    shutil.copy(PORT_DIR / "tsconfig.json", tmp_path)
    shutil.copy(PORT_DIR / "package.json", tmp_path)
    (tmp_path / "src" / "agent.ts").write_text(quick.group(1).replace("port: 8080", "port: 0"))
    done = subprocess.run([str(tsc), "-p", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    proc = subprocess.Popen([NODE, str(tmp_path / "dist" / "agent.js")], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env={**os.environ, "AGENT_TOKEN": AGENT_TOKEN})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("dispatch URL: http://0.0.0.0:") and line.rstrip().endswith("/dispatch"), line
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/dispatch", body=b'{"ping": true}', headers={**AUTH, "Content-Type": "application/json"})
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        proc.kill()
        proc.wait(10)


def test_the_public_api_has_no_any() -> None:
    """The declarations tsc emits for the library name no `any`: every exported type is a real one."""
    declarations = (PORT_DIR / "dist" / "pipelines_port.d.ts").read_text()
    assert "export declare function buildResponse" in declarations and "export interface Envelope" in declarations
    words = re.findall(r"\bany\b", re.sub(r"/\*.*?\*/|//[^\n]*", "", declarations, flags=re.S))
    assert words == []


def test_no_runtime_dependency_and_the_dev_ones_are_pinned() -> None:
    """No runtime dependency; the compiler and the community types for Node's built-ins, each pinned exactly."""
    package = json.loads((PORT_DIR / "package.json").read_text())
    assert "dependencies" not in package and sorted(package["devDependencies"]) == ["@types/node", "typescript"]
    # Its declarations name Node's types: a consumer who type-checks brings @types/node, so it is an optional peer.
    assert list(package["peerDependencies"]) == ["@types/node"] and package["peerDependenciesMeta"] == {
        "@types/node": {"optional": True}}
    lock = json.loads((PORT_DIR / "package-lock.json").read_text())
    assert lock["packages"][""]["devDependencies"] == package["devDependencies"]
    for name, version in package["devDependencies"].items():
        assert re.fullmatch(r"\d+\.\d+\.\d+", version)  # exact, no range
        assert lock["packages"][f"node_modules/{name}"]["version"] == version
    assert not (PORT_DIR / "src" / "node-builtins.d.ts").exists()  # no hand-written copy of Node's types


# -- §2: the order of handling ---------------------------------------------------------------


def test_auth_before_a_strict_ping_and_the_400s(server: TsServer) -> None:
    assert post(server, {"ping": True})[0] == 401
    status, headers, body = post(server, {"ping": True}, {"Authorization": "Bearer guess-123"})
    assert status == 401 and b"guess-123" not in body and headers["www-authenticate"] == "Bearer"
    assert post(server, {"ping": True}, {"Authorization": AGENT_TOKEN})[0] == 401  # no Bearer scheme
    status, _, body = post(server, {"ping": True}, AUTH)
    assert (status, json.loads(body)) == (200, {"ok": True})
    for shaped in ({"ping": True, "x": 1}, {"ping": 1}, {"ping": "true"}):
        status, _, body = post(server, shaped, AUTH)
        detail = json.loads(body)["detail"]
        assert status == 400 and "proxy URL" in detail and "X-Pipelines-Run-Token" in detail
    status, _, body = post(server, b"{not json", AUTH)
    assert status == 400 and "not valid JSON" in json.loads(body)["detail"]
    status, _, body = post(server, [1, 2], AUTH)
    assert status == 400 and "JSON object" in json.loads(body)["detail"]


def test_routes_methods_framing_and_keep_alive(server: TsServer) -> None:
    status, headers, body = post(server, b"", AUTH, method="GET")
    assert status == 405 and headers["allow"] == "POST"
    status, _, body = post(server, {"ping": True}, AUTH, path="/elsewhere")
    assert status == 404 and "/dispatch" in json.loads(body)["detail"]
    status, _, body = post(server, b"", method="GET", path="/healthz")
    assert status == 200 and json.loads(body)["ok"] is True
    auth = f"Authorization: Bearer {AGENT_TOKEN}\r\n".encode()
    out = raw_request(server, b"POST /dispatch HTTP/1.1\r\nHost: x\r\n" + auth +
                      b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 411") and b"chunked" in out
    # 100 MB announced, nothing sent: refused at once, the connection closed rather than read.
    out = raw_request(server, b"POST /dispatch HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 100000000\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 413") and b"Connection: close" in out
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        sockets = set()
        for headers in (AUTH, {"Authorization": "Bearer wrong"}, AUTH):
            conn.request("POST", "/dispatch", body=b'{"ping": true}', headers=headers)
            resp = conn.getresponse()
            resp.read()
            sockets.add(id(conn.sock))
        assert resp.status == 200 and len(sockets) == 1
    finally:
        conn.close()


def test_unset_token_env_is_503_and_a_custom_auth_header_carries_the_raw_value() -> None:
    node = TsServer("--token-env", "TS_PORT_UNSET_TOKEN", env={"TS_PORT_UNSET_TOKEN": ""})
    try:
        status, _, body = post(node, {"ping": True}, AUTH)
        assert status == 503 and "TS_PORT_UNSET_TOKEN" in json.loads(body)["detail"]
    finally:
        assert node.stop() == 0
    node = TsServer("--auth-header", "X-API-Key")
    try:
        assert post(node, {"ping": True}, {"X-API-Key": AGENT_TOKEN})[0] == 200
        assert post(node, {"ping": True}, {"X-API-Key": f"Bearer {AGENT_TOKEN}"})[0] == 401
        assert post(node, {"ping": True}, AUTH)[0] == 401
    finally:
        assert node.stop() == 0


# -- the conformance agent: echo mode -------------------------------------------------------------


def test_echo_mode_shows_the_envelope_with_header_fallbacks(server: TsServer, proxy: MockProxy) -> None:
    body = {"input": {"user_instruction": "hello", "session_id": "s-1"}, "future_field": {"kept": True},
            "sub_agents": [{"actor_id": "triage"}, "refunds", 7, "bad label!"]}
    headers = {**AUTH, "X-Pipelines-Run-Token": RUN_TOKEN, "X-Pipelines-Odyssey-Proxy-Url": proxy.url + "/",
               "X-Pipelines-Run-Id": "17", "X-Pipelines-Task-Id": "42", "X-Pipelines-Run-Token-Jti": "jti-h"}
    status, _, raw = post(server, body, headers)
    assert status == 200 and RUN_TOKEN.encode() not in raw
    reply = json.loads(raw)
    assert set(reply) == {"final_response"}
    echoed = json.loads(reply["final_response"])["envelope"]
    assert echoed["proxy_url"] == proxy.url and echoed["api_url"] == proxy.url.split("/api/")[0]
    assert (echoed["run_id"], echoed["task_id"], echoed["agent_id"], echoed["run_token_jti"]) == ("17", "42", None, "jti-h")
    assert echoed["run_token_sha256"] == hashlib.sha256(RUN_TOKEN.encode()).hexdigest()
    assert (echoed["user_instruction"], echoed["task_input"], echoed["session_id"]) == ("hello", {}, "s-1")
    assert echoed["sub_agents"] == ["triage", "refunds"] and echoed["raw"] == body
    status, reply = dispatch(server, proxy, "plain text", odyssey_proxy_url="file:///etc/passwd")
    assert status == 400 and "http" in reply["detail"]


# -- the conformance agent: script mode through the proxy shim -----------------------------------------


def test_script_calls_retries_errors_and_traces(server: TsServer, proxy: MockProxy) -> None:
    proxy.script("get_order", [{"response": {"status": "shipped"}}])
    proxy.script("flaky", [{"status": 429, "headers": {"Retry-After": "0"}, "error_class": "rate_limited"},
                           {"response": "{\"a\": 1}"}])
    proxy.script("expired", [{"status": 401, "error_class": "run_token_expired", "message": "gone"}])
    proxy.script("broken", [{"status": 503, "error_class": "simulator_unavailable", "message": "down"}])
    steps = [
        {"call": "get_order", "args": {"order_id": "4521"}},
        {"call": "flaky", "args": {}, "actor": "  supervisor/refunds  "},
        {"call": "expired", "args": {}},
        {"call": "broken", "args": {}},
        {"call": "bad name", "args": {}},
        {"call": "get_order", "args": [1, 2]},
        {"call": "get_order", "args": {}, "actor": "a//b"},
        {"trace": "assistant_message", "payload": {"text": "working"}},
        {"trace": "debug_dump", "payload": {}},
        {"handoff": {"from": "triage", "to": "triage"}},
        {"handoff": {"from": "triage", "to": "refunds", "reason": "refund asked"}},
        {"sleep_ms": 1},
    ]
    status, reply = dispatch(server, proxy, {"steps": steps})
    assert status == 200, reply
    request_error = {"ok": False, "error": {"kind": "request", "status_code": None, "error_class": None}}
    assert results(reply) == [
        {"ok": True, "value": {"status": "shipped"}},
        {"ok": True, "value": "{\"a\": 1}"},
        {"ok": False, "error": {"kind": "stale_run_token", "status_code": 401, "error_class": "run_token_expired"}},
        {"ok": False, "error": {"kind": "proxy", "status_code": 503, "error_class": "simulator_unavailable"}},
        request_error,
        request_error,
        {"ok": False, "error": {"kind": "request", "status_code": None, "error_class": "actor_id_invalid"}},
        {"ok": True, "value": {"accepted": True, "sequence": 1}},
        request_error,
        {"ok": True, "value": None},
        {"ok": True, "value": {"accepted": True, "sequence": 2}},
        {"ok": True, "value": None},
    ]
    tools = proxy.calls()
    assert [c.name for c in tools] == ["get_order", "flaky", "flaky", "expired", "broken"]
    assert all(c.bearer == RUN_TOKEN and "x-pipelines-run-token" not in c.headers for c in tools)
    assert tools[0].json == {"order_id": "4521"} and tools[0].actor is None
    assert tools[1].idempotency_key == tools[2].idempotency_key != tools[0].idempotency_key
    assert tools[1].actor == tools[2].actor == "supervisor/refunds"
    traces = proxy.calls(kind="traces")
    assert [t.name for t in traces] == ["assistant_message", "handoff"]
    assert traces[0].json["text"] == "working" and traces[0].json["__occurred_at"].endswith("Z")
    assert traces[1].json["from_sub_agent"] == "triage" and traces[1].json["to_sub_agent"] == "refunds"
    # The transcript pairs every call with its outcome and is a valid response envelope.
    assert pp.validate_response(reply) == []
    messages = reply["messages"]
    assert messages[0] == {"role": "user", "content": json.dumps({"steps": steps})}
    assert messages[1]["tool_calls"] == [{"id": "call_1", "name": "get_order", "arguments": {"order_id": "4521"}}]
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": json.dumps(results(reply)[0], separators=(",", ":"))}
    assert messages[11]["tool_calls"][0]["arguments"] == "[1,2]"  # non-object args shown as JSON text
    assert len(messages) == 1 + 2 * 7 + 1 and messages[-1] == {"role": "assistant", "content": reply["final_response"]}
    assert reply["metadata"]["model"] == "conformance-agent" and reply["metadata"]["agent_runtime_ms"] >= 0


def test_parallel_calls_overlap_and_keep_their_order(server: TsServer, proxy: MockProxy) -> None:
    proxy.script("*", lambda r: {"response": {"name": r.name}, "delay_s": 0.2})
    status, reply = dispatch(server, proxy, {"steps": [{"parallel": [{"call": n, "args": {}} for n in "abc"]}]})
    assert status == 200
    assert results(reply) == [{"parallel": [{"ok": True, "value": {"name": n}} for n in "abc"]}]
    assert proxy.max_in_flight == 3
    assert [m["tool_calls"][0]["id"] for m in reply["messages"][1:-1:2]] == ["call_1", "call_2", "call_3"]


def test_concurrent_dispatches_never_cross_run_tokens(server: TsServer, proxy: MockProxy) -> None:
    proxy.script("whoami", lambda r: {"response": {"bearer_sha": hashlib.sha256(r.bearer.encode()).hexdigest()},
                                      "delay_s": 0.05})
    script = {"steps": [{"call": "whoami", "args": {}}, {"call": "whoami", "args": {}}]}
    replies: Dict[int, Tuple[int, Dict[str, Any]]] = {}

    def one(i: int) -> None:
        replies[i] = dispatch(server, proxy, script, token=f"node-run-token-{i:03d}", run_id=i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i in range(20):
        status, reply = replies[i]
        want = hashlib.sha256(f"node-run-token-{i:03d}".encode()).hexdigest()
        assert status == 200 and [r["value"]["bearer_sha"] for r in results(reply)] == [want, want]
    assert len(proxy.calls("whoami")) == 40 and proxy.max_in_flight > 5


def test_agent_errors_and_unusable_results_are_500s(server: TsServer, proxy: MockProxy) -> None:
    status, reply = dispatch(server, proxy, {"steps": [{"raise": f"boom with {RUN_TOKEN} and {AGENT_TOKEN}"}]})
    assert status == 500 and reply["detail"].startswith("Error: boom with [redacted]") and AGENT_TOKEN not in reply["detail"]
    status, reply = dispatch(server, proxy, {"steps": [{"raise": "x" * 2000}]})
    assert status == 500 and len(reply["detail"]) <= 500
    status, reply = dispatch(server, proxy, {"steps": [{"return": ""}]})
    assert status == 500 and "final_response" in reply["detail"]
    status, reply = dispatch(server, proxy, {"steps": [{"return": {"final_response": "custom", "trace_id": "t"}}]})
    assert (status, reply) == (200, {"final_response": "custom", "trace_id": "t"})
    status, reply = dispatch(server, proxy, {"steps": [{"call": "get_order", "args": {}}, {"dance": True}]})
    assert status == 500 and "steps[1]" in reply["detail"] and proxy.requests == []  # checked before anything is sent
    status, reply = dispatch(server, proxy, {"steps": [{"call": "get_order"}]})
    assert status == 500 and "steps[0]" in reply["detail"] and '"args"' in reply["detail"]
    status, reply = dispatch(server, proxy, {"steps": [{"return": f"leak {RUN_TOKEN}"}]})
    assert status == 200 and "[redacted]" in reply["final_response"]


def test_connectivity_check_probes_without_running_the_agent(server: TsServer, proxy: MockProxy) -> None:
    status, _, body = post(server, {"connectivity_check": True, "odyssey_proxy_url": proxy.url}, AUTH)
    out = json.loads(body)["outbound"]
    assert status == 200 and out["reachable"] is True and out["status_code"] == 401
    assert proxy.requests[-1].name == "__reachability_probe__" and proxy.requests[-1].bearer == "fake-token"
    status, _, body = post(server, {"connectivity_check": True}, AUTH)
    assert status == 400 and "proxy URL" in json.loads(body)["detail"]


# -- the command line: start-up errors and graceful SIGTERM -------------------------------------------------


def test_bad_arguments_are_one_clear_line() -> None:
    for args, needle in ((["--port", "abc"], "--port"), (["--bogus"], "--bogus"), (["--path", "nope"], "path")):
        done = subprocess.run([NODE, str(SERVER), *args], capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and needle in done.stderr and "    at " not in done.stderr, done.stderr


def test_sigterm_lets_an_in_flight_dispatch_finish(proxy: MockProxy) -> None:
    assert_sigterm_lets_a_dispatch_finish(TsServer(), proxy, agent_token=AGENT_TOKEN, run_token=RUN_TOKEN)


# -- the conformance checker -------------------------------------------------------------------------------


def run_check(node: TsServer, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "conformance", "check", node.url, "--token", AGENT_TOKEN, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert " 0 failed, 0 warned" in summary, summary
    return summary


def test_the_conformance_check_passes_every_case() -> None:
    node = TsServer()
    try:
        summary = run_check(node, "--strict")  # MUST and SHOULD
        api = run_check(node, "--strict", "--profile", "api")  # and the kit's own choices, which it mirrors
    finally:
        assert node.stop() == 0
    passed = int(summary.split(" passed")[0])
    assert passed > 200 and int(api.split(" passed")[0]) > passed, summary
    # The cases that need a custom auth header, against a server registered with one.
    node = TsServer("--auth-header", "X-API-Key")
    try:
        run_check(node, "--auth-header", "X-API-Key", "--only", "auth,ping,vectors.inbound")
    finally:
        assert node.stop() == 0
    # The misconfigured mode: the token variable unset, every request a 503.
    node = TsServer(env={"AGENT_TOKEN": ""})
    try:
        assert run_check(node, "--misconfigured", "--strict").startswith("1 passed")
    finally:
        assert node.stop() == 0
