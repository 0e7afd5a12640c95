"""Simulations beyond one machine: shards of a dataset, a streamed result file, resume, merge.

``simulate --shard K/N`` runs the K-th of N shards; ``--jsonl OUT.jsonl`` appends every finished run to OUT as
one JSON record, flushed at once, after a header record (dataset, agent, options, shard); ``--resume`` skips
the runs OUT already holds; ``merge A.jsonl B.jsonl ... --json ALL.json --html report.html``
makes the report of the whole dataset from the shards' files (``pipelines-port merge``, or
``python3 -m conformance merge`` in a checkout).

The unit of work is one trial of one row, ``(row, trial)`` (``simulate --trials K``; trial 1 alone without it):
a record holds one, a resumed file runs only the trials it lacks, a merge wants every row's K trials.

The split: the dataset's rows in file order, row number ``i`` (counting from 0 in that order) going to shard
``i % N + 1``, with all its K trials.  It depends only on the dataset, so every job of an N-way split computes the
same shards with no coordination, re-runs give the same rows, and the shards differ in size by one row at most.
A row's trials stay in one shard so that a shard's own report, gate and JUnit hold whole rows (pass^k is a
row's measure).

A record is one line: its JSON, then ``\\n``, written by one ``write`` and flushed.  A crash can leave at most
the last line cut short; ``--resume`` drops such a line (its run runs again) and ``merge`` names it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from typing import Any, Dict, IO, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from . import gate, report
from ..kit import prog

__all__ = ["Unit", "Shard", "parse_shard", "shard_rows", "shard_units", "unit_name", "ResultFile", "ShardFile",
           "read_result_file", "trials_in", "merge_files", "summarise", "main"]

HEADER_KIND = "pipelines_port.simulation.header"
RUN_KIND = "pipelines_port.simulation.run"
VERSION = 1

Unit = Tuple[int, int]  # (row, trial): one run of one row, the unit of work


class ShardError(Exception):
    """Bad input to a shard, a result file or a merge: one line that names the problem."""


class Shard(NamedTuple):
    index: int  # K, from 1
    count: int  # N

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


_SHARD_RE = re.compile(r"\s*(\d{1,6})\s*/\s*(\d{1,6})\s*")


def parse_shard(text: str) -> Shard:
    """``"2/3"`` as ``Shard(2, 3)``; anything else (``0/3``, ``4/3``, ``x/y``) raises :class:`ShardError`."""
    match = _SHARD_RE.fullmatch(text or "")
    if match is None:
        raise ShardError(f"--shard: expected K/N, the K-th of N shards (e.g. 2/3), got {text!r}")
    index, count = int(match.group(1)), int(match.group(2))
    if count < 1 or not 1 <= index <= count:
        raise ShardError(f"--shard: K must be between 1 and N (shards are counted from 1), got {index}/{count}")
    return Shard(index, count)


def shard_rows(rows: Sequence[int], shard: Optional[Shard]) -> List[int]:
    """The rows of ``shard`` (all of them without one): every N-th row in file order, starting at the K-th."""
    ordered = sorted(rows)
    if shard is None:
        return ordered
    return [row for i, row in enumerate(ordered) if i % shard.count == shard.index - 1]


def shard_units(rows: Sequence[int], trials: int, shard: Optional[Shard]) -> List[Unit]:
    """The units of ``shard`` (all of them without one): its rows, each with its ``trials`` trials, in order."""
    return [(row, trial) for row in shard_rows(rows, shard) for trial in range(1, trials + 1)]


def unit_name(unit: Unit, trials: int) -> str:
    """``row 3``, or ``row 3 trial 2`` when rows run more than one trial."""
    return f"row {unit[0]}" + (f" trial {unit[1]}" if trials > 1 else "")


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 16), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------
# The result file: a header line, then one line per finished row
# ---------------------------------------------------------------------------


class ShardFile(NamedTuple):
    """What a result file holds: its header, its runs by unit, and whether its last line was cut short."""

    path: str
    header: Dict[str, Any]
    runs: Dict[Unit, Dict[str, Any]]
    partial_line: Optional[int]  # the line number of a cut-short last record, if any
    good_bytes: int  # the length of the file up to its last whole record


def read_result_file(path: str) -> ShardFile:
    """Read a result file; a cut-short last line is reported, not fatal; anything else malformed raises."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ShardError(f"cannot read {path}: {exc.strerror or exc}") from None
    lines = data.split(b"\n")
    last_complete = data.endswith(b"\n")
    header: Optional[Dict[str, Any]] = None
    runs: Dict[Unit, Dict[str, Any]] = {}
    partial: Optional[int] = None
    good = 0
    for number, raw in enumerate(lines, 1):
        if number == len(lines):  # after the last "\n": empty, or a line cut short by a crash
            if raw.strip():
                partial = number
            break
        try:
            record = json.loads(raw)
        except ValueError:
            if number == len(lines) - 1 and not last_complete:
                partial = number
                break
            raise ShardError(f"{path}:{number}: not a JSON record: the file is damaged (only its last line can "
                             "be cut short by a crash)") from None
        if not isinstance(record, dict):
            raise ShardError(f"{path}:{number}: not a JSON object")
        if number == 1:
            if record.get("kind") != HEADER_KIND:
                raise ShardError(f"{path}: not a simulate --jsonl result file (its first line is no header record)")
            if record.get("version") != VERSION:
                raise ShardError(f"{path}: result file version {record.get('version')!r}; this kit reads {VERSION}")
            header = record
        elif _is_run_record(record):
            unit = (record["row"], record.get("trial", 1))  # a file from before trials holds trial 1s
            if unit in runs:
                raise ShardError(f"{path}:{number}: {unit_name(unit, trials_in(header or {}))} is recorded twice")
            runs[unit] = record["run"]
        else:
            raise ShardError(f"{path}:{number}: not a run record")
        good += len(raw) + 1
    if header is None:
        raise ShardError(f"{path}: empty: no header record (was the simulation killed before it started?)")
    return ShardFile(path, header, runs, partial, good)


