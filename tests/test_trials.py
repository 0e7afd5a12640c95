"""Trials (issue 41): simulate --trials K, pass^k and pass@k, the gate, JUnit, resume, shards and merge, the cache.

Offline: a scripted code-mode agent whose answer depends on the trial (it reads its run id from the proxy URL,
as the run ids of trial n follow those of trial n-1), judged by the kit's scripted judge, which passes "Order
4521 has shipped." and fails "I cannot do that, sorry." as ``correct_refusal_no_oracle``.
"""

from __future__ import annotations

import json
import pathlib
import xml.etree.ElementTree as ET
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest

from conformance.simulator import gate, shards, simulate
from tests.test_simulate import simulate_cli, without_timings, write_csv

# Each trial's run id is (trial - 1) * rows + row; the agent answers finals[trial - 1] (cycling).
TRIAL_AGENT = r'''
import json, os
import pipelines_port as pp


def agent(envelope):
    spec = json.loads(envelope.user_instruction)
    run_id = int(envelope.proxy_url.rstrip("/").rsplit("/", 1)[1])  # code mode: the run id is in the proxy URL
    trial = (run_id - spec["row"]) // spec["rows"] + 1
    with open(os.environ["TRIALS_TEST_LOG"], "a") as log:
        log.write(json.dumps({"row": spec["row"], "trial": trial, "run_id": run_id, "token": envelope.run_token,
                              "session_id": envelope.session_id}) + "\n")
    for name, args in spec.get("calls", []):
        pp.proxy_call(name, args, envelope=envelope, errors="return")
    final = spec["finals"][(trial - 1) % len(spec["finals"])]
    if spec.get("echo_run_id"):
        final += f" (run {run_id})"
    messages = [{"role": "user", "content": envelope.user_instruction}, {"role": "assistant", "content": final}]
    if envelope.session_id is not None:  # a model_as_user turn
        return pp.build_turn_reply(final, session_done=True)
    return pp.build_response(final, messages=messages)


run = pp.code_mode(agent)
'''
OK = "Order 4521 has shipped."
BAD = "I cannot do that, sorry."
STATE = json.dumps({"order": {"4521": {"status": "shipped"}}})
GET = ["get_order", {"order_id": "4521"}]
# Row 1 passes every trial, row 2 is flaky (2/3), row 3 always fails, row 4 is flaky (1/3), row 5 always passes.
FINALS = [[OK], [OK, BAD, OK], [BAD], [BAD, BAD, OK], [OK]]


def dataset(path: pathlib.Path, finals: Sequence[Sequence[str]] = FINALS, **extra: Any) -> pathlib.Path:
    rows = [{"user": json.dumps({"row": i, "rows": len(finals), "finals": list(f), "calls": [GET], **extra}),
             "state": STATE} for i, f in enumerate(finals, 1)]
    return write_csv(path, rows)


