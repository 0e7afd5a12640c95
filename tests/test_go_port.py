"""The Go port (conformance/ports/go/): its own tests, the conformance check, and its server over 127.0.0.1.

The server (``cmd/conformance-server``, serving the conformance agent) is built
once into a temporary directory and run as a subprocess; the agent's tool
calls go to a MockProxy. Skipped when ``go`` is not on PATH.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from conformance.mock_proxy import MockProxy
from tests.port_process import PortServer, post

ROOT = pathlib.Path(__file__).resolve().parent.parent
PORT_DIR = ROOT / "conformance" / "ports" / "go"
GO = shutil.which("go")
AGENT_TOKEN = "go-agent-token-5d5d5d5d"
RUN_TOKEN = "go-run-token-6e6e6e6e"

pytestmark = pytest.mark.skipif(GO is None, reason="go is not on PATH: the Go port cannot be built")


def go_env(cache: pathlib.Path) -> Dict[str, str]:
    """The environment for ``go``: no network needed (standard library only), a build cache that exists."""
    env = {**os.environ, "GOFLAGS": "-mod=mod", "GOPROXY": "off", "GO111MODULE": "on"}
    if not env.get("GOCACHE") and not env.get("HOME") and not env.get("XDG_CACHE_HOME"):
        env["GOCACHE"] = str(cache)
    return env


@pytest.fixture(scope="module")
def binary(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """``go build`` of the conformance server, once per module."""
    out = tmp_path_factory.mktemp("go-port")
    exe = out / "conformance-server"
    done = subprocess.run([GO, "build", "-o", str(exe), "./cmd/conformance-server"], cwd=PORT_DIR,
                          env=go_env(out / "cache"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return exe


class GoServer(PortServer):
    """The built conformance server as a subprocess on a free port; ``url`` is its dispatch URL."""

    def __init__(self, exe: pathlib.Path, *args: str, env: Optional[Dict[str, str]] = None) -> None:
        super().__init__([str(exe)], *args, agent_token=AGENT_TOKEN, env=env)


@pytest.fixture(scope="module")
def server(binary: pathlib.Path) -> Iterator[GoServer]:
    go = GoServer(binary)
    yield go
    log = go.log()
    assert go.stop() == 0
    assert AGENT_TOKEN not in log and RUN_TOKEN not in log  # no token in any log line


@pytest.fixture
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[RUN_TOKEN]) as p:
        yield p


AUTH = {"Authorization": f"Bearer {AGENT_TOKEN}"}


def dispatch(server: GoServer, proxy: MockProxy, instruction: Any, **body: Any) -> Tuple[int, Dict[str, Any]]:
    """One dispatch as the platform sends it; ``instruction`` (a script when not a string) becomes user_instruction."""
    text = instruction if isinstance(instruction, str) else json.dumps(instruction)
    payload = {"task_id": 42, "run_id": 17, "agent_id": 8, "run_token_jti": "jti-17", "odyssey_proxy_url": proxy.url,
               "input": {"task_id": 42, "user_instruction": text, "input": {"order_id": "4521"}}, **body}
    status, _, raw = post(server, payload, {**AUTH, "X-Pipelines-Run-Token": RUN_TOKEN})
    assert RUN_TOKEN.encode() not in raw and AGENT_TOKEN.encode() not in raw
    return status, json.loads(raw)


# -- the port's own tests ------------------------------------------------------------------------


def test_go_vet_and_go_test_pass(tmp_path: pathlib.Path) -> None:
    env = go_env(tmp_path / "cache")
    vet = subprocess.run([GO, "vet", "./..."], cwd=PORT_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert vet.returncode == 0, vet.stdout + vet.stderr
    done = subprocess.run([GO, "test", "-count=1", "-v", "-run", "TestVectors", "./..."], cwd=PORT_DIR, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (counts,) = [line for line in done.stdout.splitlines() if "vectors:" in line]
    passed = int(counts.split("vectors:")[1].split(" passed")[0])
    assert passed > 200 and " 0 failed" in counts, counts
    done = subprocess.run([GO, "test", "-count=1", "./..."], cwd=PORT_DIR, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def test_gofmt_is_clean() -> None:
    gofmt = shutil.which("gofmt") or str(pathlib.Path(GO).with_name("gofmt"))  # type: ignore[arg-type]
    done = subprocess.run([gofmt, "-l", "."], cwd=PORT_DIR, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "", done.stdout + done.stderr


# -- the conformance check -----------------------------------------------------------------------


def run_check(server: GoServer, *args: str) -> Dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "conformance", "check", server.url, "--token", AGENT_TOKEN,
                           "--json", "-", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "AGENT_TOKEN"})
    assert done.returncode == 0, done.stderr[-4000:]
    report: Dict[str, Any] = json.loads(done.stdout)
    flagged = [(c["id"], c["status"]) for c in report["cases"] if c["status"] not in ("pass", "skip")]
    assert not flagged and report["failed"] == 0 and report["warned"] == 0, flagged
    return report


def test_the_conformance_check_passes_at_strict(server: GoServer) -> None:
    report = run_check(server, "--strict")
    assert report["passed"] > 200 and report["level_met"] == "MUST+SHOULD"
    skipped = [c["id"] for c in report["cases"] if c["status"] == "skip"]
    assert all(case.startswith("vectors.inbound:auth-") for case in skipped), skipped  # the X-API-Key vectors
    api = run_check(server, "--strict", "--profile", "api")  # and the kit's own choices, which it mirrors
    assert api["passed"] > report["passed"]


def test_a_custom_auth_header_and_the_misconfigured_mode(binary: pathlib.Path) -> None:
    go = GoServer(binary, "--auth-header", "X-API-Key")
    try:
        report = run_check(go, "--strict", "--auth-header", "X-API-Key", "--only", "auth,ping,vectors.inbound")
        assert report["passed"] > 10
        assert post(go, {"ping": True}, {"X-API-Key": AGENT_TOKEN})[0] == 200
        assert post(go, {"ping": True}, AUTH)[0] == 401
    finally:
        assert go.stop() == 0
    go = GoServer(binary, env={"AGENT_TOKEN": ""})
    try:
        report = run_check(go, "--misconfigured", "--strict")
        assert report["passed"] == 1
        status, _, body = post(go, {"ping": True}, AUTH)
        assert status == 503 and "AGENT_TOKEN" in json.loads(body)["detail"]
    finally:
        assert go.stop() == 0


# -- direct HTTP ---------------------------------------------------------------------------------


def test_auth_ping_and_the_refusals(server: GoServer) -> None:
    status, headers, body = post(server, {"ping": True}, {"Authorization": "Bearer guess-8f8f8f"})
    assert status == 401 and b"guess-8f8f8f" not in body and AGENT_TOKEN.encode() not in body
    assert headers["www-authenticate"] == "Bearer"
    assert post(server, {"ping": True}, {"Authorization": AGENT_TOKEN})[0] == 401  # no Bearer scheme
    assert post(server, b"{oops")[0] == 401  # auth before JSON
    status, _, body = post(server, {"ping": True}, AUTH)
    assert (status, json.loads(body)) == (200, {"ok": True})
    status, _, body = post(server, {"ping": True, "x": 1}, AUTH)
    assert status == 400 and "proxy URL" in json.loads(body)["detail"]
    assert post(server, b'{"ping": false, "ping": true}', AUTH)[0] == 400
    assert post(server, b"{oops", AUTH)[0] == 400
    assert post(server, [1, 2], AUTH)[0] == 400
    status, headers, _ = post(server, b"", AUTH, method="GET")
    assert status == 405 and headers["allow"] == "POST"
    assert post(server, {"ping": True}, AUTH, path="/elsewhere")[0] == 404
    status, _, body = post(server, b"", method="GET", path="/healthz")
    assert status == 200 and json.loads(body)["ok"] is True


def test_a_script_through_the_proxy_and_a_failing_agent(server: GoServer, proxy: MockProxy) -> None:
    proxy.script("get_order", [{"response": {"status": "shipped"}}])
    steps = [{"call": "get_order", "args": {"order_id": "4521"}, "actor": " triage "},
             {"trace": "assistant_message", "payload": {"text": "hi"}}]
    status, reply = dispatch(server, proxy, {"steps": steps})
    assert status == 200, reply
    assert json.loads(reply["final_response"])["results"] == [
        {"ok": True, "value": {"status": "shipped"}}, {"ok": True, "value": {"accepted": True, "sequence": 1}}]
    (call,) = proxy.calls()
    assert call.bearer == RUN_TOKEN and call.actor == "triage" and call.idempotency_key
    status, reply = dispatch(server, proxy, "echo me")
    echoed = json.loads(reply["final_response"])["envelope"]
    assert status == 200 and echoed["run_token_sha256"] == hashlib.sha256(RUN_TOKEN.encode()).hexdigest()
    assert (echoed["run_id"], echoed["task_input"]) == (17, {"order_id": "4521"})
    status, reply = dispatch(server, proxy, {"steps": [{"raise": f"boom {RUN_TOKEN} and {AGENT_TOKEN}"}]})
    assert status == 500 and reply["detail"] == "Error: boom [redacted] and [redacted]"


def test_bad_arguments_are_one_line(binary: pathlib.Path) -> None:
    for args, needle in ((["--port", "abc"], "port"), (["--bogus"], "bogus"), (["--path", "nope"], "path"),
                         (["--timeout", "0"], "timeout")):
        done = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and needle in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_sigterm_lets_an_in_flight_dispatch_finish(binary: pathlib.Path, proxy: MockProxy) -> None:
    go = GoServer(binary)
    outcome: List[Tuple[int, Dict[str, Any]]] = []
    script = {"steps": [{"call": "started", "args": {}}, {"sleep_ms": 400}]}
    worker = threading.Thread(target=lambda: outcome.append(dispatch(go, proxy, script)))
    worker.start()
    try:
        for _ in range(500):
            if proxy.calls("started"):
                break
            threading.Event().wait(0.01)
        assert proxy.calls("started")
        assert go.stop() == 0
    finally:
        worker.join(15)
    assert outcome[0][0] == 200 and json.loads(outcome[0][1]["final_response"])["results"][1] == {"ok": True, "value": None}


def test_the_readme_quick_start_builds_and_serves(tmp_path: pathlib.Path) -> None:
    """The README's Go quick start, as printed, is a complete program: it builds against the port and serves."""
    readme = (PORT_DIR / "README.md").read_text()
    quick = re.search(r"## Quick start: your own agent\n.*?```go\n(.*?)```", readme, re.S)
    assert quick is not None and len(quick.group(1).splitlines()) <= 30
    module = tmp_path / "agent"
    module.mkdir()
    (module / "go.mod").write_text(f"module agent\n\ngo 1.19\n\nrequire pipelinesport v0.0.0\n\n"
                                   f"replace pipelinesport => {PORT_DIR}\n")
    (module / "main.go").write_text(quick.group(1).replace('"127.0.0.1:8080"', '"127.0.0.1:0"'))
    exe = tmp_path / "quick-start"
    done = subprocess.run([GO, "build", "-o", str(exe), "."], cwd=module, env=go_env(tmp_path / "cache"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([GO, "vet", "."], cwd=module, env=go_env(tmp_path / "cache"), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    proc = subprocess.Popen([str(exe)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "AGENT_TOKEN": AGENT_TOKEN})
    try:
        # It logs nothing at start (127.0.0.1:0 picks a port): find the port it listens on from /proc.
        port = None
        for _ in range(100):
            port = listening_port(proc.pid)
            if port:
                break
            threading.Event().wait(0.05)
        assert port, "the quick start did not listen"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/dispatch", body=b'{"ping": true}',
                     headers={"Authorization": f"Bearer {AGENT_TOKEN}", "Content-Type": "application/json"})
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        proc.kill()
        proc.wait(10)


def listening_port(pid: int) -> Optional[int]:
    """The TCP port a process listens on, from /proc (Linux), or None."""
    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        rows = pathlib.Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    for row in rows:
        fields = row.split()
        if fields[3] == "0A" and f"socket:[{fields[9]}]" in inodes:  # 0A: LISTEN
            return int(fields[1].split(":")[1], 16)
    return None