def _is_run_record(record: Mapping[str, Any]) -> bool:
    trial = record.get("trial", 1)
    return (record.get("kind") == RUN_KIND and isinstance(record.get("row"), int)
            and isinstance(record.get("run"), dict) and isinstance(trial, int) and not isinstance(trial, bool)
            and trial >= 1)


def trials_in(header: Mapping[str, Any]) -> int:
    """K, the trials per row of the simulation a result file's header describes (1 before trials)."""
    trials = (header.get("options") or {}).get("trials", 1)
    return trials if isinstance(trials, int) and not isinstance(trials, bool) and trials >= 1 else 1


def _same_run(header: Mapping[str, Any], other: Mapping[str, Any]) -> List[str]:
    """What differs between two headers of one simulation (dataset, agent, options): empty when they agree."""
    differences = []
    if header.get("dataset", {}).get("sha256") != other.get("dataset", {}).get("sha256"):
        differences.append(f"the dataset (sha256 {str(header.get('dataset', {}).get('sha256'))[:12]} vs "
                           f"{str(other.get('dataset', {}).get('sha256'))[:12]})")
    for key in ("agent", "options"):
        if header.get(key) != other.get(key):
            differences.append(f"the {key} ({json.dumps(header.get(key))} vs {json.dumps(other.get(key))})")
    return differences


