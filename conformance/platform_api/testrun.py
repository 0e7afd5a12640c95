"""``pipelines-port test FILE.csv --agent ID|NAME``: run a dataset on the platform, follow it, gate CI on it.

The dataset is checked first, as ``dataset`` checks it (an error stops here, exit status 2); its rows go
out as the CSV has them (``POST /api/agents/{id}/test-runs``, the SDK's body).  The run is then polled
(``GET /api/test-runs/{id}``) with a progress line on stderr until no row is in flight, ``--timeout``
passes, or the platform reports that rows were not dispatched; ``--attach RUN_ID`` re-joins a run.

The summary (stdout) gives each row's verdict and failure mode as the platform judged it.  ``--json``,
``--junit`` and ``--min-pass-rate`` are the local judge's (``simulator/gate.py``): one report shape, one
pass rate (PASS / rows; a row not judged, e.g. ``not_dispatched`` or failed, is not a pass), one JUnit.

Exit status: 0 the run finished (and met ``--min-pass-rate``); 1 a row failed or timed out on the platform,
the rate is below ``--min-pass-rate``, rows were not dispatched, the command timed out, or the platform
could not be reached; 2 bad flags or dataset, or the platform refused them (key, permissions, agent);
130 interrupted (the run goes on: ``--attach``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ..kit import PROG, prog
from ..simulator import dataset as datasets
from ..simulator import gate
from . import client as api

__all__ = ["KIND", "IN_FLIGHT", "seed_rows", "is_complete", "dispatch_warnings", "judgement", "build_report",
           "follow", "main"]

KIND = "pipelines_port.platform_test_run"
IN_FLIGHT = ("pending", "running", "judging", "not_dispatched")  # the SDK counts not_dispatched as in flight
DONE = ("completed", "failed", "timed_out", "cancelled")
RUN_FAILURES = ("failed", "timed_out")  # a row the platform could not run: the command fails (as the SDK's)
DEFAULT_TIMEOUT_S = 14_400.0  # the SDK's defaults (0.1.15)
DEFAULT_POLL_S = 3.0


class SetupError(api.SetupError):
    """Flags or a dataset that cannot make a test run: exit status 2."""


class Row(NamedTuple):
    """A dataset row as the report names it."""

    row: int
    line: int
    user_instruction: str
    expected_outcome: str


# ---------------------------------------------------------------------------
# The dataset, as the platform takes it
# ---------------------------------------------------------------------------


def seed_rows(data: bytes, name: str) -> Tuple[datasets.Dataset, List[Dict[str, str]], List[Row]]:
    """The checked dataset, the rows to send (``{column: cell}`` as the CSV has them) and what names them.

    Rows the check skips (every cell empty) are not sent; cells beyond the header are dropped, missing
    ones read as empty, as the SDK's CSV reader reads them.
    """
    checked = datasets.parse_bytes(data, name)
    if not checked.ok:
        return checked, [], []
    header, records, _ = datasets.read_table(data.decode("utf-8-sig"))
    kept = {task.row: task for task in checked.tasks}
    names = [h.strip() for h in header]
    rows, described = [], []
    for record in records:
        task = kept.get(record.row)
        if task is None:
            continue
        rows.append({column: record.cells[i] if i < len(record.cells) else "" for i, column in enumerate(names)})
        described.append(Row(task.row, task.line, task.user_instruction, task.expected_outcome))
    return checked, rows, described


# ---------------------------------------------------------------------------
# Reading the platform's rollup (the keys the SDK reads, 0.1.15)
# ---------------------------------------------------------------------------


def _count(totals: Mapping[str, Any], key: str) -> int:
    value = totals.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _totals(rollup: Mapping[str, Any]) -> Mapping[str, Any]:
    totals = rollup.get("totals")
    return totals if isinstance(totals, Mapping) else {}


def is_complete(rollup: Mapping[str, Any]) -> bool:
    """True when no row is in flight (pending, running, judging or not dispatched)."""
    return sum(_count(_totals(rollup), key) for key in IN_FLIGHT) == 0


def dispatch_warnings(reply: Any) -> List[str]:
    """The reply's ``warnings``: rows created but never queued (the run cannot progress on its own)."""
    warnings = reply.get("warnings") if isinstance(reply, Mapping) else None
    return [str(w) for w in warnings if w] if isinstance(warnings, list) else []


