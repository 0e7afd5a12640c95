"""The dataset validator (CONTRACT §6): every rule has a failing and a passing CSV in tests/data/datasets/."""

from __future__ import annotations

import json
import pathlib
from typing import List, Optional, Tuple

import pytest

from conformance.simulator import dataset as ds

DATA = pathlib.Path(__file__).resolve().parent / "data" / "datasets"


def check(name: str) -> ds.Dataset:
    return ds.load_dataset(str(DATA / name))


def where(d: ds.Dataset, severity: str = "error") -> List[Tuple[Optional[int], Optional[int], Optional[str]]]:
    """(line, row, column) of every problem of one severity."""
    return [(p.line, p.row, p.column) for p in d.problems if p.severity == severity]


def messages(d: ds.Dataset, severity: str = "error") -> List[str]:
    return [p.message for p in d.problems if p.severity == severity]


# ---------------------------------------------------------------------------
# Passing files
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ok_minimal.csv", "ok_all_columns.csv", "ok_bom.csv", "ok_crlf.csv",
                                  "ok_multiline.csv", "ok_workspace_columns.csv"])
def test_valid_files_have_no_problem_at_all(name: str) -> None:
    d = check(name)
    assert d.problems == []
    assert d.ok and d.tasks and len(d.tasks) == d.rows


def test_all_columns_become_the_seed_axes() -> None:
    tasks = check("ok_all_columns.csv").tasks
    first, refusal, bare, star = tasks
    assert first.user_instruction == "Refund order 4521"
    assert first.behavior_instructions.startswith("refund_order rejects")
    assert first.initial_state == {"order": {"4521": {"status": "shipped", "amount": 79.5}}}
    assert [r["trigger"] for r in first.failure_rules] == \
        ["after_n_calls", "random", "random", "random", "after_state_change"]
    assert (first.expected_outcome, first.expected_outcome_given) == ("completion", True)
    # case-insensitive on input, stored lower-case; empty means the default, marked as not given
    assert (refusal.expected_outcome, refusal.expected_outcome_given) == ("refusal", True)
    assert (bare.expected_outcome, bare.expected_outcome_given) == ("completion", False)
    assert (bare.initial_state, bare.failure_rules) == ({}, [])
    assert star.expected_outcome == "completion"  # " Completion " with spaces


def test_bom_is_dropped_and_the_header_read() -> None:
    d = check("ok_bom.csv")
    assert d.header == ["user", "state"]
    assert d.tasks[0].initial_state["order"]["4521"]["status"] == "shipped"


def test_line_numbers_follow_multi_line_cells() -> None:
    for name in ("ok_multiline.csv", "ok_crlf.csv"):
        tasks = check(name).tasks
        assert [(t.row, t.line) for t in tasks] == [(1, 2), (2, 3), (3, 6 if name == "ok_multiline.csv" else 5)]
        assert "\n" in tasks[1].user_instruction


def test_workspace_columns_are_legal_and_kept_on_the_task() -> None:
    tasks = check("ok_workspace_columns.csv").tasks
    assert tasks[0].workspace == {"scenario_ref": "repo-a", "workspace_seed": "seed-1", "setup_command": "make setup"}
    assert tasks[1].workspace == {}


# ---------------------------------------------------------------------------
# Header rules
# ---------------------------------------------------------------------------


def test_missing_user_column_is_an_error() -> None:
    d = check("bad_missing_user_column.csv")
    assert where(d) == [(1, None, None)]
    assert messages(d) == ["the required column `user` is missing"]
    assert d.tasks == []


@pytest.mark.parametrize("name, axis, column", [
    ("bad_axis_user_instruction.csv", "user_instruction", "user"),
    ("bad_axis_behavior_instructions.csv", "behavior_instructions", "behavior"),
    ("bad_axis_initial_state.csv", "initial_state", "state"),
])
def test_axis_names_as_headers_get_a_did_you_mean_hint(name: str, axis: str, column: str) -> None:
    d = check(name)
    hinted = [p for p in d.errors if p.column == axis]
    assert len(hinted) == 1 and hinted[0].line == 1
    assert f"did you mean `{column}`?" in hinted[0].message
    if column == "user":  # and the required column is then missing, with the same hint
        assert any("`user` is missing (found `user_instruction`: did you mean `user`?)" in m for m in messages(d))


def test_duplicate_column_is_an_error() -> None:
    d = check("bad_duplicate_column.csv")
    assert where(d) == [(1, None, "user")]
    assert "appears twice (columns 1 and 3)" in messages(d)[0]


