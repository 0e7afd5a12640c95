"""``pipelines-port compare OLD.json NEW.json``: which rows regressed and which were fixed between two judged reports.

    pipelines-port compare OLD.json NEW.json [--json FILE] [--html FILE] [--fail-on-regression]
    pipelines-port simulate ... --judge MODEL --baseline OLD.json [--fail-on-regression]

A report is what ``simulate --json``, ``merge --json`` or ``test --json`` writes, with the judge's verdicts.
Rows are matched by their seed (``user``, ``behavior``, ``state``, ``failure_rules``, ``expected_outcome`` as
the row gives it, ``turn_mode``), never by their number: reordering rows or inserting some changes nothing, and
a row whose seed changed is one row removed and another added.  Rows with the same seed are matched in order.
A row the dataset check rejected has no seed: it is matched by its number.

Each row counts its passing trials (``simulate --trials K``; one trial without it): a row **regressed** when its
share of passing trials fell (PASS to FAIL or to not judged; 3/3 to 2/3), was **fixed** when it rose, and is
unchanged otherwise (1/1 and 3/3 are the same share).  The JSON::

    {"kind": "pipelines_port.comparison", "before": {...}, "after": {...}, "notes": [...],
     "regressed": [ENTRY, ...], "fixed": [...], "unchanged": N, "added": [...], "removed": [...]}

    ENTRY = {"row": {"before": 3, "after": 4}, "user_instruction": "...", "before": "3/3", "after": "2/3",
             "failure_modes": {"before": [], "after": ["incorrect_completion"]}}

``before``/``after`` at the top describe the two reports (file, judge, trials, rows, pass rate, pass^k);
``failure_modes`` lists each trial that did not pass, in trial order (its FAIL's mode, or ``not judged``); an
added row has no ``before``, a removed row no ``after``.  Reports of different judges, rubrics or trial counts
are compared all the same, and ``notes`` (the first lines of the text) say so plainly: a verdict that moved
may be the judge's doing, not the agent's.

Exit status: 0; 1 with ``--fail-on-regression`` when a row regressed; 2 for a file that cannot be compared (not
readable, not JSON, not a report, a report without the judge's verdicts), in one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, cast

from . import gate, report
from ..kit import prog

__all__ = ["KIND", "CompareError", "load_report", "seed_of", "compare", "regressed", "write_comparison", "main"]

KIND = "pipelines_port.comparison"
REPORT_KINDS = ("pipelines_port.simulation", "pipelines_port.platform_test_run")


class CompareError(Exception):
    """A report that cannot be compared: one line naming the file and the problem."""


def load_report(path: str) -> Dict[str, Any]:
    """A judged report read from ``path``; raises :class:`CompareError` naming what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise CompareError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CompareError(f"{path} is not a report: not UTF-8 text") from None
    try:
        result = json.loads(text)
    except ValueError as exc:
        first = text.split("\n", 1)[0]
        if '"pipelines_port.simulation.header"' in first:
            raise CompareError(f"{path} is a simulate --jsonl result file: make it a report first "
                               f"({prog('merge')} {path} --json OUT.json)") from None
        raise CompareError(f"{path} is not valid JSON: {exc}") from None
    runs = result.get("runs") if isinstance(result, dict) else None
    kind = result.get("kind") if isinstance(result, dict) else None
    if kind not in REPORT_KINDS or not isinstance(runs, list) or not all(
            isinstance(run, dict) and "row" in run for run in runs):
        what = f"a {kind!r} document" if isinstance(kind, str) else "JSON, but no report"
        raise CompareError(f"{path} is {what}: compare reads the reports of simulate --json, merge --json and "
                           "test --json")
    if not any(isinstance(run.get("judge"), dict) for run in runs):
        raise CompareError(f"{path} has no judge verdicts to compare: run simulate with --judge MODEL "
                           "(--judge scripted runs offline)")
    return cast(Dict[str, Any], result)