@pytest.fixture
def trial_agent(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Dict[str, Any]:
    agent = tmp_path / "trial_agent.py"
    agent.write_text(TRIAL_AGENT, encoding="utf-8")
    log = tmp_path / "runs.log"
    log.write_text("", encoding="utf-8")
    monkeypatch.setenv("TRIALS_TEST_LOG", str(log))
    return {"agent": agent, "log": log, "dir": tmp_path}


def logged(log: pathlib.Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]


def load(path: pathlib.Path) -> Dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def scores(report: Dict[str, Any]) -> List[Tuple[Any, List[Optional[str]]]]:
    return [(r.row, r.verdicts()) for r in gate.row_verdicts(report["runs"], report["summary"]["trials"])]


EXPECTED = [(1, ["PASS"] * 3), (2, ["PASS", "FAIL", "PASS"]), (3, ["FAIL"] * 3), (4, ["FAIL", "FAIL", "PASS"]),
            (5, ["PASS"] * 3)]


def test_flaky_rows_over_three_trials_in_every_report(trial_agent: Dict[str, Any],
                                                      capsys: pytest.CaptureFixture) -> None:
    out = trial_agent["dir"]
    code, text, err = simulate_cli(capsys, "--csv", dataset(out / "rows.csv"), "--code", trial_agent["agent"],
                                   "--judge", "scripted", "--trials", "3", "--jobs", "4", "--json", out / "r.json",
                                   "--html", out / "r.html", "--junit", out / "r.xml")
    assert code == 0, err
    report = load(out / "r.json")
    runs = report["runs"]
    assert [(r["row"], r["trial"]) for r in runs] == [(row, t) for row in range(1, 6) for t in (1, 2, 3)]
    assert [r["run_id"] for r in runs] == [(t - 1) * 5 + row for row in range(1, 6) for t in (1, 2, 3)]
    assert all(r["task_id"] == r["row"] for r in runs)  # the task is the row; each trial is a run of it
    assert scores(report) == EXPECTED
    summary = report["summary"]
    assert (summary["runs"], summary["trials"]) == (15, 3)
    judged = summary["judge"]
    assert (judged["pass"], judged["fail"], judged["pass_rate"]) == (9, 6, 0.6)  # PASS over runs, as before
    assert (judged["pass_hat_k"], judged["pass_at_k"], judged["flaky"]) == (0.4, 0.8, 2)
    # each trial is a run of its own: its own token, and every agent call saw the row's state afresh
    seen = logged(trial_agent["log"])
    assert len(seen) == 15 and len({s["token"] for s in seen}) == 15
    assert all(r["tool_calls"][0]["response"]["status"] == "shipped" for r in runs)
    # the text report: each row's passes out of K, the flaky ones marked, pass^k and pass@k
    assert "row 2 (line 3) trial 2/3  ran" in text
    assert "row 2 (line 3)  2/3 passed  FLAKY  [PASS, FAIL correct_refusal_no_oracle, PASS]" in text
    assert "row 1 (line 2)  3/3 passed  [PASS, PASS, PASS]" in text and "row 3 (line 4)  0/3 passed  [FAIL" in text
    assert "15 runs (5 rows, 3 trials each)" in text
    assert "pass^3 40.0% (rows that passed every trial), pass@3 80.0%" in text and "2 flaky row(s)" in text
    assert "[15/15]" in err and "runs/s" in err and "trial 3/3" in err
    # the HTML report: the rows' table, a pill per trial, the flaky filter, an anchor per run
    page = (out / "r.html").read_text(encoding="utf-8")
    assert '<table class="trials" id="trials">' in page and page.count('<tr data-row="') == 5
    assert 'id="row-2"' in page and 'id="row-2-t2"' in page and 'id="row-2-t3"' in page and 'href="#row-4-t3"' in page
    assert '<option value="flaky">' in page and "pass^3 40.0%" in page and "pass@3 80.0%" in page
    assert page.count('data-tags="ran pass flaky"') == 3  # rows 2 and 4: their three PASS runs
    assert page.count('data-tags="ran fail mode-correct-refusal-no-oracle flaky"') == 3
    # JUnit: one testcase per row, failed unless every trial passed, the trials' verdicts in the message
    suite = ET.parse(out / "r.xml").getroot().find("testsuite")
    assert suite is not None and (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("5", "3", "0")
    cases = suite.findall("testcase")
    assert [c.find("failure") is not None for c in cases] == [False, True, True, True, False]
    failure = cases[1].find("failure")
    assert failure is not None and failure.get("type") == "correct_refusal_no_oracle"
    assert failure.get("message") == ("2/3 trials passed (flaky): trial 1 PASS, trial 2 FAIL "
                                      "correct_refusal_no_oracle, trial 3 PASS")
    assert "trial 2: FAIL 2/5 correct_refusal_no_oracle" in (failure.text or "")
    passed = cases[0].find("system-out")
    assert passed is not None and (passed.text or "").startswith("3/3 trials passed: trial 1 PASS")


def run(*, row: int, trial: int, verdict: Optional[str], mode: Optional[str] = None) -> Dict[str, Any]:
    judge = {"verdict": verdict, "failure_mode": mode} if verdict else {"verdict": None, "error": "HTTP 503"}
    return {"row": row, "trial": trial, "user_instruction": f"task {row}", "duration_ms": 100, "judge": judge}


def test_pass_hat_k_and_pass_at_k_arithmetic() -> None:
    runs = [run(row=1, trial=t, verdict="PASS") for t in (1, 2, 3, 4)]
    runs += [run(row=2, trial=1, verdict="PASS"), run(row=2, trial=2, verdict=None),
             run(row=2, trial=3, verdict="PASS"), run(row=2, trial=4, verdict="PASS")]
    runs += [run(row=3, trial=t, verdict="FAIL", mode="x") for t in (1, 2, 3, 4)]
    runs += [run(row=4, trial=t, verdict="PASS") for t in (1, 2, 3)]  # its fourth trial never ran (Ctrl-C)
    assert gate.pass_rate(runs) == round(10 / 15, 4)
    assert gate.pass_hat_k(runs, 4) == 0.25  # row 1 only: a trial not judged or not run is not a pass
    assert gate.pass_at_k(runs) == 0.75
    summary = gate.judge_summary(runs, 4)
    assert summary is not None and (summary["pass_hat_k"], summary["pass_at_k"], summary["flaky"]) == (0.25, 0.75, 2)
    rows = gate.row_verdicts(runs, 4)
    assert [(r.score, r.passed_all, r.flaky) for r in rows] == [
        ("4/4", True, False), ("3/4", False, True), ("0/4", False, False), ("3/4", False, True)]
    assert gate.trials_of({"runs": runs}) == 4 and gate.trials_of({"runs": runs, "summary": {"trials": 5}}) == 5
    # without trials (a platform test run, or --trials 1): pass^1 = pass@1 = the pass rate, JUnit as it was
    single = [run(row=n, trial=1, verdict=v) for n, v in enumerate(["PASS", "FAIL", None, "PASS"], 1)]
    for one in single:
        del one["trial"]
    assert gate.pass_hat_k(single) == gate.pass_at_k(single) == gate.pass_rate(single) == 0.5
    root = ET.fromstring(gate.junit_xml({"runs": single}))
    assert [c[0].tag if len(c) else None for c in root.iter("testcase")] == ["system-out", "failure", "error",
                                                                           "system-out"]
    assert gate.pass_hat_k([]) == gate.pass_at_k([]) == 0.0
    # a row not judged in one trial and FAILed in none is an error in JUnit, with every trial's verdict
    root = ET.fromstring(gate.junit_xml({"runs": runs, "summary": {"trials": 4}}))
    cases = root.findall("testsuite/testcase")
    error = cases[1].find("error")
    assert error is not None and error.get("type") == "not_judged"
    assert error.get("message") == ("3/4 trials passed (flaky): trial 1 PASS, trial 2 not judged, trial 3 PASS, "
                                    "trial 4 PASS")
    missing = cases[3].find("error")
    assert missing is not None and "trial 4 not run" in (missing.get("message") or "")
    assert root.find("testsuite").get("tests") == "4"  # type: ignore[union-attr]
    failure = gate.pass_hat_k_failure({"runs": runs, "summary": {"trials": 4}}, 0.5)
    assert failure == ("pass^4 25.0% (1 of 4 rows passed all 4 trials) is below --min-pass-hat-k 50.0% "
                       "(flaky: rows 2, 4)")
    with pytest.raises(ValueError, match="--min-pass-hat-k"):
        gate.parse_rate("1.5", "--min-pass-hat-k")


def test_the_gate_flags_and_their_exit_status(trial_agent: Dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    out = trial_agent["dir"]
    common = ["--csv", dataset(out / "rows.csv"), "--code", trial_agent["agent"], "--judge", "scripted",
              "--trials", "3"]
    code, _, err = simulate_cli(capsys, *common, "--min-pass-hat-k", "0.4", "--min-pass-rate", "60%")
    assert code == 0 and "pass^3 40.0% meets --min-pass-hat-k 40.0%" in err and "meets --min-pass-rate" in err
    code, _, err = simulate_cli(capsys, *common, "--min-pass-hat-k", "0.5", "--min-pass-rate", "0.6")
    assert code == 1 and "meets --min-pass-rate 60.0%" in err  # the pass rate holds; pass^k does not
    assert ("FAILED the gate: pass^3 40.0% (2 of 5 rows passed all 3 trials) is below --min-pass-hat-k 50.0% "
            "(flaky: rows 2, 4)") in err
    code, _, err = simulate_cli(capsys, *common, "--min-pass-rate", "0.7")
    assert code == 1 and "pass rate 60.0% (9 of 15 runs) is below --min-pass-rate 70.0%" in err
    bad = [([*common, "--min-pass-hat-k", "2"], "--min-pass-hat-k: '2' is not between 0 and 1"),
           ([*common[:-4], "--min-pass-hat-k", "0.5"], "--min-pass-hat-k go(es) with --judge MODEL"),
           ([*common[:-1], "0"], "--trials must be between 1 and 100, got 0"),
           ([*common[:-1], "101"], "--trials must be between 1 and 100, got 101")]
    for argv, words in bad:
        code, _, err = simulate_cli(capsys, *argv)
        assert code == 2 and words in err and "Traceback" not in err, err
    # merge gates the same way, from the shards' files
    for k in (1, 2):
        assert simulate_cli(capsys, *common, "--shard", f"{k}/2", "--jsonl", out / f"s{k}.jsonl")[0] == 0
    files = [out / "s1.jsonl", out / "s2.jsonl"]
    code, _, err = simulate_cli_merge(capsys, *files, "--min-pass-hat-k", "0.5")
    assert code == 1 and "merge: FAILED the gate: pass^3 40.0%" in err
    code, _, err = simulate_cli_merge(capsys, *files, "--min-pass-hat-k", "40%")
    assert code == 0 and "merge: pass^3 40.0% meets --min-pass-hat-k 40.0%" in err
    code, _, err = simulate_cli_merge(capsys, *files, "--min-pass-hat-k", "x")
    assert code == 2 and "--min-pass-hat-k: expected a fraction" in err


def simulate_cli_merge(capsys: pytest.CaptureFixture, *argv: Any) -> Tuple[int, str, str]:
    code = shards.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_shards_and_merge_carry_trials(trial_agent: Dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    out = trial_agent["dir"]
    common = ["--csv", dataset(out / "rows.csv"), "--code", trial_agent["agent"], "--judge", "scripted",
              "--trials", "3"]
    assert simulate_cli(capsys, *common, "--json", out / "whole.json")[0] == 0
    units = []
    for k in (1, 2, 3, 4):
        code, _, err = simulate_cli(capsys, *common, "--shard", f"{k}/4", "--jsonl", out / f"s{k}.jsonl", "--junit",
                                    out / f"s{k}.xml")
        assert code == 0, err
        assert f"simulate: shard {k}/4: {2 if k == 1 else 1} of 5 rows, 3 trials each" in err
        records = [json.loads(line) for line in (out / f"s{k}.jsonl").read_text(encoding="utf-8").splitlines()]
        units.append([(r["row"], r["trial"]) for r in records[1:]])
    assert [len(u) for u in units] == [6, 3, 3, 3]  # rows 1 and 5, 2, 3, 4: each with its three trials
    assert sorted(unit for shard in units for unit in shard) == [(row, t) for row in range(1, 6) for t in (1, 2, 3)]
    assert units[0] == [(1, 1), (1, 2), (1, 3), (5, 1), (5, 2), (5, 3)]
    # a shard's own JUnit holds whole rows: shard 1's rows 1 and 5 passed every trial, shard 2's row 2 is flaky
    for k, expected in ((1, ("2", "0")), (2, ("1", "1"))):
        shard_suite = ET.parse(out / f"s{k}.xml").getroot().find("testsuite")
        assert shard_suite is not None and (shard_suite.get("tests"), shard_suite.get("failures")) == expected
    files = [out / f"s{k}.jsonl" for k in (3, 1, 4, 2)]
    code, _, err = simulate_cli_merge(capsys, *files, "--json", out / "all.json", "--junit", out / "all.xml")
    assert code == 0, err
    whole, merged = load(out / "whole.json"), load(out / "all.json")
    assert without_timings(merged) == without_timings(whole)
    assert merged["summary"] == whole["summary"] and scores(merged) == EXPECTED
    suite = ET.parse(out / "all.xml").getroot().find("testsuite")
    assert suite is not None and (suite.get("tests"), suite.get("failures")) == ("5", "3")
    code, _, err = simulate_cli_merge(capsys, *files[:3])
    assert code == 2 and "3 of 15 runs have no record (row 2 trial 1, row 2 trial 2, row 2 trial 3)" in err
    # a --trials 1 shard and a --trials 3 shard are not one simulation
    assert simulate_cli(capsys, *common[:-2], "--shard", "2/4", "--jsonl", out / "k1.jsonl")[0] == 0
    code, _, err = simulate_cli_merge(capsys, out / "s1.jsonl", out / "k1.jsonl")
    assert code == 2 and "come from different simulations: the options" in err and '"trials": 3' in err


def test_resume_runs_only_the_missing_trials(trial_agent: Dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    out = trial_agent["dir"]
    common = ["--csv", dataset(out / "rows.csv"), "--code", trial_agent["agent"], "--judge", "scripted",
              "--trials", "3", "--jsonl", out / "run.jsonl"]
    assert simulate_cli(capsys, *common, "--json", out / "first.json")[0] == 0
    lines = (out / "run.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    # what a crash mid-way leaves: some trials of some rows recorded, the last record cut short
    lost = {(2, 2), (2, 3), (4, 1), (5, 3)}
    kept = [line for line in lines[1:] if (json.loads(line)["row"], json.loads(line)["trial"]) not in lost]
    (out / "run.jsonl").write_text(lines[0] + "".join(kept) + lines[-1][:40], encoding="utf-8")
    trial_agent["log"].write_text("", encoding="utf-8")
    code, _, err = simulate_cli(capsys, *common, "--resume", "--json", out / "resumed.json")
    assert code == 0, err
    assert "11 run(s) already in" in err and "4 to run" in err and "cut short" in err
    assert sorted((s["row"], s["trial"]) for s in logged(trial_agent["log"])) == sorted(lost)  # only those ran
    records = [json.loads(line) for line in (out / "run.jsonl").read_text(encoding="utf-8").splitlines()[1:]]
    assert sorted((r["row"], r["trial"]) for r in records) == [(row, t) for row in range(1, 6) for t in (1, 2, 3)]
    resumed, first = load(out / "resumed.json"), load(out / "first.json")
    assert without_timings(resumed) == without_timings(first) and scores(resumed) == EXPECTED
    # the same file cannot be continued by a simulation of another K
    code, _, err = simulate_cli(capsys, *common[:-4], "--trials", "2", "--jsonl", out / "run.jsonl", "--resume")
    assert code == 2 and "another simulation: the options" in err


def test_the_judges_cache_answers_a_trial_only_with_the_same_case(trial_agent: Dict[str, Any],
                                                                   capsys: pytest.CaptureFixture) -> None:
    """Trials whose runs showed the judge exactly the same case share its answer; any difference (a trial's run id
    in the answer) is a case of its own, and a re-run replays each trial's own verdict."""
    out = trial_agent["dir"]
    cache = out / "cache"
    common = ["--code", trial_agent["agent"], "--judge", "scripted", "--model-cache", cache, "--trials", "3",
              "--jobs", "1", "--judge-jobs", "1"]
    assert simulate_cli(capsys, "--csv", dataset(out / "rows.csv"), *common, "--json", out / "a.json")[0] == 0
    first = load(out / "a.json")
    assert scores(first) == EXPECTED  # a flaky row's trials got their own verdicts
    # the same case asked once: rows 1, 3 and 5 repeat theirs three times, rows 2 and 4 one of theirs twice
    assert first["summary"]["judge"]["usage"]["requests"] == 7 and first["summary"]["judge"]["usage"]["cached"] == 8
    cached = [(r["row"], r["trial"]) for r in first["runs"] if r["judge"].get("cached")]
    assert cached == [(1, 2), (1, 3), (2, 3), (3, 2), (3, 3), (4, 2), (5, 2), (5, 3)]
    assert simulate_cli(capsys, "--csv", dataset(out / "rows.csv"), *common, "--json", out / "b.json")[0] == 0
    again = load(out / "b.json")
    assert scores(again) == EXPECTED and again["summary"]["judge"]["usage"] == {
        "requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cached": 15}
    # an agent whose answer names its run: no two trials' cases are the same, so none shares a verdict
    echo = dataset(out / "echo.csv", echo_run_id=True)
    assert simulate_cli(capsys, "--csv", echo, *common, "--json", out / "c.json")[0] == 0
    echoed = load(out / "c.json")
    assert scores(echoed) == EXPECTED and echoed["summary"]["judge"]["usage"]["requests"] == 15


def test_sessions_get_a_session_of_their_own_per_trial(trial_agent: Dict[str, Any],
                                                       capsys: pytest.CaptureFixture) -> None:
    out = trial_agent["dir"]
    data = dataset(out / "rows.csv", [[OK], [OK]])
    common = ["--csv", data, "--code", trial_agent["agent"], "--turn-mode", "model_as_user", "--user-model",
              "scripted", "--trials", "2", "--json", out / "r.json"]
    assert simulate_cli(capsys, *common)[0] == 0
    report = load(out / "r.json")
    sessions = [r["session"]["session_id"] for r in report["runs"]]
    assert len(set(sessions)) == 4 and all(s.startswith(f"sim-{r['run_id']}-") for s, r in zip(sessions,
                                                                                               report["runs"]))
    assert {s["session_id"] for s in logged(trial_agent["log"])} == set(sessions)  # every turn sent its run's
    assert simulate_cli(capsys, *common)[0] == 0  # a re-run sends the same ids (so its answers replay)
    assert [r["session"]["session_id"] for r in load(out / "r.json")["runs"]] == sessions


def test_run_ids_follow_the_rows_trial_after_trial() -> None:
    assert [simulate.run_id_of(row, trial, 4) for trial in (1, 2, 3) for row in (1, 2, 3, 4)] == list(range(1, 13))
    assert shards.shard_units([1, 2], 1, None) == [(1, 1), (2, 1)]
    assert shards.shard_units([1, 2, 3, 4, 5], 2, shards.Shard(2, 3)) == [(2, 1), (2, 2), (5, 1), (5, 2)]