def progress(rollup: Mapping[str, Any]) -> Dict[str, int]:
    """``total``, ``done``, ``in_flight``, ``passed``, ``failed`` from the rollup's totals."""
    totals = _totals(rollup)
    return {"total": _count(totals, "task_count"), "done": sum(_count(totals, k) for k in DONE),
            "in_flight": sum(_count(totals, k) for k in IN_FLIGHT), "passed": _count(totals, "pass_count"),
            "failed": _count(totals, "fail_count")}


def _not_judged(status: str) -> str:
    if status == "not_dispatched":
        return "not dispatched: the platform never queued this row's agent run"
    if status in ("failed", "timed_out"):
        return f"the agent run {'timed out' if status == 'timed_out' else 'failed'} on the platform"
    if status == "cancelled":
        return "the run was cancelled on the platform"
    if status in ("pending", "running", "judging"):
        return f"not finished ({status}) when the command stopped following the run"
    if status == "completed":
        return "the platform gave no verdict"
    return f"no verdict (status {status or 'unknown'!r})"


def judgement(task: Mapping[str, Any]) -> Dict[str, Any]:
    """The row's ``judge`` in the local judge's shape: the platform's verdict, or why there is none.

    The verdict is ``judge_passed`` (what the SDK reads; a ``verdict`` of PASS / FAIL also counts);
    ``failure_mode``, ``task_completion``, ``instruction_adherence`` and ``explanation`` are taken when the
    platform gives them.
    """
    passed = task.get("judge_passed")
    if not isinstance(passed, bool) and task.get("verdict") in gate.VERDICTS:
        passed = task.get("verdict") == "PASS"
    if not isinstance(passed, bool):
        return {"verdict": None, "error": _not_judged(str(task.get("status") or ""))}
    score = task.get("task_completion")
    mode = task.get("failure_mode")
    adherence = task.get("instruction_adherence")
    return {"verdict": "PASS" if passed else "FAIL",
            "task_completion": score if isinstance(score, int) and not isinstance(score, bool) else None,
            "failure_mode": str(mode) if mode and not passed else None,
            "instruction_adherence": adherence if isinstance(adherence, int) and not isinstance(adherence, bool)
            else None,
            "explanation": str(task.get("explanation") or ""), "model": "platform"}