def test_unknown_columns_are_warnings_with_hints() -> None:
    d = check("warn_unknown_column.csv")
    assert d.ok and d.errors == []
    assert where(d, "warning") == [(1, None, "notes"), (1, None, "Stat")]
    assert "did you mean `state`?" in messages(d, "warning")[1]
    assert "did you mean" not in messages(d, "warning")[0]


# ---------------------------------------------------------------------------
# Cell rules
# ---------------------------------------------------------------------------


def test_empty_user_cells_are_errors_and_the_rows_dropped() -> None:
    d = check("bad_empty_user.csv")
    assert where(d) == [(2, 1, "user"), (3, 2, "user")]
    assert [t.row for t in d.tasks] == [3]


def test_state_must_be_json() -> None:
    d = check("bad_state_json.csv")
    assert where(d) == [(2, 1, "state"), (3, 2, "state")]
    assert messages(d)[0].startswith("not valid JSON: Expecting property name")
    assert messages(d)[1] == "not valid JSON: NaN is not valid JSON"
    assert [t.row for t in d.tasks] == [3]


def test_state_shape_is_type_id_attrs() -> None:
    d = check("bad_state_shape.csv")
    assert where(d) == [(2, 1, "state"), (3, 2, "state"), (4, 3, "state")]
    assert "got an array" in messages(d)[0]
    assert messages(d)[1].startswith("state.order: must be an object {entity_id: {attrs}}")
    assert messages(d)[2].startswith("state.order.1: must be an object of attributes")


def test_failure_rules_must_be_a_json_array_of_objects() -> None:
    d = check("bad_rules_json.csv")
    assert where(d) == [(2, 1, "failure_rules"), (3, 2, "failure_rules"), (4, 3, "failure_rules")]
    assert messages(d)[0].startswith("not valid JSON")
    assert "must be a JSON array of rules, got an object" in messages(d)[1]
    assert messages(d)[2].startswith("failure_rules[0]: a rule must be an object")


def test_null_is_no_object_and_no_array() -> None:
    d = check("bad_null_cells.csv")
    assert where(d) == [(2, 1, "state"), (3, 2, "failure_rules")]
    assert messages(d)[0].startswith("must be a JSON object") and messages(d)[0].endswith("got null")
    assert messages(d)[1] == "must be a JSON array of rules, got null"
    assert [t.row for t in d.tasks] == [3]


@pytest.mark.parametrize("column", ["state", "failure_rules"])
def test_json_nested_too_deeply_is_a_problem_on_its_cell(column: str) -> None:
    for depth in (65, 5000, 200000):  # past the limit; past the stack while parsing
        cell = "[" * depth + "]" * depth
        d = ds.parse_bytes(f'user,{column}\nhi,"{cell}"\nok,\n'.encode())
        assert where(d) == [(2, 1, column)]
        assert messages(d) == [f"the JSON is nested more than {ds.MAX_JSON_DEPTH} levels deep "
                               "(arrays and objects inside each other)"]
        assert [t.row for t in d.tasks] == [2]
    deep = '{"order": {"1": {"a": ' + "[" * 61 + "]" * 61 + "}}}"  # 64 levels: fine
    assert ds.parse_bytes(f'user,state\nhi,"{deep.replace(chr(34), chr(34) * 2)}"\n'.encode()).ok


def test_a_cell_over_the_csv_modules_default_limit_is_read_and_the_limit_restored() -> None:
    import csv

    before = csv.field_size_limit()
    note = "x" * (300 << 10)  # over the csv module's default 128 KiB field limit
    cell = json.dumps({"order": {"1": {"note": note}}}).replace('"', '""')
    d = ds.parse_bytes(f'user,state\nhi,"{cell}"\n'.encode())
    assert d.problems == [] and d.tasks[0].initial_state["order"]["1"]["note"] == note
    assert csv.field_size_limit() == before


