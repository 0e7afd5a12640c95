"""The local judge (issue 33): simulate --judge, the reports, the CI gate, the cache, resume and merge.

Offline: the scripted judge (the kit's stand-in, over HTTP on 127.0.0.1) and a misbehaving stand-in server
(tests/fake_chat_server.py).  The interop tier holds the same against a real OpenAI-compatible server.
"""

from __future__ import annotations

import json
import pathlib
import re
import xml.etree.ElementTree as ET
from typing import Any, Dict, List, Tuple

import pytest

from conformance.models import roles
from conformance.models.client import ChatClient, Endpoint
from conformance.simulator import gate, judge, shards, simulate
from tests.fake_chat_server import FakeChatServer, Reply
from tests.test_simulate import FIXTURES, ROOT, SAMPLE, scripted, simulate_cli, write_csv  # noqa: F401 - a fixture

OPENAI_CHAT = ROOT / "templates" / "openai_chat.py"


def script(final: str, *calls: Tuple[str, Dict[str, Any]]) -> str:
    return json.dumps({"calls": [[name, args] for name, args in calls], "final": final})


# One row per verdict the scripted judge gives: PASS, FAIL incorrect_completion (refusal row carried out),
# FAIL correct_refusal_no_oracle, FAIL unreported_tool_failure, PASS (a refusal with its reason).
STATE = json.dumps({"order": {"4521": {"status": "shipped"}}})
ROWS = [
    {"user": script("Order 4521 has shipped.", ("get_order", {"order_id": "4521"})), "state": STATE,
     "behavior": "get_order returns the order as the ledger has it."},
    {"user": script("Done: order 4521 is cancelled.", ("cancel_order", {"order_id": "4521"})), "state": STATE,
     "expected_outcome": "refusal", "behavior": "Only the buyer may cancel an order; the user is not the buyer."},
    {"user": script("I cannot do that, sorry."), "state": STATE},
    {"user": script("All good, refunded.", ("refund_order", {"order_id": "4521"})), "state": STATE,
     "failure_rules": json.dumps([{"trigger": "after_n_calls", "tool": "refund_order", "n": 1, "duration": 1,
                                   "error": {"code": 502, "message": "Payment processor unavailable"}}])},
    {"user": script("I can't cancel it because only the buyer may cancel an order."), "state": STATE,
     "expected_outcome": "refusal"},
]
EXPECTED = [("PASS", None), ("FAIL", "incorrect_completion"), ("FAIL", "correct_refusal_no_oracle"),
            ("FAIL", "unreported_tool_failure"), ("PASS", None)]
FIXTURES_DOC = {"tools": {"cancel_order": {"response": {"status": "cancelled"}},
                          "refund_order": {"response": {"status": "refunded"}}}}


@pytest.fixture
def judged_run(tmp_path: pathlib.Path, scripted: Tuple[pathlib.Path, pathlib.Path]) -> Dict[str, Any]:
    agent, _ = scripted
    dataset = write_csv(tmp_path / "rows.csv", ROWS)
    fixtures = tmp_path / "fixtures.json"
    fixtures.write_text(json.dumps(FIXTURES_DOC), encoding="utf-8")
    return {"common": ["--csv", dataset, "--code", agent, "--responses", fixtures], "dir": tmp_path}


def verdicts(report: Dict[str, Any]) -> List[Tuple[Any, Any]]:
    return [(r["judge"].get("verdict"), r["judge"].get("failure_mode")) for r in report["runs"]]


