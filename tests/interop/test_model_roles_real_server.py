"""The kit's model-backed roles against a real OpenAI-compatible server that no one here wrote: llama.cpp's
(``llama-cpp-python[server]``), on the tiny model ``tests/interop/model_server.py`` writes (no download).

The model's weights are random, so its verdicts mean nothing: what is proven is the wire.  The client finds
the server's structured-output form by itself (the server refuses OpenAI's ``json_schema`` with a 500 and
constrains sampling to ``{"type": "json_object", "schema": ...}``), parses what comes back, counts its
tokens, and every role ends each row either answered within its schema or with a reason (never a crash,
never a PASS it did not get).  Skipped when ``llama_cpp`` or ``gguf`` is not installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import pytest

from conformance.models import roles
from conformance.models.client import ChatClient, Endpoint, ModelError
from conformance.simulator import simulate
from tests.interop.hosts import ROOT
from tests.interop.model_server import ModelServer

FIXTURES = ROOT / "conformance" / "simulator" / "samples" / "orders_fixtures.json"
TOOLS = ROOT / "templates" / "tools_schema.json"


def endpoint(server: ModelServer) -> Endpoint:
    return Endpoint(server.base_url, server.model, None, timeout_s=120.0, concurrency=2, max_tokens=1000)


def test_the_client_finds_the_servers_form_and_gets_a_verdict_of_the_schema(
        openai_compatible_server: ModelServer) -> None:
    client = ChatClient(endpoint(openai_compatible_server), sleep=lambda s: None)
    case = {"user_instruction": "What is the status of order 4521?", "trajectory": [],
            "final_response": "Order 4521 has shipped."}
    try:
        answer = client.ask_json([{"role": "system", "content": "Grade the run."},
                                  {"role": "user", "content": json.dumps(case)}], roles.judge_schema(False),
                                 name=roles.JUDGE)
    except ModelError as exc:  # a random model may miss the integer range twice: named, never a crash
        assert "schema" in str(exc) and "task_completion" in str(exc)
        usage = exc.usage
    else:
        assert answer.value["verdict"] in ("PASS", "FAIL") and 1 <= answer.value["task_completion"] <= 5
        usage = answer.usage
    assert client.form == "json_object+schema"  # json_schema was refused (a 500 naming response_format)
    assert usage["prompt_tokens"] > 100 and usage["completion_tokens"] > 0


def run_simulate(tmp_path: Path, server: ModelServer, capsys: pytest.CaptureFixture, *extra: str) -> Dict[str, Any]:
    rows = ROOT / "conformance" / "simulator" / "samples" / "orders.csv"
    lines = rows.read_text(encoding="utf-8").splitlines()
    dataset = tmp_path / "rows.csv"
    dataset.write_text("\n".join([lines[0], lines[1], lines[6], lines[7]]) + "\n", encoding="utf-8")  # rows 1, 6, 7
    out = tmp_path / "r.json"
    code = simulate.main([str(a) for a in ("--csv", dataset, "--code", ROOT / "templates" / "openai_chat.py",
                                           "--model", "scripted", "--responses", FIXTURES, "--tools", TOOLS,
                                           "--no-model-cache", "--json", out, *extra)])
    _, err = capsys.readouterr()
    assert code in (0, 1) and "Traceback" not in err, err
    return json.loads(out.read_text(encoding="utf-8"))


def test_every_role_through_the_real_server(tmp_path: Path, openai_compatible_server: ModelServer,
                                            capsys: pytest.CaptureFixture) -> None:
    server = openai_compatible_server
    report = run_simulate(tmp_path, server, capsys, "--judge", server.model, "--judge-url", server.base_url,
                          "--judge-key-env", "", "--simulator", server.model, "--simulator-url", server.base_url,
                          "--simulator-key-env", "", "--user-model", server.model, "--user-url", server.base_url,
                          "--user-key-env", "", "--max-turns", "2", "--judge-jobs", "2")
    runs = report["runs"]
    assert len(runs) == 3
    for run in runs:  # the judge: a verdict of the schema, or not judged with the reason; never a silent PASS
        judge = run["judge"]
        assert (judge["verdict"] in ("PASS", "FAIL") and 1 <= judge["task_completion"] <= 5) or (
            judge["verdict"] is None and judge["error"])
    model_calls = [c for r in runs for c in r["tool_calls"] if c.get("answered_by") == "model"]
    assert model_calls, "the row with change_shipping_address reached the simulated backend"
    for call in model_calls:  # answered within the ledger's rules, or an error naming why: nothing half-applied
        assert call["source"] == "odyssey" or (call["source"] == "error" and "simulated backend" in
                                               call["response"]["error"])
        if call["source"] == "error":
            assert call["changes"] == []
    session = runs[2]
    assert session["session"]["turns"] >= 1 and session["conversation"][0]["user"] == session["user_instruction"]
    usage = report["summary"]["model_usage"]
    assert usage["judge"]["requests"] >= 3 and usage["simulator"]["requests"] >= 1
    assert usage["judge"]["prompt_tokens"] > 0 and usage["simulator"]["completion_tokens"] > 0
