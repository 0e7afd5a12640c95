"""Verdicts as a CI gate: the pass rate, pass^k, ``--min-pass-rate``, ``--min-pass-hat-k`` and JUnit XML, for any
report with judged runs.

A report (``simulate``, ``merge``, or a platform test run read back) lists ``runs``; a judged run carries
``"judge": {"verdict": "PASS" | "FAIL", "task_completion", "failure_mode", "instruction_adherence",
"explanation", "model"}``, or
``{"verdict": null, "error": "..."}`` when it could not be judged.  With ``simulate --trials K`` each row has K
runs (``"trial": 1..K``; ``summary.trials`` is K); a report without trials has one run per row.  The rules, the
same wherever a report comes from:

- the pass rate is PASS / runs: a run not judged (no judge, a judge that failed, a row not run) is not a pass;
- pass^k (``pass_hat_k``, as tau-bench has it) is the share of rows whose K trials all passed, pass@k
  (``pass_at_k``) the share of rows with at least one PASS; a trial that never ran is not a pass.  A row is
  *flaky* when some of its trials passed and some did not;
- ``--min-pass-rate F`` fails (exit status 1) when the pass rate is below F, ``--min-pass-hat-k F`` when pass^k is;
- JUnit: one ``<testcase>`` per row, passed when every trial passed; otherwise a ``<failure>`` when a trial
  FAILed, else an ``<error>`` (not judged), its message the judge's explanation or the reason (over K trials:
  each trial's verdict), as Jenkins, GitLab and the GitHub test reporters read it.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence

__all__ = ["VERDICTS", "verdict_of", "verdict_word", "RowVerdicts", "row_verdicts", "trials_of", "judge_summary",
           "adherence_summary", "usage_total", "pass_rate", "pass_hat_k", "pass_at_k", "parse_rate", "gate_failure",
           "pass_hat_k_failure", "junit_xml", "apply"]

VERDICTS = ("PASS", "FAIL")
NOT_JUDGED = "not judged"


def verdict_of(run: Mapping[str, Any]) -> Optional[str]:
    """``"PASS"``, ``"FAIL"``, or ``None`` when the run was not judged."""
    judge = run.get("judge")
    verdict = judge.get("verdict") if isinstance(judge, Mapping) else None
    return verdict if verdict in VERDICTS else None


def usage_total(runs: Sequence[Mapping[str, Any]], role: str) -> Dict[str, int]:
    """What one model-backed role (``judge``, ``simulator``, ``user``) spent over ``runs``."""
    total = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cached": 0}
    for run in runs:
        spent = (run.get("usage") or {}).get(role)
        if isinstance(spent, Mapping):
            for key in total:
                value = spent.get(key)
                total[key] += value if isinstance(value, int) and not isinstance(value, bool) else 0
    return total


class RowVerdicts(NamedTuple):
    """One row over its trials: its runs (in report order), how many passed, of how many trials it was to run."""

    row: Any
    runs: List[Mapping[str, Any]]
    passes: int
    trials: int

    @property
    def passed_all(self) -> bool:
        """pass^k for this row: every one of its trials ran and passed."""
        return self.passes >= self.trials

    @property
    def flaky(self) -> bool:
        """Some trials passed and some did not (FAIL, not judged, or never ran)."""
        return 0 < self.passes < self.trials

    @property
    def score(self) -> str:
        """Passes out of trials: ``"2/3"``."""
        return f"{self.passes}/{self.trials}"

    def verdicts(self) -> List[Optional[str]]:
        """Each run's verdict in trial order (``None``: not judged)."""
        return [verdict_of(run) for run in self.runs]


def row_verdicts(runs: Sequence[Mapping[str, Any]], trials: Optional[int] = None) -> List[RowVerdicts]:
    """Each row's verdicts over its trials, rows in the order of their first run; ``trials`` is K (default: the
    most runs any row has)."""
    rows: Dict[Any, List[Mapping[str, Any]]] = {}
    for run in runs:
        rows.setdefault(run.get("row"), []).append(run)
    k = trials or max((len(group) for group in rows.values()), default=1)
    return [RowVerdicts(row, group, sum(1 for run in group if verdict_of(run) == "PASS"), max(k, len(group)))
            for row, group in rows.items()]


