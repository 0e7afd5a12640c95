"""Regressions against a baseline (issue 41): pipelines-port compare OLD.json NEW.json, simulate --baseline.

Offline: reports of real simulations judged by the scripted judge (it passes "Order 4521 has shipped." and fails
"I cannot do that, sorry."), the agent told by an environment variable which rows to break, so that a row keeps
its seed while its verdict moves; and reports written by hand for the arithmetic of shares and trials.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest

from conformance import cli
from conformance.simulator import compare
from tests.test_simulate import ROOT, simulate_cli, write_csv
from tests.test_trials import FINALS, dataset, trial_agent  # noqa: F401 - a fixture

AGENT = r'''
import json, os
import pipelines_port as pp


def agent(envelope):
    spec = json.loads(envelope.user_instruction)
    with open(os.environ["COMPARE_TEST_LOG"], "a") as log:
        log.write(spec["id"] + "\n")
    pp.proxy_call("get_order", {"order_id": "4521"}, envelope=envelope, errors="return")
    broken = spec["id"] in json.loads(os.environ.get("COMPARE_TEST_BROKEN", "[]"))
    fixed = spec["id"] in json.loads(os.environ.get("COMPARE_TEST_FIXED", "[]"))
    return pp.build_response("I cannot do that, sorry." if broken else "Order 4521 has shipped." if fixed
                             else spec["final"])


run = pp.code_mode(agent)
'''
OK = "Order 4521 has shipped."
BAD = "I cannot do that, sorry."
STATE = json.dumps({"order": {"4521": {"status": "shipped"}}})


def row(name: str, final: str = OK, state: str = STATE, **cells: str) -> Dict[str, str]:
    return {"user": json.dumps({"id": name, "final": final}), "state": state, **cells}


BASELINE = [row("a"), row("b"), row("c", BAD), row("d"), row("e", expected_outcome="completion")]


@pytest.fixture
def agent(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Dict[str, Any]:
    path = tmp_path / "agent.py"
    path.write_text(AGENT, encoding="utf-8")
    log = tmp_path / "ran.log"
    log.write_text("", encoding="utf-8")
    monkeypatch.setenv("COMPARE_TEST_LOG", str(log))
    monkeypatch.delenv("COMPARE_TEST_BROKEN", raising=False)
    monkeypatch.delenv("COMPARE_TEST_FIXED", raising=False)
    return {"agent": path, "log": log, "dir": tmp_path, "env": monkeypatch}


def judged(capsys: pytest.CaptureFixture, agent: Dict[str, Any], rows: List[Dict[str, str]], name: str,
           *extra: Any) -> Tuple[int, pathlib.Path, str, str]:
    out = agent["dir"]
    data = write_csv(out / f"{name}.csv", rows)
    report = out / f"{name}.json"
    code, text, err = simulate_cli(capsys, "--csv", data, "--code", agent["agent"], "--judge", "scripted",
                                   "--json", report, *extra)
    return code, report, text, err


def run_compare(capsys: pytest.CaptureFixture, *argv: Any) -> Tuple[int, str, str]:
    code = compare.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_rows_are_matched_by_their_seed_not_their_number(agent: Dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    code, old, _, err = judged(capsys, agent, BASELINE, "old")
    assert code == 0, err
    # the same rows reordered, one inserted: nothing regressed, nothing fixed, one added
    moved = [BASELINE[4], BASELINE[2], row("new"), BASELINE[0], BASELINE[3], BASELINE[1]]
    code, new, _, err = judged(capsys, agent, moved, "moved")
    assert code == 0, err
    code, text, err = run_compare(capsys, old, new, "--json", agent["dir"] / "c.json")
    assert code == 0, err
    result = json.loads((agent["dir"] / "c.json").read_text(encoding="utf-8"))
    assert (result["regressed"], result["fixed"], result["removed"], result["unchanged"]) == ([], [], [], 5)
    assert result["added"] == [{"row": {"before": None, "after": 3}, "user_instruction": row("new")["user"],
                                "before": None, "after": "1/1", "failure_modes": {"before": None, "after": []}}]
    assert result["notes"] == [] and "0 regressed, 0 fixed, 5 unchanged, 1 added, 0 removed" in text
    # now row d breaks (its seed unchanged), row b's state changes (another seed), row c is fixed by a change
    # of the agent, and the expected outcome row e gave explicitly is dropped (another seed: the judge sees less)
    agent["env"].setenv("COMPARE_TEST_BROKEN", json.dumps(["d"]))
    agent["env"].setenv("COMPARE_TEST_FIXED", json.dumps(["c"]))
    changed_state = json.dumps({"order": {"4521": {"status": "paid"}}})
    rows = [BASELINE[0], row("b", state=changed_state), BASELINE[2], BASELINE[3], row("e")]
    code, newer, _, err = judged(capsys, agent, rows, "newer")
    assert code == 0, err
    regressions = json.loads(newer.read_text(encoding="utf-8"))
    assert [r["judge"]["verdict"] for r in regressions["runs"]] == ["PASS", "PASS", "PASS", "FAIL", "PASS"]
    code, text, err = run_compare(capsys, old, newer, "--json", "-")
    assert code == 0, err
    result = json.loads(text)
    assert result["regressed"] == [{"row": {"before": 4, "after": 4}, "user_instruction": row("d")["user"],
                                    "before": "1/1", "after": "0/1",
                                    "failure_modes": {"before": [], "after": ["correct_refusal_no_oracle"]}}]
    assert result["fixed"] == [{"row": {"before": 3, "after": 3}, "user_instruction": row("c", BAD)["user"],
                                "before": "0/1", "after": "1/1",
                                "failure_modes": {"before": ["correct_refusal_no_oracle"], "after": []}}]
    assert result["unchanged"] == 1  # row a
    assert [(e["row"], e["before"], e["after"]) for e in result["removed"]] == [
        ({"before": 2, "after": None}, "1/1", None), ({"before": 5, "after": None}, "1/1", None)]
    assert [(e["row"], e["after"]) for e in result["added"]] == [({"before": None, "after": 2}, "1/1"),
                                                                 ({"before": None, "after": 5}, "1/1")]
    code, text, _ = run_compare(capsys, old, newer, "--fail-on-regression", "--html", agent["dir"] / "c.html")
    assert code == 1 and "1 regressed, 1 fixed, 1 unchanged, 2 added, 2 removed" in text
    assert "  row 4  1/1 -> 0/1  " in text and "[after: correct_refusal_no_oracle]" in text
    page = (agent["dir"] / "c.html").read_text(encoding="utf-8")
    assert '<table class="trials regressed">' in page and "1 regressed" in page and "correct_refusal_no_oracle" in page
    assert run_compare(capsys, old, old, "--fail-on-regression")[0] == 0


def test_trials_compare_by_their_share_of_passing_trials(trial_agent: Dict[str, Any],  # noqa: F811
                                                         capsys: pytest.CaptureFixture) -> None:
    out = trial_agent["dir"]
    common = ["--csv", dataset(out / "rows.csv"), "--code", trial_agent["agent"], "--judge", "scripted"]
    assert simulate_cli(capsys, *common, "--json", out / "one.json")[0] == 0  # trial 1 alone: rows 1, 2, 5 pass
    code, text, err = simulate_cli(capsys, *common, "--trials", "3", "--json", out / "three.json", "--baseline",
                                   out / "one.json", "--fail-on-regression")
    assert code == 1 and "FAILED --fail-on-regression: 1 row(s) regressed against" in err
    assert text.index("NOTE: different trials: 1 per row before, 3 after") > text.index("pass^3 40.0%")  # after
    assert "1 regressed, 1 fixed, 3 unchanged, 0 added, 0 removed" in text
    assert "  row 2  1/1 -> 2/3  " in text and "  row 4  0/1 -> 1/3  " in text
    code, text, _ = run_compare(capsys, out / "one.json", out / "three.json", "--json", "-")
    result = json.loads(text)
    assert [(e["row"]["after"], e["before"], e["after"], e["failure_modes"]["after"]) for e in result["regressed"]] \
        == [(2, "1/1", "2/3", ["correct_refusal_no_oracle"])]
    assert [(e["row"]["after"], e["before"], e["after"]) for e in result["fixed"]] == [(4, "0/1", "1/3")]
    assert result["after"]["trials"] == 3 and result["after"]["pass_hat_k"] == 0.4
    # --json - keeps stdout for the JSON report: the comparison goes to stderr
    code, text, err = simulate_cli(capsys, *common, "--json", "-", "--baseline", out / "three.json")
    assert code == 0 and json.loads(text)["kind"] == "pipelines_port.simulation"
    assert "1 regressed, 1 fixed, 3 unchanged" in err  # row 4: 1/3 -> 0/1; row 2: 2/3 -> 1/1


def report(*rows: Tuple[str, Sequence[Optional[str]]], judge: str = "scripted", prompt: str = "p1",
           trials: Optional[int] = None) -> Dict[str, Any]:
    """A judged report by hand: each row an instruction and its trials' verdicts (``None``: not judged)."""
    runs = []
    for number, (instruction, verdicts) in enumerate(rows, 1):
        for trial, verdict in enumerate(verdicts, 1):
            judged = {"verdict": verdict, "failure_mode": "incorrect_completion" if verdict == "FAIL" else None} \
                if verdict else {"verdict": None, "error": "HTTP 503"}
            runs.append({"row": number, "trial": trial, "status": "ok", "user_instruction": instruction,
                         "behavior_instructions": "", "initial_state": {}, "failure_rules": [],
                         "expected_outcome": "completion", "expected_outcome_given": False, "judge": judged})
    k = trials or max(len(v) for _, v in rows)
    return {"kind": "pipelines_port.simulation", "dataset": {"file": "t.csv"}, "judge": {
        "model": judge, "prompt_sha256": prompt}, "summary": {"trials": k}, "runs": runs}


