"""simulate beyond one machine (issue 25): --shard K/N, --jsonl, --resume, and merge.

- Three shards merged give the report of the whole run (same rows, statuses, outcomes, final responses,
  tool calls), the split balanced and the same on every re-run.
- A simulation killed mid-way (SIGKILL, a crash, even one that cut its last record short) and then resumed ends
  with every row recorded exactly once, and no recorded row run again.
- Bad input gets one clear line and exit status 2, and leaves every file as it was.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Tuple

import pytest

from conformance.simulator import shards
from conformance.simulator import simulate
from tests.test_simulate import FIXTURES, MINIMAL, ROOT, SAMPLE, SLOW_AGENT, many_rows, without_timings


def run_cli(main: Any, capsys: pytest.CaptureFixture, *argv: Any) -> Tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def records(path: pathlib.Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_three_shards_merged_equal_the_whole_run(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path) -> None:
    dataset = many_rows(tmp_path / "many.csv", 4)  # 20 rows
    common = ["--csv", dataset, "--code", MINIMAL, "--responses", FIXTURES]
    code, _, err = run_cli(simulate.main, capsys, *common, "--json", tmp_path / "whole.json")
    assert code == 0, err
    sizes = []
    for k in (1, 2, 3):
        code, _, err = run_cli(simulate.main, capsys, *common, "--shard", f"{k}/3", "--jsonl", tmp_path / f"s{k}.jsonl")
        assert code == 0, err
        progress = [line for line in err.splitlines() if line.startswith("[shard")]
        assert progress and all(line.startswith(f"[shard {k}/3] [") for line in progress)
        sizes.append(len(records(tmp_path / f"s{k}.jsonl")) - 1)
    assert sizes == [7, 7, 6]  # balanced
    code, _, err = run_cli(shards.main, capsys, tmp_path / "s2.jsonl", tmp_path / "s3.jsonl", tmp_path / "s1.jsonl",
                             "--json", tmp_path / "all.json", "--html", tmp_path / "all.html")
    assert code == 0, err
    whole = json.loads((tmp_path / "whole.json").read_text(encoding="utf-8"))
    merged = json.loads((tmp_path / "all.json").read_text(encoding="utf-8"))
    assert without_timings(merged) == without_timings(whole)  # every row: status, outcome, calls, final response
    assert merged["summary"] == whole["summary"] and merged["dataset"] == whole["dataset"]
    assert 'id="row-20"' in (tmp_path / "all.html").read_text(encoding="utf-8")
    # the split is a function of the dataset alone: a re-run of shard 2 takes the same rows
    code, _, _ = run_cli(simulate.main, capsys, *common, "--shard", "2/3", "--jsonl", tmp_path / "again.jsonl")
    assert [r["row"] for r in records(tmp_path / "again.jsonl")[1:]] == [r["row"] for r in
                                                                       records(tmp_path / "s2.jsonl")[1:]]


LOGGING_AGENT = SLOW_AGENT.replace('    time.sleep(0.3)\n', '''    with open(__import__("os").environ["SHARD_TEST_LOG"], "a") as log:
        log.write(envelope.user_instruction + "\\n")
    time.sleep(0.3)
''')


def test_a_run_killed_mid_way_then_resumed_records_every_row_exactly_once(tmp_path: pathlib.Path) -> None:
    agent = tmp_path / "slow.py"
    agent.write_text(LOGGING_AGENT, encoding="utf-8")
    log = tmp_path / "ran.log"
    dataset = many_rows(tmp_path / "many.csv", 2)  # 10 rows of 0.3 s, one at a time
    out = tmp_path / "run.jsonl"
    command = [sys.executable, "-m", "conformance", "simulate", "--csv", str(dataset), "--code", str(agent),
               "--jsonl", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SHARD_TEST_LOG": str(log)}
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not out.exists()
                                           or len(out.read_text(encoding="utf-8").splitlines()) < 4):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # a crash: no handler runs
    proc.wait(10)
    before = records(out)
    recorded = [r["run"]["user_instruction"] for r in before[1:]]
    assert 3 <= len(recorded) < 10
    with open(out, "a", encoding="utf-8") as f:  # and the crash cut a last record short
        f.write('{"kind": "pipelines_port.simulation.run", "row": 99, "run": {"sta')
    resumed = subprocess.run([*command, "--resume", "--json", str(tmp_path / "all.json")], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{len(recorded)} row(s) already in" in resumed.stderr and "cut short" in resumed.stderr
    after = records(out)
    assert [r["kind"] for r in after].count(shards.HEADER_KIND) == 1
    rows = [r["row"] for r in after[1:]]
    assert sorted(rows) == list(range(1, 11)) and len(rows) == len(set(rows))  # every row, exactly once
    ran = log.read_text(encoding="utf-8").splitlines()
    assert all(ran.count(instruction) == 1 for instruction in recorded)  # nothing recorded ran again
    report = json.loads((tmp_path / "all.json").read_text(encoding="utf-8"))
    assert report["summary"]["runs"] == 10 and [r["row"] for r in report["runs"]] == list(range(1, 11))


@pytest.mark.parametrize("shard,words", [("0/3", "between 1 and N"), ("4/3", "between 1 and N"),
                                         ("x/y", "expected K/N"), ("3", "expected K/N"), ("1/0", "between 1 and N")])
def test_bad_shards_are_one_clear_line(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path, shard: str,
                                       words: str) -> None:
    code, _, err = run_cli(simulate.main, capsys, "--csv", SAMPLE, "--code", MINIMAL, "--shard", shard,
                           "--jsonl", tmp_path / "out.jsonl")
    assert code == 2 and words in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()


def test_result_files_are_never_overwritten_or_mixed_up(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path) -> None:
    common = ["--code", MINIMAL, "--responses", FIXTURES]
    out = tmp_path / "run.jsonl"
    assert run_cli(simulate.main, capsys, "--csv", SAMPLE, *common, "--jsonl", out)[0] == 0
    kept = out.read_bytes()
    other = many_rows(tmp_path / "other.csv", 1)  # the same rows, another file: another dataset
    (tmp_path / "other.csv").write_text(other.read_text(encoding="utf-8") + "\n", encoding="utf-8")
    cases = [
        (["--csv", SAMPLE, *common, "--jsonl", out], "exists: add --resume"),
        (["--csv", other, *common, "--jsonl", out, "--resume"], "another simulation: the dataset"),
        (["--csv", SAMPLE, "--code", MINIMAL, "--jsonl", out, "--resume"], "another simulation: the options"),
        (["--csv", SAMPLE, *common, "--shard", "1/2", "--jsonl", out, "--resume"], "another simulation: the shard"),
        (["--csv", SAMPLE, *common, "--resume"], "--resume continues a --jsonl result file"),
    ]
    for argv, words in cases:
        code, _, err = run_cli(simulate.main, capsys, *argv)
        assert code == 2 and words in err and err.startswith("simulate: ") and "Traceback" not in err, err
        assert out.read_bytes() == kept  # untouched
    damaged = tmp_path / "damaged.jsonl"
    lines = kept.decode("utf-8").splitlines(keepends=True)
    damaged.write_text(lines[0] + "{not json\n" + "".join(lines[1:]), encoding="utf-8")
    code, _, err = run_cli(simulate.main, capsys, "--csv", SAMPLE, *common, "--jsonl", damaged, "--resume")
    assert code == 2 and "damaged.jsonl:2: not a JSON record" in err


def test_merge_names_overlaps_gaps_truncation_and_foreign_files(capsys: pytest.CaptureFixture,
                                                                tmp_path: pathlib.Path) -> None:
    common = ["--csv", SAMPLE, "--code", MINIMAL, "--responses", FIXTURES]
    for k in (1, 2):
        assert run_cli(simulate.main, capsys, *common, "--shard", f"{k}/2", "--jsonl", tmp_path / f"s{k}.jsonl")[0] == 0
    s1, s2 = tmp_path / "s1.jsonl", tmp_path / "s2.jsonl"
    code, _, err = run_cli(shards.main, capsys, s1, s1)
    assert code == 2 and "row 1 is in both" in err
    code, _, err = run_cli(shards.main, capsys, s1)
    assert code == 2 and "3 of 7 rows have no record (2, 4, 6)" in err and "--allow-partial" in err
    code, out, err = run_cli(shards.main, capsys, s1, "--allow-partial", "--json", "-")
    assert code == 0 and "warning: merge: 3 of 7 rows have no record" in err
    assert [r["row"] for r in json.loads(out)["runs"]] == [1, 3, 5, 7] and json.loads(out)["summary"]["not_run"] == 3
    cut = tmp_path / "cut.jsonl"
    text = s2.read_text(encoding="utf-8")
    cut.write_text(text[:-20], encoding="utf-8")  # the last record cut short by a crash
    code, _, err = run_cli(shards.main, capsys, s1, cut)
    assert code == 2 and "1 of 7 rows have no record (6)" in err and "cut.jsonl:4: a record cut short" in err
    foreign = tmp_path / "foreign.jsonl"
    other = many_rows(tmp_path / "other.csv", 1)
    assert run_cli(simulate.main, capsys, "--csv", other, "--code", MINIMAL, "--responses", FIXTURES,
                   "--shard", "2/2", "--jsonl", foreign)[0] == 0
    code, _, err = run_cli(shards.main, capsys, s1, foreign)
    assert code == 2 and "come from different simulations: the dataset" in err
    (tmp_path / "empty.jsonl").write_text("", encoding="utf-8")
    code, _, err = run_cli(shards.main, capsys, s1, tmp_path / "empty.jsonl")
    assert code == 2 and "no header record" in err and "Traceback" not in err


def test_a_changed_agent_is_refused_on_resume_and_by_merge(capsys: pytest.CaptureFixture,
                                                          tmp_path: pathlib.Path) -> None:
    """The header records the agent's file hash: an edited agent cannot continue, nor be merged with, old rows."""
    agent = tmp_path / "agent.py"
    agent.write_text(MINIMAL.read_text(encoding="utf-8"), encoding="utf-8")
    common = ["--csv", SAMPLE, "--responses", FIXTURES]
    out = tmp_path / "s1.jsonl"
    assert run_cli(simulate.main, capsys, *common, "--code", agent, "--shard", "1/2", "--jsonl", out)[0] == 0
    kept = out.read_bytes()
    agent.write_text(agent.read_text(encoding="utf-8") + "\n# edited after the first shard ran\n", encoding="utf-8")
    code, _, err = run_cli(simulate.main, capsys, *common, "--code", agent, "--shard", "1/2", "--jsonl", out,
                           "--resume")
    assert code == 2 and "another simulation: the agent" in err and "Traceback" not in err, err
    assert out.read_bytes() == kept  # untouched
    s2 = tmp_path / "s2.jsonl"
    assert run_cli(simulate.main, capsys, *common, "--code", agent, "--shard", "2/2", "--jsonl", s2)[0] == 0
    code, _, err = run_cli(shards.main, capsys, out, s2, "--json", tmp_path / "all.json")
    assert code == 2 and "come from different simulations: the agent" in err
    assert not (tmp_path / "all.json").exists()