def trials_of(result: Mapping[str, Any]) -> int:
    """K, the trials each row of a report was to run: ``summary.trials``, else the most runs any row has."""
    trials = (result.get("summary") or {}).get("trials")
    if isinstance(trials, int) and not isinstance(trials, bool) and trials >= 1:
        return trials
    return max((r.trials for r in row_verdicts(result.get("runs") or [])), default=1)


def judge_summary(runs: Sequence[Mapping[str, Any]], trials: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """The summary's ``judge`` part (``None`` when no run carries a judgement): counts, modes, rates, usage."""
    if not any("judge" in run for run in runs):
        return None
    counts = {"PASS": 0, "FAIL": 0, NOT_JUDGED: 0}
    modes: Dict[str, int] = {}
    for run in runs:
        verdict = verdict_of(run)
        counts[verdict or NOT_JUDGED] += 1
        mode = (run.get("judge") or {}).get("failure_mode") if verdict == "FAIL" else None
        if verdict == "FAIL":
            modes[str(mode) if mode else "(none given)"] = modes.get(str(mode) if mode else "(none given)", 0) + 1
    summary = {"pass": counts["PASS"], "fail": counts["FAIL"], "not_judged": counts[NOT_JUDGED],
               "pass_rate": pass_rate(runs), "pass_hat_k": pass_hat_k(runs, trials), "pass_at_k": pass_at_k(runs),
               "flaky": sum(1 for r in row_verdicts(runs, trials) if r.flaky),
               "failure_modes": dict(sorted(modes.items(), key=lambda kv: (-kv[1], kv[0]))),
               "usage": usage_total(runs, "judge")}
    summary["instruction_adherence"] = adherence_summary(runs)
    return summary


def adherence_summary(runs: Sequence[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """The mean ``instruction_adherence`` over the runs that have one (rows with behavior instructions, judged),
    and how many those are; ``None`` when none has."""
    scores = [score for run in runs for score in [(run.get("judge") or {}).get("instruction_adherence")]
              if isinstance(score, int) and not isinstance(score, bool)]
    return {"mean": round(sum(scores) / len(scores), 2), "runs": len(scores)} if scores else None


def _share(rows: Sequence[RowVerdicts], test: Callable[[RowVerdicts], bool]) -> float:
    return round(sum(1 for r in rows if test(r)) / len(rows), 4) if rows else 0.0


def pass_rate(runs: Sequence[Mapping[str, Any]]) -> float:
    """PASS / runs (0.0 for no runs): a run not judged counts as not passed."""
    return round(sum(1 for run in runs if verdict_of(run) == "PASS") / len(runs), 4) if runs else 0.0


def pass_hat_k(runs: Sequence[Mapping[str, Any]], trials: Optional[int] = None) -> float:
    """pass^k: the share of rows whose ``trials`` (K) trials all passed (0.0 for no rows)."""
    return _share(row_verdicts(runs, trials), lambda r: r.passed_all)


def pass_at_k(runs: Sequence[Mapping[str, Any]]) -> float:
    """pass@k: the share of rows with at least one PASS among their trials (0.0 for no rows)."""
    return _share(row_verdicts(runs), lambda r: r.passes > 0)


_RATE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(%?)\s*")


def parse_rate(text: str, option: str = "--min-pass-rate") -> float:
    """``"0.8"`` or ``"80%"`` as 0.8; raises ``ValueError`` naming ``option`` and the problem for anything else."""
    match = _RATE.fullmatch(text or "")
    if match is None:
        raise ValueError(f"{option}: expected a fraction from 0 to 1 (0.8) or a percentage (80%), got {text!r}")
    value = float(match.group(1)) / (100 if match.group(2) else 1)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{option}: {text!r} is not between 0 and 1 (or 0% and 100%)")
    return value


def gate_failure(result: Mapping[str, Any], min_pass_rate: float) -> Optional[str]:
    """Why the report fails ``--min-pass-rate`` (one line), or ``None`` when it passes."""
    runs = result.get("runs") or []
    rate = pass_rate(runs)
    if runs and rate >= min_pass_rate:
        return None
    passed = sum(1 for run in runs if verdict_of(run) == "PASS")
    not_judged = sum(1 for run in runs if verdict_of(run) is None)
    why = f" ({not_judged} not judged count as not passed)" if not_judged else ""
    unit = "runs" if trials_of(result) > 1 else "rows"
    return (f"pass rate {rate:.1%} ({passed} of {len(runs)} {unit}) is below --min-pass-rate {min_pass_rate:.1%}"
            + why)


def pass_hat_k_failure(result: Mapping[str, Any], min_pass_hat_k: float) -> Optional[str]:
    """Why the report fails ``--min-pass-hat-k`` (one line), or ``None`` when it passes."""
    k = trials_of(result)
    rows = row_verdicts(result.get("runs") or [], k)
    rate = _share(rows, lambda r: r.passed_all)
    if rows and rate >= min_pass_hat_k:
        return None
    passed = sum(1 for r in rows if r.passed_all)
    flaky = [str(r.row) for r in rows if r.flaky]
    why = f" (flaky: row{'s' if len(flaky) > 1 else ''} {', '.join(flaky[:10])}{' ...' if len(flaky) > 10 else ''})" \
        if flaky else ""
    return (f"pass^{k} {rate:.1%} ({passed} of {len(rows)} rows passed all {k} trial{'s' if k > 1 else ''}) is "
            f"below --min-pass-hat-k {min_pass_hat_k:.1%}" + why)


def _case_name(run: Mapping[str, Any]) -> str:
    text = " ".join(str(run.get("user_instruction") or "").split())
    return f"row {run.get('row')}" + (f": {text[:80]}{'...' if len(text) > 80 else ''}" if text else "")


def _xml_text(value: Any) -> str:
    """Text XML 1.0 can carry: the characters it forbids (most C0 controls) become U+FFFD."""
    return re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]", "\ufffd", str(value))


def junit_xml(result: Mapping[str, Any], *, suite: str = "pipelines-port") -> str:
    """The report as JUnit XML: one testsuite, one testcase per row (see the module docstring)."""
    rows = row_verdicts(result.get("runs") or [], trials_of(result))
    dataset = str((result.get("dataset") or {}).get("file") or "dataset")
    outcomes = [_row_outcome(row) for row in rows]
    seconds = sum(float(run.get("duration_ms") or 0) for row in rows for run in row.runs) / 1000
    attributes = {"name": _xml_text(f"{suite}: {dataset}"), "tests": str(len(rows)),
                  "failures": str(sum(1 for o in outcomes if o.tag == "failure")),
                  "errors": str(sum(1 for o in outcomes if o.tag == "error")), "skipped": "0",
                  "time": f"{seconds:.3f}"}
    root = ET.Element("testsuites", attributes)
    suite_element = ET.SubElement(root, "testsuite", dict(attributes, timestamp=str(result.get("started_at") or "")))
    for row, outcome in zip(rows, outcomes):
        case = ET.SubElement(suite_element, "testcase", {
            "classname": _xml_text(dataset), "name": _xml_text(_case_name(row.runs[0])),
            "time": f"{sum(float(run.get('duration_ms') or 0) for run in row.runs) / 1000:.3f}"})
        said = {} if outcome.tag == "system-out" else {"message": _xml_text(outcome.message[:1000]),
                                                        "type": _xml_text(outcome.type)}
        ET.SubElement(case, outcome.tag, said).text = _xml_text(outcome.text)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


class _Outcome(NamedTuple):
    """A testcase's JUnit element: its tag (``failure``, ``error``, or ``system-out`` for a pass), type, message
    and text."""

    tag: str
    type: str
    message: str
    text: str


def _row_outcome(row: RowVerdicts) -> _Outcome:
    """A row's testcase element: one run's own (a row without trials), else each trial's verdict."""
    if row.trials == 1 and len(row.runs) == 1:
        return _run_outcome(row.runs[0])
    verdicts = row.verdicts()
    numbers = [run.get("trial", i) for i, run in enumerate(row.runs, 1)]
    missing = [f"trial {n} not run" for n in range(len(row.runs) + 1, row.trials + 1)]
    head = f"{row.score} trials passed" + (" (flaky)" if row.flaky else "")
    message = head + ": " + ", ".join([f"trial {n} {verdict_word(run)}" for n, run in zip(numbers, row.runs)]
                                       + missing)
    text = "\n".join([message] + [f"trial {n}: {_verdict_line(run)}" for n, run in zip(numbers, row.runs)])
    if row.passed_all:
        return _Outcome("system-out", "", "", text)
    if "FAIL" in verdicts:
        modes = sorted({str(_judge(run).get("failure_mode") or "FAIL") for run in row.runs
                        if verdict_of(run) == "FAIL"})
        return _Outcome("failure", ", ".join(modes), message, text)
    return _Outcome("error", "not_judged", message, text)


def _run_outcome(run: Mapping[str, Any]) -> _Outcome:
    """One run's testcase element: the verdict and the judge's explanation, or why it was not judged."""
    judge = _judge(run)
    verdict = verdict_of(run)
    if verdict == "FAIL":
        mode = str(judge.get("failure_mode") or "FAIL")
        explanation = str(judge.get("explanation") or "")
        return _Outcome("failure", mode, explanation or mode,
                        f"task_completion {judge.get('task_completion')}, failure_mode {mode}\n{explanation}")
    if verdict is None:
        reason = _not_judged_reason(run)
        return _Outcome("error", "not_judged", reason, reason)
    return _Outcome("system-out", "", "", f"PASS, task_completion {judge.get('task_completion')}: "
                                          f"{judge.get('explanation')}")


def _judge(run: Mapping[str, Any]) -> Mapping[str, Any]:
    judge = run.get("judge")
    return judge if isinstance(judge, Mapping) else {}


def verdict_word(run: Mapping[str, Any]) -> str:
    """A run's verdict in a word or two: ``PASS``, ``FAIL incorrect_completion``, ``not judged``."""
    verdict = verdict_of(run)
    mode = _judge(run).get("failure_mode") if verdict == "FAIL" else None
    return f"{verdict} {mode}" if mode else verdict or NOT_JUDGED


def _verdict_line(run: Mapping[str, Any]) -> str:
    """One trial's verdict on one line: ``PASS 5/5``, ``FAIL 2/5 incorrect_completion: why``, ``not judged: why``."""
    judge = _judge(run)
    verdict = verdict_of(run)
    if verdict is None:
        return _not_judged_reason(run)[:300]
    mode = f" {judge['failure_mode']}" if verdict == "FAIL" and judge.get("failure_mode") else ""
    explanation = " ".join(str(judge.get("explanation") or "").split())
    return f"{verdict} {judge.get('task_completion')}/5{mode}" + (f": {explanation[:200]}" if explanation else "")


def _not_judged_reason(run: Mapping[str, Any]) -> str:
    judge = run.get("judge")
    if isinstance(judge, Mapping) and judge.get("error"):
        return f"not judged: {judge['error']}"
    if run.get("status") == "invalid":
        return "not run: the dataset check rejected the row: " + "; ".join(str(e) for e in run.get("errors") or [])
    return "not judged: no judge ran (simulate --judge MODEL)"


def apply(result: Mapping[str, Any], *, junit: Optional[str], min_pass_rate: Optional[float],
          write: Callable[[str, str], None], say: Callable[[str], None], command: str,
          min_pass_hat_k: Optional[float] = None) -> bool:
    """A command's gate: ``--junit`` written through ``write(path, text)``, then ``--min-pass-rate`` and
    ``--min-pass-hat-k`` checked and their outcome said; True when the gate fails (the command exits 1)."""
    if junit:
        write(junit, junit_xml(result))
    failed = False
    runs = result.get("runs") or []
    if min_pass_rate is not None:
        failure = gate_failure(result, min_pass_rate)
        if failure:
            say(f"{command}: FAILED the gate: {failure}")
        else:
            say(f"{command}: pass rate {pass_rate(runs):.1%} meets --min-pass-rate {min_pass_rate:.1%}")
        failed = failed or failure is not None
    if min_pass_hat_k is not None:
        failure = pass_hat_k_failure(result, min_pass_hat_k)
        k = trials_of(result)
        if failure:
            say(f"{command}: FAILED the gate: {failure}")
        else:
            say(f"{command}: pass^{k} {pass_hat_k(runs, k):.1%} meets --min-pass-hat-k {min_pass_hat_k:.1%}")
        failed = failed or failure is not None
    return failed
