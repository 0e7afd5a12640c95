"""``python3 -m conformance dataset FILE.csv [--json]``: check a task-seeding CSV (CONTRACT §6).

Every rule of §6 is checked and every problem reported, each naming its CSV
line, its 1-based data row and its column.  Errors make the exit status 1;
warnings alone leave it 0.  The checks are pure functions
(:func:`parse_bytes`, :func:`validate_rows`) so the simulator and other
commands reuse them.

Columns (the CSV uses the short names):

==================  =========================  ======================================
column              seed axis                  checked
==================  =========================  ======================================
``user``            ``user_instruction``       required column, non-empty cells
``behavior``        ``behavior_instructions``  free text (a warning when it talks to the agent)
``state``           ``initial_state``          JSON ``{entity_type: {entity_id: {attrs}}}``
``failure_rules``   ``failure_rules``          JSON array of rules (triggers, fields, error)
``expected_outcome`` ``expected_outcome``      ``completion`` (default) or ``refusal``, any case
``turn_mode``       (the kit's own)            ``single`` (default) or ``model_as_user``, any case
==================  =========================  ======================================

A column titled with an axis name (``user_instruction``, ``behavior_instructions``,
``initial_state``) is an error with a "did you mean ..." hint, as the platform's
uploader flags it.  The coding-workspace columns ``scenario_ref``,
``workspace_seed`` and ``setup_command`` are legal and accepted without a
warning (their values are kept on the task as ``workspace``); the local
simulator drives ledger tasks only and says so when it meets them.  Any other
column is a warning (it is ignored), with a hint when it looks like a known one.

Reading: UTF-8, with or without a BOM; other encodings, NUL bytes, malformed
quoting, rows with more cells than the header, empty files and unreadable
paths are reported as problems, never raised.  A cell may hold up to 64 MiB;
a JSON cell may nest arrays and objects up to 64 levels deep, and ``null`` is
not an empty cell (``state`` must be an object, ``failure_rules`` an array).  A row with fewer cells than the
header is a warning (the missing cells read as empty); a row whose cells are
all empty is skipped with a warning; blank lines are skipped silently.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import io
import json
import os
import re
import sys
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

from . import engine
from ..kit import prog

__all__ = [
    "COLUMNS",
    "AXIS_NAMES",
    "WORKSPACE_COLUMNS",
    "KIT_COLUMNS",
    "OUTCOMES",
    "TURN_MODES",
    "Problem",
    "Record",
    "Task",
    "Dataset",
    "read_table",
    "parse_table",
    "validate_rows",
    "parse_bytes",
    "load_dataset",
    "main",
]

SAMPLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "samples")  # the bundled sample dataset

COLUMNS = ("user", "behavior", "state", "failure_rules", "expected_outcome")
AXIS_NAMES = {  # axis name -> CSV column
    "user_instruction": "user",
    "behavior_instructions": "behavior",
    "initial_state": "state",
}
WORKSPACE_COLUMNS = ("scenario_ref", "workspace_seed", "setup_command")
KIT_COLUMNS = ("turn_mode",)  # the kit's own: how the simulator runs the row
OUTCOMES = ("completion", "refusal")
TURN_MODES = ("single", "model_as_user")

_NO_ROWS = "the file has a header but no data rows"
_EMPTY = "the file is empty: expected a header row with at least a `user` column"

_AGENT_DIRECTED = re.compile(r"\byou\s+(should|must|need to|have to|are)\b", re.I)
_FIELD_SIZE_LIMIT = 64 << 20  # the csv module's own default (128 KiB) is too small for a big `state` cell
_UNREADABLE = object()  # a JSON cell that could not be parsed (its problem is reported)
MAX_JSON_DEPTH = 64  # nesting levels a JSON cell may have: the simulator copies and renders values recursively


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


class Problem(NamedTuple):
    """One finding.  ``line`` is the CSV line (1 = header), ``row`` the 1-based data row."""

    severity: str  # "error" | "warning"
    message: str
    line: Optional[int] = None
    row: Optional[int] = None
    column: Optional[str] = None

    @property
    def where(self) -> str:
        parts = []
        if self.row is not None:
            parts.append(f"row {self.row}")
        if self.column is not None:
            parts.append(f"column `{self.column}`")
        return ", ".join(parts)

    def __str__(self) -> str:
        line = f"line {self.line}: " if self.line is not None else ""
        where = f"{self.where}: " if self.where else ""
        return f"{line}{self.severity}: {where}{self.message}"

    def to_json(self) -> Dict[str, Any]:
        return {"severity": self.severity, "line": self.line, "row": self.row, "column": self.column,
                "message": self.message}


class Record(NamedTuple):
    """One CSV record: the line it starts on, its cells and its 1-based data row."""

    line: int
    cells: List[str]
    row: int


class Task(NamedTuple):
    """One valid data row, with the axis names of the seed it becomes."""

    row: int
    line: int
    user_instruction: str
    behavior_instructions: str
    initial_state: Dict[str, Any]
    failure_rules: List[Dict[str, Any]]
    expected_outcome: str  # "completion" | "refusal", lower-case
    expected_outcome_given: bool  # False when the cell was empty (the judge then infers)
    workspace: Dict[str, str]  # scenario_ref / workspace_seed / setup_command cells, when present
    turn_mode: str = "single"  # "single" | "model_as_user" (the kit's `turn_mode` column)

    def to_json(self) -> Dict[str, Any]:
        return dict(self._asdict())


class Dataset(NamedTuple):
    """A checked CSV: its header, the valid rows as tasks, every problem, and how many data rows it has."""

    name: str
    header: List[str]
    tasks: List[Task]
    problems: List[Problem]
    rows: int

    @property
    def errors(self) -> List[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> List[Problem]:
        return [p for p in self.problems if p.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_json(self) -> Dict[str, Any]:
        return {
            "file": self.name,
            "ok": self.ok,
            "rows": self.rows,
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "columns": self.header,
            "problems": [p.to_json() for p in self.problems],
            "tasks": [t.to_json() for t in self.tasks],
        }


# ---------------------------------------------------------------------------
# Bytes -> records
# ---------------------------------------------------------------------------


def _decode(data: bytes) -> Tuple[Optional[str], List[Problem]]:
    """The text of a CSV file (``None`` when it cannot be read as text at all) and encoding problems."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return None, [Problem("error", "the file is UTF-16 (it starts with a UTF-16 byte-order mark); "
                                       "save it as UTF-8")]
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        text = data.decode("utf-8")
        problems: List[Problem] = []
    except UnicodeDecodeError:
        bad, pos = [], 0
        while len(bad) < 100:
            try:
                data[pos:].decode("utf-8")
                break
            except UnicodeDecodeError as exc:
                bad.append(pos + exc.start)
                pos += exc.end
        lines = sorted({data[:offset].count(b"\n") + 1 for offset in bad})
        first = bad[0]
        shown = ", ".join(str(n) for n in lines[:10]) + (", ..." if len(lines) > 10 else "")
        problems = [Problem(
            "error",
            f"the file is not UTF-8: byte 0x{data[first]:02x} at offset {first} is not valid UTF-8 "
            f"(bad bytes on line(s) {shown}); save the file as UTF-8 (a UTF-8 BOM is fine)",
            line=lines[0],
        )]
        text = data.decode("utf-8", errors="replace")
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        problems.append(Problem("error", "the file contains NUL bytes (is it a spreadsheet or UTF-16 file "
                                         "rather than CSV?)", line=line))
        text = text.replace("\x00", "")
    return text, problems