@pytest.mark.parametrize("name, expected", [
    ("bad_rule_trigger.csv", [
        "failure_rules[0].trigger: must be one of after_n_calls, random, after_state_change, got nothing",
        'failure_rules[0].trigger: must be one of after_n_calls, random, after_state_change, got "after_calls"']),
    ("bad_rule_after_n_calls.csv", ["failure_rules[0].n: must be a positive integer, got 0",
                                    'failure_rules[0].n: must be a positive integer, got "3"',
                                    "failure_rules[0].n: must be a positive integer, got 1.5",
                                    "failure_rules[0].n: must be a positive integer, got true",
                                    "failure_rules[0]: `after_n_calls` needs `duration` (a positive integer)",
                                    "failure_rules[0].duration: must be a positive integer, got 0",
                                    "failure_rules[0]: `after_n_calls` needs `n` (a positive integer)"]),
    ("bad_rule_random.csv", ["failure_rules[0].probability: must be a number from 0 to 1, got 1.5",
                             "failure_rules[0].probability: must be a number from 0 to 1, got -0.1",
                             'failure_rules[0].probability: must be a number from 0 to 1, got "0.5"',
                             "failure_rules[0].probability: must be a number from 0 to 1, got true",
                             "failure_rules[0].probability: must be a number from 0 to 1, got nothing"]),
    ("bad_rule_after_state_change.csv", [
        "failure_rules[0].condition: must be a ledger flag name (a non-empty string), got nothing",
        'failure_rules[0].condition: must be a ledger flag name (a non-empty string), got "  "',
        "failure_rules[0].condition: must be a ledger flag name (a non-empty string), got 5",
        "failure_rules[0]: `after_state_change` needs `duration` (a positive integer)"]),
    ("bad_rule_tool.csv", ['failure_rules[0].tool: must be a tool name or "*", got nothing',
                           'failure_rules[0].tool: must be a tool name or "*", got 5',
                           'failure_rules[0].tool: must be a tool name or "*", got ""']),
    ("bad_rule_error.csv", [
        "failure_rules[0]: needs `error`: {code, message} or {code: 200, response}",
        "failure_rules[0].error: must be an object {code, message} or {code: 200, response}, got a string",
        "failure_rules[0].error: needs `code` (200 for a forced response, or an HTTP error status)",
        'failure_rules[0].error.code: must be an integer HTTP status from 100 to 599, got "502"',
        "failure_rules[0].error.code: must be an integer HTTP status from 100 to 599, got 99",
        "failure_rules[0].error.code: must be an integer HTTP status from 100 to 599, got 600",
        "failure_rules[0].error: code 200 (forced success) needs `response`, the value the agent receives",
        "failure_rules[0].error.message: code 502 needs `message`, a non-empty string, got nothing",
        'failure_rules[0].error.message: code 500 needs `message`, a non-empty string, got ""']),
])
def test_each_rule_field_is_checked_one_row_per_case(name: str, expected: List[str]) -> None:
    d = check(name)
    assert messages(d) == expected
    assert where(d) == [(i + 2, i + 1, "failure_rules") for i in range(len(expected))]
    assert d.tasks == []


def test_rule_oddities_that_do_no_harm_are_warnings() -> None:
    d = check("warn_rule_extras.csv")
    assert d.ok and len(d.tasks) == 1
    assert sorted(messages(d, "warning")) == sorted([
        "failure_rules[0].error.response: is ignored: only code 200 returns a response",
        "failure_rules[0]: `probability` is not used by `after_n_calls`: ignored",
        "failure_rules[0]: unknown key(s) `comment` ignored",
    ])


def test_expected_outcome_values_with_hints() -> None:
    d = check("bad_expected_outcome.csv")
    assert where(d) == [(2, 1, "expected_outcome"), (3, 2, "expected_outcome"), (4, 3, "expected_outcome")]
    assert messages(d)[0].endswith("got 'refuse': did you mean `refusal`?")
    assert messages(d)[1].endswith("got 'yes'")
    assert messages(d)[2].endswith("did you mean `completion`?")
    assert [(t.row, t.expected_outcome) for t in d.tasks] == [(4, "refusal")]


def test_behavior_written_to_the_agent_is_a_warning() -> None:
    d = check("warn_behavior_to_agent.csv")
    assert d.ok and where(d, "warning") == [(2, 1, "behavior")]


def test_duplicate_json_keys_are_a_warning() -> None:
    d = check("warn_duplicate_json_key.csv")
    assert d.ok and where(d, "warning") == [(2, 1, "state")]
    assert d.tasks[0].initial_state == {"order": {"2": {}}}


# ---------------------------------------------------------------------------
# Reading: shapes, encodings, unreadable input
# ---------------------------------------------------------------------------


def test_rows_with_extra_cells_are_errors_but_trailing_empty_cells_are_fine() -> None:
    d = check("bad_ragged.csv")
    assert where(d) == [(2, 1, None)]
    assert "3 cells but the header has 2 columns" in messages(d)[0]
    assert [t.row for t in d.tasks] == [2]


def test_short_rows_are_a_warning_and_read_as_empty() -> None:
    d = check("warn_short_row.csv")
    assert d.ok and where(d, "warning") == [(2, 1, None)]
    assert "1 cell but the header has 3 columns" in messages(d, "warning")[0]


def test_empty_rows_are_skipped_with_a_warning_and_blank_lines_silently() -> None:
    d = check("warn_empty_row.csv")
    assert where(d, "warning") == [(3, 2, None)]
    assert [(t.row, t.line, t.user_instruction) for t in d.tasks] == [(1, 2, "hello"), (3, 5, "bye")]


