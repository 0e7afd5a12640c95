"""The JUnit of ``--trials K`` in ``junitparser``, the library CI result publishers (such as
EnricoMi/publish-unit-test-result-action) read JUnit with: one testcase per row, failed unless all its trials
passed, the trials' verdicts in the message; a row passed on every trial a passed case.

Skipped when ``junitparser`` is missing (``.ci/run`` installs it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from conformance.simulator import gate

junitparser = pytest.importorskip("junitparser", reason="needs junitparser")


def trial(row: int, n: int, verdict: Optional[str], mode: Optional[str] = None) -> Dict[str, Any]:
    judge = {"verdict": verdict, "task_completion": 5 if verdict == "PASS" else 2, "failure_mode": mode,
             "explanation": f"trial {n} of row {row}"} if verdict else {"verdict": None, "error": "HTTP 503"}
    return {"row": row, "trial": n, "user_instruction": f"task {row}", "duration_ms": 500, "judge": judge}


def test_trials_read_in_junitparser(tmp_path: Path) -> None:
    runs: List[Dict[str, Any]] = [trial(1, n, "PASS") for n in (1, 2, 3)]
    runs += [trial(2, 1, "PASS"), trial(2, 2, "FAIL", "incorrect_completion"), trial(2, 3, "PASS")]
    runs += [trial(3, 1, "PASS"), trial(3, 2, None), trial(3, 3, "PASS")]
    path = tmp_path / "results.xml"
    path.write_text(gate.junit_xml({"dataset": {"file": "tasks.csv"}, "summary": {"trials": 3}, "runs": runs}),
                    encoding="utf-8")
    xml = junitparser.JUnitXml.fromfile(str(path))
    suite = next(iter(xml)) if isinstance(xml, junitparser.JUnitXml) else xml
    assert (suite.tests, suite.failures, suite.errors) == (3, 1, 1)
    cases = list(suite)
    assert [c.name for c in cases] == ["row 1: task 1", "row 2: task 2", "row 3: task 3"]
    assert cases[0].is_passed and abs(cases[0].time - 1.5) < 1e-9  # the three trials' time
    assert "3/3 trials passed" in (cases[0].system_out or "")
    failure = cases[1].result[0]
    assert isinstance(failure, junitparser.Failure) and failure.type == "incorrect_completion"
    assert failure.message == "2/3 trials passed (flaky): trial 1 PASS, trial 2 FAIL incorrect_completion, trial 3 PASS"
    assert "trial 2: FAIL 2/5 incorrect_completion: trial 2 of row 2" in (failure.text or "")
    error = cases[2].result[0]
    assert isinstance(error, junitparser.Error) and error.type == "not_judged" and "trial 2 not judged" in error.message