def _duration_ms(task: Mapping[str, Any]) -> float:
    """The row's longest agent-run latency (the platform reports one per run), 0 when none."""
    latencies = [r.get("latency_ms") for r in task.get("runs") or [] if isinstance(r, Mapping)]
    numbers = [float(v) for v in latencies if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return max(numbers) if numbers else 0.0


def _status(platform_status: str) -> str:
    return {"completed": "ok", "failed": "error", "timed_out": "error"}.get(platform_status, platform_status)


def build_report(rollup: Mapping[str, Any], rows: Sequence[Row], *, dataset: Mapping[str, Any], agent: Any,
                 api_url: str, started_at: str, duration_ms: float, outcome: str) -> Dict[str, Any]:
    """The local judge's report shape for a platform test run: one run per task, matched to rows in order."""
    runs: List[Dict[str, Any]] = []
    for i, task in enumerate(t for t in rollup.get("tasks") or [] if isinstance(t, Mapping)):
        row = rows[i] if i < len(rows) else None
        status = str(task.get("status") or "")
        runs.append({
            "row": row.row if row else i + 1,
            "line": row.line if row else None,
            "user_instruction": row.user_instruction if row else str(task.get("instruction_excerpt")
                                                                     or task.get("name") or ""),
            "expected_outcome": row.expected_outcome if row else None,
            "status": _status(status),
            "platform_status": status,
            "duration_ms": _duration_ms(task),
            "task_id": task.get("task_id"),
            "web_url": task.get("web_url"),
            "judge": judgement(task),
        })
    summary: Dict[str, Any] = {"runs": len(runs), "ok": sum(1 for r in runs if r["status"] == "ok"),
                               "errors": sum(1 for r in runs if r["status"] != "ok"),
                               "judge": gate.judge_summary(runs), "platform": dict(_totals(rollup))}
    return {"kind": KIND, "version": 1, "started_at": started_at, "duration_ms": round(duration_ms, 1),
            "outcome": outcome, "test_run_id": rollup.get("test_run_id"), "agent": agent, "api_url": api_url,
            "web_url": rollup.get("web_url"), "warnings": dispatch_warnings(rollup), "dataset": dict(dataset),
            "summary": summary, "runs": runs}


def render_text(result: Mapping[str, Any]) -> str:
    """The summary printed at the end: one line per row (verdict, failure mode, instruction), then the totals."""
    runs = result.get("runs") or []
    judged = (result.get("summary") or {}).get("judge") or {}
    lines = [(f"test run #{result.get('test_run_id')}: {len(runs)} rows: {judged.get('pass', 0)} PASS, "
              f"{judged.get('fail', 0)} FAIL, {judged.get('not_judged', 0)} not judged; pass rate "
              f"{judged.get('pass_rate', 0.0):.1%}")]
    for run in runs:
        judge = run.get("judge") or {}
        verdict = judge.get("verdict")
        said = (f"{verdict} {judge.get('failure_mode') or ''}".strip() if verdict
                else f"not judged: {judge.get('error')}")
        text = " ".join(str(run.get("user_instruction") or "").split())
        lines.append(f"  row {run.get('row')}: {said}: {text[:70]}{'...' if len(text) > 70 else ''}")
    modes = judged.get("failure_modes") or {}
    if modes:
        lines.append("failure modes: " + ", ".join(f"{mode} {n}" for mode, n in modes.items()))
    if result.get("web_url"):
        lines.append(f"results: {result['web_url']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Following a run
# ---------------------------------------------------------------------------


class Progress:
    """The progress line on stderr: rewritten in place on a terminal, a new line on each change elsewhere."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.last = ""

    def show(self, run_id: Any, rollup: Mapping[str, Any], elapsed: float) -> None:
        p = progress(rollup)
        text = (f"test run #{run_id}: {p['done']}/{p['total']} done ({p['passed']} PASS, {p['failed']} FAIL), "
                f"{p['in_flight']} in flight")
        if self.tty:
            self.stream.write(f"\r{text}, {elapsed:.0f} s\x1b[K")
            self.stream.flush()
        elif text != self.last:
            self.stream.write(f"{text}, {elapsed:.0f} s\n")
        self.last = text

    def end(self) -> None:
        if self.tty and self.last:
            self.stream.write("\n")


def follow(client: api.Client, run_id: Any, *, timeout: float, poll_interval: float, show: Progress,
           clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], Any] = time.sleep) -> Tuple[Optional[Dict[str, Any]], str]:
    """Poll the run until ``"complete"``, ``"dispatch_failed"``, ``"timeout"`` or ``"detached"`` (Ctrl-C);
    the last rollup read, and the outcome.  Errors of the platform propagate."""
    started = clock()
    deadline = started + timeout
    rollup: Optional[Dict[str, Any]] = None
    try:
        while True:
            rollup = client.get_test_run(run_id)
            show.show(run_id, rollup, clock() - started)
            if dispatch_warnings(rollup):  # before completeness: not_dispatched rows never finish
                return rollup, "dispatch_failed"
            if is_complete(rollup):
                return rollup, "complete"
            left = deadline - clock()
            if left <= 0:
                return rollup, "timeout"
            sleep(min(poll_interval, left))
    except KeyboardInterrupt:
        return rollup, "detached"
    finally:
        show.end()


def all_tasks(client: api.Client, run_id: Any, rollup: Dict[str, Any]) -> Dict[str, Any]:
    """The rollup with every task: the platform sends one page of them (``?page=N`` for the rest)."""
    tasks = list(rollup.get("tasks") or [])
    total = _count(_totals(rollup), "task_count")
    page = 1
    while len(tasks) < total:
        page += 1
        more = client.get_test_run(run_id, page=page).get("tasks") or []
        if not more:
            break
        tasks.extend(more)
    return dict(rollup, tasks=tasks)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _positive(flag: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes seconds, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{flag} must be more than 0, got {text}")
        return value
    return parse


def _rate(text: str) -> float:
    try:
        return gate.parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("--min-pass-rate: ", "")) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog("test"),
        description="Run a task-seeding dataset against an agent on the platform, follow the run to its end and "
                    f"print each row's verdict. The API key is read from {api.ENV_API_KEY}.",
        epilog="Exit status: 0 finished (and met --min-pass-rate); 1 a row failed or timed out on the platform, "
               "the pass rate is below --min-pass-rate, rows were not dispatched, --timeout passed, or the "
               "platform could not be reached; 2 bad flags or dataset, or refused by the platform (key, "
               "permissions, agent); 130 interrupted (the run goes on: --attach).")
    parser.add_argument("file", metavar="FILE.csv", nargs="?", help="the dataset (optional with --attach: it names "
                                                                    "the rows)")
    parser.add_argument("--agent", metavar="ID|NAME", help="the agent on the platform (pipelines-port register)")
    parser.add_argument("--attach", metavar="RUN_ID", help="follow a test run already started, instead of a new one")
    parser.add_argument("--timeout", metavar="S", type=_positive("--timeout"), default=DEFAULT_TIMEOUT_S,
                        help=f"stop following after S seconds, exit 1 (default {DEFAULT_TIMEOUT_S:g}; the run goes "
                             "on)")
    parser.add_argument("--poll-interval", metavar="S", type=_positive("--poll-interval"), default=DEFAULT_POLL_S,
                        help=f"seconds between polls (default {DEFAULT_POLL_S:g})")
    parser.add_argument("--min-pass-rate", metavar="F", type=_rate,
                        help="exit 1 when PASS / rows is below F (0.8 or 80%%); a row not judged is not a pass")
    parser.add_argument("--junit", metavar="FILE", help="write JUnit XML (one testcase per row)")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON (the local judge's shape)")
    parser.add_argument("--api-url", metavar="URL", help=f"the platform's API (default: ${api.ENV_API_URL}, else "
                                                         f"{api.DEFAULT_API_URL})")
    return parser


def _say(text: str) -> None:
    print(f"test: {text}", file=sys.stderr)


def _write(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _agent_id(client: api.Client, agent: str) -> Any:
    """``--agent``: an id as given, a name looked up (exactly one agent of that name)."""
    if agent.strip().isdigit():
        return int(agent.strip())
    matches = client.agents_named(agent)
    if not matches:
        raise SetupError(f"no agent named {agent!r} on the platform for this API key: register it first "
                         f"({prog('register')} --name {agent} ...) or pass its id")
    if len(matches) > 1:
        ids = ", ".join(str(m.get("id")) for m in matches)
        raise SetupError(f"{len(matches)} agents are named {agent!r} (ids {ids}): pass --agent ID")
    return matches[0].get("id")


def _load(path: str) -> Tuple[datasets.Dataset, List[Dict[str, str]], List[Row]]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise SetupError(f"cannot read {path}: {exc.strerror or exc}") from None
    checked, rows, described = seed_rows(data, path)
    for line in datasets.format_problems(checked):
        print(line, file=sys.stderr)
    if not checked.ok:
        raise SetupError(datasets.summary(checked) + ": fix the errors above (the platform would reject the rows)")
    if not rows:
        raise SetupError(f"{path}: no row to run")
    return checked, rows, described


def run(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """The command, once its flags are parsed; raises :class:`SetupError` and :class:`api.PlatformError`."""
    if args.attach is None and (args.file is None or args.agent is None):
        raise SetupError("give the dataset and the agent (FILE.csv --agent ID|NAME), or --attach RUN_ID")
    if args.attach is not None and not args.attach.strip().isdigit():
        raise SetupError(f"--attach {args.attach!r}: expected a test run's id (digits)")
    checked, rows, described = _load(args.file) if args.file else (None, [], [])
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    clock = time.monotonic()
    with api.connect(args.api_url, environ) as client:
        agent: Any = None
        if args.attach is not None:
            run_id: Any = args.attach.strip()
            created_warnings: List[str] = []
        else:
            agent = _agent_id(client, args.agent)
            created = client.create_test_run(agent, {"rows": rows, "options": {}})
            run_id = created.get("test_run_id")
            if run_id is None:
                raise api.PlatformError("the platform created a test run but sent no test_run_id")
            created_warnings = dispatch_warnings(created)
            _say(f"test run #{run_id} created: {len(rows)} rows for agent {agent}")
        rollup: Optional[Dict[str, Any]]
        if created_warnings:  # the SDK stops here: nothing will run.  One read, for the reports.
            rollup, outcome = client.get_test_run(run_id), "dispatch_failed"
            if not dispatch_warnings(rollup):
                rollup["warnings"] = created_warnings
        else:
            rollup, outcome = follow(client, run_id, timeout=args.timeout, poll_interval=args.poll_interval,
                                     show=Progress())
        if rollup is not None and outcome != "detached":
            rollup = all_tasks(client, run_id, rollup)
        origin = client.origin
    if rollup is None:  # interrupted before the first reply
        _say(f"interrupted; the run goes on: {prog('test')} --attach {run_id}")
        return 130
    if agent is None:
        agent = rollup.get("agent_id")
    info = {"file": checked.name, "rows": checked.rows, "problems": [p.to_json() for p in checked.problems]} \
        if checked else {"file": None}
    result = build_report(rollup, described, dataset=info, agent=agent, api_url=origin, started_at=started_at,
                          duration_ms=(time.monotonic() - clock) * 1000, outcome=outcome)
    print(render_text(result))
    if args.json:
        _write(args.json, json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    if args.junit:
        _write(args.junit, gate.junit_xml(result, suite=f"{PROG} test"))
    rejoin = f"{prog('test')} --attach {run_id}"
    if outcome == "detached":
        _say(f"detached; the run goes on on the platform: {rejoin}")
        return 130
    if outcome == "dispatch_failed":
        _say("the run's rows were created, but their agent runs were not queued: nothing will run")
        for warning in result["warnings"]:
            _say(f"  - {warning}")
        _say(f"fix what the warnings say, then run again (or {rejoin} once the rows are queued)")
        return 1
    if outcome == "timeout":
        _say(f"timed out after {args.timeout:g} s with rows in flight; the run goes on on the platform: {rejoin}")
        return 1
    totals = _totals(rollup)
    failed = {key: _count(totals, key) for key in RUN_FAILURES if _count(totals, key)}
    if failed:
        _say("rows the platform could not run: " + ", ".join(f"{n} {key}" for key, n in failed.items()))
        return 1
    if args.min_pass_rate is not None:
        why = gate.gate_failure(result, args.min_pass_rate)
        if why:
            _say(why)
            return 1
    return 0


def main(argv: Optional[List[str]] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        return run(args, os.environ if environ is None else environ)
    except api.SetupError as exc:
        _say(str(exc))
        return 2
    except api.PlatformError as exc:
        _say(str(exc))
        return 2 if exc.usage else 1
    except KeyboardInterrupt:
        _say("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