def test_malformed_quoting_is_reported_per_row_and_reading_goes_on() -> None:
    d = check("bad_quote.csv")
    assert where(d) == [(2, 1, None), (4, 3, None)]
    assert 'must be doubled: ""' in messages(d)[0]
    assert "a quoted cell is never closed" in messages(d)[1]
    assert [(t.row, t.user_instruction) for t in d.tasks] == [(2, "fine")]
    assert d.rows == 3


def test_not_utf8_names_the_line_of_each_bad_byte() -> None:
    d = check("bad_latin1.csv")
    assert where(d) == [(2, None, None)]
    assert "not UTF-8: byte 0xe9" in messages(d)[0] and "line(s) 2, 4" in messages(d)[0]


def test_utf16_and_nul_bytes_are_reported() -> None:
    assert "UTF-16" in messages(check("bad_utf16.csv"))[0]
    d = check("bad_nul.csv")
    assert where(d) == [(2, None, None)] and "NUL" in messages(d)[0]


@pytest.mark.parametrize("name, text", [("empty.csv", "the file is empty"),
                                        ("bad_header_only.csv", "a header but no data rows")])
def test_empty_files_are_errors(name: str, text: str) -> None:
    d = check(name)
    assert [p.severity for p in d.problems] == ["error"] and text in d.problems[0].message


def test_unreadable_paths_are_problems_not_exceptions(tmp_path: pathlib.Path) -> None:
    for path in (tmp_path / "missing.csv", tmp_path):
        d = ds.load_dataset(str(path))
        assert not d.ok and d.problems[0].message.startswith("cannot read the file: ")


def test_every_problem_of_a_file_is_reported_in_line_order() -> None:
    d = check("bad_many_problems.csv")
    assert where(d) == [(1, None, "initial_state"), (4, 3, "user"), (4, 3, "state"), (4, 3, "failure_rules"),
                        (4, 3, "failure_rules"), (4, 3, "failure_rules"), (4, 3, "expected_outcome")]
    assert where(d, "warning") == [(2, 1, None)]
    assert [t.row for t in d.tasks] == [2]


def test_validate_rows_is_pure_and_numbers_plain_rows() -> None:
    problems = ds.validate_rows(["user", "state"], [["hi", "{}"], ["", "[]"]])
    assert [(p.line, p.row, p.column) for p in problems] == [(3, 2, "user"), (3, 2, "state")]
    assert ds.validate_rows(["user"], []) == [ds.Problem("error", "the file has a header but no data rows", line=1)]


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------


def test_cli_text_output_and_exit_status(capsys: pytest.CaptureFixture) -> None:
    assert ds.main([str(DATA / "ok_minimal.csv")]) == 0
    assert capsys.readouterr().out.strip().endswith("ok_minimal.csv: 1 row, 0 errors, 0 warnings")
    assert ds.main([str(DATA / "warn_unknown_column.csv")]) == 0  # warnings alone pass
    capsys.readouterr()
    assert ds.main([str(DATA / "bad_empty_user.csv")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{DATA / 'bad_empty_user.csv'}:2: error: row 1, column `user`: the user instruction is empty"
    assert out[-1].endswith("3 rows, 2 errors, 0 warnings")


def test_cli_json_output(capsys: pytest.CaptureFixture) -> None:
    assert ds.main([str(DATA / "bad_expected_outcome.csv"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["ok"], report["rows"], report["errors"], report["warnings"]) == (False, 4, 3, 0)
    assert report["problems"][0] == {"severity": "error", "line": 2, "row": 1, "column": "expected_outcome",
                                     "message": "must be `completion` or `refusal` (any case), got 'refuse': "
                                                "did you mean `refusal`?"}
    assert report["tasks"][0]["row"] == 4 and report["tasks"][0]["expected_outcome"] == "refusal"


def test_cli_bad_arguments_and_paths_never_raise(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path) -> None:
    assert ds.main([]) == 2
    assert "usage" in capsys.readouterr().err
    assert ds.main([str(tmp_path / "nope.csv")]) == 1
    out = capsys.readouterr().out
    assert "cannot read the file: No such file or directory" in out and "Traceback" not in out


def test_the_sample_dataset_is_valid() -> None:
    d = ds.load_dataset(str(DATA.parent.parent.parent / "conformance" / "simulator" / "samples" / "orders.csv"))
    assert d.problems == [] and len(d.tasks) == 7 and [t.turn_mode for t in d.tasks][-1] == "model_as_user"
    triggers = {r["trigger"] for t in d.tasks for r in t.failure_rules}
    assert triggers == {"after_n_calls", "random", "after_state_change"}
    assert [t.expected_outcome for t in d.tasks].count("refusal") == 1