def _csv_error_message(exc: csv.Error) -> str:
    text = str(exc)
    if "unexpected end of data" in text:
        return "malformed CSV: a quoted cell is never closed"
    if "expected after" in text:
        return f"malformed CSV: {text} (a quote inside a quoted cell must be doubled: \"\")"
    if "field larger than field limit" in text:
        return f"a cell is too large for the CSV reader ({text})"
    return f"malformed CSV: {text}"


def read_table(text: str) -> Tuple[List[str], List[Record], List[Problem]]:
    """Split CSV text into the header, the records (blank lines dropped) and parse problems.

    Cells may be up to 64 MiB: the csv module's field size limit is raised
    while reading and restored afterwards (it is process-global).
    """
    previous = csv.field_size_limit(_FIELD_SIZE_LIMIT)
    try:
        return _read_records(text)
    finally:
        csv.field_size_limit(previous)


def _read_records(text: str) -> Tuple[List[str], List[Record], List[Problem]]:
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    records: List[Record] = []
    problems: List[Problem] = []
    header: Optional[List[str]] = None
    row = 0
    last_line = 0
    while True:
        start = last_line + 1
        try:
            cells = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            last_line = reader.line_num
            if header is None:
                problems.append(Problem("error", "the header row: " + _csv_error_message(exc), line=start))
                return [], [], problems
            row += 1
            problems.append(Problem("error", _csv_error_message(exc) + "; the row is skipped", line=start, row=row))
            continue
        last_line = reader.line_num
        if not cells:
            continue  # a blank line
        if header is None:
            header = cells
            continue
        row += 1
        records.append(Record(start, cells, row))
    if header is None:
        problems.append(Problem("error", _EMPTY, line=1))
        return [], [], problems
    return header, records, problems