class ResultFile:
    """A ``--jsonl`` file being written: its header first, then one flushed line per finished run."""

    def __init__(self, path: str, header: Dict[str, Any], *, resume: bool) -> None:
        self.path = path
        self.done: Dict[Unit, Dict[str, Any]] = {}
        self.dropped_partial = False
        exists = os.path.exists(path) and os.path.getsize(path) > 0
        if exists and not resume:
            raise ShardError(f"--jsonl: {path} exists: add --resume to continue it, or remove it to start over")
        if exists:
            found = read_result_file(path)
            differences = _same_run(found.header, header)
            if found.header.get("shard") != header.get("shard"):
                differences.append(f"the shard ({found.header.get('shard')} vs {header.get('shard')})")
            if differences:
                raise ShardError(f"--resume: {path} was written for another simulation: " + "; ".join(differences))
            self.done = found.runs
            if found.partial_line is not None:  # a crash cut the last record short: that run runs again
                with open(path, "r+b") as f:
                    f.truncate(found.good_bytes)
                self.dropped_partial = True
            self._file: IO[str] = open(path, "a", encoding="utf-8")
        else:
            self._file = open(path, "w", encoding="utf-8")
            self._write(header)

    def _write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")  # one write: one whole line
        self._file.flush()

    def add(self, run: Mapping[str, Any]) -> None:
        """One finished run (its ``row`` and ``trial`` name its unit)."""
        self._write({"kind": RUN_KIND, "row": run["row"], "trial": run.get("trial", 1), "run": run})

    def close(self) -> None:
        self._file.close()


def header_record(*, dataset: Mapping[str, Any], agent: Any, options: Mapping[str, Any],
                  shard: Optional[Shard], rows: Sequence[int], all_rows: Sequence[int]) -> Dict[str, Any]:
    return {"kind": HEADER_KIND, "version": VERSION, "dataset": dict(dataset), "agent": agent,
            "options": dict(options), "shard": str(shard) if shard else None, "rows": list(rows),
            "all_rows": list(all_rows)}


# ---------------------------------------------------------------------------
# Summaries and the merge
# ---------------------------------------------------------------------------


def summarise(runs: Sequence[Mapping[str, Any]], trials: int = 1) -> Dict[str, Any]:
    """The report's ``summary`` of ``runs``, ``trials`` (K) per row (what ``simulate`` writes); ``judge`` when
    runs were judged."""
    summary = {
        "runs": len(runs),
        "trials": trials,
        "ok": sum(1 for r in runs if r["status"] == "ok"),
        "errors": sum(1 for r in runs if r["status"] != "ok"),
        "tool_calls": sum(len(r["tool_calls"]) for r in runs),
        "injected": sum(1 for r in runs for c in r["tool_calls"]
                        if c.get("source") == "injected" and not c.get("replayed")),
        "flagged": sum(1 for r in runs if (r.get("outcome") or {}).get("flags")),
    }
    verdicts = gate.judge_summary(runs, trials)
    if verdicts is not None:
        summary["judge"] = verdicts
    roles = sorted({role for run in runs for role in (run.get("usage") or {})})
    if roles:
        summary["model_usage"] = {role: gate.usage_total(runs, role) for role in roles}
    sessions = [run for run in runs if run.get("session")]
    if sessions:
        summary["sessions"] = {"runs": len(sessions), "turns": sum(run["session"]["turns"] for run in sessions)}
    return summary