def seed_of(run: Mapping[str, Any]) -> Dict[str, Any]:
    """What makes a row the row it is: its seed as the run recorded it (its number, for a row not run)."""
    if run.get("status") == "invalid" or "user_instruction" not in run:
        return {"rejected_row": run.get("row")}
    rules = run.get("failure_rules") or []
    return {"user": run.get("user_instruction"), "behavior": run.get("behavior_instructions") or "",
            "state": run.get("initial_state") or {},
            "failure_rules": [r.get("rule", r) if isinstance(r, Mapping) else r for r in rules],
            "expected_outcome": run.get("expected_outcome") if run.get("expected_outcome_given", True) else None,
            "turn_mode": run.get("turn_mode") or "single"}


class _Row(NamedTuple):
    """One report's row over its trials, as a comparison shows it."""

    number: Any
    instruction: str
    passes: int
    trials: int
    failure_modes: List[str]

    @property
    def share(self) -> Fraction:
        return Fraction(self.passes, self.trials)

    @property
    def score(self) -> str:
        return f"{self.passes}/{self.trials}"


def _rows(result: Mapping[str, Any]) -> Dict[Tuple[str, int], _Row]:
    """The report's rows keyed by seed (and, among rows of the same seed, by their order)."""
    found: Dict[Tuple[str, int], _Row] = {}
    seen: Dict[str, int] = {}
    for row in gate.row_verdicts(result.get("runs") or [], gate.trials_of(result)):
        first = row.runs[0]
        seed = json.dumps(seed_of(first), sort_keys=True, ensure_ascii=False, default=str)
        seen[seed] = seen.get(seed, 0) + 1
        modes = [_failure_mode(run) for run in row.runs if gate.verdict_of(run) != "PASS"]
        modes += ["not run"] * (row.trials - len(row.runs))
        found[(seed, seen[seed])] = _Row(row.row, str(first.get("user_instruction") or ""), row.passes, row.trials,
                                         modes)
    return found


def _failure_mode(run: Mapping[str, Any]) -> str:
    """Why a trial did not pass: its FAIL's mode, or ``not judged``."""
    if gate.verdict_of(run) is None:
        return gate.NOT_JUDGED
    judge = run.get("judge") or {}
    return str(judge.get("failure_mode") or "(none given)")


def _entry(before: Optional[_Row], after: Optional[_Row], instruction: str) -> Dict[str, Any]:
    return {"row": {"before": before.number if before else None, "after": after.number if after else None},
            "user_instruction": instruction,
            "before": before.score if before else None, "after": after.score if after else None,
            "failure_modes": {"before": before.failure_modes if before else None,
                              "after": after.failure_modes if after else None}}


def _describe(result: Mapping[str, Any], file: str) -> Dict[str, Any]:
    """What the comparison says of one report: its file, dataset, judge, trials and rates."""
    verdicts = (result.get("summary") or {}).get("judge") or gate.judge_summary(result.get("runs") or []) or {}
    runs = result.get("runs") or []
    trials = gate.trials_of(result)
    return {"file": file, "dataset": (result.get("dataset") or {}).get("file"), "judge": _judge_of(result),
            "trials": trials, "rows": len(gate.row_verdicts(runs, trials)), "runs": len(runs),
            "pass_rate": verdicts.get("pass_rate", gate.pass_rate(runs)),
            "pass_hat_k": verdicts.get("pass_hat_k", gate.pass_hat_k(runs, trials))}


def _judge_of(result: Mapping[str, Any]) -> Dict[str, Any]:
    """The report's judge: model and rubric (a platform test run's judge is the platform's)."""
    judge = result.get("judge")
    if isinstance(judge, Mapping):
        return {"model": judge.get("model"), "prompt_sha256": judge.get("prompt_sha256")}
    models = sorted({str(run["judge"].get("model")) for run in result.get("runs") or []
                     if isinstance(run.get("judge"), Mapping) and run["judge"].get("model")})
    return {"model": ", ".join(models) or None, "prompt_sha256": None}