# ---------------------------------------------------------------------------
# Records -> tasks
# ---------------------------------------------------------------------------


def _hint(name: str) -> Optional[str]:
    """The known column ``name`` most likely means, if any."""
    normal = re.sub(r"[\s-]+", "_", name.strip().lower())
    if normal in COLUMNS or normal in WORKSPACE_COLUMNS or normal in KIT_COLUMNS:
        return normal
    if normal in AXIS_NAMES:
        return AXIS_NAMES[normal]
    known = list(COLUMNS) + list(AXIS_NAMES) + list(WORKSPACE_COLUMNS) + list(KIT_COLUMNS)
    close = difflib.get_close_matches(normal, known, n=1, cutoff=0.75)
    if close:
        return AXIS_NAMES.get(close[0], close[0])
    return None


def _header_problems(header: Sequence[str]) -> Tuple[Dict[str, int], List[Problem]]:
    """``{known column: index}`` and the header's problems."""
    problems: List[Problem] = []
    index: Dict[str, int] = {}
    seen: Dict[str, int] = {}
    for i, raw in enumerate(header):
        name = raw.strip()
        if name != raw:
            problems.append(Problem("warning", f"the name {raw!r} has surrounding whitespace; read as `{name}`",
                                    line=1, column=name or None))
        if not name:
            problems.append(Problem("warning", f"column {i + 1} has no name; its cells are ignored", line=1))
            continue
        if name in seen:
            problems.append(Problem("error", f"`{name}` appears twice (columns {seen[name] + 1} and {i + 1})",
                                    line=1, column=name))
            continue
        seen[name] = i
        if name in COLUMNS or name in WORKSPACE_COLUMNS or name in KIT_COLUMNS:
            index[name] = i
        elif name in AXIS_NAMES:
            problems.append(Problem(
                "error",
                f"`{name}` is the seed axis name; the CSV column is the short name: did you mean `{AXIS_NAMES[name]}`?",
                line=1, column=name))
        else:
            hint = _hint(name)
            tail = f": did you mean `{hint}`?" if hint else f" (known columns: {', '.join(COLUMNS)})"
            problems.append(Problem("warning", f"unknown column, ignored{tail}", line=1, column=name))
    if "user" not in index:
        near = [n.strip() for n in header if n.strip() and n.strip() != "user" and _hint(n) == "user"]
        tail = f" (found `{near[0]}`: did you mean `user`?)" if near else ""
        problems.append(Problem("error", f"the required column `user` is missing{tail}", line=1))
    return index, problems


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _json_cell(text: str, column: str, line: int, row: int) -> Tuple[Any, List[Problem]]:
    """Parse a JSON cell: its value (``_UNREADABLE`` when it cannot be parsed) and its problems.

    Duplicate keys are warnings; NaN/Infinity, syntax errors and nesting too deep to parse are errors.
    """
    duplicates: List[str] = []

    def pairs(items: List[Tuple[str, Any]]) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for key, value in items:
            if key in out:
                duplicates.append(key)
            out[key] = value
        return out

    try:
        value = json.loads(text, object_pairs_hook=pairs, parse_constant=_reject_constant)
    except ValueError as exc:
        return _UNREADABLE, [Problem("error", f"not valid JSON: {exc}", line=line, row=row, column=column)]
    except RecursionError:
        value = None
        depth = MAX_JSON_DEPTH + 1
    else:
        depth = _depth(value)
    if depth > MAX_JSON_DEPTH:
        message = f"the JSON is nested more than {MAX_JSON_DEPTH} levels deep (arrays and objects inside each other)"
        return _UNREADABLE, [Problem("error", message, line=line, row=row, column=column)]
    problems = [Problem("warning", f"the key {key!r} appears twice in one object; the last one wins",
                        line=line, row=row, column=column) for key in duplicates]
    return value, problems


