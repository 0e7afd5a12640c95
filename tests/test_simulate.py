"""The local simulator end to end over real sockets: code mode, HTTP mode, the reports, bad input."""

from __future__ import annotations

import csv
import textwrap
import importlib.util
import json
import os
import pathlib
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Iterator, List, Tuple

import pytest

import pipelines_port as pp
from conformance.simulator import simulate

ROOT = pathlib.Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "conformance" / "simulator" / "samples" / "orders.csv"
FIXTURES = ROOT / "conformance" / "simulator" / "samples" / "orders_fixtures.json"
MINIMAL = ROOT / "templates" / "minimal.py"
AGENT_TOKEN = "agent-token-5f1e0c9a"

# A scripted agent: the instruction is a JSON script (or plain text: one get_order call).
SCRIPTED_AGENT = r'''
import asyncio, json, os, time
import pipelines_port as pp


def agent(envelope):
    with open(os.environ["SIM_TEST_TOKEN_LOG"], "a") as log:
        log.write(envelope.run_token + "\n")
    text = envelope.user_instruction
    spec = json.loads(text) if text.startswith("{") else {"calls": [["get_order", {"order_id": "4521"}]]}
    if "raise" in spec:
        raise ValueError(spec["raise"])
    if "hang" in spec:
        time.sleep(spec["hang"])
    if spec.get("empty"):
        return {"final_response": ""}
    messages = [{"role": "user", "content": text}]
    results = []
    for i, (name, args, *key) in enumerate(spec.get("calls", []), 1):
        result = pp.proxy_call(name, args, envelope=envelope, errors="return", idempotency_key=(key or [None])[0])
        results.append(result)
        messages.append({"role": "assistant", "content": None,
                         "tool_calls": [{"id": f"c{i}", "name": name, "arguments": args}]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": json.dumps(result)})
    if spec.get("trace"):
        pp.post_trace("assistant_message", {"text": spec["trace"]}, envelope=envelope)
    if spec.get("wrong_token"):
        try:
            pp.proxy_call("get_order", {"order_id": "1"}, envelope=envelope.replace(run_token="not-this-runs-token"))
        except pp.ProxyError:
            pass
    if spec.get("array_body"):  # what a port that skips the object check would send
        import urllib.request
        request = urllib.request.Request(envelope.proxy_url + "/tools/get_order", data=b"[1]", method="POST",
                                         headers={"Authorization": "Bearer " + envelope.run_token})
        try:
            urllib.request.urlopen(request, timeout=10)
        except OSError:
            pass
    final = spec.get("final", "results: " + json.dumps(results))
    if spec.get("leak"):
        final += " token " + envelope.run_token
    messages.append({"role": "assistant", "content": final})
    return pp.build_response(final, messages=messages, metadata={"model": "scripted"})


_run = pp.code_mode(agent)


def run(task_input, *, proxy_url, run_token):
    if task_input["user_instruction"] == '{"raw": true}':  # a body that skips build_response
        return {"final_response": "", "messages": "not a list"}
    return _run(task_input, proxy_url=proxy_url, run_token=run_token)


def run_raw(task_input, *, proxy_url, run_token):
    async def main():
        return {"final_response": "never"}
    coroutine = main()
    try:
        return asyncio.run(coroutine)
    finally:
        coroutine.close()
'''


@pytest.fixture
def scripted(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Tuple[pathlib.Path, pathlib.Path]:
    """The scripted agent file and the file it logs every run token it sees to."""
    agent = tmp_path / "scripted_agent.py"
    agent.write_text(SCRIPTED_AGENT, encoding="utf-8")
    log = tmp_path / "tokens.log"
    log.write_text("", encoding="utf-8")
    monkeypatch.setenv("SIM_TEST_TOKEN_LOG", str(log))
    return agent, log


def write_csv(path: pathlib.Path, rows: List[Dict[str, str]]) -> pathlib.Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["user", "behavior", "state", "failure_rules", "expected_outcome",
                                               "turn_mode"])
        writer.writeheader()
        for row in rows:
            writer.writerow(row)
    return path


def simulate_cli(capsys: pytest.CaptureFixture, *argv: str) -> Tuple[int, str, str]:
    code = simulate.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def trajectory(report: Dict[str, Any]) -> List[List[Tuple[Any, ...]]]:
    return [[(c["tool_name"], json.dumps(c["arguments"], sort_keys=True), c["source"], c["matched_rule_index"],
              json.dumps(c["response"], sort_keys=True)) for c in run["tool_calls"]] for run in report["runs"]]


