"""The conformance suite: `python3 -m conformance check` passes our port and catches broken ones.

The check runs as its own process against servers running as their own
processes (our CLI, and tests/broken_ports.py variants), so no monkeypatching
can leak into the checker.  The agent, the dispatcher and the mock proxy are
also tested in-process, over real sockets on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

import pipelines_port as pp
from conformance.checker import agent as conformance_agent
from conformance.checker import check
from conformance.harness.dispatcher import Dispatcher, DispatchError, Run, envelope_body, envelope_headers
from conformance.harness.mock_proxy import MockProxy
from tests.broken_ports import VARIANTS

ROOT = Path(__file__).resolve().parent.parent
AGENT_TOKEN = "conformance-agent-token-5d5d5d"
RUN_TOKEN_RE = re.compile(r"run-token-[0-9a-f]{32}")


# -- helpers: servers and the check, each in its own process -------------------------------------


@contextlib.contextmanager
def served(args: List[str], log_path: Path, env: Optional[Dict[str, str]] = None) -> Iterator[str]:
    """Start a server process that prints ``listening on URL`` (its stderr to ``log_path``); yield the URL."""
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable] + args, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    watchdog = threading.Timer(30, proc.kill)  # a server that never says where it listens
    watchdog.start()
    try:
        assert proc.stdout is not None
        url = None
        while url is None:
            line = proc.stdout.readline()
            assert line, f"server did not start: {log_path.read_text()}"
            match = re.search(r"listening on (http://\S+)", line)
            url = match.group(1) if match else None
        watchdog.cancel()
        yield url
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        log.close()


def run_check(url: str, *args: str, token: Optional[str] = AGENT_TOKEN) -> Tuple[int, Dict[str, Any], str]:
    """``python3 -m conformance check URL --json - ...``: (exit status, the JSON report, stderr)."""
    cmd = [sys.executable, "-m", "conformance", "check", url, "--json", "-", "--timeout", "20", *args]
    if token:
        cmd += ["--token", token]
    env = {k: v for k, v in os.environ.items() if k != "AGENT_TOKEN"}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90, env=env)
    report = json.loads(done.stdout) if done.stdout.strip() else {}
    return done.returncode, report, done.stderr


def statuses(report: Dict[str, Any]) -> Dict[str, str]:
    return {c["id"]: c["status"] for c in report["cases"]}


# -- the check against our port and the broken ones, all started at once -----------------------------------

BROKEN = sorted(name for name, variant in VARIANTS.items() if variant.fails)
LEGAL = sorted(name for name, variant in VARIANTS.items() if not variant.fails and name != "correct")
OUR_PORT = [str(ROOT / "pipelines_port.py"), "serve", "conformance/checker/agent.py:agent", "--port", "0"]
OUR_ASYNC_PORT = [str(ROOT / "pipelines_port.py"), "serve", "conformance/checker/agent.py:agent_async", "--port", "0"]
Outcome = Tuple[int, Dict[str, Any], str]


def broken(variant: str) -> List[str]:
    return [str(ROOT / "tests" / "broken_ports.py"), variant, "--port", "0", "--token", AGENT_TOKEN]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Outcome]:
    """Every server-plus-check run of this file, concurrently (they mostly wait on sockets and retries).

    Our port and every legal variation get the whole check at --strict; each broken variant the case it must
    fail (the whole check against every variant, Python and Node, is tests/mutation_score.py's job).
    """
    logs = tmp_path_factory.mktemp("servers")

    def job(name: str, server: List[str], env: Optional[Dict[str, str]], *check_args: str) -> Outcome:
        with served(server, logs / f"{name.replace(' ', '_')}.log", env) as url:
            return run_check(url, *check_args)

    guarded = sorted({VARIANTS[v].fails for v in BROKEN if VARIANTS[v].mode == "normal"})
    jobs = {"our port": (OUR_PORT, {"AGENT_TOKEN": AGENT_TOKEN}, "--strict"),
            "our port, api profile": (OUR_PORT, {"AGENT_TOKEN": AGENT_TOKEN}, "--strict", "--profile", "api"),
            "our port, async agent": (OUR_ASYNC_PORT, {"AGENT_TOKEN": AGENT_TOKEN}, "--strict", "--profile", "api"),
            "correct variant": (broken("correct"), None, "--strict", "--profile", "api", "--only", ",".join(guarded)),
            "leak scan": (broken("token_in_error_detail"), None, "--only", "secrets"),
            "should, not strict": (broken("no_key_on_tool_calls"), None, "--only", "proxy.idempotency_fresh"),
            "shared cause": (broken("stale_token_header"), None, "--only", "proxy,trace.event_shape")}
    for variant in BROKEN:
        mode = ("--misconfigured",) if VARIANTS[variant].mode == "misconfigured" else ()
        jobs[variant] = (broken(variant), None, "--strict", "--profile", "api", "--only", VARIANTS[variant].fails, *mode)
    for variant in LEGAL:
        jobs[variant] = (broken(variant), None, "--strict")
    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = {name: pool.submit(job, name, *spec) for name, spec in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


SKIPPED_HERE = {  # only the auth vectors written for another header (and for an empty token) cannot apply
    "vectors.inbound:auth-custom-header-raw-value", "vectors.inbound:auth-custom-header-does-not-take-a-bearer-prefix",
    "vectors.inbound:auth-credential-in-the-wrong-header", "vectors.inbound:auth-empty-expected-token-never-matches",
}


def test_our_async_agent_on_the_asyncio_driver_passes_every_case_too(outcomes: Dict[str, Outcome]) -> None:
    """The conformance agent as ``async def`` (its calls on the asyncio driver, on the server's one loop)."""
    code, report, stderr = outcomes["our port, async agent"]
    bad = [c for c in report["cases"] if c["status"] not in ("pass", "skip")]
    assert code == 0 and bad == [], bad
    assert statuses(report) == statuses(outcomes["our port, api profile"][1])  # the same cases ran and passed


def test_our_port_passes_every_case_must_and_should(outcomes: Dict[str, Outcome]) -> None:
    code, report, stderr = outcomes["our port"]
    bad = [c for c in report["cases"] if c["status"] not in ("pass", "skip")]
    assert code == 0 and bad == [], bad
    assert {c["id"] for c in report["cases"] if c["status"] == "skip"} == SKIPPED_HERE
    assert report["passed"] == len(report["cases"]) - 4 > 200
    assert report["level_met"] == "MUST+SHOULD" and report["strict"] and report["profile"] == "wire"
    ids = [c["id"] for c in report["cases"]]
    assert ids[-1] == "secrets.no_token_in_any_body" and len(set(ids)) == len(ids)
    assert not any(c["rules"][0].startswith("kit-") for c in report["cases"])  # the wire profile: platform rules
    progress = [line for line in stderr.splitlines() if line.split(" ", 1)[0] in ("PASS", "FAIL", "WARN", "SKIP")]
    assert sorted(line.split()[1].rstrip(":") for line in progress) == sorted(ids)  # one line per case
    assert stderr.rstrip().endswith(f"{report['passed']} passed, 0 failed, 0 warned, 4 skipped")
    assert AGENT_TOKEN not in stderr and not RUN_TOKEN_RE.search(stderr + json.dumps(report))
    by_level = report["by_level"]
    assert by_level["MUST"]["passed"] > 75 and by_level["SHOULD"]["passed"] > 80 and by_level["MAY"]["passed"] >= 3


def test_our_port_passes_the_api_profile_too(outcomes: Dict[str, Outcome]) -> None:
    code, report, stderr = outcomes["our port, api profile"]
    assert code == 0 and report["failed"] == report["warned"] == 0, stderr[-3000:]
    kit = [c for c in report["cases"] if c["rules"][0].startswith("kit-")]
    assert len(kit) > 20 and all(c["status"] == "pass" for c in kit)
    assert report["passed"] > outcomes["our port"][1]["passed"]


@pytest.mark.parametrize("variant", BROKEN)
def test_a_broken_port_fails_on_the_right_case(variant: str, outcomes: Dict[str, Outcome]) -> None:
    fails = VARIANTS[variant].fails
    code, report, stderr = outcomes[variant]
    assert code == 1, stderr[-2000:]
    (failure,) = [c for c in report["cases"] if c["id"] == fails]
    assert failure["status"] == "fail", stderr[-2000:]
    for finding in failure["findings"]:  # every finding names a rule, its level and its section
        assert finding["rule"] and finding["level"] in ("MUST", "SHOULD", "MAY") and finding["section"].startswith("§")
        assert finding["expected"] and finding["got"]
    assert failure["failed_level"] in ("MUST", "SHOULD")
    assert f"FAILED {fails}:" in stderr
    assert AGENT_TOKEN not in stderr + json.dumps(report) and not RUN_TOKEN_RE.search(stderr + json.dumps(report))


def test_the_correct_variant_passes_the_cases_the_broken_ones_fail(outcomes: Dict[str, Outcome]) -> None:
    code, report, stderr = outcomes["correct variant"]
    assert code == 0 and set(statuses(report).values()) == {"pass"}, stderr
    assert set(statuses(report)) == {VARIANTS[v].fails for v in BROKEN if VARIANTS[v].mode == "normal"}


@pytest.mark.parametrize("variant", LEGAL)
def test_a_legal_variation_passes_the_whole_check(variant: str, outcomes: Dict[str, Outcome]) -> None:
    """What the contract leaves open (chunked bodies, either token header, other wording, extra keys...) passes
    every case, SHOULD rules included: no false failure, no false warning."""
    code, report, stderr = outcomes[variant]
    assert code == 0 and len(report["cases"]) > 200, stderr[-3000:]
    assert report["failed"] == report["warned"] == 0, [c for c in report["cases"] if c["status"] in ("fail", "warn")]


def test_a_broken_should_rule_is_a_warning_unless_strict(outcomes: Dict[str, Outcome]) -> None:
    code, report, stderr = outcomes["should, not strict"]
    (case,) = report["cases"]
    assert code == 0 and case["status"] == "warn" and case["failed_level"] == "SHOULD"
    assert case["findings"][0]["rule"] == "idempotency-key-per-call"
    assert report["level_met"] == "MUST" and "WARNING proxy.idempotency_fresh" in stderr
    assert any("idempotency-key-per-call" in line and "mutating tool" in line for line in report["advice"])


def test_failures_with_one_cause_are_reported_once(outcomes: Dict[str, Outcome]) -> None:
    """Two run-token headers that disagree make every call fail: the report names that cause, not 30 mysteries."""
    code, report, stderr = outcomes["shared cause"]
    assert code == 1
    caused = [c for c in report["cases"] if c["cause"]]
    assert len(caused) > 10 and all("two run-token headers that disagree" in c["cause"] for c in caused)
    assert report["advice"][0].startswith(f"Fix this first: {len(caused)} case(s) failed because the proxy refused")
    assert f"{len(caused)} case(s) share one cause" in stderr
    assert stderr.count("the same cause as the cases above") == len(caused) - 3


def test_a_token_in_the_agents_own_text_is_a_should_and_the_final_scan_leaves_it_to_its_case(
        outcomes: Dict[str, Outcome]) -> None:
    """The wrapper passing on the agent's own exception text, token included, breaks agent-text-scrubbed (SHOULD,
    hardening), not run-token-secret (MUST: what the wrapper itself writes); the report says which and why."""
    code, report, _ = outcomes["leak scan"]
    assert code == 0 and report["level_met"] == "MUST"
    assert statuses(report) == {"secrets.agent_error_detail": "warn", "secrets.agent_response": "pass",
                                "secrets.proxy_error_echo": "pass", "secrets.no_token_in_any_body": "pass"}
    (finding,) = report["cases"][0]["findings"]
    assert (finding["rule"], finding["level"], finding["kind"]) == ("agent-text-scrubbed", "SHOULD", "platform SHOULD")
    assert finding["source"].startswith("hardening") and report["level_met_by_profile"] == {"wire": "MUST"}


def test_a_cross_run_leak_is_reported_once_by_the_isolation_case(tmp_path: Path) -> None:
    """A port that shares one envelope between runs: the isolation case fails, the rest run one at a time."""
    with served(broken("global_envelope"), tmp_path / "leak.log") as url:
        code, report, stderr = run_check(url, "--only", "concurrency,proxy.request_shape,proxy.unwrap,envelope.echo")
    assert code == 1
    assert statuses(report) == {"proxy.request_shape": "pass", "concurrency.distinct_tokens": "fail",
                                "proxy.unwrap": "pass", "envelope.echo": "pass"}
    assert "run one at a time" in stderr
    (leak,) = [c for c in report["cases"] if c["status"] == "fail"]
    assert leak["findings"][0]["rule"] == "per-request-binding" and "request-scoped" in leak["findings"][0]["hint"]


# -- the command line ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conformance", "check", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=30)


def test_an_unreachable_endpoint_is_one_line_and_exit_2() -> None:
    done = cli(f"http://127.0.0.1:{free_port()}/dispatch", "--token", AGENT_TOKEN)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "connection refused" in done.stderr
    assert "Traceback" not in done.stderr and AGENT_TOKEN not in done.stderr


@pytest.mark.parametrize("args, needle", [
    ([], "URL"),
    (["ftp://127.0.0.1/x"], "http"),
    (["http://127.0.0.1:1/d", "--only", "no.such.case"], "no case"),
    (["http://127.0.0.1:1/d", "--auth-header", "Bad Header"], "header name"),
    (["http://127.0.0.1:1/d", "--timeout", "0"], "--timeout"),
])
def test_usage_errors_are_one_line_and_exit_2(args: List[str], needle: str) -> None:
    done = cli(*args)
    assert done.returncode == 2
    assert needle in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.startswith("conformance check: ") and done.stderr.count("\n") == 1


def test_list_names_every_case_with_its_section() -> None:
    done = cli("--list")
    assert done.returncode == 0
    rows = [line.split("\t") for line in done.stdout.splitlines()]
    ids = [row[0] for row in rows]
    wire = [c for c in check.all_cases() if c.mode == "normal" and c.profile == "wire"]
    assert len(ids) == len(set(ids)) == len(wire)
    assert all(len(row) == 5 and row[1] in ("MUST", "SHOULD", "MAY") and row[2] and row[3] for row in rows)
    assert "proxy.retry_429" in ids and "vectors.proxy_replies:429-with-retry-after-seconds-is-retried" in ids
    # Code-mode envelope cases and Python result objects do not run over HTTP.
    assert not any("code-mode" in i for i in ids) and not any("a-result-object" in i for i in ids)
    only = cli("--list", "--only", "proxy.retry_*,vectors.tool_names", "--skip", "proxy.retry_bounded")
    listed = [line.split("\t")[0] for line in only.stdout.splitlines()]
    assert listed[:4] == ["proxy.retry_429", "proxy.retry_503_context_store_unavailable",
                          "proxy.retry_503_lock_contention", "proxy.retry_503_trace_sequence_contended"]
    assert len(listed) == 4 + 17 and all(i.startswith("vectors.tool_names:") for i in listed[4:])


# -- in-process: custom auth header, no token, --json to a file ------------------------------------------


@pytest.fixture
def quick_client() -> Iterator[None]:
    previous = pp.set_default_client(pp.ProxyClient(rate_per_minute=0, timeout=20))
    yield
    pp.set_default_client(previous)


def test_a_custom_auth_header_runs_its_own_auth_vectors(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                         quick_client: None) -> None:
    server = pp.start_server(conformance_agent.agent, token="k-123-abcdefgh", auth_header="X-API-Key")
    try:
        out = tmp_path / "report.json"
        code = check.main([server.url, "--token", "k-123-abcdefgh", "--auth-header", "X-API-Key",
                           "--only", "auth,ping,vectors.inbound", "--json", str(out)])
    finally:
        server.close(1)
    report = json.loads(out.read_text())
    result = statuses(report)
    assert code == 0 and "fail" not in result.values()
    assert result["vectors.inbound:auth-custom-header-raw-value"] == "pass"
    assert result["vectors.inbound:auth-credential-in-the-wrong-header"] == "pass"
    assert result["vectors.inbound:auth-bearer-matches"] == "skip"
    assert result["auth.ping_wrong_credential"] == "pass"
    captured = capsys.readouterr()
    assert captured.out.rstrip().endswith(f"{report['passed']} passed, 0 failed, 0 warned, {report['skipped']} skipped")
    assert "k-123-abcdefgh" not in captured.out + captured.err + out.read_text()


def test_without_a_token_the_auth_cases_are_skipped(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
                                                    quick_client: None) -> None:
    monkeypatch.delenv("AGENT_TOKEN", raising=False)
    server = pp.start_server(conformance_agent.agent, no_auth=True)
    try:
        code = check.main([server.url, "--only", "auth,ping.exact,connectivity", "--json", "-"])
    finally:
        server.close(1)
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert statuses(report) == {"auth.ping_wrong_credential": "skip", "auth.credential_variants": "skip",
                                "auth.dispatch_without_credential": "skip",
                                "auth.invalid_json_without_credential": "skip", "ping.exact": "pass",
                                "connectivity.reachable": "pass",
                                "connectivity.unreachable": "pass", "connectivity.missing_url": "pass"}
    assert "no --token" in report["cases"][0]["note"]


def test_a_port_without_the_connectivity_extension_is_skipped_not_failed(capsys: pytest.CaptureFixture,
                                                                         quick_client: None) -> None:
    app = pp.DispatchApp(conformance_agent.agent, no_auth=True)
    app.connectivity_check = lambda proxy_url: pp.error_reply(pp.EnvelopeError("dispatch is missing run token"))  # type: ignore[method-assign]

    async def no_extension(proxy_url: str) -> pp.HttpReply:
        return app.connectivity_check(proxy_url)

    app.aconnectivity_check = no_extension  # type: ignore[method-assign]
    server = pp.start_server(app)
    try:
        code = check.main([server.url, "--only", "connectivity", "--json", "-"])
    finally:
        server.close(1)
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert statuses(report) == {"connectivity.reachable": "skip", "connectivity.unreachable": "skip",
                                "connectivity.missing_url": "pass"}
    assert "SDK extension" in report["cases"][0]["note"]


# -- the conformance agent ---------------------------------------------------------------------------------


@pytest.fixture
def proxy() -> Iterator[MockProxy]:
    with MockProxy() as p:
        yield p


def dispatched(proxy: MockProxy, instruction: str, **extra: Any) -> Tuple[int, Any, Any]:
    """Dispatch to our server running the conformance agent: (status, body, the proxy run)."""
    run_proxy = proxy.new_run()
    run = Run(run_token=run_proxy.token, proxy_url=run_proxy.url, run_id=17, task_id=42, agent_id=8,
              run_token_jti="jti-1")
    server = pp.start_server(conformance_agent.agent, no_auth=True)
    dispatcher = Dispatcher(server.url, timeout=20)
    try:
        reply = dispatcher.dispatch(run, user_instruction=instruction, **extra)
    finally:
        dispatcher.close()
        server.close(1)
    return reply.status, reply.json, run_proxy


def test_echo_mode_shows_the_envelope_and_only_a_hash_of_the_token(proxy: MockProxy, quick_client: None) -> None:
    status, body, run = dispatched(proxy, "not a script", task_input={"k": 1}, sub_agents=["triage", "bad label"],
                                   future={"x": 1})
    assert status == 200 and set(body) == {"final_response"}
    echoed = json.loads(body["final_response"])["envelope"]
    assert set(echoed) == {"proxy_url", "run_token_sha256", "run_id", "task_id", "agent_id", "run_token_jti",
                           "user_instruction", "task_input", "latest_user_prompt", "session_id", "turn_id",
                           "messages", "scenario_state", "workspace", "tools_schema", "sub_agents", "api_url", "raw"}
    assert echoed["run_token_sha256"] == hashlib.sha256(run.token.encode()).hexdigest()
    assert run.token not in body["final_response"]
    assert (echoed["run_id"], echoed["task_input"], echoed["sub_agents"]) == (17, {"k": 1}, ["triage"])
    assert echoed["api_url"] == proxy.origin and echoed["raw"]["future"] == {"x": 1}


def test_script_mode_reports_every_outcome_kind_and_a_valid_transcript(proxy: MockProxy, quick_client: None) -> None:
    steps = [
        {"call": "ok_tool", "args": {"a": 1}, "actor": "supervisor"},
        {"call": "stale", "args": {}},
        {"call": "broken", "args": {}},
        {"call": "get order", "args": [1, 2]},
        {"call": 7, "args": None},
        {"parallel": [{"call": "slow", "args": {}}, {"call": "slow", "args": {"n": 2}}]},
        {"trace": "custom", "payload": {"x": 1}},
        {"handoff": {"from": "a", "to": "a"}},
        {"sleep_ms": 1},
    ]
    proxy_setup: Dict[str, Any] = {
        "stale": [{"status": 401, "error_class": "run_token_expired", "message": "over"}],
        "broken": [{"status": 500, "error_class": "internal", "message": "boom"}],
        "slow": [{"response": "zz", "delay_s": 0.3}],
    }
    run_proxy = proxy.new_run()
    for name, replies in proxy_setup.items():
        run_proxy.script(name, replies)
    server = pp.start_server(conformance_agent.agent, no_auth=True)
    try:
        reply = Dispatcher(server.url, timeout=20).dispatch(
            Run(run_token=run_proxy.token, proxy_url=run_proxy.url), user_instruction=json.dumps({"steps": steps}))
    finally:
        server.close(1)
    body = reply.json
    assert reply.status == 200 and pp.validate_response(body) == []
    results = json.loads(body["final_response"])["results"]
    error = lambda kind, status=None, cls=None: {"ok": False, "error": {"kind": kind, "status_code": status,  # noqa: E731
                                                                         "error_class": cls}}
    assert results == [
        {"ok": True, "value": {"tool": "ok_tool", "args": {"a": 1}}},
        error("stale_run_token", 401, "run_token_expired"),
        error("proxy", 500, "internal"),
        error("request"),
        error("request"),
        {"parallel": [{"ok": True, "value": "zz"}, {"ok": True, "value": "zz"}]},
        {"ok": True, "value": {"accepted": True, "sequence": 1}},
        {"ok": True, "value": None},
        {"ok": True, "value": None},
    ]
    assert run_proxy.calls("ok_tool")[0].actor == "supervisor"
    assert len(run_proxy.calls("slow")) == 2 and proxy.max_in_flight == 2  # the parallel calls overlapped
    calls = [m["tool_calls"][0] for m in body["messages"] if m.get("tool_calls")]
    assert [c["id"] for c in calls] == [f"call_{n}" for n in range(1, 8)]
    assert (calls[3]["name"], calls[3]["arguments"], calls[4]["name"], calls[4]["arguments"]) == (
        "get order", "[1,2]", "7", "null")
    assert body["metadata"]["model"] == "conformance-agent" and body["messages"][-1]["content"] == body["final_response"]


@pytest.mark.parametrize("steps, where", [
    ([{"bogus": 1}], "steps[0]"),
    ([{"sleep_ms": 1}, {"call": "x"}], "steps[1]"),
    ([{"call": "x", "args": {}, "trace": "custom"}], "steps[0]"),
    ([{"parallel": [{"call": "x", "args": {}}, {"args": {}}]}], "steps[0].parallel[1]"),
    ([{"trace": "custom"}], "steps[0]"),
    ([{"handoff": {"from": "a"}}], "steps[0].handoff"),
    ([{"sleep_ms": -1}], "steps[0].sleep_ms"),
    ([{"raise": 5}], "steps[0].raise"),
    ([{"turn_reply": {"session_done": True}}], "steps[0].turn_reply"),
])
def test_a_malformed_script_raises_naming_the_step(steps: List[Any], where: str) -> None:
    envelope = pp.Envelope(proxy_url="http://127.0.0.1:9/p", run_token="t",
                           user_instruction=json.dumps({"steps": steps}))
    with pp.bind_envelope(envelope), pytest.raises(conformance_agent.ScriptError) as info:
        conformance_agent.agent(envelope)
    assert str(info.value).startswith(where + ":")


def test_return_and_raise_end_the_run() -> None:
    envelope = pp.Envelope(proxy_url="http://127.0.0.1:9/p", run_token="t",
                           user_instruction=json.dumps({"steps": [{"return": {"final_response": "x"}}, {"raise": "no"}]}))
    assert conformance_agent.agent(envelope) == {"final_response": "x"}
    raising = envelope.replace(user_instruction=json.dumps({"steps": [{"raise": "boom"}, {"return": "x"}]}))
    with pytest.raises(RuntimeError, match="^boom$"):
        conformance_agent.agent(raising)


def test_a_turn_reply_step_returns_what_the_ports_builder_builds() -> None:
    envelope = pp.Envelope(proxy_url="http://127.0.0.1:9/p", run_token="t", user_instruction=json.dumps(
        {"steps": [{"turn_reply": {"message": "Which one?", "metadata": {"model": "m"}, "session_done": True}}]}))
    assert conformance_agent.agent(envelope) == {"message": "Which one?", "session_done": True, "metadata": {"model": "m"}}
    plain = envelope.replace(user_instruction=json.dumps({"steps": [{"turn_reply": {"message": "Hi"}}]}))
    assert conformance_agent.agent(plain) == {"message": "Hi", "session_done": False}
    blank = envelope.replace(user_instruction=json.dumps({"steps": [{"turn_reply": {"message": " "}}]}))
    with pytest.raises(pp.ResponseError, match="message"):  # the builder refuses it: the port answers 500
        conformance_agent.agent(blank)


# -- the dispatcher ----------------------------------------------------------------------------------------


def test_envelope_body_and_headers_and_the_header_only_form() -> None:
    run = Run(run_token="tok", proxy_url="http://p/x", run_id=17, task_id=42, agent_id=8, run_token_jti="j")
    assert envelope_body(run, user_instruction="hi", task_input={"a": 1}, tools_schema=[]) == {
        "task_id": 42, "run_id": 17, "agent_id": 8, "input": {"task_id": 42, "user_instruction": "hi", "input": {"a": 1}},
        "odyssey_proxy_url": "http://p/x", "run_token_jti": "j", "tools_schema": []}
    assert envelope_body(run, user_instruction="hi", header_only=True) == {
        "agent_id": 8, "input": {"user_instruction": "hi", "input": {}}}
    assert envelope_headers(run) == {
        "X-Pipelines-Run-Token": "tok", "X-Pipelines-Odyssey-Proxy-Url": "http://p/x", "X-Pipelines-Run-Id": "17",
        "X-Pipelines-Task-Id": "42", "X-Pipelines-Run-Token-Jti": "j"}


def test_the_dispatcher_sends_the_platform_headers_over_one_keep_alive_connection(proxy: MockProxy) -> None:
    run = Run(run_token="tok-1", proxy_url="http://p/x", run_id=17)
    dispatcher = Dispatcher(proxy.origin + "/hook", token="agent-t", timeout=5)
    try:
        for _ in range(3):
            assert dispatcher.dispatch(run, user_instruction="hi").status == 404  # the mock routes nothing here
        dispatcher.ping()
    finally:
        dispatcher.close()
    assert proxy.connections == 1 and len(proxy.requests) == 4
    first = proxy.requests[0]
    assert first.headers["authorization"] == "Bearer agent-t" and first.headers["x-pipelines-run-token"] == "tok-1"
    assert first.headers["content-type"] == "application/json" and first.headers["x-pipelines-run-id"] == "17"
    assert first.json["input"]["user_instruction"] == "hi" and proxy.requests[3].json == {"ping": True}
    custom = Dispatcher("http://127.0.0.1:1/x", token="k", auth_header="X-API-Key")
    assert custom.credential() == {"X-API-Key": "k"} and Dispatcher("http://127.0.0.1:1/x").credential() == {}


def test_the_dispatcher_times_out_and_reports_refusals_in_one_line() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)  # accepts, never answers
        with pytest.raises(DispatchError, match=r"no reply from http://127\.0\.0\.1:\d+ within 0\.3 s"):
            Dispatcher(f"http://127.0.0.1:{silent.getsockname()[1]}/d", timeout=0.3).ping()
    with pytest.raises(DispatchError, match="connection refused"):
        Dispatcher(f"http://127.0.0.1:{free_port()}/d").ping()
    with pytest.raises(ValueError, match="http"):
        Dispatcher("file:///etc/passwd")


# -- the mock proxy's runs and platform checks ---------------------------------------------------------------


def post(url: str, body: bytes, headers: Dict[str, str]) -> Tuple[int, Dict[str, str], Any]:
    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    path = "/" + url.split("//", 1)[1].split("/", 1)[1]
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(data) if data else None
    finally:
        conn.close()


def test_each_run_has_its_own_path_token_scripts_and_requests(proxy: MockProxy) -> None:
    a, b = proxy.new_run(), proxy.new_run(name="b")
    assert a.base_path != b.base_path and b.url == proxy.origin + "/api/odyssey-proxy/runs/b" and a.token != b.token
    a.script("t", [{"response": "from a"}])
    auth = lambda run: {"Authorization": f"Bearer {run.token}", "Idempotency-Key": "k1"}  # noqa: E731
    assert post(a.url + "/tools/t", b"{}", auth(a))[2]["response"] == "from a"
    assert post(b.url + "/tools/t", b"{}", auth(b))[2]["response"] == {"tool": "t", "args": {}}  # same key, other run
    status, _, body = post(b.url + "/tools/t", b"{}", auth(a))
    assert status == 401 and body["detail"]["error_class"] == "run_token_invalid"
    assert post(a.url + "/traces/custom", b"{}", {**auth(a), "Idempotency-Key": "k2"})[2] == {"accepted": True, "sequence": 1}
    assert [len(a.requests), len(b.requests), len(proxy.requests), len(proxy.calls())] == [2, 2, 4, 0]
    with pytest.raises(ValueError, match="exists"):
        proxy.new_run(name="b")
    proxy.reset()
    assert a.requests == [] and proxy.requests == []


@pytest.mark.parametrize("body, headers, status, error_class", [
    (b"[1]", {}, 422, None),
    (b"not json", {}, 422, None),
    (b'{"a": "' + b"x" * (1 << 20) + b'"}', {}, 413, "payload_too_large"),
    (b"{}", {"X-Pipelines-Actor-Id": "a//b"}, 400, "actor_id_invalid"),
    (b"{}", {"X-Pipelines-Actor-Id": "supervisor/refunds"}, 200, None),
])
def test_the_mock_checks_requests_as_the_platform_does(proxy: MockProxy, body: bytes, headers: Dict[str, str],
                                                       status: int, error_class: Optional[str]) -> None:
    got, _, reply = post(proxy.url + "/tools/t", body, {"Authorization": f"Bearer {proxy.token}", **headers})
    assert got == status
    if error_class:
        assert reply["detail"]["error_class"] == error_class


def test_the_mock_rate_limit_answers_429_with_retry_after() -> None:
    with MockProxy(rate_limit=2) as limited:
        headers = {"Authorization": f"Bearer {limited.token}"}
        codes = [post(limited.url + "/tools/t", b"{}", headers)[:2] for _ in range(3)]
    assert [c[0] for c in codes] == [200, 200, 429] and 1 <= int(codes[2][1]["retry-after"]) <= 60


def raw_post(proxy: MockProxy, path: str, head: str, body: bytes) -> bytes:
    """Send one hand-framed POST on a fresh socket; everything the proxy answers until it closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        request = f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{head}\r\n".encode()
        try:
            s.sendall(request + body)
        except OSError:  # the proxy may close before reading it all: its reply is still there to read
            pass
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


def chunked(body: bytes, size: int) -> bytes:
    """``body`` in chunked transfer coding, ``size`` bytes a chunk (one with an extension), then a trailer."""
    pieces = [body[i:i + size] for i in range(0, len(body), size)]
    framed = [b"%x;ext=1\r\n%s\r\n" % (len(pieces[0]), pieces[0])] + [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces[1:]]
    return b"".join(framed) + b"0\r\nX-Trailer: t\r\n\r\n"


def test_the_mock_reads_a_chunked_request_body(proxy: MockProxy) -> None:
    args = {"order_id": "4521", "note": "ü" * 3000}
    body = json.dumps(args).encode()
    head = f"Authorization: Bearer {proxy.token}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
    reply = raw_post(proxy, proxy.base_path + "/tools/get_order", head, chunked(body, 1000))
    assert reply.startswith(b"HTTP/1.1 200")
    (request,) = proxy.requests
    assert request.body == body and request.json == args
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["response"] == {"tool": "get_order", "args": args}
    # Over the 1 MiB cap but within the read margin: read whole, then refused as the platform does.
    big = json.dumps({"blob": "x" * (1 << 20)}).encode()
    reply = raw_post(proxy, proxy.base_path + "/tools/bulk", head, chunked(big, 65536))
    assert reply.startswith(b"HTTP/1.1 413") and b"payload_too_large" in reply
    assert proxy.requests[-1].body == big


@pytest.mark.parametrize("framing, status", [
    (b"%x\r\n" % (4 << 20) + b"x" * (2 << 20), 413),  # announced far past the cap: refused unread
    (b"".join(b"10000\r\n" + b"x" * 65536 + b"\r\n" for _ in range(40)) + b"0\r\n\r\n", 413),  # 2.5 MiB
    (b"zz\r\n{}\r\n0\r\n\r\n", 400),  # a size that is not hex
    (b"2\r\n{}XX0\r\n\r\n", 400),  # no CRLF after the chunk
], ids=["announced-4MiB", "sent-2.5MiB", "size-not-hex", "no-CRLF-after-chunk"])
def test_the_mock_refuses_an_oversized_or_malformed_chunked_body(proxy: MockProxy, framing: bytes, status: int) -> None:
    head = f"Authorization: Bearer {proxy.token}\r\nTransfer-Encoding: chunked\r\n"
    reply = raw_post(proxy, proxy.base_path + "/tools/bulk", head, framing)
    assert reply.startswith(b"HTTP/1.1 %d" % status)
    (request,) = proxy.requests
    assert request.reply_status == status and len(request.body) <= (1 << 20) + (64 << 10)


@pytest.mark.parametrize("headers, status", [
    ({"Authorization": "bearer {t}"}, 200),  # the scheme is case-insensitive
    ({"Authorization": "BEARER  {t}"}, 200),
    ({"X-Pipelines-Run-Token": "{t}"}, 200),  # §3.1: the other token header
    ({"Authorization": "Bearer {t}", "X-Pipelines-Run-Token": "{t}"}, 200),  # both, agreeing
    ({"Authorization": "Bearer {t}", "X-Pipelines-Run-Token": "other"}, 401),  # both, diverging
    ({"Authorization": "Basic {t}"}, 401),
    ({}, 401),
])
def test_the_mock_takes_the_run_token_from_either_header(proxy: MockProxy, headers: Dict[str, str],
                                                         status: int) -> None:
    sent = {k: v.format(t=proxy.token) for k, v in headers.items()}
    assert post(proxy.url + "/tools/t", b"{}", sent)[0] == status
    (request,) = proxy.requests
    bearer = sent.get("Authorization", "").lower().startswith("bearer ")
    assert request.bearer == (proxy.token if bearer else None)
    assert request.run_token == (proxy.token if bearer or "X-Pipelines-Run-Token" in sent else None)


def test_the_mock_refuses_a_tool_name_outside_the_pattern(proxy: MockProxy) -> None:
    auth = {"Authorization": f"Bearer {proxy.token}"}
    for path, name in (("get%20order", "get order"), ("..%2Fadmin", "../admin"), ("9lives", "9lives"),
                       ("caf%C3%A9", "café")):
        status, _, reply = post(proxy.url + "/tools/" + path, b"{}", auth)
        assert (status, reply["detail"]["error_class"]) == (404, "unknown_tool")
        assert proxy.requests[-1].name == name and proxy.requests[-1].kind == "tools"
    assert post(proxy.url + "/tools/get%5Forder", b"{}", auth)[2]["response"]["tool"] == "get_order"