def test_shares_of_passing_trials_and_plain_notes() -> None:
    p, f = "PASS", "FAIL"
    old = report(("a", [p, p, p]), ("b", [p, f, f]), ("c", [p, f, p]), ("d", [p, p, p]), ("same", [p, p, p]),
                 ("same", [f, f, f]))
    new = report(("a", [p, f, p]), ("b", [p, f, f]), ("c", [p, p, p]), ("d", [p, None, p]), ("same", [p, p, p]),
                 ("same", [p, f, f]))
    result = compare.compare(old, new)
    assert [(e["user_instruction"], e["before"], e["after"]) for e in result["regressed"]] == [
        ("a", "3/3", "2/3"), ("d", "3/3", "2/3")]  # a FAIL, and a trial not judged, are not passes
    assert result["regressed"][1]["failure_modes"] == {"before": [], "after": ["not judged"]}
    assert [(e["user_instruction"], e["before"], e["after"]) for e in result["fixed"]] == [
        ("c", "2/3", "3/3"), ("same", "0/3", "1/3")]  # rows of one seed are matched in order
    assert result["unchanged"] == 2 and result["notes"] == []
    stopped = compare.compare(report(("a", [p, p]), trials=3), report(("a", [p, p, p])))  # a trial never ran
    assert [(e["before"], e["after"], e["failure_modes"]["before"]) for e in stopped["fixed"]] == [
        ("2/3", "3/3", ["not run"])]
    one = report(("a", ["PASS"]), ("b", ["FAIL"]))
    three = report(("a", ["PASS"] * 3), ("b", ["FAIL"] * 3))
    same = compare.compare(one, three)
    assert same["unchanged"] == 2 and not same["regressed"] and not same["fixed"]  # 1/1 and 3/3: the same share
    assert same["notes"] == ["different trials: 1 per row before, 3 after; rows compare by their share of passing "
                             "trials"]
    other_judge = compare.compare(one, report(("a", ["PASS"]), ("b", ["FAIL"]), judge="gpt-4.1-mini"))
    assert other_judge["notes"][0].startswith("different judges: scripted before, gpt-4.1-mini after")
    other_rubric = compare.compare(one, report(("a", ["PASS"]), ("b", ["FAIL"]), prompt="p2"))
    assert other_rubric["notes"][0].startswith("different rubrics (--judge-prompt)")
    # a platform test run's report (pipelines-port test --json) compares too: its judge is the platform
    platform = {"kind": "pipelines_port.platform_test_run", "summary": {}, "runs": [
        {"row": n, "user_instruction": text, "expected_outcome": "completion", "status": "ok",
         "judge": {"verdict": verdict, "failure_mode": None if verdict == "PASS" else "incorrect_completion",
                   "model": "platform"}} for n, (text, verdict) in enumerate([("a", "PASS"), ("b", "FAIL")], 1)]}
    later = json.loads(json.dumps(platform))
    later["runs"].reverse()
    later["runs"][1]["judge"] = {"verdict": "FAIL", "failure_mode": "incorrect_completion", "model": "platform"}
    on_the_platform = compare.compare(platform, later)
    assert [(e["row"], e["before"], e["after"]) for e in on_the_platform["regressed"]] == [
        ({"before": 1, "after": 1}, "1/1", "0/1")]
    assert on_the_platform["unchanged"] == 1 and on_the_platform["before"]["judge"]["model"] == "platform"
    # a row the dataset check rejected has no seed: it is matched by its number
    rejected = {"row": 3, "status": "invalid", "errors": ["bad cell"], "tool_calls": []}
    a, b = report(("a", ["PASS"])), report(("a", ["PASS"]))
    a["runs"].append(dict(rejected))
    b["runs"].append(dict(rejected))
    assert compare.compare(a, b)["unchanged"] == 2