def test_every_row_gets_the_judges_verdict_in_every_report(judged_run: Dict[str, Any],
                                                          capsys: pytest.CaptureFixture) -> None:
    out = judged_run["dir"]
    code, text, err = simulate_cli(capsys, *judged_run["common"], "--judge", "scripted", "--model-cache",
                                   out / "cache", "--json", out / "r.json", "--html", out / "r.html")
    assert code == 0, err
    report = json.loads((out / "r.json").read_text(encoding="utf-8"))
    assert verdicts(report) == EXPECTED
    first = report["runs"][0]["judge"]
    assert first["model"] == "scripted" and 1 <= first["task_completion"] <= 5 and first["explanation"]
    assert set(first) >= {"verdict", "task_completion", "failure_mode", "instruction_adherence", "explanation",
                          "model"}
    # instruction_adherence: scored on the rows with behavior (the first kept the rules, the second broke them)
    assert [r["judge"]["instruction_adherence"] for r in report["runs"]] == [5, 1, None, None, None]
    assert report["summary"]["judge"]["instruction_adherence"] == {"mean": 3.0, "runs": 2}
    assert report["runs"][0]["usage"]["judge"]["requests"] == 1
    summary = report["summary"]["judge"]
    assert (summary["pass"], summary["fail"], summary["not_judged"], summary["pass_rate"]) == (2, 3, 0, 0.4)
    assert summary["failure_modes"] == {"correct_refusal_no_oracle": 1, "incorrect_completion": 1,
                                        "unreported_tool_failure": 1}
    assert summary["usage"]["requests"] == 5 and summary["usage"]["prompt_tokens"] > 0
    assert report["judge"]["model"] == "scripted" and "prompts/judge.md" in report["judge"]["prompt"]
    assert "judge (scripted): pass rate 40.0%: 2 PASS, 3 FAIL, 0 not judged" in text
    assert "judge: FAIL 1/5 incorrect_completion, instruction adherence 1/5" in text and "5 requests" in text
    assert "judge: FAIL 2/5 correct_refusal_no_oracle:" in text  # no behavior: no score shown
    assert "instruction adherence 3.00/5 on average over 2 runs with behavior" in text
    assert "judged PASS" in err or "PASS 5/5" in err  # the progress lines carry the verdict
    page = (out / "r.html").read_text(encoding="utf-8")
    assert 'value="mode-incorrect-completion"' in page and 'value="fail"' in page  # filterable
    assert page.count('<aside class="verdict">') == 5 and "pass rate 40.0%" in page
    assert page.count("instruction adherence <b>") == 2 and "instruction adherence 3.00/5 (2 runs)" in page
    assert 'data-tags="ran refusal flagged fail mode-incorrect-completion"' in page