def load_module(path: pathlib.Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"_test_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------
# The sample dataset against templates/minimal.py, code mode and HTTP mode
# ---------------------------------------------------------------------------


def test_sample_dataset_end_to_end_in_code_mode(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path) -> None:
    out_json, out_html = tmp_path / "report.json", tmp_path / "report.html"
    code, out, err = simulate_cli(capsys, "--csv", SAMPLE, "--code", MINIMAL, "--responses", FIXTURES,
                                  "--json", out_json, "--html", out_html)
    assert code == 0, err
    report = json.loads(out_json.read_text(encoding="utf-8"))
    assert report["summary"] == {"runs": 7, "trials": 1, "ok": 7, "errors": 0, "tool_calls": 7, "injected": 2,
                                 "flagged": 0, "sessions": {"runs": 1, "turns": 1}}  # row 7's first turn: no --user-model
    assert [r["trial"] for r in report["runs"]] == [1] * 7 and [r["run_id"] for r in report["runs"]] == list(range(1, 8))
    assert report["agent"] == {"mode": "code", "target": f"{MINIMAL}:run"}
    runs = report["runs"]
    assert [r["status"] for r in runs] == ["ok"] * 7
    assert [c["tool_name"] for r in runs for c in r["tool_calls"]] == ["search_kb"] * 7
    # row 2: the search_kb rule (index 1) fires on the first call; the refund rule (index 0) never sees a call
    call = runs[1]["tool_calls"][0]
    assert (call["source"], call["matched_rule_index"]) == ("injected", 1)
    assert call["response"] == {"error": "Knowledge base search timed out", "status_code": 504}
    assert [(r["index"], r["fired"]) for r in runs[1]["failure_rules"]] == [(0, 0), (1, 1)]
    assert "Knowledge base search timed out" in runs[1]["final_response"]
    # row 3: the seeded random rule fires on the first call
    assert (runs[2]["tool_calls"][0]["source"], runs[2]["tool_calls"][0]["matched_rule_index"]) == ("injected", 0)
    # the other rows are answered from the fixture, with the template filled in
    first = runs[0]["tool_calls"][0]
    assert first["source"] == "odyssey" and first["response"]["query"] == "What is the status of order 4521?"
    assert [r["expected_outcome"] for r in runs] == ["completion"] * 4 + ["refusal"] + ["completion"] * 2
    assert runs[1]["expected_outcome_given"] is False
    assert runs[4]["behavior_instructions"].startswith("Only the original buyer")
    # a progress line per row on stderr, the text report on stdout
    progress = [line for line in err.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == [f"[{n}/7" for n in range(1, 8)]
    assert "row 2 (line 3): ran, 1 tool call, 1 injected" in progress[1]
    assert "7 runs: 7 ran without error, 0 errors; 7 tool calls, 2 injected" in out
    assert out.rstrip().endswith("expected outcomes: not judged (no --judge); 0 refusal row(s) flagged "
                                 "for an action carried out")
    assert out.count("expected outcome: completion") == 6 and "refusal: not judged" in out
    html_text = out_html.read_text(encoding="utf-8")
    for run in runs:
        assert f'id="row-{run["row"]}"' in html_text


def test_sample_dataset_over_http_gives_the_same_trajectories(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    code_json, url_json = tmp_path / "code.json", tmp_path / "url.json"
    code, _, err = simulate_cli(capsys, "--csv", SAMPLE, "--code", MINIMAL, "--responses", FIXTURES,
                                "--json", code_json)
    assert code == 0, err
    server = pp.start_server(load_module(MINIMAL).agent, token=AGENT_TOKEN)
    try:
        monkeypatch.setenv("SIM_AGENT_TOKEN", AGENT_TOKEN)
        code, out, err = simulate_cli(capsys, "--csv", SAMPLE, "--url", server.url, "--token-env", "SIM_AGENT_TOKEN",
                                      "--responses", FIXTURES, "--json", url_json)
    finally:
        server.close(1)
    assert code == 0, err
    by_code = json.loads(code_json.read_text(encoding="utf-8"))
    by_url = json.loads(url_json.read_text(encoding="utf-8"))
    assert by_url["agent"] == {"mode": "url", "target": server.url}
    assert trajectory(by_url) == trajectory(by_code)
    assert [r["final_response"] for r in by_url["runs"]] == [r["final_response"] for r in by_code["runs"]]
    assert AGENT_TOKEN not in out + err + url_json.read_text(encoding="utf-8")


def test_reruns_replay_the_same_failures(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path) -> None:
    reports = []
    for name in ("a.json", "b.json"):
        assert simulate_cli(capsys, "--csv", SAMPLE, "--code", MINIMAL, "--responses", FIXTURES,
                            "--json", tmp_path / name)[0] == 0
        reports.append(json.loads((tmp_path / name).read_text(encoding="utf-8")))
    assert trajectory(reports[0]) == trajectory(reports[1])


# ---------------------------------------------------------------------------
# The trajectory: sources, rules, ledger changes, trace events, errors
# ---------------------------------------------------------------------------

STATE = json.dumps({"order": {"4521": {"status": "shipped", "amount": 79.5, "currency": "EUR"}}})
REFUND = {"order_id": "4521", "reason": "damaged"}


def scripted_rows() -> List[Dict[str, str]]:
    story = {"calls": [["get_order", {"order_id": "4521"}], ["refund_order", REFUND], ["refund_order", REFUND],
                       ["get_order", {"order_id": "4521"}], ["get_order", {"order_id": "4521"}]],
             "trace": "checking the <order>", "leak": True}
    rules = [
        {"trigger": "after_n_calls", "tool": "refund_order", "n": 1, "duration": 1,
         "error": {"code": 502, "message": "Payment processor unavailable"}},
        {"trigger": "after_state_change", "tool": "get_order", "condition": "refund_issued", "duration": 1,
         "error": {"code": 200, "response": {"status": "shipped", "stale": True}}},
    ]
    return [
        {"user": json.dumps(story), "behavior": "Refunds take 5 days.", "state": STATE,
         "failure_rules": json.dumps(rules), "expected_outcome": "completion"},
        {"user": json.dumps({"raise": "boom in the agent"}), "behavior": "", "state": "", "failure_rules": "",
         "expected_outcome": ""},
        {"user": json.dumps({"raw": True}), "behavior": "", "state": "", "failure_rules": "", "expected_outcome": ""},
        {"user": json.dumps({"calls": [["list_orders", {}, "key-1"], ["list_orders", {}, "key-1"]],
                             "wrong_token": True, "array_body": True}),
         "behavior": "", "state": "", "failure_rules": "", "expected_outcome": ""},
        {"user": "a row the dataset check rejects", "behavior": "", "state": "", "failure_rules": "",
         "expected_outcome": "maybe"},
        {"user": "plain text", "behavior": "", "state": STATE, "failure_rules": "", "expected_outcome": "refusal"},
    ]


def test_trajectory_errors_and_invalid_rows(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path,
                                            scripted: Tuple[pathlib.Path, pathlib.Path]) -> None:
    agent, token_log = scripted
    data = write_csv(tmp_path / "scripted.csv", scripted_rows())
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    code, out, err = simulate_cli(capsys, "--csv", data, "--code", agent, "--responses", FIXTURES,
                                  "--json", out_json, "--html", out_html)
    assert code == 1
    report = json.loads(out_json.read_text(encoding="utf-8"))
    runs = report["runs"]
    assert [r["status"] for r in runs] == ["ok", "error", "error", "error", "invalid", "ok"]
    assert report["summary"]["errors"] == 4

    story = runs[0]
    calls = story["tool_calls"]
    assert [(c["tool_name"], c["source"], c["matched_rule_index"]) for c in calls] == [
        ("get_order", "odyssey", None),       # answered by the ledger itself
        ("refund_order", "injected", 0),      # after_n_calls n=1 duration=1
        ("refund_order", "odyssey", None),    # the retry reaches the fixture: effects run
        ("get_order", "injected", 1),         # after_state_change: the flag the refund set
        ("get_order", "odyssey", None),       # duration 1 is over
    ]
    assert calls[1]["response"] == {"error": "Payment processor unavailable", "status_code": 502}
    assert calls[2]["response"]["status"] == "refunded" and calls[2]["arguments"] == REFUND
    assert calls[3]["response"] == {"status": "shipped", "stale": True}
    assert calls[4]["response"]["status"] == "refunded"
    assert [(c["op"], c["call"]) for c in story["ledger_changes"]] == [("update", 3), ("set_flag", 3)]
    assert story["final_state"]["order"]["4521"]["status"] == "refunded" and story["flags"] == ["refund_issued"]
    assert all(c["latency_ms"] >= 0 and c["http_status"] == 200 for c in calls)
    assert [c["at_ms"] for c in calls] == sorted(c["at_ms"] for c in calls)
    assert [(e["event_type"], e["payload"]["text"]) for e in story["trace_events"]] == [
        ("assistant_message", "checking the <order>")]
    assert story["metadata"] == {"model": "scripted"} and story["messages"][0]["role"] == "user"
    assert [(r["index"], r["fired"]) for r in story["failure_rules"]] == [(0, 1), (1, 1)]

    raised, empty, wrong_token, invalid, plain = runs[1:]
    assert raised["errors"] == ["run() raised AgentError: agent raised ValueError: boom in the agent"]
    assert "ValueError: boom in the agent" in raised["traceback"]
    assert empty["errors"] == [  # pp.validate_response's problems, each one
        "invalid response: final_response: must not be empty (the judge has nothing to grade)",
        "invalid response: messages: must be an array or null, got a string (the platform drops it)"]
    assert wrong_token["errors"] == [
        "the proxy rejected the agent's call to 'get_order' without this run's token (HTTP 401)",
        "the proxy rejected the agent's call to 'get_order' with arguments that are not a JSON object (HTTP 422)"]
    assert [(c["tool_name"], c["http_status"], c["source"], c.get("replayed")) for c in wrong_token["tool_calls"]] == [
        ("list_orders", 200, "error", None), ("list_orders", 200, "error", True),  # a retry with the same key
        ("get_order", 401, None, None), ("get_order", 422, None, None)]
    assert "1 call(s) were retries the proxy answered from its Idempotency-Key replay memory" in wrong_token["notes"]
    assert invalid["tool_calls"] == [] and "did you mean `completion`?" not in invalid["errors"][0]
    assert invalid["errors"][0].startswith("row 5, column `expected_outcome`: must be")
    assert plain["final_response"].startswith("results: [{\"id\": \"4521\"")

    # The run tokens are secrets: never in the outputs, even when the agent leaks one in its answer.
    tokens = [t for t in token_log.read_text(encoding="utf-8").split() if t]
    assert len(tokens) == 4 and len(set(tokens)) == 4  # one per run that reached agent(); a fresh one each
    written = out + err + out_json.read_text(encoding="utf-8") + out_html.read_text(encoding="utf-8")
    assert not any(t in written for t in tokens)
    assert story["final_response"].endswith("token [redacted]")
    assert "Traceback" not in out + err


def test_timeouts_and_the_kernel_loop_are_row_errors(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path,
                                                     scripted: Tuple[pathlib.Path, pathlib.Path]) -> None:
    agent, _ = scripted
    data = write_csv(tmp_path / "hang.csv", [
        {"user": json.dumps({"hang": 2}), "behavior": "", "state": "", "failure_rules": "", "expected_outcome": ""},
        {"user": "plain text", "behavior": "", "state": STATE, "failure_rules": "", "expected_outcome": ""},
    ])
    code, out, err = simulate_cli(capsys, "--csv", data, "--code", agent, "--timeout", "0.3", "--json", "-")
    assert code == 1
    report = json.loads(out)  # --json - prints the JSON report instead of the text one
    assert report["runs"][0]["errors"] == ["the agent did not return within 0.3 s (--timeout)"]
    assert report["runs"][1]["status"] == "ok"
    # run() is called from inside a running event loop, as in the sandbox's kernel: asyncio.run() fails there
    code, out, err = simulate_cli(capsys, "--csv", data, "--code", f"{agent}:run_raw", "--json", "-")
    errors = json.loads(out)["runs"][1]["errors"]
    assert code == 1 and errors[0].startswith("run_raw() raised RuntimeError: asyncio.run() cannot be called")


# ---------------------------------------------------------------------------
# HTTP mode: exactly the platform's dispatch
# ---------------------------------------------------------------------------


class RecordingAgent(BaseHTTPRequestHandler):
    """A plain stdlib dispatch endpoint that records each request and makes one tool call."""

    protocol_version = "HTTP/1.1"
    seen: List[Tuple[Dict[str, str], Any]] = []

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        headers = dict(self.headers.items())
        self.seen.append((headers, body))
        if body == {"ping": True}:
            reply: Any = {"ok": True}
        else:
            envelope = pp.Envelope.from_dispatch(body, headers)
            order = pp.proxy_call("get_order", {"order_id": "4521"}, envelope=envelope)
            reply = pp.build_response(f"order is {order['status']}")
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def recording_agent() -> Iterator[str]:
    RecordingAgent.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), RecordingAgent)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/dispatch"
    server.shutdown()
    server.server_close()


def test_dispatch_headers_and_body_are_the_platforms(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path,
                                                     recording_agent: str) -> None:
    rules = json.dumps([{"trigger": "random", "tool": "*", "probability": 0, "error": {"code": 503, "message": "x"}}])
    data = write_csv(tmp_path / "one.csv", [{"user": "Where is order 4521?", "behavior": "secret backend rule",
                                             "state": STATE, "failure_rules": rules, "expected_outcome": "refusal"}])
    code, out, err = simulate_cli(capsys, "--csv", data, "--url", recording_agent, "--token", AGENT_TOKEN,
                                  "--auth-header", "X-API-Key", "--json", "-")
    assert code == 0, err
    (ping_headers, ping), (headers, body) = RecordingAgent.seen
    assert ping == {"ping": True} and ping_headers["X-API-Key"] == AGENT_TOKEN
    assert headers["X-API-Key"] == AGENT_TOKEN and "Authorization" not in headers  # a custom header: no Bearer
    assert headers["Content-Type"] == "application/json"
    assert set(body) == {"task_id", "run_id", "input", "odyssey_proxy_url", "run_token_jti"}
    assert body["input"] == {"task_id": 1, "user_instruction": "Where is order 4521?", "input": {}}
    assert headers["X-Pipelines-Odyssey-Proxy-Url"] == body["odyssey_proxy_url"]
    assert body["odyssey_proxy_url"].endswith("/api/odyssey-proxy/runs/1")
    assert (headers["X-Pipelines-Run-Id"], headers["X-Pipelines-Task-Id"]) == ("1", "1")
    assert headers["X-Pipelines-Run-Token-Jti"] == body["run_token_jti"] and len(body["run_token_jti"]) == 32
    assert headers["X-Pipelines-Run-Token"].startswith("sim-")
    assert "secret backend rule" not in json.dumps(body) and "4521\": {" not in json.dumps(body)
    report = json.loads(out)
    assert report["runs"][0]["final_response"] == "order is shipped"
    assert report["runs"][0]["tool_calls"][0]["source"] == "odyssey"
    assert headers["X-Pipelines-Run-Token"] not in out + err and AGENT_TOKEN not in out + err


def test_http_agent_problems(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path,
                             scripted: Tuple[pathlib.Path, pathlib.Path]) -> None:
    agent, _ = scripted
    data = write_csv(tmp_path / "two.csv", [
        {"user": json.dumps({"raise": "kaboom"}), "behavior": "", "state": "", "failure_rules": "",
         "expected_outcome": ""},
        {"user": "plain text", "behavior": "", "state": STATE, "failure_rules": "", "expected_outcome": ""},
    ])
    server = pp.start_server(load_module(agent).agent, token=AGENT_TOKEN)
    try:
        code, out, err = simulate_cli(capsys, "--csv", data, "--url", server.url, "--token", "wrong-token-value")
        assert code == 2 and "refused the ping with HTTP 401" in err and "wrong-token-value" not in err
        code, out, err = simulate_cli(capsys, "--csv", data, "--url", server.url, "--token", AGENT_TOKEN, "--json", "-")
        report = json.loads(out)
        assert code == 1 and [r["status"] for r in report["runs"]] == ["error", "ok"]
        assert report["runs"][0]["errors"][0].startswith("the agent answered HTTP 500:")
        assert "kaboom" in report["runs"][0]["errors"][0]
    finally:
        server.close(1)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    code, out, err = simulate_cli(capsys, "--csv", data, "--url", f"http://127.0.0.1:{closed}/dispatch")
    assert code == 2 and err.startswith("simulate: cannot reach the agent at http://127.0.0.1:") and "\n" == err[-1]


# ---------------------------------------------------------------------------
# The HTML report
# ---------------------------------------------------------------------------


def test_html_report_shows_calls_and_answers_and_escapes_everything(
        capsys: pytest.CaptureFixture, tmp_path: pathlib.Path, scripted: Tuple[pathlib.Path, pathlib.Path]) -> None:
    agent, _ = scripted
    nasty = '<script>alert("x")</script> & <b>'
    spec = {"calls": [["get_order", {"order_id": nasty}], ["list_orders", {}]], "final": f"answer {nasty}"}
    data = write_csv(tmp_path / "html.csv", [
        {"user": json.dumps(spec), "behavior": nasty, "state": STATE, "failure_rules": "", "expected_outcome": ""},
        {"user": "plain text", "behavior": "", "state": STATE, "failure_rules": "", "expected_outcome": ""},
    ])
    out_html = tmp_path / "r.html"
    code, out, err = simulate_cli(capsys, "--csv", data, "--code", agent, "--html", out_html)
    assert code == 0, err
    page = out_html.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "<style>" in page
    assert page.count("<script") == 1 and "<script>" in page  # one inline script of ours: self-contained
    assert '<div class="toolbar" id="toolbar" hidden>' in page  # without JavaScript the toolbar stays hidden
    assert "& <b>" not in page and "<link" not in page
    assert "src=" not in page and "href=" not in page and "url(" not in page and "@import" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &lt;b&gt;" in page
    assert "answer &lt;script&gt;" in page  # the final response
    assert "results: [{&quot;id&quot;: &quot;4521&quot;" in page  # row 2's final response
    for name in ("#1 get_order", "#2 list_orders"):
        assert name in page
    assert page.count('class="final"') == 2


MALFORMED_TRANSCRIPTS = r'''
def run(task_input, *, proxy_url, run_token):
    kind = task_input["user_instruction"]
    message = {"role": "assistant", "content": "x <i>"}
    if kind == "messages-a-number":
        return {"final_response": "done", "messages": 5}
    if kind == "messages-a-string":
        return {"final_response": "done", "messages": "<b>not a list</b>"}
    if kind == "tool_calls-a-number":
        return {"final_response": "done", "messages": [dict(message, tool_calls=5)]}
    if kind == "thinking-a-number":
        return {"final_response": "done", "messages": [dict(message, thinking=7)]}
    return {"final_response": "done", "messages": [dict(message, thinking=["<t>", {"no_text": 1}],
                                                        tool_calls=["<c>", {"function": 3}]), "<m>"]}
'''


def test_html_report_shows_a_malformed_transcript_as_it_came(capsys: pytest.CaptureFixture,
                                                              tmp_path: pathlib.Path) -> None:
    agent = tmp_path / "malformed.py"
    agent.write_text(MALFORMED_TRANSCRIPTS, encoding="utf-8")
    kinds = ["messages-a-number", "messages-a-string", "tool_calls-a-number", "thinking-a-number", "odd-items"]
    data = write_csv(tmp_path / "odd.csv", [{"user": k, "behavior": "", "state": "", "failure_rules": "",
                                             "expected_outcome": ""} for k in kinds])
    out_html = tmp_path / "r.html"
    code, out, err = simulate_cli(capsys, "--csv", data, "--code", agent, "--html", out_html)
    assert code == 1 and "Traceback" not in out + err  # invalid transcripts are row errors, not a crash
    page = out_html.read_text(encoding="utf-8")
    assert page.count("<h3>Transcript</h3>") == 5 and page.count('class="final"') == 5
    assert '<div class="msg"><pre>5</pre></div>' in page
    assert "<pre>&lt;b&gt;not a list&lt;/b&gt;</pre>" in page
    assert '<span class="lbl">tool call</span><pre>5</pre>' in page
    assert '<details><summary class="lbl">thinking</summary><pre>7</pre></details>' in page
    for shown in ("<pre>&lt;t&gt;</pre>", "&quot;no_text&quot;: 1", "<pre>&lt;c&gt;</pre>", "<pre>&lt;m&gt;</pre>"):
        assert shown in page
    assert "x <i>" not in page and "<b>not a list" not in page and "x &lt;i&gt;" in page


def test_html_report_falls_back_to_the_raw_run_when_a_run_cannot_be_drawn() -> None:
    from conformance.simulator import report

    odd = {"row": 1, "line": 2, "status": "ok", "tool_calls": [{"tool_name": "<x>"}], "errors": [], "warnings": [],
           "trace_events": [], "failure_rules": [], "expected_outcome": "completion", "user_instruction": "<u>"}
    result = {"summary": {"runs": 1, "ok": 1, "errors": 0, "tool_calls": 1, "injected": 0},
              "dataset": {"file": "d.csv", "problems": []}, "runs": [odd]}
    page = report.render_html(result)
    assert page.rstrip().endswith("</script></body></html>") and "row 1 (line 2)" in page
    assert "&quot;tool_name&quot;: &quot;&lt;x&gt;&quot;" in page and "<x>" not in page and "<u>" not in page


class LeakyAgent(BaseHTTPRequestHandler):
    """A buggy HTTP agent whose error bodies quote the credentials it got, after a long prefix."""

    run_tokens: List[str] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body == {"ping": True}:  # the agent token lands across the 300-character cut
            status, detail = 503, "misconfigured: " + "x" * 260 + " got " + self.headers["Authorization"]
        else:
            token = self.headers["X-Pipelines-Run-Token"]
            self.run_tokens.append(token)
            status, detail = 500, "RuntimeError: " + "y" * 270 + " token=" + token
        data = json.dumps({"detail": detail}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_no_part_of_a_secret_survives_a_cut_message(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), LeakyAgent)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    data = write_csv(tmp_path / "one.csv", [{"user": "hello", "behavior": "", "state": "", "failure_rules": "",
                                             "expected_outcome": ""}])
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/dispatch"
        code, out, err = simulate_cli(capsys, "--csv", data, "--url", url, "--token", AGENT_TOKEN, "--json", "-")
    finally:
        server.shutdown()
        server.server_close()
    (run_token,) = LeakyAgent.run_tokens
    assert code == 1 and "warning: the agent answered the ping with HTTP 503: misconfigured:" in err
    assert "the agent answered HTTP 500: RuntimeError: yyy" in json.loads(out)["runs"][0]["errors"][0]
    assert AGENT_TOKEN[:6] not in err  # the ping warning
    assert run_token[:6] not in out + err  # the row's error


RAISES_WITH_THE_TOKEN = r'''
import os


def run(task_input, *, proxy_url, run_token):
    with open(os.environ["SIM_TEST_TOKEN_LOG"], "a") as log:
        log.write(run_token + "\n")
    raise ValueError(run_token + "z" * 5990)  # the token straddles the traceback's 6000-character tail
'''


def test_a_traceback_tail_never_keeps_half_a_run_token(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path,
                                                       scripted: Tuple[pathlib.Path, pathlib.Path]) -> None:
    _, token_log = scripted
    agent = tmp_path / "raises.py"
    agent.write_text(RAISES_WITH_THE_TOKEN, encoding="utf-8")
    data = write_csv(tmp_path / "one.csv", [{"user": "hello", "behavior": "", "state": "", "failure_rules": "",
                                             "expected_outcome": ""}])
    code, out, err = simulate_cli(capsys, "--csv", data, "--code", agent, "--json", "-")
    (run,) = json.loads(out)["runs"]
    (token,) = token_log.read_text(encoding="utf-8").split()
    assert code == 1 and run["errors"][0].startswith("run() raised ValueError: [redacted]zzz")
    assert run["traceback"] == "redacted]" + "z" * 5990 + "\n"  # the cut falls in the placeholder
    assert len(token) > 20 and token[-8:] not in out + err


def test_a_null_failure_rules_cell_is_a_rejected_row_not_a_crash(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path,
                                                                  scripted: Tuple[pathlib.Path, pathlib.Path]) -> None:
    agent, _ = scripted
    data = write_csv(tmp_path / "null.csv", [
        {"user": "plain text", "behavior": "", "state": "null", "failure_rules": "", "expected_outcome": ""},
        {"user": "plain text", "behavior": "", "state": STATE, "failure_rules": "null", "expected_outcome": ""},
        {"user": "plain text", "behavior": "", "state": STATE, "failure_rules": "", "expected_outcome": ""}])
    code, out, err = simulate_cli(capsys, "--csv", data, "--code", agent, "--json", "-")
    report = json.loads(out)
    assert code == 1 and [r["status"] for r in report["runs"]] == ["invalid", "invalid", "ok"]
    assert "got null" in report["runs"][0]["errors"][0] and "got null" in report["runs"][1]["errors"][0]
    assert "Traceback" not in err


# ---------------------------------------------------------------------------
# Bad input: one line on stderr, exit 2, no traceback
# ---------------------------------------------------------------------------


def test_setup_errors_are_one_clear_line(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path,
                                         scripted: Tuple[pathlib.Path, pathlib.Path]) -> None:
    agent, _ = scripted
    data = write_csv(tmp_path / "ok.csv", [{"user": "plain", "behavior": "", "state": STATE, "failure_rules": "",
                                             "expected_outcome": ""}])
    broken = tmp_path / "broken.py"
    broken.write_text("def run(:\n", encoding="utf-8")
    raising = tmp_path / "raising.py"
    raising.write_text("raise SystemExit('no')\n", encoding="utf-8")
    only_agent = tmp_path / "only_agent.py"
    only_agent.write_text("def agent(envelope):\n    return 'x'\n", encoding="utf-8")
    bad_fixtures = tmp_path / "fixtures.json"
    bad_fixtures.write_text('{"tools": {"t": {}}}', encoding="utf-8")
    not_json = tmp_path / "not.json"
    not_json.write_text("{", encoding="utf-8")
    cases = [
        (["--code", tmp_path / "missing.py"], "--code: no such file"),
        (["--code", broken], "has a syntax error: "),
        (["--code", raising], "raised SystemExit: no"),
        (["--code", only_agent], "has no function 'run' (it has `agent`: add `run = pp.code_mode(agent)`)"),
        (["--code", agent, "--responses", bad_fixtures], "has 1 error(s); fix them first"),
        (["--code", agent, "--responses", not_json], "is not valid JSON"),
        (["--code", agent, "--tools", not_json], "--tools: tools schema"),
        (["--code", agent, "--token", "x"], "are for --url agents"),
        (["--code", agent, "--timeout", "0"], "--timeout must be a positive number"),
        (["--url", "ftp://example.com/x"], "--url must be an http:// or https:// URL"),
        (["--url", "http://127.0.0.1:9/d", "--token-env", "SIM_UNSET_VARIABLE"], "SIM_UNSET_VARIABLE is not set"),
    ]
    for extra, expected in cases:
        code, out, err = simulate_cli(capsys, "--csv", data, *extra)
        last = err.strip().splitlines()[-1]
        assert code == 2, (extra, err)
        assert last.startswith("simulate: ") and expected in last, (extra, last)
        assert "Traceback" not in err + out
    code, out, err = simulate_cli(capsys, "--csv", tmp_path / "nope.csv", "--code", agent)
    assert code == 2 and "cannot read the file" in err
    header_only = tmp_path / "bad.csv"
    header_only.write_text("user_instruction\nhi\n", encoding="utf-8")
    code, out, err = simulate_cli(capsys, "--csv", header_only, "--code", agent)
    assert code == 2 and "did you mean `user`?" in err and "fix them first" in err
    assert simulate_cli(capsys, "--csv", data)[0] == 2  # neither --code nor --url: argparse usage error


def test_a_simulation_is_strict_unless_asked_to_be_lenient(capsys: pytest.CaptureFixture,
                                                           tmp_path: pathlib.Path) -> None:
    """simulate --code builds the agent's response strictly: what the platform would drop is an error to see."""
    agent = tmp_path / "sloppy.py"
    agent.write_text(textwrap.dedent('''
        import pipelines_port as pp

        def agent(envelope):
            return {"final_response": "done", "messages": [{"role": "bot", "content": "?"}]}

        run = pp.code_mode(agent)
    '''))
    data = write_csv(tmp_path / "one.csv", [{"user": "do it", "behavior": "", "state": "", "failure_rules": "",
                                              "expected_outcome": ""}])
    code, out, _ = simulate_cli(capsys, "--csv", data, "--code", agent, "--json", "-")
    run = json.loads(out)["runs"][0]
    assert code == 1 and run["status"] == "error" and "messages[0].role" in " ".join(run["errors"])
    code, out, _ = simulate_cli(capsys, "--csv", data, "--code", agent, "--json", "-", "--lenient")
    run = json.loads(out)["runs"][0]
    assert code == 0 and run["status"] == "ok" and run.get("messages") in (None, [])
    assert os.environ.get("PIPELINES_PORT_STRICT") is None  # the simulation leaves the environment as it found it


# ---------------------------------------------------------------------------
# Scale: --jobs, progress with rate and ETA, Ctrl-C
# ---------------------------------------------------------------------------


def many_rows(path: pathlib.Path, copies: int) -> pathlib.Path:
    """The sample dataset's five single-turn rows, ``copies`` times over (each copy its own row, so its own seed)."""
    with open(SAMPLE, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))[:5]
    return write_csv(path, [dict(row, user=f"{row['user']} (copy {n})") for n in range(copies) for row in rows])