@pytest.mark.parametrize("content,words", [
    ("user,state\nhello,{}\n", "is not valid JSON"),
    ('[1, 2]', "is JSON, but no report"),
    ('{"kind": "pipelines_port.comparison", "regressed": []}', "is a 'pipelines_port.comparison' document"),
    ('{"kind": "pipelines_port.simulation", "runs": [{"row": 1, "status": "ok"}]}', "has no judge verdicts"),
    ('{"kind": "pipelines_port.simulation.header", "version": 1}\n{"kind": "pipelines_port.simulation.run"}\n',
     "is a simulate --jsonl result file: make it a report first"),
    (b"\xff\xfe not text", "not UTF-8"),
])
def test_a_file_that_cannot_be_compared_is_one_clear_line(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture,
                                                          content: Any, words: str) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(report(("a", ["PASS"]))), encoding="utf-8")
    bad = tmp_path / "bad.json"
    if isinstance(content, bytes):
        bad.write_bytes(content)
    else:
        bad.write_text(content, encoding="utf-8")
    for argv in ([bad, good], [good, bad]):
        code, out, err = run_compare(capsys, *argv, "--json", tmp_path / "c.json")
        assert code == 2 and words in err and err.startswith("compare: ") and err.count("\n") == 1, err
        assert "Traceback" not in err and out == "" and not (tmp_path / "c.json").exists()
    for missing in (tmp_path / "nothing.json", tmp_path):
        code, _, err = run_compare(capsys, missing, good)
        assert code == 2 and "cannot read" in err and "Traceback" not in err