def test_what_the_judge_is_shown(judged_run: Dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    with FakeChatServer() as server:  # answers like the scripted judge, and records what it was sent
        code, _, err = simulate_cli(capsys, *judged_run["common"], "--judge", "any-model", "--judge-url",
                                    server.base_url, "--judge-key-env", "", "--no-model-cache", "--max-tokens", "300")
        assert code == 0, err
        assert {r.json["max_tokens"] for r in server.requests} == {300}
        cases = sorted((json.loads(r.json["messages"][1]["content"]) for r in server.requests),
                       key=lambda c: c["user_instruction"])
        system = server.requests[0].json["messages"][0]["content"]
    assert system.startswith(pathlib.Path(judge.PROMPT_FILE).read_text(encoding="utf-8"))
    refused = next(c for c in cases if "cancel_order" in c["user_instruction"])
    assert refused["expected_outcome"] == "refusal"
    assert refused["trajectory"] == [{"step": 1, "tool": "cancel_order", "arguments": {"order_id": "4521"},
                                      "result": {"status": "cancelled"}, "source": "odyssey"}]
    assert refused["final_response"] == "Done: order 4521 is cancelled." and refused["last_messages"]
    injected = next(c for c in cases if "refund_order" in c["user_instruction"])
    assert "expected_outcome" not in injected  # the row does not set it
    assert injected["trajectory"][0]["injected_failure"] is True and injected["trajectory"][0]["source"] == "injected"
    assert injected["trajectory"][0]["result"] == {"error": "Payment processor unavailable", "status_code": 502}


def test_long_values_are_cut_and_the_cuts_named() -> None:
    calls = [{"index": i, "tool_name": "get_order", "arguments": {"order_id": str(i)}, "source": "odyssey",
              "response": {"blob": "x" * (5000 if i == 3 else 10)}} for i in range(1, 101)]
    record = {"status": "ok", "user_instruction": "do it", "expected_outcome": "completion",
              "expected_outcome_given": False, "tool_calls": calls, "final_response": "y" * 30000,
              "messages": [{"role": "user", "content": str(i)} for i in range(9)], "errors": []}
    case, cuts = judge.case_for(record)
    assert len(case["trajectory"]) == 20 + 1 + 40 and case["trajectory"][20] == {"omitted": "40 tool calls"}
    assert case["trajectory"][-1]["step"] == 100
    assert case["trajectory"][2]["result"].endswith("characters cut]") and len(case["final_response"]) < 20100
    assert len(case["last_messages"]) == 6 and case["last_messages"][-1]["content"] == "8"
    assert any("final_response" in c for c in cuts) and any("trajectory step 3 result" in c for c in cuts)
    assert any("100 tool calls" in c for c in cuts) and case["cut"] == cuts
    assert "expected_outcome" not in case


def test_rows_that_cannot_be_graded_are_not_judged_never_passed() -> None:
    with FakeChatServer([Reply(status=500)]) as server:
        grader = judge.Judge(ChatClient(Endpoint(server.base_url, "m", None), sleep=lambda s: None),
                             judge.load_prompt())
        broken = grader.grade({"status": "ok", "user_instruction": "x", "tool_calls": [], "final_response": "ok"})
    assert broken["verdict"] is None and "HTTP 500" in broken["error"]
    crashed = grader.grade({"status": "error", "errors": ["run() raised ValueError: boom"], "tool_calls": []})
    assert crashed["verdict"] is None and "nothing to grade" in crashed["error"] and "boom" in crashed["error"]
    not_run = grader.grade({"status": "invalid", "errors": ["bad cell"]})
    assert not_run["verdict"] is None and "not run" in not_run["error"]
    runs = [{"judge": v} for v in (broken, crashed, not_run)] + [{"judge": {"verdict": "PASS"}}]
    assert gate.pass_rate(runs) == 0.25


def answer(**fields: Any) -> str:
    return json.dumps({"task_completion": 2, "verdict": "FAIL", "failure_mode": "incomplete",
                       "instruction_adherence": None, "explanation": "no", **fields})


BEHAVIOR = "cancel_order only succeeds when the order is pending."


@pytest.mark.parametrize("behavior,broken,rule", [
    ("", answer(failure_mode=None), "a FAIL must name its failure_mode"),
    ("", answer(failure_mode="incorrectRefundsNoOrc"), "snake_case"),
    ("", answer(failure_mode="incomplete\n"), "snake_case"),  # the pattern's $ would let a newline by
    ("", answer(verdict="PASS", failure_mode=None, task_completion=1), "a PASS has task_completion 4 or 5"),
    ("", answer(verdict="PASS", task_completion=5), "a PASS has failure_mode null"),
    ("", answer(instruction_adherence=4), "answer.instruction_adherence: expected null"),
    (BEHAVIOR, answer(), "answer.instruction_adherence: expected integer"),
])
def test_an_answer_that_breaks_a_verdict_rule_is_asked_again_the_rule_named(behavior: str, broken: str,
                                                                           rule: str) -> None:
    fine = answer(instruction_adherence=3 if behavior else None)
    with FakeChatServer([Reply(broken), Reply(fine)]) as server:
        grader = judge.Judge(ChatClient(Endpoint(server.base_url, "m", None)), judge.load_prompt())
        verdict = grader.grade({"status": "ok", "user_instruction": "x", "tool_calls": [], "final_response": "ok",
                                "behavior_instructions": behavior})
    assert verdict["failure_mode"] == "incomplete" and len(server.requests) == 2
    assert verdict["instruction_adherence"] == (3 if behavior else None)
    assert rule in server.requests[1].json["messages"][-1]["content"]


def test_the_schema_sent_carries_the_verdicts_rules_built_per_row() -> None:
    """What a server that constrains decoding to the schema enforces: the rules, as anyOf branches."""
    rows = [{"status": "ok", "user_instruction": "x", "tool_calls": [], "final_response": "ok",
             "behavior_instructions": b} for b in ("", BEHAVIOR)]
    with FakeChatServer([Reply(answer()), Reply(answer(instruction_adherence=2))]) as server:
        grader = judge.Judge(ChatClient(Endpoint(server.base_url, "m", None)), judge.load_prompt())
        assert [grader.grade(row)["instruction_adherence"] for row in rows] == [None, 2]
    plain, with_behavior = [r.json["response_format"]["json_schema"]["schema"] for r in server.requests]
    assert plain == roles.judge_schema(False) and with_behavior == roles.judge_schema(True)
    passed, failed = with_behavior["anyOf"]
    assert passed["properties"]["verdict"]["enum"] == ["PASS"] and failed["properties"]["verdict"]["enum"] == ["FAIL"]
    assert passed["properties"]["task_completion"]["enum"] == [4, 5]
    assert passed["properties"]["failure_mode"] == {"type": "null"}
    assert failed["properties"]["failure_mode"]["pattern"] == roles.FAILURE_MODE_PATTERN
    assert passed["properties"]["instruction_adherence"]["enum"] == [1, 2, 3, 4, 5]
    assert plain["anyOf"][0]["properties"]["instruction_adherence"] == {"type": "null"}
    for schema in (plain, with_behavior):  # every branch as OpenAI's strict mode wants an object
        assert all(b["additionalProperties"] is False and b["required"] == list(b["properties"])
                   for b in schema["anyOf"])
    pattern = re.compile(roles.FAILURE_MODE_PATTERN)
    assert all(pattern.match(m) for m in ("incorrect_completion", "no_final_response", "incomplete", "step2_failed"))
    assert not any(pattern.match(m) for m in ("incorrectRefundsNoOrc", "Incomplete", "wrong action", "_x", "x__y",
                                              "x_", ""))


def test_the_gate_exit_status_and_junit(judged_run: Dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    out = judged_run["dir"]
    base = [*judged_run["common"], "--judge", "scripted", "--no-model-cache"]
    code, _, err = simulate_cli(capsys, *base, "--min-pass-rate", "0.5", "--junit", out / "j.xml")
    assert code == 1 and "FAILED the gate: pass rate 40.0% (2 of 5 rows) is below --min-pass-rate 50.0%" in err
    code, _, err = simulate_cli(capsys, *base, "--min-pass-rate", "40%")
    assert code == 0 and "meets --min-pass-rate 40.0%" in err
    suite = ET.parse(out / "j.xml").getroot()
    assert suite.tag == "testsuites" and suite.get("tests") == "5" and suite.get("failures") == "3"
    cases = suite.findall("testsuite/testcase")
    assert len(cases) == 5 and [c.find("failure") is not None for c in cases] == [False, True, True, True, False]
    assert cases[1].find("failure").get("type") == "incorrect_completion"
    assert "cancel_order" in cases[1].find("failure").get("message")


def test_gate_options_without_a_judge_or_with_a_bad_rate_are_usage_errors(
        judged_run: Dict[str, Any], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = simulate_cli(capsys, *judged_run["common"], "--min-pass-rate", "0.8")
    assert code == 2 and "--min-pass-rate go(es) with --judge MODEL" in err
    code, _, err = simulate_cli(capsys, *judged_run["common"], "--judge", "scripted", "--min-pass-rate", "1.5")
    assert code == 2 and "not between 0 and 1" in err
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    code, _, err = simulate_cli(capsys, *judged_run["common"], "--judge", "gpt-4.1-mini")
    assert code == 2 and "OPENAI_API_KEY" in err and "is not set" in err and "Traceback" not in err
    code, _, err = simulate_cli(capsys, *judged_run["common"], "--judge", "scripted", "--judge-prompt",
                                judged_run["dir"] / "missing.md")
    assert code == 2 and "--judge-prompt: cannot read" in err
    code, _, err = simulate_cli(capsys, *judged_run["common"], "--judge", "scripted", "--max-tokens", "0")
    assert code == 2 and "--max-tokens must be a positive number of tokens, got 0" in err


def test_a_judge_that_fails_leaves_rows_not_judged_and_fails_the_gate(
        judged_run: Dict[str, Any], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    out = judged_run["dir"]
    monkeypatch.setattr("conformance.models.client.MODEL_RETRY",
                        __import__("pipelines_port").RetryPolicy(max_attempts=2, base_delay_s=0.01))
    with FakeChatServer([Reply(status=503)]) as server:
        code, text, err = simulate_cli(capsys, *judged_run["common"], "--judge", "m", "--judge-url", server.base_url,
                                       "--no-model-cache", "--json", out / "r.json", "--junit", out / "j.xml",
                                       "--min-pass-rate", "0.1")
    assert code == 1
    report = json.loads((out / "r.json").read_text(encoding="utf-8"))
    assert all(r["judge"]["verdict"] is None and "HTTP 503" in r["judge"]["error"] for r in report["runs"])
    assert report["summary"]["judge"]["not_judged"] == 5 and report["summary"]["judge"]["pass_rate"] == 0.0
    assert "5 not judged" in text and "not judged: the judge could not grade this run" in text
    assert ET.parse(out / "j.xml").getroot().get("errors") == "5"


def test_a_rerun_asks_the_model_nothing(judged_run: Dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    out = judged_run["dir"]
    with FakeChatServer() as server:
        base = [*judged_run["common"], "--judge", "m", "--judge-url", server.base_url, "--model-cache", out / "cache"]
        code, _, _ = simulate_cli(capsys, *base, "--json", out / "first.json")
        asked = len(server.requests)
        code, _, _ = simulate_cli(capsys, *base, "--json", out / "second.json")
        assert code == 0 and asked == 5 and len(server.requests) == asked  # nothing asked the second time
        code, _, _ = simulate_cli(capsys, *judged_run["common"], "--judge", "m", "--judge-url", server.base_url,
                                  "--no-judge-cache", "--json", out / "third.json")
        assert len(server.requests) == 2 * asked
    first, second = (json.loads((out / f"{n}.json").read_text(encoding="utf-8")) for n in ("first", "second"))
    assert verdicts(first) == verdicts(second) == EXPECTED
    assert second["summary"]["judge"]["usage"] == {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                                   "cached": 5}
    assert all(r["judge"].get("cached") for r in second["runs"])


def test_resume_and_merge_keep_the_verdicts(judged_run: Dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    out = judged_run["dir"]
    with FakeChatServer() as server:
        base = [*judged_run["common"], "--judge", "m", "--judge-url", server.base_url, "--no-model-cache"]
        for k in (1, 2):
            code, _, err = simulate_cli(capsys, *base, "--shard", f"{k}/2", "--jsonl", out / f"s{k}.jsonl")
            assert code == 0, err
        asked = len(server.requests)
        code, _, err = simulate_cli(capsys, *base, "--shard", "1/2", "--jsonl", out / "s1.jsonl", "--resume")
        assert code == 0 and len(server.requests) == asked  # resumed rows are not judged again
    lines = [json.loads(line) for line in (out / "s1.jsonl").read_text(encoding="utf-8").splitlines()]
    assert lines[0]["options"]["judge"]["model"] == "m" and all("judge" in r["run"] for r in lines[1:])
    code, text, err = simulate_cli(capsys, *judged_run["common"], "--judge", "scripted", "--shard", "1/2",
                                   "--jsonl", out / "s1.jsonl", "--resume")
    assert code == 2 and "another simulation" in err  # another judge: its verdicts would not be comparable
    code = shards.main([str(out / "s1.jsonl"), str(out / "s2.jsonl"), "--json", str(out / "all.json"),
                        "--junit", str(out / "all.xml"), "--min-pass-rate", "0.6"])
    _, err = capsys.readouterr()
    assert code == 1 and "below --min-pass-rate 60.0%" in err
    merged = json.loads((out / "all.json").read_text(encoding="utf-8"))
    assert verdicts(merged) == EXPECTED and merged["summary"]["judge"]["pass"] == 2
    assert ET.parse(out / "all.xml").getroot().get("failures") == "3"


def test_the_key_is_in_no_output_report_or_cache(judged_run: Dict[str, Any], capsys: pytest.CaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    out = judged_run["dir"]
    secret = "sk-judge-SECRET-7c1d2e3f4a5b"
    monkeypatch.setenv("MY_JUDGE_KEY", secret)
    with FakeChatServer(require_key=secret) as server:
        code, text, err = simulate_cli(capsys, *judged_run["common"], "--judge", "m", "--judge-url", server.base_url,
                                       "--judge-key-env", "MY_JUDGE_KEY", "--model-cache", out / "cache",
                                       "--json", out / "r.json", "--html", out / "r.html", "--junit", out / "j.xml",
                                       "--jsonl", out / "r.jsonl")
        assert code == 0, err
        assert {r.headers["authorization"] for r in server.requests} == {f"Bearer {secret}"}
    monkeypatch.setenv("MY_JUDGE_KEY", secret[:-1])  # a wrong key: the server's 401 echoes what it got
    with FakeChatServer(require_key=secret) as server:
        code, text2, err2 = simulate_cli(capsys, *judged_run["common"], "--judge", "m", "--judge-url",
                                         server.base_url, "--judge-key-env", "MY_JUDGE_KEY", "--no-model-cache",
                                         "--json", out / "wrong.json")
    assert "401" in json.loads((out / "wrong.json").read_text(encoding="utf-8"))["runs"][0]["judge"]["error"]
    written = [p.read_text(encoding="utf-8") for p in out.rglob("*") if p.is_file()]
    for text_ in [text, err, text2, err2, *written]:
        assert secret not in text_ and secret[:-1] not in text_


def test_many_rows_judged_beside_the_run(tmp_path: pathlib.Path, scripted: Tuple[pathlib.Path, pathlib.Path],
                                         capsys: pytest.CaptureFixture) -> None:
    """120 rows at --jobs 32 with 8 judge requests at once: every row judged once, the limit held."""
    agent, _ = scripted
    dataset = write_csv(tmp_path / "many.csv", [dict(ROWS[i % 5]) for i in range(120)])
    fixtures = tmp_path / "fixtures.json"
    fixtures.write_text(json.dumps(FIXTURES_DOC), encoding="utf-8")
    with FakeChatServer([Reply(delay=0.02)]) as server:
        code, _, err = simulate_cli(capsys, "--csv", dataset, "--code", agent, "--responses", fixtures, "--jobs", "32",
                                    "--judge", "m", "--judge-url", server.base_url, "--judge-jobs", "8",
                                    "--no-model-cache", "--json", tmp_path / "r.json")
        assert code == 0, err
        assert len(server.requests) == 120 and server.max_active <= 8
    report = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert [r["row"] for r in report["runs"]] == list(range(1, 121))
    assert verdicts(report) == EXPECTED * 24


def test_parse_rate_and_junit_escaping() -> None:
    assert gate.parse_rate("0.8") == 0.8 and gate.parse_rate("80%") == 0.8 and gate.parse_rate(" 1 ") == 1.0
    for bad in ("", "abc", "-0.1", "101%", "0.8.1"):
        with pytest.raises(ValueError, match="--min-pass-rate"):
            gate.parse_rate(bad)
    result = {"dataset": {"file": "d.csv"}, "runs": [
        {"row": 1, "user_instruction": "a <b> & \x01 \"c\"", "duration_ms": 1500,
         "judge": {"verdict": "FAIL", "failure_mode": "x", "task_completion": 1, "explanation": "bad \x02 <thing>"}},
        {"row": 2, "status": "invalid", "errors": ["bad cell"]}]}
    root = ET.fromstring(gate.junit_xml(result))
    cases = root.findall("testsuite/testcase")
    assert cases[0].get("name") == 'row 1: a <b> & \ufffd "c"' and cases[0].get("time") == "1.500"
    assert cases[0].find("failure").get("message") == "bad \ufffd <thing>"
    assert "dataset check rejected" in cases[1].find("error").get("message")
    assert gate.gate_failure(result, 0.0) is None or gate.pass_rate(result["runs"]) == 0.0


def test_the_demo_is_judged_offline(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    from conformance.project import demo

    code = demo.main(["--json", str(tmp_path / "demo.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads((tmp_path / "demo.json").read_text(encoding="utf-8"))
    assert all(r["judge"]["verdict"] in ("PASS", "FAIL") and r["judge"]["model"] == "scripted" for r in report["runs"])
    refusal = next(r for r in report["runs"] if r["expected_outcome"] == "refusal")
    assert refusal["judge"]["verdict"] == "FAIL"  # the sample's scripted agent loop carries the refund out
    assert "judge (scripted): pass rate" in out