def _notes(before: Mapping[str, Any], after: Mapping[str, Any]) -> List[str]:
    """What differs between the two reports beyond the agent: the judge, its rubric, the trials."""
    notes = []
    judges = before["judge"], after["judge"]
    if judges[0]["model"] != judges[1]["model"]:
        notes.append(f"different judges: {judges[0]['model']} before, {judges[1]['model']} after; a verdict that "
                     "moved may be the judge's doing, not the agent's")
    elif judges[0]["prompt_sha256"] != judges[1]["prompt_sha256"] and all(j["prompt_sha256"] for j in judges):
        notes.append("different rubrics (--judge-prompt): the same judge graded by other rules; a verdict that "
                     "moved may be the rubric's doing, not the agent's")
    if before["trials"] != after["trials"]:
        notes.append(f"different trials: {before['trials']} per row before, {after['trials']} after; rows compare by "
                     "their share of passing trials")
    return notes


def compare(before: Mapping[str, Any], after: Mapping[str, Any], *, before_file: str = "before",
            after_file: str = "after") -> Dict[str, Any]:
    """The comparison of two judged reports (the module docstring gives its shape)."""
    old, new = _rows(before), _rows(after)
    result: Dict[str, Any] = {"kind": KIND, "version": 1, "before": _describe(before, before_file),
                              "after": _describe(after, after_file)}
    result["notes"] = _notes(result["before"], result["after"])
    regressions, fixes, unchanged = [], [], 0
    for key, now in new.items():
        then = old.get(key)
        if then is None:
            continue
        if now.share < then.share:
            regressions.append(_entry(then, now, now.instruction))
        elif now.share > then.share:
            fixes.append(_entry(then, now, now.instruction))
        else:
            unchanged += 1
    result.update(regressed=regressions, fixed=fixes, unchanged=unchanged,
                  added=[_entry(None, now, now.instruction) for key, now in new.items() if key not in old],
                  removed=[_entry(then, None, then.instruction) for key, then in old.items() if key not in new])
    return result


def regressed(comparison: Mapping[str, Any]) -> bool:
    """Whether a row regressed (``--fail-on-regression``)."""
    return bool(comparison.get("regressed"))


def write_comparison(comparison: Mapping[str, Any], json_path: Optional[str], html_path: Optional[str],
                     write: Callable[[str, str], None]) -> None:
    """The comparison's JSON to ``json_path`` (``-``: standard output) and its page to ``html_path``."""
    if json_path:
        text = json.dumps(comparison, indent=2, ensure_ascii=False)
        if json_path == "-":
            print(text)
        else:
            write(json_path, text + "\n")
    if html_path:
        write(html_path, report.render_comparison_html(comparison))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog("compare"),
        description="Compare two judged reports (simulate, merge or test --json): the rows that regressed (their "
                    "share of passing trials fell), were fixed, added or removed. Rows are matched by their seed "
                    "(user, behavior, state, failure_rules, expected_outcome, turn_mode), not their number.",
        epilog="Exit status: 0; 1 with --fail-on-regression when a row regressed; 2 a file that cannot be compared.")
    parser.add_argument("before", metavar="OLD.json", help="the baseline's report")
    parser.add_argument("after", metavar="NEW.json", help="the report to hold to it")
    parser.add_argument("--json", metavar="FILE", help="write the comparison as JSON ('-' for stdout instead of the "
                                                       "text)")
    parser.add_argument("--html", metavar="FILE", help="write the comparison as a self-contained HTML page")
    parser.add_argument("--fail-on-regression", action="store_true", help="exit 1 when a row regressed")
    return parser


def _write(path: str, text: str) -> None:
    try:
        report.write_file(path, text)
    except OSError as exc:
        raise CompareError(f"cannot write {path}: {exc.strerror or exc}") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(None if argv is None else list(argv))
    try:
        comparison = compare(load_report(args.before), load_report(args.after), before_file=args.before,
                             after_file=args.after)
        write_comparison(comparison, args.json, args.html, _write)
    except CompareError as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 2
    if args.json != "-":
        print(report.render_comparison_text(comparison))
    return 1 if args.fail_on_regression and regressed(comparison) else 0


if __name__ == "__main__":
    sys.exit(main())
