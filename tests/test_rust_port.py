"""The Rust port (conformance/ports/rust/): its own tests, the conformance check, and its server over 127.0.0.1.

The server (``src/bin/conformance-server``, serving the conformance agent) is built once with ``cargo build``
into the one shared target directory of ``tests/rust_mutants.py`` (the dependencies compile once for the port,
its tests and the mutants) and run as a subprocess; the agent's tool calls go to a MockProxy. Skipped when
``cargo`` is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from conformance.mock_proxy import MockProxy
from tests.port_process import PortServer, post
from tests.rust_mutants import CARGO, PORT, build, target_dir

ROOT = pathlib.Path(__file__).resolve().parent.parent
AGENT_TOKEN = "rust-agent-token-5d5d5d5d"
RUN_TOKEN = "rust-run-token-6e6e6e6e"

pytestmark = pytest.mark.skipif(CARGO is None, reason="cargo is not on PATH: the Rust port cannot be built")


def cargo(*args: str, cwd: pathlib.Path = PORT, timeout: float = 900) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    env = {**os.environ, "CARGO_TARGET_DIR": str(target_dir()), "CARGO_TERM_COLOR": "never"}
    return subprocess.run([str(CARGO), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def binary(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """``cargo build`` of the conformance server, once per module, copied out of the shared target directory."""
    return build(PORT, tmp_path_factory.mktemp("rust-port") / "conformance-server")


class RustServer(PortServer):
    """The built conformance server as a subprocess on a free port; ``url`` is its dispatch URL."""

    def __init__(self, exe: pathlib.Path, *args: str, env: Optional[Dict[str, str]] = None) -> None:
        super().__init__([str(exe)], *args, agent_token=AGENT_TOKEN, env=env)


@pytest.fixture(scope="module")
def server(binary: pathlib.Path) -> Iterator[RustServer]:
    rust = RustServer(binary)
    yield rust
    log = rust.log()
    assert rust.stop() == 0
    assert AGENT_TOKEN not in log and RUN_TOKEN not in log  # no token in any log line


@pytest.fixture
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[RUN_TOKEN]) as p:
        yield p


AUTH = {"Authorization": f"Bearer {AGENT_TOKEN}"}


def dispatch(server: RustServer, proxy: MockProxy, instruction: Any, **body: Any) -> Tuple[int, Dict[str, Any]]:
    """One dispatch as the platform sends it; ``instruction`` (a script when not a string) becomes user_instruction."""
    text = instruction if isinstance(instruction, str) else json.dumps(instruction)
    payload = {"task_id": 42, "run_id": 17, "agent_id": 8, "run_token_jti": "jti-17", "odyssey_proxy_url": proxy.url,
               "input": {"task_id": 42, "user_instruction": text, "input": {"order_id": "4521"}}, **body}
    status, _, raw = post(server, payload, {**AUTH, "X-Pipelines-Run-Token": RUN_TOKEN})
    assert RUN_TOKEN.encode() not in raw and AGENT_TOKEN.encode() not in raw
    return status, json.loads(raw)


# -- the port's own gates ------------------------------------------------------------------------


def test_cargo_fmt_clippy_and_cargo_test_pass() -> None:
    fmt = cargo("fmt", "--check")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
    clippy = cargo("clippy", "--locked", "--all-targets", "--all-features", "--", "-D", "warnings")
    assert clippy.returncode == 0, clippy.stderr[-4000:]
    done = cargo("test", "--locked", "--test", "vectors", "--", "--nocapture")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (counts,) = [line for line in done.stdout.splitlines() if line.startswith("vectors:")]
    passed = int(counts.split("vectors:")[1].split(" passed")[0])
    assert passed > 250 and " 0 failed" in counts, counts
    done = cargo("test", "--locked")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def test_the_crate_keeps_its_promises() -> None:
    manifest = (PORT / "Cargo.toml").read_text()
    assert re.search(r'^rust-version = "1\.\d+"', manifest, re.M)
    assert (PORT / "Cargo.lock").exists()
    assert "#![forbid(unsafe_code)]" in (PORT / "src" / "lib.rs").read_text()
    core = cargo("tree", "--locked", "--no-default-features", "-e", "normal", "--depth", "1")
    assert core.returncode == 0, core.stderr
    direct = sorted(line.split()[1] for line in core.stdout.splitlines()[1:] if line.strip())
    assert direct == ["serde", "serde_json"], direct  # the contract core depends on serde and serde_json only


# -- the conformance check -----------------------------------------------------------------------


def run_check(server: RustServer, *args: str) -> Dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "conformance", "check", server.url, "--token", AGENT_TOKEN,
                           "--json", "-", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "AGENT_TOKEN"})
    assert done.returncode == 0, done.stderr[-4000:]
    report: Dict[str, Any] = json.loads(done.stdout)
    flagged = [(c["id"], c["status"]) for c in report["cases"] if c["status"] not in ("pass", "skip")]
    assert not flagged and report["failed"] == 0 and report["warned"] == 0, flagged
    return report


def test_the_conformance_check_passes_at_strict(server: RustServer) -> None:
    report = run_check(server, "--strict")
    assert report["passed"] > 200 and report["level_met"] == "MUST+SHOULD"
    skipped = [c["id"] for c in report["cases"] if c["status"] == "skip"]
    assert all(case.startswith("vectors.inbound:auth-") for case in skipped), skipped  # the X-API-Key vectors
    api = run_check(server, "--strict", "--profile", "api")  # and the kit's own choices, which it mirrors
    assert api["passed"] > report["passed"]


def test_a_custom_auth_header_and_the_misconfigured_mode(binary: pathlib.Path) -> None:
    rust = RustServer(binary, "--auth-header", "X-API-Key")
    try:
        report = run_check(rust, "--strict", "--auth-header", "X-API-Key", "--only", "auth,ping,vectors.inbound")
        assert report["passed"] > 10
        assert post(rust, {"ping": True}, {"X-API-Key": AGENT_TOKEN})[0] == 200
        assert post(rust, {"ping": True}, AUTH)[0] == 401
    finally:
        assert rust.stop() == 0
    rust = RustServer(binary, env={"AGENT_TOKEN": ""})
    try:
        report = run_check(rust, "--misconfigured", "--strict")
        assert report["passed"] == 1
        status, _, body = post(rust, {"ping": True}, AUTH)
        assert status == 503 and "AGENT_TOKEN" in json.loads(body)["detail"]
    finally:
        assert rust.stop() == 0


# -- direct HTTP ---------------------------------------------------------------------------------


def test_auth_ping_and_the_refusals(server: RustServer) -> None:
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


def test_a_script_through_the_proxy_and_a_failing_agent(server: RustServer, proxy: MockProxy) -> None:
    proxy.script("get_order", [{"response": {"status": "shipped"}}])
    steps = [{"call": "get_order", "args": {"order_id": "4521"}, "actor": " triage "},
             {"trace": "assistant_message", "payload": {"text": "hi"}}]
    status, reply = dispatch(server, proxy, {"steps": steps})
    assert status == 200, reply
    assert json.loads(reply["final_response"])["results"] == [
        {"ok": True, "value": {"status": "shipped"}}, {"ok": True, "value": {"accepted": True, "sequence": 1}}]
    (call,) = proxy.calls()
    assert call.bearer == RUN_TOKEN and call.actor == "triage" and call.idempotency_key
    status, reply = dispatch(server, proxy, "echo me \ud83d cut")  # a lone surrogate arrives as U+FFFD
    echoed = json.loads(reply["final_response"])["envelope"]
    assert status == 200 and echoed["run_token_sha256"] == hashlib.sha256(RUN_TOKEN.encode()).hexdigest()
    assert (echoed["run_id"], echoed["task_input"]) == (17, {"order_id": "4521"})
    assert echoed["user_instruction"] == "echo me \ufffd cut"
    status, reply = dispatch(server, proxy, {"steps": [{"raise": f"boom {RUN_TOKEN} and {AGENT_TOKEN}"}]})
    assert status == 500 and reply["detail"] == "Error: boom [redacted] and [redacted]"


def test_bad_arguments_are_one_line(binary: pathlib.Path) -> None:
    for args, needle in ((["--port", "abc"], "port"), (["--bogus"], "bogus"), (["--path", "nope"], "path"),
                         (["--timeout", "0"], "timeout")):
        done = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and needle in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_sigterm_lets_an_in_flight_dispatch_finish(binary: pathlib.Path, proxy: MockProxy) -> None:
    rust = RustServer(binary)
    outcome: List[Tuple[int, Dict[str, Any]]] = []
    script = {"steps": [{"call": "started", "args": {}}, {"sleep_ms": 400}]}
    worker = threading.Thread(target=lambda: outcome.append(dispatch(rust, proxy, script)))
    worker.start()
    try:
        for _ in range(500):
            if proxy.calls("started"):
                break
            threading.Event().wait(0.01)
        assert proxy.calls("started")
        assert rust.stop() == 0
    finally:
        worker.join(15)
    assert outcome[0][0] == 200 and json.loads(outcome[0][1]["final_response"])["results"][1] == {"ok": True, "value": None}


def test_the_readme_quick_start_builds(tmp_path: pathlib.Path) -> None:
    """The README's Rust quick start, as printed, is a complete program that builds against the port."""
    readme = (PORT / "README.md").read_text()
    quick = re.search(r"## Quick start: your own agent\n.*?```rust\n(.*?)```", readme, re.S)
    assert quick is not None and len(quick.group(1).splitlines()) <= 40
    crate = tmp_path / "agent"
    (crate / "src").mkdir(parents=True)
    (crate / "Cargo.toml").write_text(
        '[package]\nname = "quick-start"\nversion = "0.1.0"\nedition = "2021"\n\n[dependencies]\n'
        f'pipelines-port = {{ path = "{PORT}" }}\nserde_json = "1"\n'
        'tokio = { version = "1", features = ["macros", "rt-multi-thread", "signal", "net"] }\n')
    (crate / "src" / "main.rs").write_text(quick.group(1))
    shutil_lock = (PORT / "Cargo.lock").read_text()
    (crate / "Cargo.lock").write_text(shutil_lock)  # the port's pinned versions, so nothing new is resolved
    done = cargo("build", "--offline", cwd=crate)
    assert done.returncode == 0, done.stderr[-3000:]