def test_merge_through_both_command_lines(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path) -> None:
    """``pipelines-port merge`` (the kit's entry point, conformance.cli) and ``python3 -m conformance merge``."""
    from conformance import cli

    common = ["--csv", SAMPLE, "--code", MINIMAL, "--responses", FIXTURES]
    assert run_cli(simulate.main, capsys, *common, "--json", tmp_path / "whole.json")[0] == 0
    for k in (1, 2):
        assert run_cli(simulate.main, capsys, *common, "--shard", f"{k}/2", "--jsonl", tmp_path / f"s{k}.jsonl")[0] == 0
    files = [tmp_path / "s1.jsonl", tmp_path / "s2.jsonl"]
    code, _, err = run_cli(cli.main, capsys, "merge", *files, "--json", tmp_path / "a.json",
                           "--html", tmp_path / "a.html")
    assert code == 0, err
    done = subprocess.run([sys.executable, "-m", "conformance", "merge", *map(str, files), "--json",
                           str(tmp_path / "b.json"), "--html", str(tmp_path / "b.html")],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    whole = without_timings(json.loads((tmp_path / "whole.json").read_text(encoding="utf-8")))
    for name in ("a", "b"):
        assert without_timings(json.loads((tmp_path / f"{name}.json").read_text(encoding="utf-8"))) == whole
        assert 'id="row-5"' in (tmp_path / f"{name}.html").read_text(encoding="utf-8")
    bad = subprocess.run([sys.executable, "-m", "conformance", "merge", str(files[0])], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--allow-partial" in bad.stderr and "Traceback" not in bad.stderr