def _depth(value: Any) -> int:
    """How many arrays and objects deep ``value`` goes (iteratively: the value may be deeper than the stack)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def _findings(findings: Iterable[engine.Finding], column: str, line: int, row: int) -> List[Problem]:
    """Engine findings as problems; the message starts with the JSON path inside the cell, if any."""
    problems = []
    for f in findings:
        path = "" if not f.where else column + (f.where if f.where.startswith("[") else "." + f.where) + ": "
        problems.append(Problem(f.severity, path + f.message, line=line, row=row, column=column))
    return problems


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _row(index: Dict[str, int], header_width: int, record: Record) -> Tuple[Optional[Task], List[Problem]]:
    """The task of one record (``None`` when it has errors or is empty) and its problems."""
    line, cells, row = record
    problems: List[Problem] = []
    if len(cells) > header_width:
        extra = cells[header_width:]
        if any(c.strip() for c in extra):
            problems.append(Problem(
                "error", f"the row has {_count(len(cells), 'cell')} but the header has {header_width} columns "
                         "(a comma inside a cell needs the cell in double quotes)", line=line, row=row))
    elif len(cells) < header_width:
        problems.append(Problem(
            "warning", f"the row has {_count(len(cells), 'cell')} but the header has {header_width} columns; "
                       "the missing cells read as empty", line=line, row=row))
    if not any(c.strip() for c in cells):
        return None, [Problem("warning", "every cell is empty; the row is skipped", line=line, row=row)]

    def cell(name: str) -> str:
        i = index.get(name)
        return cells[i] if i is not None and i < len(cells) else ""

    user = cell("user")
    if "user" in index and not user.strip():
        problems.append(Problem("error", "the user instruction is empty", line=line, row=row, column="user"))

    behavior = cell("behavior")
    if _AGENT_DIRECTED.search(behavior):
        problems.append(Problem(
            "warning", "reads like an instruction to the agent; `behavior` describes how the simulated tools "
                       "respond and is never forwarded to the agent", line=line, row=row, column="behavior"))

    state: Any = {}
    if cell("state").strip():
        state, found = _json_cell(cell("state"), "state", line, row)
        problems += found
        if state is not _UNREADABLE:  # null included: it is no object
            problems += _findings(engine.state_findings(state), "state", line, row)

    rules: Any = []
    if cell("failure_rules").strip():
        rules, found = _json_cell(cell("failure_rules"), "failure_rules", line, row)
        problems += found
        if rules is not _UNREADABLE:  # null included: it is no array
            problems += _findings(engine.rule_findings(rules), "failure_rules", line, row)

    outcome = _choice(cell("expected_outcome"), OUTCOMES, "expected_outcome", line, row, problems)
    turn_mode = _choice(cell("turn_mode"), TURN_MODES, "turn_mode", line, row, problems)

    if any(p.severity == "error" for p in problems):
        return None, problems
    task = Task(
        row=row,
        line=line,
        user_instruction=user,
        behavior_instructions=behavior,
        initial_state=state,
        failure_rules=rules,
        expected_outcome=outcome or "completion",
        expected_outcome_given=bool(outcome),
        workspace={name: cell(name) for name in WORKSPACE_COLUMNS if name in index and cell(name).strip()},
        turn_mode=turn_mode or "single",
    )
    return task, problems


def _choice(text: str, choices: Sequence[str], column: str, line: int, row: int, problems: List[Problem]) -> str:
    """A cell that names one of ``choices`` (any case), lower-cased; ``""`` when empty or not one (a problem)."""
    value = text.strip().lower()
    if value and value not in choices:
        close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
        tail = f": did you mean `{close[0]}`?" if close else ""
        named = " or ".join(f"`{c}`" for c in choices)
        problems.append(Problem("error", f"must be {named} (any case), got {text.strip()!r}{tail}", line=line,
                                row=row, column=column))
        return ""
    return value


RecordLike = Union[Record, Sequence[str]]


def parse_table(header: Sequence[str], records: Sequence[RecordLike]) -> Tuple[List[Task], List[Problem]]:
    """The valid rows as tasks, and every problem of the header and rows.

    ``records`` are :class:`Record` values or plain cell lists (then taken to
    be data rows 1, 2, ... on lines 2, 3, ...).  A row with an error gives no task.
    """
    index, problems = _header_problems(header)
    tasks: List[Task] = []
    width = len(header)
    for i, record in enumerate(records):
        if not isinstance(record, Record):
            record = Record(i + 2, list(record), i + 1)
        task, found = _row(index, width, record)
        problems += found
        if task is not None and "user" in index:
            tasks.append(task)
    if not records:
        problems.append(Problem("error", _NO_ROWS, line=1))
    return tasks, problems


def validate_rows(header: Sequence[str], records: Sequence[RecordLike]) -> List[Problem]:
    """Every problem of a header and its rows (see :func:`parse_table`)."""
    return parse_table(header, records)[1]


def parse_bytes(data: bytes, name: str = "<csv>") -> Dataset:
    """Check the bytes of a CSV file: decoding, CSV syntax, then every row."""
    text, problems = _decode(data)
    if text is None:
        return Dataset(name, [], [], problems, 0)
    if not text.strip():
        problems.append(Problem("error", _EMPTY, line=1))
        return Dataset(name, [], [], problems, 0)
    header, records, read_problems = read_table(text)
    problems += read_problems
    if not header:
        return Dataset(name, [], [], problems, 0)
    tasks, row_problems = parse_table(header, records)
    rejected = [p for p in read_problems if p.row is not None]
    if rejected:  # the rows the CSV reader rejected were data rows after all
        row_problems = [p for p in row_problems if p.message != _NO_ROWS]
    problems += row_problems
    problems.sort(key=lambda p: (p.line or 0, p.row or 0))
    return Dataset(name, [h.strip() for h in header], tasks, problems, len(records) + len(rejected))


def load_dataset(path: str) -> Dataset:
    """Read and check the CSV file at ``path``; an unreadable path is a problem, not an exception."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        return Dataset(str(path), [], [], [Problem("error", f"cannot read the file: {reason}")], 0)
    return parse_bytes(data, str(path))


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def format_problems(dataset: Dataset) -> List[str]:
    """One line per problem, ``FILE:LINE: severity: row N, column `c`: message``."""
    lines = []
    for p in dataset.problems:
        at = f"{dataset.name}:{p.line}" if p.line is not None else dataset.name
        where = f"{p.where}: " if p.where else ""
        lines.append(f"{at}: {p.severity}: {where}{p.message}")
    return lines


def summary(dataset: Dataset) -> str:
    """``FILE: N rows, E errors, W warnings``."""
    return (f"{dataset.name}: {_count(dataset.rows, 'row')}, {_count(len(dataset.errors), 'error')}, "
            f"{_count(len(dataset.warnings), 'warning')}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog("dataset"),
        description="Check a task-seeding CSV against the dataset rules (CONTRACT §6). "
                    "Exit 1 when any error is found.",
    )
    parser.add_argument("file", metavar="FILE.csv", help="the dataset to check")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON report (problems and parsed tasks) instead of text")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    dataset = load_dataset(args.file)
    if args.json:
        print(json.dumps(dataset.to_json(), indent=2, ensure_ascii=False))
    else:
        for line in format_problems(dataset):
            print(line)
        print(summary(dataset))
    return 0 if dataset.ok else 1


if __name__ == "__main__":
    sys.exit(main())