def without_timings(report: Dict[str, Any]) -> List[Dict[str, Any]]:
    timing = {"duration_ms", "at_ms", "latency_ms"}

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in timing}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value
    return strip(report["runs"])


def test_jobs_give_the_runs_of_one_at_a_time(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path) -> None:
    dataset = many_rows(tmp_path / "many.csv", 8)  # 40 rows, random and counted failure rules among them
    reports = {}
    for jobs in ("1", "8"):
        out = tmp_path / f"jobs{jobs}.json"
        code, _, err = simulate_cli(capsys, "--csv", dataset, "--code", MINIMAL, "--responses", FIXTURES,
                                    "--jobs", jobs, "--json", out)
        assert code == 0, err
        reports[jobs] = json.loads(out.read_text(encoding="utf-8"))
        progress = [line for line in err.splitlines() if line.startswith("[")]
        assert len(progress) == 40 and all("rows/s" in line for line in progress)
        assert "ETA" in progress[0] and "ETA" not in progress[-1]
    assert reports["8"]["jobs"] == 8 and reports["1"]["jobs"] == 1
    assert [r["row"] for r in reports["8"]["runs"]] == list(range(1, 41))  # row order, whatever finished first
    assert without_timings(reports["8"]) == without_timings(reports["1"])
    assert reports["8"]["summary"]["injected"] == reports["1"]["summary"]["injected"] > 8


