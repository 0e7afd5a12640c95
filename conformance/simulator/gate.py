"""Verdicts as a CI gate: the pass rate, ``--min-pass-rate`` and JUnit XML, for any report with judged runs.

A report (``simulate``, ``merge``, or a platform test run read back) lists ``runs``; a judged run carries
``"judge": {"verdict": "PASS" | "FAIL", "task_completion", "failure_mode", "explanation", "model"}``, or
``{"verdict": null, "error": "..."}`` when it could not be judged.  The rules, the same wherever a report
comes from:

- the pass rate is PASS / rows: a row not judged (no judge, a judge that failed, a row not run) is not a pass;
- ``--min-pass-rate F`` fails (exit status 1) when the rate is below F;
- JUnit: one ``<testcase>`` per row; FAIL is a ``<failure>``, not judged an ``<error>``, each with the judge's
  explanation (or the reason) as its message, as Jenkins, GitLab and the GitHub test reporters read it.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

__all__ = ["VERDICTS", "verdict_of", "judge_summary", "usage_total", "pass_rate", "parse_rate", "gate_failure",
           "junit_xml", "apply"]

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


def judge_summary(runs: Sequence[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """The summary's ``judge`` part (``None`` when no run carries a judgement): counts, modes, rate, usage."""
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
    return {"pass": counts["PASS"], "fail": counts["FAIL"], "not_judged": counts[NOT_JUDGED],
            "pass_rate": pass_rate(runs), "failure_modes": dict(sorted(modes.items(), key=lambda kv: (-kv[1], kv[0]))),
            "usage": usage_total(runs, "judge")}


def pass_rate(runs: Sequence[Mapping[str, Any]]) -> float:
    """PASS / rows (0.0 for no rows): a row not judged counts as not passed."""
    return round(sum(1 for run in runs if verdict_of(run) == "PASS") / len(runs), 4) if runs else 0.0


_RATE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(%?)\s*")


def parse_rate(text: str) -> float:
    """``"0.8"`` or ``"80%"`` as 0.8; raises ``ValueError`` naming the problem for anything else."""
    match = _RATE.fullmatch(text or "")
    if match is None:
        raise ValueError(f"--min-pass-rate: expected a fraction from 0 to 1 (0.8) or a percentage (80%), got {text!r}")
    value = float(match.group(1)) / (100 if match.group(2) else 1)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"--min-pass-rate: {text!r} is not between 0 and 1 (or 0% and 100%)")
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
    return (f"pass rate {rate:.1%} ({passed} of {len(runs)} rows) is below --min-pass-rate {min_pass_rate:.1%}"
            + why)


def _case_name(run: Mapping[str, Any]) -> str:
    text = " ".join(str(run.get("user_instruction") or "").split())
    return f"row {run.get('row')}" + (f": {text[:80]}{'...' if len(text) > 80 else ''}" if text else "")


def _xml_text(value: Any) -> str:
    """Text XML 1.0 can carry: the characters it forbids (most C0 controls) become U+FFFD."""
    return re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]", "\ufffd", str(value))


def junit_xml(result: Mapping[str, Any], *, suite: str = "pipelines-port") -> str:
    """The report as JUnit XML: one testsuite, one testcase per row (see the module docstring)."""
    runs: List[Mapping[str, Any]] = list(result.get("runs") or [])
    dataset = str((result.get("dataset") or {}).get("file") or "dataset")
    failures = sum(1 for run in runs if verdict_of(run) == "FAIL")
    errors = sum(1 for run in runs if verdict_of(run) is None)
    seconds = sum(float(run.get("duration_ms") or 0) for run in runs) / 1000
    attributes = {"name": _xml_text(f"{suite}: {dataset}"), "tests": str(len(runs)), "failures": str(failures),
                  "errors": str(errors), "skipped": "0", "time": f"{seconds:.3f}"}
    root = ET.Element("testsuites", attributes)
    suite_element = ET.SubElement(root, "testsuite", dict(attributes, timestamp=str(result.get("started_at") or "")))
    for run in runs:
        case = ET.SubElement(suite_element, "testcase", {
            "classname": _xml_text(dataset), "name": _xml_text(_case_name(run)),
            "time": f"{float(run.get('duration_ms') or 0) / 1000:.3f}"})
        judge = run.get("judge") if isinstance(run.get("judge"), Mapping) else {}
        verdict = verdict_of(run)
        if verdict == "FAIL":
            mode = judge.get("failure_mode") or "FAIL"
            explanation = str(judge.get("explanation") or "")
            element = ET.SubElement(case, "failure", {"message": _xml_text(explanation[:1000] or mode),
                                                      "type": _xml_text(mode)})
            element.text = _xml_text(f"task_completion {judge.get('task_completion')}, failure_mode {mode}\n"
                                     f"{explanation}")
        elif verdict is None:
            reason = _not_judged_reason(run)
            element = ET.SubElement(case, "error", {"message": _xml_text(reason[:1000]), "type": "not_judged"})
            element.text = _xml_text(reason)
        else:
            out = ET.SubElement(case, "system-out")
            out.text = _xml_text(f"PASS, task_completion {judge.get('task_completion')}: {judge.get('explanation')}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _not_judged_reason(run: Mapping[str, Any]) -> str:
    judge = run.get("judge")
    if isinstance(judge, Mapping) and judge.get("error"):
        return f"not judged: {judge['error']}"
    if run.get("status") == "invalid":
        return "not run: the dataset check rejected the row: " + "; ".join(str(e) for e in run.get("errors") or [])
    return "not judged: no judge ran (simulate --judge MODEL)"


def apply(result: Mapping[str, Any], *, junit: Optional[str], min_pass_rate: Optional[float],
          write: Callable[[str, str], None], say: Callable[[str], None], command: str) -> bool:
    """A command's gate: ``--junit`` written through ``write(path, text)``, then ``--min-pass-rate`` checked and
    its outcome said; True when the gate fails (the command exits 1)."""
    if junit:
        write(junit, junit_xml(result))
    if min_pass_rate is None:
        return False
    failure = gate_failure(result, min_pass_rate)
    if failure:
        say(f"{command}: FAILED the gate: {failure}")
        return True
    say(f"{command}: pass rate {pass_rate(result.get('runs') or []):.1%} meets --min-pass-rate {min_pass_rate:.1%}")
    return False