def merge_files(paths: Sequence[str], *, allow_partial: bool = False) -> Tuple[Dict[str, Any], List[str]]:
    """The report of the whole dataset from shards' result files, and warnings; raises :class:`ShardError`."""
    if not paths:
        raise ShardError("merge: give the result files to merge (simulate --jsonl ...)")
    files = [read_result_file(p) for p in paths]
    first = files[0]
    for other in files[1:]:
        differences = _same_run(first.header, other.header)
        if differences:
            raise ShardError(f"merge: {other.path} and {first.path} come from different simulations: "
                             + "; ".join(differences))
    warnings: List[str] = []
    owner: Dict[Unit, str] = {}
    runs: Dict[Unit, Dict[str, Any]] = {}
    trials = trials_in(first.header)
    for found in files:
        for unit, run in found.runs.items():
            if unit in owner:
                raise ShardError(f"merge: {unit_name(unit, trials)} is in both {owner[unit]} and {found.path} (the "
                                 "same shard twice, or overlapping splits)")
            owner[unit], runs[unit] = found.path, run
        if found.partial_line is not None:
            warnings.append(f"{found.path}:{found.partial_line}: a record cut short (a crash?); its run counts as "
                            f"missing: finish that shard with simulate --resume")
    all_units = shard_units([int(r) for r in first.header.get("all_rows") or []], trials, None)
    missing = [unit for unit in all_units if unit not in runs]
    if missing:
        names = [str(row) for row, _ in missing] if trials == 1 else [unit_name(u, trials) for u in missing]
        shown = ", ".join(names[:10]) + (" ..." if len(missing) > 10 else "")
        message = f"{len(missing)} of {len(all_units)} {'rows' if trials == 1 else 'runs'} have no record ({shown})"
        if not allow_partial:
            raise ShardError(f"merge: {message}: merge every shard's file, or pass --allow-partial"
                             + (f" ({warnings[0]})" if warnings else ""))
        warnings.append(f"merge: {message}; the report covers the others (--allow-partial)")
    ordered = [runs[unit] for unit in sorted(runs)]
    dataset = dict(first.header["dataset"])
    result: Dict[str, Any] = {
        "kind": "pipelines_port.simulation",
        "version": 1,
        "started_at": min((f.header.get("started_at") or "" for f in files), default=""),
        "duration_ms": round(sum(float(r.get("duration_ms") or 0) for r in ordered), 1),  # the rows' own time
        "jobs": len(files),
        "interrupted": False,
        "dataset": {"file": dataset.get("file"), "rows": dataset.get("rows"), "problems": dataset.get("problems", [])},
        "summary": summarise(ordered, trials),
        "runs": ordered,
        "merged_from": [{"file": f.path, "shard": f.header.get("shard"), "runs": len(f.runs)} for f in files],
    }
    if missing:
        result["summary"]["not_run"] = len(missing)
    result.update(first.header.get("describe") or {})
    return result, warnings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog("merge"),
        description="Merge simulate --jsonl result files (one per shard) into the report of the whole dataset.")
    parser.add_argument("files", nargs="+", metavar="FILE.jsonl", help="the shards' result files")
    parser.add_argument("--json", metavar="OUT", help="write the merged JSON report to OUT (- for stdout)")
    parser.add_argument("--html", metavar="OUT", help="write the merged HTML report to OUT")
    parser.add_argument("--allow-partial", action="store_true",
                        help="merge even when rows have no record (a warning instead of an error)")
    parser.add_argument("--min-pass-rate", metavar="F",
                        help="exit 1 when PASS / rows is below F (0.8 or 80%%; the shards' verdicts, from simulate "
                             "--judge; a row not judged is not a pass)")
    parser.add_argument("--min-pass-hat-k", metavar="F",
                        help="exit 1 when pass^k (the share of rows whose K trials all passed, simulate --trials K) "
                             "is below F")
    parser.add_argument("--junit", metavar="FILE", help="write JUnit XML: one testcase per row (failed unless all its "
                                                       "trials passed)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        min_pass_rate = gate.parse_rate(args.min_pass_rate) if args.min_pass_rate is not None else None
        min_pass_hat_k = gate.parse_rate(args.min_pass_hat_k, "--min-pass-hat-k") \
            if args.min_pass_hat_k is not None else None
    except ValueError as exc:
        print(f"merge: {exc}", file=sys.stderr)
        return 2
    try:
        result, warnings = merge_files(args.files, allow_partial=args.allow_partial)
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)
        report.write_reports(result, args.json, args.html, _write)
        if args.json != "-":
            print(report.render_text(result))
        failed_gate = gate.apply(result, junit=args.junit, min_pass_rate=min_pass_rate, write=_write,
                                 say=lambda text: print(text, file=sys.stderr), command="merge",
                                 min_pass_hat_k=min_pass_hat_k)
    except ShardError as exc:
        print(str(exc) if str(exc).startswith("merge") else f"merge: {exc}", file=sys.stderr)
        return 2
    return 1 if failed_gate or result["summary"]["errors"] else 0


def _write(path: str, text: str) -> None:
    try:
        report.write_file(path, text)  # never a half-written report
    except OSError as exc:
        raise ShardError(f"cannot write {path}: {exc.strerror or exc}") from None


if __name__ == "__main__":
    sys.exit(main())