SLOW_AGENT = '''
import time
import pipelines_port as pp

def agent(envelope):
    time.sleep(0.3)
    return "done: " + envelope.user_instruction

run = pp.code_mode(agent)
'''


def test_ctrl_c_stops_cleanly_and_writes_the_reports_of_finished_rows(tmp_path: pathlib.Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    agent = tmp_path / "slow.py"
    agent.write_text(SLOW_AGENT, encoding="utf-8")
    dataset = many_rows(tmp_path / "many.csv", 10)  # 50 rows of 0.3 s at 2 at a time: about 8 s in all
    out_json, out_html = tmp_path / "report.json", tmp_path / "report.html"
    proc = subprocess.Popen([sys.executable, "-m", "conformance", "simulate", "--csv", str(dataset), "--code",
                             str(agent), "--jobs", "2", "--json", str(out_json), "--html", str(out_html)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            # A shell's background job inherits SIGINT ignored, and Python then never raises
                            # KeyboardInterrupt: the child gets the default disposition, as at a terminal.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stderr is not None
    seen = []
    while len(seen) < 4:  # a few rows done, then Ctrl-C
        line = proc.stderr.readline()
        assert line, "the simulation ended before it was interrupted"
        if line.startswith("["):
            seen.append(line)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130 and time.monotonic() - started < 5
    assert "interrupted" in err and "Traceback" not in err
    report = json.loads(out_json.read_text(encoding="utf-8"))
    assert report["interrupted"] is True
    finished = report["summary"]["runs"]
    assert 4 <= finished < 50 and report["summary"]["not_run"] == 50 - finished
    assert all(r["status"] == "ok" for r in report["runs"])
    assert f'id="row-{report["runs"][0]["row"]}"' in out_html.read_text(encoding="utf-8")
