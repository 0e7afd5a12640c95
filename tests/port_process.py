"""A reference port's conformance server as a subprocess, and the checks the tests of every port share
(TypeScript, Go, Rust)."""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import signal
import subprocess
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

Reply = Tuple[int, Dict[str, str], bytes]


class PortServer:
    """``CMD --port 0 ARGS`` as a subprocess; ``url`` is its dispatch URL, ``host`` and ``port`` its address.

    The server must print ``listening on http://HOST:PORT/PATH`` on stdout within ``start_s`` seconds (a host
    that announces itself otherwise gives ``banner``, a pattern whose group is its base URL, and ``path``).  Its
    stderr is kept for :meth:`log`; ``AGENT_TOKEN`` is ``agent_token`` unless ``env`` says otherwise.
    """

    def __init__(self, cmd: Sequence[str], *args: str, agent_token: str, env: Optional[Dict[str, str]] = None,
                 cwd: Optional[str] = None, banner: str = r"listening on (http://\S+)", path: str = "",
                 start_s: float = 15) -> None:
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [*cmd, "--port", "0", *args], stdout=subprocess.PIPE, stderr=self.stderr, text=True, cwd=cwd,
            env={**os.environ, "AGENT_TOKEN": agent_token, **(env or {})},
        )
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout or ()], daemon=True).start()
        deadline = time.monotonic() + start_s
        seen: List[str] = []
        found = None
        while found is None:
            try:
                seen.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                self.proc.kill()
                raise AssertionError(f"{cmd[-1]} did not start: {''.join(seen)}{self.log()}") from None
            found = re.search(banner, seen[-1])
        self.url = found.group(1).rstrip("/") + path
        self.host, rest = self.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        self.port = int(rest)

    def log(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode("utf-8", "replace")

    def stop(self) -> int:
        """SIGTERM, then the exit status (the server lets in-flight dispatches finish first)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(15)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.stderr.close()


def post(server: PortServer, body: Any, headers: Optional[Dict[str, str]] = None, *, method: str = "POST",
         path: Optional[str] = None) -> Reply:
    """One request on a fresh connection: status, lower-cased headers, body (``body`` bytes as they are, else JSON);
    ``path`` defaults to the dispatch URL's."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    path = path or "/" + server.url.split("//", 1)[1].split("/", 1)[1]
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        conn.request(method, path, body=raw if method == "POST" else None,
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def platform_dispatch(server: PortServer, proxy: Any, instruction: Any, *, agent_token: str, run_token: str,
                      **body: Any) -> Tuple[int, Dict[str, Any]]:
    """One dispatch as the platform sends it to a port serving the conformance agent; ``instruction`` (a script
    when not a string) becomes user_instruction.  Neither token may come back in the reply."""
    text = instruction if isinstance(instruction, str) else json.dumps(instruction)
    payload = {"task_id": 42, "run_id": 17, "agent_id": 8, "run_token_jti": "jti-17", "odyssey_proxy_url": proxy.url,
               "input": {"task_id": 42, "user_instruction": text, "input": {"order_id": "4521"}}, **body}
    headers = {"Authorization": f"Bearer {agent_token}", "X-Pipelines-Run-Token": run_token}
    status, _, raw = post(server, payload, headers)
    assert run_token.encode() not in raw and agent_token.encode() not in raw
    return status, json.loads(raw)


def run_check(server: PortServer, agent_token: str, *args: str, timeout: float = 300) -> Dict[str, Any]:
    """``python3 -m conformance check`` against ``server``: its JSON report, every case passed or skipped."""
    import pathlib
    import sys

    done = subprocess.run([sys.executable, "-m", "conformance", "check", server.url, "--token", agent_token,
                           "--json", "-", *args], cwd=pathlib.Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=timeout,
                          env={k: v for k, v in os.environ.items() if k != "AGENT_TOKEN"})
    assert done.returncode == 0, done.stderr[-4000:]
    report: Dict[str, Any] = json.loads(done.stdout)
    flagged = [(c["id"], c["status"]) for c in report["cases"] if c["status"] not in ("pass", "skip")]
    assert not flagged and report["failed"] == 0 and report["warned"] == 0, flagged
    return report


def assert_bad_arguments_are_one_line(cmd: Sequence[str]) -> None:
    """Each bad flag of a port's conformance server: exit status 2 and one line on stderr naming it."""
    for args, needle in ((["--port", "abc"], "port"), (["--bogus"], "bogus"), (["--path", "nope"], "path"),
                         (["--timeout", "0"], "timeout")):
        done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=30)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and needle in done.stderr and len(lines) == 1, done.stderr


def assert_sigterm_lets_a_dispatch_finish(server: PortServer, proxy: Any, *, agent_token: str, run_token: str) -> None:
    """SIGTERM while a dispatch runs (its first tool call made, then a 400 ms sleep): it still gets its 200 and
    the server exits 0."""
    outcome: List[Tuple[int, Dict[str, Any]]] = []
    script = {"steps": [{"call": "started", "args": {}}, {"sleep_ms": 400}]}
    worker = threading.Thread(target=lambda: outcome.append(
        platform_dispatch(server, proxy, script, agent_token=agent_token, run_token=run_token)))
    worker.start()
    try:
        for _ in range(500):
            if proxy.calls("started"):
                break
            threading.Event().wait(0.01)
        assert proxy.calls("started")
        assert server.stop() == 0
    finally:
        worker.join(15)
    status, reply = outcome[0]
    assert status == 200 and json.loads(reply["final_response"])["results"][1] == {"ok": True, "value": None}


def assert_the_check_passes_at_strict(server: PortServer, agent_token: str) -> None:
    """The whole check at ``--strict`` (only the X-API-Key vectors skipped), then the api profile too."""
    report = run_check(server, agent_token, "--strict")
    assert report["passed"] > 200 and report["level_met"] == "MUST+SHOULD"
    skipped = [c["id"] for c in report["cases"] if c["status"] == "skip"]
    assert all(case.startswith("vectors.inbound:auth-") for case in skipped), skipped  # the X-API-Key vectors
    api = run_check(server, agent_token, "--strict", "--profile", "api")  # the kit's own choices, which it mirrors
    assert api["passed"] > report["passed"]


def assert_a_custom_auth_header_and_the_misconfigured_mode(start: Callable[..., PortServer], agent_token: str) -> None:
    """``start(*args, env=...)`` serves the port: with ``--auth-header X-API-Key``, then its token variable unset."""
    auth = {"Authorization": f"Bearer {agent_token}"}
    server = start("--auth-header", "X-API-Key")
    try:
        report = run_check(server, agent_token, "--strict", "--auth-header", "X-API-Key", "--only",
                           "auth,ping,vectors.inbound")
        assert report["passed"] > 10
        assert post(server, {"ping": True}, {"X-API-Key": agent_token})[0] == 200
        assert post(server, {"ping": True}, auth)[0] == 401
    finally:
        assert server.stop() == 0
    server = start(env={"AGENT_TOKEN": ""})
    try:
        report = run_check(server, agent_token, "--misconfigured", "--strict")
        assert report["passed"] == 1
        status, _, body = post(server, {"ping": True}, auth)
        assert status == 503 and "AGENT_TOKEN" in json.loads(body)["detail"]
    finally:
        assert server.stop() == 0


def assert_auth_ping_and_the_refusals(server: PortServer, agent_token: str) -> None:
    """Auth before anything, a strict ping, the 400s, the routes and methods, over a socket."""
    auth = {"Authorization": f"Bearer {agent_token}"}
    status, headers, body = post(server, {"ping": True}, {"Authorization": "Bearer guess-8f8f8f"})
    assert status == 401 and b"guess-8f8f8f" not in body and agent_token.encode() not in body
    assert headers["www-authenticate"] == "Bearer"
    assert post(server, {"ping": True}, {"Authorization": agent_token})[0] == 401  # no Bearer scheme
    assert post(server, b"{oops")[0] == 401  # auth before JSON
    status, _, body = post(server, {"ping": True}, auth)
    assert (status, json.loads(body)) == (200, {"ok": True})
    status, _, body = post(server, {"ping": True, "x": 1}, auth)
    assert status == 400 and "proxy URL" in json.loads(body)["detail"]
    assert post(server, b'{"ping": false, "ping": true}', auth)[0] == 400
    assert post(server, b"{oops", auth)[0] == 400
    assert post(server, [1, 2], auth)[0] == 400
    status, headers, _ = post(server, b"", auth, method="GET")
    assert status == 405 and headers["allow"] == "POST"
    assert post(server, {"ping": True}, auth, path="/elsewhere")[0] == 404
    status, _, body = post(server, b"", method="GET", path="/healthz")
    assert status == 200 and json.loads(body)["ok"] is True


def assert_a_script_through_the_proxy_and_a_failing_agent(server: PortServer, proxy: Any, *, agent_token: str,
                                                          run_token: str) -> None:
    """The conformance agent's script (a call with an actor, a trace), its echo mode, and an agent that raises
    with both tokens in its message."""
    import hashlib

    def dispatch(instruction: Any) -> Tuple[int, Dict[str, Any]]:
        return platform_dispatch(server, proxy, instruction, agent_token=agent_token, run_token=run_token)

    proxy.script("get_order", [{"response": {"status": "shipped"}}])
    steps = [{"call": "get_order", "args": {"order_id": "4521"}, "actor": " triage "},
             {"trace": "assistant_message", "payload": {"text": "hi"}}]
    status, reply = dispatch({"steps": steps})
    assert status == 200, reply
    assert json.loads(reply["final_response"])["results"] == [
        {"ok": True, "value": {"status": "shipped"}}, {"ok": True, "value": {"accepted": True, "sequence": 1}}]
    (call,) = proxy.calls()
    assert call.bearer == run_token and call.actor == "triage" and call.idempotency_key
    status, reply = dispatch("echo me \ud83d cut")  # a lone surrogate arrives as U+FFFD
    echoed = json.loads(reply["final_response"])["envelope"]
    assert status == 200 and echoed["run_token_sha256"] == hashlib.sha256(run_token.encode()).hexdigest()
    assert (echoed["run_id"], echoed["task_input"]) == (17, {"order_id": "4521"})
    assert echoed["user_instruction"] == "echo me \ufffd cut"
    status, reply = dispatch({"steps": [{"raise": f"boom {run_token} and {agent_token}"}]})
    assert status == 500 and reply["detail"] == "Error: boom [redacted] and [redacted]"


def assert_concurrent_dispatches_keep_their_tokens(server: PortServer, agent_token: str, n: int = 100,
                                                  together: int = 40) -> None:
    """``n`` dispatches at once, each with a run token of its own and two tool calls: every call reaches the proxy
    with its own run's token, and the first ``together`` calls are held until all are in flight (real overlap)."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    from conformance.harness.mock_proxy import MockProxy
    from tests.conftest import Together

    tokens = [f"run-token-{i:03d}-{server.port}-xxxxxxxx" for i in range(n)]
    script = {"steps": [{"call": "whoami", "args": {}}, {"call": "whoami", "args": {}}]}
    with MockProxy(tokens=tokens) as proxy:
        proxy.script("whoami", Together(together)(
            lambda r: {"response": {"bearer_sha": hashlib.sha256(r.bearer.encode()).hexdigest()}}))

        def one(i: int) -> Tuple[int, Dict[str, Any]]:
            return platform_dispatch(server, proxy, script, agent_token=agent_token, run_token=tokens[i], run_id=i)

        with ThreadPoolExecutor(n) as pool:
            replies = list(pool.map(one, range(n)))
        for i, (status, reply) in enumerate(replies):
            want = hashlib.sha256(tokens[i].encode()).hexdigest()
            results = json.loads(reply["final_response"])["results"] if status == 200 else reply
            assert results == [{"ok": True, "value": {"bearer_sha": want}}] * 2, (i, status, reply)
        calls = proxy.calls("whoami")
        assert len(calls) == 2 * n and sorted(c.bearer for c in calls) == sorted(tokens * 2)
        assert proxy.max_in_flight >= together