def test_simulate_checks_its_baseline_before_anything_runs(agent: Dict[str, Any],
                                                          capsys: pytest.CaptureFixture) -> None:
    out = agent["dir"]
    data = write_csv(out / "rows.csv", BASELINE)
    unjudged = out / "unjudged.json"
    assert simulate_cli(capsys, "--csv", data, "--code", agent["agent"], "--json", unjudged)[0] == 0
    agent["log"].write_text("", encoding="utf-8")
    common = ["--csv", data, "--code", agent["agent"]]
    cases = [([*common, "--judge", "scripted", "--baseline", unjudged], "--baseline: ", "has no judge verdicts"),
             ([*common, "--judge", "scripted", "--baseline", out / "none.json"], "--baseline: cannot read", ""),
             ([*common, "--baseline", unjudged], "--baseline go(es) with --judge MODEL", ""),
             ([*common, "--judge", "scripted", "--fail-on-regression"], "--fail-on-regression goes with --baseline",
              ""),
             ([*common, "--judge", "scripted", "--baseline", unjudged, "--shard", "1/2"], "merge the shards' files",
              "")]
    for argv, words, more in cases:
        code, _, err = simulate_cli(capsys, *argv)
        assert code == 2 and words in err and more in err and "Traceback" not in err, err
    assert agent["log"].read_text(encoding="utf-8") == ""  # nothing ran


def test_compare_through_both_command_lines(agent: Dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    code, old, _, err = judged(capsys, agent, BASELINE, "old")
    assert code == 0, err
    agent["env"].setenv("COMPARE_TEST_BROKEN", json.dumps(["a"]))
    assert judged(capsys, agent, BASELINE, "new")[0] == 0
    new = agent["dir"] / "new.json"
    code = cli.main(["compare", str(old), str(new), "--fail-on-regression"])
    out, _ = capsys.readouterr()
    assert code == 1 and "1 regressed" in out and "  row 1  1/1 -> 0/1  " in out
    done = subprocess.run([sys.executable, "-m", "conformance", "compare", str(old), str(new), "--json", "-"],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and json.loads(done.stdout)["regressed"][0]["row"] == {"before": 1, "after": 1}
    helped = subprocess.run([sys.executable, "-m", "conformance", "compare", "--help"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "matched by their seed" in helped.stdout and "--fail-on-regression" in helped.stdout
