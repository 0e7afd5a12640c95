"""The model-backed simulated backend and model-as-user sessions (issue 34), offline.

The engine's precedence and strict-mode checks as pure functions; ``simulate --simulator`` and
``--user-model`` end to end with the scripted stand-in and with a misbehaving server
(tests/fake_chat_server.py); sessions through code mode and HTTP mode, the multi-turn fields checked turn by
turn.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Dict, List, Tuple

import pytest

import pipelines_port as pp
from conformance.simulator import engine, simulate
from tests.fake_chat_server import FakeChatServer, Reply
from tests.test_simulate import simulate_cli, write_csv

STATE = {"order": {"4521": {"status": "paid", "user_id": "u-1"}}}


def backend(**options: Any) -> engine.Backend:
    return engine.Backend(STATE, options.pop("rules", []), seed="t", **options)


# -- the engine: precedence and the strict checks ------------------------------------------------------------


def test_a_model_answers_only_what_nothing_else_answers() -> None:
    asked: List[Dict[str, Any]] = []

    def ask(question: Dict[str, Any]) -> Any:
        asked.append(question)
        return {"response": {"id": "4521", "status": "cancelled"},
                "effects": [{"update": "order.4521", "set": {"status": "cancelled"}}]}

    rules = [{"trigger": "after_n_calls", "tool": "cancel_order", "n": 1, "duration": 1,
              "error": {"code": 503, "message": "busy"}}]
    fixtures = engine.load_fixtures({"tools": {"ping": {"response": "pong"}}})
    b = backend(rules=rules, fixtures=fixtures)
    first = b.call("cancel_order", {"order_id": "4521"}, ask=ask)  # the failure rule first
    assert first.source == "injected" and first.answered_by == "rule" and not asked
    assert b.call("ping", {}, ask=ask).answered_by == "fixture" and not asked
    looked_up = b.call("get_order", {"order_id": "4521"}, ask=ask)
    assert looked_up.answered_by == "ledger" and looked_up.response["status"] == "paid" and not asked
    second = b.call("cancel_order", {"order_id": "4521"}, ask=ask)
    assert second.answered_by == "model" and second.source == "odyssey" and len(asked) == 1
    assert second.changes == [{"op": "update", "entity_type": "order", "entity_id": "4521",
                               "before": {"status": "paid", "user_id": "u-1"},
                               "after": {"status": "cancelled", "user_id": "u-1"}}]
    assert b.call("get_order", {"order_id": "4521"}).response["status"] == "cancelled"  # later lookups see it
    question = asked[0]
    assert question["tool"] == "cancel_order" and question["arguments"] == {"order_id": "4521"}
    assert question["ledger"] == STATE and [c["tool"] for c in question["earlier_calls"]] == [
        "cancel_order", "ping", "get_order"]
    assert question["earlier_calls"][0]["source"] == "injected"


def test_without_a_model_the_tool_with_no_answer_is_named() -> None:
    b = backend()
    result = b.call("cancel_order", {"order_id": "4521"})
    assert result.source == "error" and result.answered_by == "none" and "--simulator" in result.response["error"]
    b.call("email_customer", {})
    b.call("cancel_order", {})
    assert b.unanswered == ["cancel_order", "email_customer"]


@pytest.mark.parametrize("answer,problem", [
    ({"response": {}, "effects": [{"update": "order.9", "set": {"status": "x"}}]}, "order '9' not found"),
    ({"response": {}, "effects": [{"frobnicate": "order.4521"}]}, "exactly one of"),
    ({"response": {}, "effects": [{"update": "order", "set": {}}]}, '"type.id"'),
    ({"response": {}, "effects": "nope"}, "effects must be an array"),
    ({"effects": []}, '"response"'),
    ({"response": {"status": "cancelled"}, "effects": []}, None),  # nothing the kit can check contradicts it
    ({"response": {"ok": True}, "effects": []}, None),
])
def test_answers_are_held_to_the_ledger(answer: Any, problem: Any) -> None:
    found = backend().answer_problem("cancel_order", {"order_id": "4521"}, answer)
    assert (found is None) if problem is None else (problem in str(found))


def test_a_response_that_contradicts_the_ledger_is_a_problem() -> None:
    b = backend()
    unknown = b.answer_problem("cancel_order", {"order_id": "9999"}, {"response": {"ok": True}, "effects": []})
    assert "order '9999', which the ledger does not have" in str(unknown)
    refused = b.answer_problem("cancel_order", {"order_id": "9999"}, {"response": {"error": "no such order"},
                                                                      "effects": []})
    assert refused is None  # an error claims nothing
    stale = b.answer_problem("get_order_status", {}, {"response": {"id": "4521", "status": "shipped"},
                                                      "effects": []})
    assert 'says status "shipped" for order \'4521\', the ledger says "paid"' in str(stale)
    made_true = b.answer_problem("ship_order", {"order_id": "4521"}, {
        "response": {"id": "4521", "status": "shipped"},
        "effects": [{"update": "order.4521", "set": {"status": "shipped"}}]})
    assert made_true is None  # the effect makes the response true
    created = b.answer_problem("create_order", {"order_id": "77"}, {
        "response": {"id": "77"}, "effects": [{"add": "order.77", "set": {"status": "new"}}]})
    assert created is None and "77" not in b.ledger.entities["order"]  # checked on a copy only


def test_a_model_that_fails_is_the_calls_error_never_a_crash() -> None:
    b = backend()

    def broken(question: Dict[str, Any]) -> Any:
        raise RuntimeError("HTTP 500 after 4 attempts")

    result = b.call("cancel_order", {"order_id": "4521"}, ask=broken)
    assert result.source == "error" and "HTTP 500 after 4 attempts" in result.response["error"]
    assert b.ledger.entities == STATE and b.ledger.changes == []
    sloppy = b.call("cancel_order", {"order_id": "4521"}, ask=lambda q: {
        "response": {}, "effects": [{"update": "order.4521", "set": {"a": 1}}, {"remove": "order.1"}]})
    assert sloppy.source == "error" and "order '1' not found" in sloppy.response["error"]
    assert b.ledger.entities == STATE  # all or nothing: the first effect did not land


# -- simulate --simulator, end to end ------------------------------------------------------------------------

AGENT = r'''
import json, os
import pipelines_port as pp

def agent(envelope):
    spec = json.loads(envelope.user_instruction) if envelope.user_instruction.startswith("{") else {"calls": []}
    results = []
    for name, args in spec.get("calls", []):
        if isinstance(args, str):  # "$new_id": the id the previous call returned
            args = {"ticket_id": results[-1].get("id") if isinstance(results[-1], dict) else None}
        results.append(pp.proxy_call(name, args, envelope=envelope, errors="return"))
    return "results: " + json.dumps(results)

run = pp.code_mode(agent)
'''

TOOLS = [
    {"name": "create_ticket", "description": "Open a support ticket.",
     "input_schema": {"type": "object", "properties": {"subject": {"type": "string"}}, "required": ["subject"]}},
    {"name": "get_ticket", "description": "Read a ticket.",
     "input_schema": {"type": "object", "properties": {"ticket_id": {"type": "string"}}, "required": ["ticket_id"]}},
    {"name": "cancel_order", "description": "Cancel an order.",
     "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}},
]


@pytest.fixture
def project(tmp_path: pathlib.Path) -> Dict[str, pathlib.Path]:
    (tmp_path / "agent.py").write_text(AGENT, encoding="utf-8")
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS), encoding="utf-8")
    state = json.dumps({"ticket": {"t-0": {"subject": "old"}}, "order": {"4521": {"status": "paid"}}})
    rows = [{"user": json.dumps({"calls": [["create_ticket", {"subject": "broken screen"}], ["get_ticket", "$new_id"]]}),
             "state": state},
            {"user": json.dumps({"calls": [["cancel_order", {"order_id": "4521"}]]}), "state": state}]
    return {"dir": tmp_path, "csv": write_csv(tmp_path / "rows.csv", rows), "agent": tmp_path / "agent.py",
            "tools": tmp_path / "tools.json"}


def report(path: pathlib.Path) -> Dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def test_the_second_call_works_only_because_the_first_calls_effects_applied(
        project: Dict[str, pathlib.Path], capsys: pytest.CaptureFixture) -> None:
    out = project["dir"] / "r.json"
    code, text, err = simulate_cli(capsys, "--csv", project["csv"], "--code", project["agent"], "--tools",
                                   project["tools"], "--simulator", "scripted", "--json", out)
    assert code == 0, err
    first, second = report(out)["runs"]
    create, read = first["tool_calls"]
    assert create["answered_by"] == "model" and create["response"]["id"] == "ticket-2"  # t-0 is there: the 2nd
    assert create["changes"][0]["op"] == "add" and create["changes"][0]["entity_id"] == "ticket-2"
    assert read["answered_by"] == "ledger" and read["response"] == {"id": "ticket-2", "subject": "broken screen"}
    assert first["final_state"]["ticket"]["ticket-2"] == {"subject": "broken screen"}
    assert second["tool_calls"][0]["response"]["status"] == "cancelled"
    assert report(out)["summary"]["model_usage"]["simulator"]["requests"] == 2
    assert "odyssey, by the model" in text
    # without --simulator the same calls have no answer, and the report says which tools
    code, text, err = simulate_cli(capsys, "--csv", project["csv"], "--code", project["agent"], "--tools",
                                   project["tools"], "--json", out)
    notes = report(out)["runs"][0]["notes"]
    assert any("no answer for create_ticket" in n and "--simulator MODEL" in n for n in notes)


def test_the_simulator_is_shown_the_tool_the_row_and_the_ledger(project: Dict[str, pathlib.Path],
                                                                capsys: pytest.CaptureFixture) -> None:
    rows = [{"user": json.dumps({"calls": [["cancel_order", {"order_id": "4521"}]]}),
             "state": json.dumps({"order": {"4521": {"status": "paid"}}}),
             "behavior": "cancel_order only cancels paid orders."}]
    dataset = write_csv(project["dir"] / "one.csv", rows)
    with FakeChatServer() as server:
        code, _, err = simulate_cli(capsys, "--csv", dataset, "--code", project["agent"], "--tools", project["tools"],
                                    "--simulator", "sim-model", "--simulator-url", server.base_url,
                                    "--no-model-cache")
        assert code == 0, err
        sent = server.requests[0].json
    assert sent["model"] == "sim-model" and sent["response_format"]["json_schema"]["name"] == "pipelines_tool_response"
    question = json.loads(sent["messages"][1]["content"])
    assert question["tool"] == TOOLS[2] and question["arguments"] == {"order_id": "4521"}
    assert question["behavior_instructions"] == "cancel_order only cancels paid orders."
    assert question["ledger"] == {"order": {"4521": {"status": "paid"}}} and question["earlier_calls"] == []
    assert "simulated backend" in sent["messages"][0]["content"]


def run_one(project: Dict[str, pathlib.Path], capsys: pytest.CaptureFixture, server: FakeChatServer,
            monkeypatch: pytest.MonkeyPatch) -> Tuple[Dict[str, Any], List[Any]]:
    monkeypatch.setattr("conformance.models.client.MODEL_RETRY",
                        pp.RetryPolicy(max_attempts=2, base_delay_s=0.01, max_delay_s=0.01))
    rows = [{"user": json.dumps({"calls": [["cancel_order", {"order_id": "4521"}]]}),
             "state": json.dumps({"order": {"4521": {"status": "paid"}}})}]
    dataset = write_csv(project["dir"] / "one.csv", rows)
    out = project["dir"] / "one.json"
    code, _, err = simulate_cli(capsys, "--csv", dataset, "--code", project["agent"], "--tools", project["tools"],
                                "--simulator", "m", "--simulator-url", server.base_url, "--no-model-cache",
                                "--json", out)
    assert code == 0, err
    return report(out)["runs"][0]["tool_calls"][0], [r.json for r in server.requests]


GOOD = json.dumps({"response": {"id": "4521", "status": "cancelled"},
                   "effects": [{"update": "order.4521", "set": {"status": "cancelled"}}]})


def test_an_answer_that_is_not_json_is_asked_again(project: Dict[str, pathlib.Path], capsys: pytest.CaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeChatServer([Reply("Cancelled it!"), Reply(GOOD)]) as server:
        call, sent = run_one(project, capsys, server, monkeypatch)
    assert call["response"] == {"id": "4521", "status": "cancelled"} and call["changes"]
    assert "not JSON" in sent[1]["messages"][-1]["content"]


def test_effects_that_cannot_apply_are_regenerated_once_then_an_error(
        project: Dict[str, pathlib.Path], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = json.dumps({"response": {"ok": True}, "effects": [{"update": "order.9", "set": {"status": "x"}}]})
    with FakeChatServer([Reply(bad), Reply(GOOD)]) as server:
        call, sent = run_one(project, capsys, server, monkeypatch)
    assert call["response"]["status"] == "cancelled"
    assert "order '9' not found" in sent[1]["messages"][-1]["content"]  # the problem named
    with FakeChatServer([Reply(bad)]) as server:
        call, sent = run_one(project, capsys, server, monkeypatch)
    assert len(sent) == 2 and call["source"] == "error" and call["answered_by"] == "model"
    assert "not usable after one re-ask" in call["response"]["error"] and "order '9' not found" in call["response"][
        "error"]
    assert call["changes"] == []


def test_429_and_500_from_the_simulators_server(project: Dict[str, pathlib.Path], capsys: pytest.CaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeChatServer([Reply(status=429, headers={"Retry-After": "0"}), Reply(GOOD)]) as server:
        call, _ = run_one(project, capsys, server, monkeypatch)
    assert call["response"]["status"] == "cancelled"
    with FakeChatServer([Reply(status=500)]) as server:
        call, sent = run_one(project, capsys, server, monkeypatch)
    assert call["source"] == "error" and "HTTP 500" in call["response"]["error"] and len(sent) == 2


def test_a_rerun_replays_the_simulators_answers_from_the_cache(project: Dict[str, pathlib.Path],
                                                              capsys: pytest.CaptureFixture) -> None:
    out = project["dir"]
    with FakeChatServer() as server:
        base = ["--csv", project["csv"], "--code", project["agent"], "--tools", project["tools"], "--simulator", "m",
                "--simulator-url", server.base_url, "--model-cache", out / "cache"]
        assert simulate_cli(capsys, *base, "--json", out / "a.json")[0] == 0
        asked = len(server.requests)
        assert simulate_cli(capsys, *base, "--json", out / "b.json")[0] == 0
        assert asked == 2 and len(server.requests) == asked
    a, b = report(out / "a.json"), report(out / "b.json")
    assert [c["response"] for r in a["runs"] for c in r["tool_calls"]] == \
        [c["response"] for r in b["runs"] for c in r["tool_calls"]]
    assert b["summary"]["model_usage"]["simulator"]["cached"] == 2


# -- model-as-user sessions ------------------------------------------------------------------------------------

SESSION_AGENT = r'''
import json, os
import pipelines_port as pp

def agent(envelope):
    with open(os.environ["SESSION_LOG"], "a") as log:
        log.write(json.dumps({"latest_user_prompt": envelope.latest_user_prompt, "session_id": envelope.session_id,
                              "turn_id": envelope.turn_id, "messages": envelope.messages,
                              "scenario_state": envelope.scenario_state, "run_id": envelope.run_id,
                              "user_instruction": envelope.user_instruction}) + "\n")
    order = pp.proxy_call("get_order", {"order_id": "4521"}, envelope=envelope, errors="return")
    if envelope.latest_user_prompt == envelope.user_instruction:
        return pp.build_turn_reply(f"Order 4521 is {order.get('status')}. Shall I cancel it?")
    return pp.build_turn_reply("It is cancelled now.", session_done=True)

run = pp.code_mode(agent)
'''


def check_turns(log: pathlib.Path, record: Dict[str, Any]) -> None:
    """The agent saw each turn's multi-turn fields; the record holds the conversation turn by turn.

    Turn 1 asks a question (``session_done: false``), so the scripted user answers it; turn 2 says
    ``session_done: true``: the runtime sends the turn reply as built (CONTRACT §4.2), and the scripted user
    takes the hint, so the session ends by it.
    """
    turns = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    instruction = record["user_instruction"]
    assert len(turns) == 2 and record["session"]["turns"] == 2
    session_id = turns[0]["session_id"]
    assert isinstance(session_id, str) and all(t["session_id"] == session_id for t in turns)
    assert [t["turn_id"] for t in turns] == [f"{session_id}-t0", f"{session_id}-t1"]
    assert [t["latest_user_prompt"] for t in turns] == [instruction, "Yes, please go ahead."]
    assert turns[0]["messages"] == [] and turns[1]["messages"] == [
        {"role": "user", "content": instruction},
        {"role": "assistant", "content": "Order 4521 is paid. Shall I cancel it?"}]
    assert all(t["scenario_state"] == {} for t in turns)
    assert all(t["run_id"] == turns[0]["run_id"] and t["user_instruction"] == instruction for t in turns)
    assert [t["turn"] for t in record["conversation"]] == [1, 2]
    assert [t["tool_calls"] for t in record["conversation"]] == [[1], [2]]
    assert [t["agent"] for t in record["conversation"]] == ["Order 4521 is paid. Shall I cancel it?",
                                                            "It is cancelled now."]
    assert [t["session_done"] for t in record["conversation"]] == [False, True]
    assert record["final_response"] == "It is cancelled now."
    assert record["session"]["ended"] == "the agent's session_done hint (turn 2), accepted by the user"
    assert [c["turn"] for c in record["tool_calls"]] == [1, 2]
    assert record["messages"] == [{"role": "user", "content": instruction},
                                  {"role": "assistant", "content": "Order 4521 is paid. Shall I cancel it?"},
                                  {"role": "user", "content": "Yes, please go ahead."},
                                  {"role": "assistant", "content": "It is cancelled now."}]


@pytest.fixture
def session_project(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Dict[str, pathlib.Path]:
    (tmp_path / "session_agent.py").write_text(SESSION_AGENT, encoding="utf-8")
    log = tmp_path / "turns.jsonl"
    log.write_text("", encoding="utf-8")
    monkeypatch.setenv("SESSION_LOG", str(log))
    rows = [{"user": "Is order 4521 cancelled yet?", "state": json.dumps({"order": {"4521": {"status": "paid"}}})}]
    dataset = tmp_path / "rows.csv"
    with open(dataset, "w", encoding="utf-8", newline="") as f:
        import csv

        writer = csv.DictWriter(f, fieldnames=["user", "state", "turn_mode"])
        writer.writeheader()
        writer.writerow({**rows[0], "turn_mode": "model_as_user"})
    return {"dir": tmp_path, "csv": dataset, "agent": tmp_path / "session_agent.py", "log": log}


def test_a_session_in_code_mode_turn_by_turn(session_project: Dict[str, pathlib.Path],
                                            capsys: pytest.CaptureFixture) -> None:
    out = session_project["dir"] / "r.json"
    code, text, err = simulate_cli(capsys, "--csv", session_project["csv"], "--code", session_project["agent"],
                                   "--user-model", "scripted", "--judge", "scripted", "--json", out,
                                   "--html", session_project["dir"] / "r.html")
    assert code == 0, err
    record = report(out)["runs"][0]
    check_turns(session_project["log"], record)
    assert record["judge"]["verdict"] in ("PASS", "FAIL") and record["usage"]["user"]["requests"] == 2
    assert "turn 2 user: Yes, please go ahead." in text and "session " in text
    page = (session_project["dir"] / "r.html").read_text(encoding="utf-8")
    assert "<h3>Conversation</h3>" in page and "Shall I cancel it?" in page


def test_a_session_over_http_turn_by_turn(session_project: Dict[str, pathlib.Path], capsys: pytest.CaptureFixture,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_session_agent", session_project["agent"])
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    server = pp.start_server(module.agent, token="session-agent-token-0123")
    try:
        out = session_project["dir"] / "r.json"
        code, _, err = simulate_cli(capsys, "--csv", session_project["csv"], "--url", server.url, "--token",
                                    "session-agent-token-0123", "--user-model", "scripted", "--json", out)
    finally:
        server.close(1)
    assert code == 0, err
    check_turns(session_project["log"], report(out)["runs"][0])


def test_turn_mode_for_the_whole_dataset_and_its_usage_errors(session_project: Dict[str, pathlib.Path],
                                                              capsys: pytest.CaptureFixture) -> None:
    out = session_project["dir"] / "first.json"  # no one to play the user: the first turn runs, and it says so
    code, _, err = simulate_cli(capsys, "--csv", session_project["csv"], "--code", session_project["agent"],
                                "--json", out)
    record = report(out)["runs"][0]
    assert code == 0 and record["session"]["turns"] == 1 and "first turn only" in record["session"]["ended"]
    assert any("--user-model MODEL" in note for note in record["notes"])
    single = write_csv(session_project["dir"] / "single.csv", [{"user": "Is order 4521 cancelled yet?",
                                                                "state": json.dumps(STATE)}])
    out = session_project["dir"] / "s.json"
    code, _, err = simulate_cli(capsys, "--csv", single, "--code", session_project["agent"], "--turn-mode",
                                "model_as_user", "--user-model", "scripted", "--max-turns", "2", "--json", out)
    assert code == 0, err
    record = report(out)["runs"][0]
    assert record["session"]["turns"] == 2 and "--max-turns 2" in record["session"]["ended"]


def test_a_user_model_that_cannot_answer_ends_the_session_with_the_reason(
        session_project: Dict[str, pathlib.Path], capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("conformance.models.client.MODEL_RETRY",
                        pp.RetryPolicy(max_attempts=2, base_delay_s=0.01, max_delay_s=0.01))
    out = session_project["dir"] / "r.json"
    not_done_but_silent = json.dumps({"message": None, "done": False})
    with FakeChatServer([Reply(not_done_but_silent)]) as server:
        code, _, _ = simulate_cli(capsys, "--csv", session_project["csv"], "--code", session_project["agent"],
                                  "--user-model", "u", "--user-url", server.base_url, "--no-model-cache",
                                  "--json", out)
        assert "must say something" in server.requests[1].json["messages"][-1]["content"]
    record = report(out)["runs"][0]
    assert code == 1 and record["status"] == "error" and record["session"]["turns"] == 1
    assert "the simulated user could not answer after turn 1" in record["errors"][0]


def test_the_dataset_checks_turn_mode(tmp_path: pathlib.Path) -> None:
    from conformance.simulator import dataset

    path = tmp_path / "d.csv"
    path.write_text("user,turn_mode\nhello,Model_As_User\nbye,\nagain,model-as-users\n", encoding="utf-8")
    loaded = dataset.load_dataset(str(path))
    assert [t.turn_mode for t in loaded.tasks] == ["model_as_user", "single"]
    problem = next(p for p in loaded.problems if p.column == "turn_mode")
    assert problem.severity == "error" and problem.row == 3 and "did you mean `model_as_user`" in problem.message


def test_the_sessions_rows_with_a_resumed_result_file(session_project: Dict[str, pathlib.Path],
                                                      capsys: pytest.CaptureFixture) -> None:
    jsonl = session_project["dir"] / "r.jsonl"
    base = ["--csv", session_project["csv"], "--code", session_project["agent"], "--user-model", "scripted",
            "--jsonl", jsonl]
    assert simulate_cli(capsys, *base)[0] == 0
    before = len(session_project["log"].read_text(encoding="utf-8").splitlines())
    assert simulate_cli(capsys, *base, "--resume")[0] == 0
    assert len(session_project["log"].read_text(encoding="utf-8").splitlines()) == before  # nothing ran again
    lines = [json.loads(line) for line in jsonl.read_text(encoding="utf-8").splitlines()]
    assert lines[0]["options"]["user_model"]["model"] == "scripted" and lines[1]["run"]["session"]["turns"] == 2


def test_the_scripted_roles_are_deterministic() -> None:
    from conformance.models.scripted_roles import simulated_tool, simulated_user

    ledger = {"order": {"4521": {"status": "paid"}}}
    assert simulated_tool({"tool": {"name": "refund_order"}, "arguments": {"order_id": "4521"}, "ledger": ledger}) == {
        "response": {"status": "refunded", "id": "4521"},
        "effects": [{"update": "order.4521", "set": {"status": "refunded"}}]}
    assert simulated_tool({"tool": {"name": "delete_order"}, "arguments": {"order_id": "9"}, "ledger": ledger})[
        "response"] == {"error": "order 9 not found"}
    assert simulated_tool({"tool": {"name": "list_orders"}, "arguments": {}, "ledger": ledger})["response"] == [
        {"status": "paid", "id": "4521"}]
    assert simulated_user({"conversation": [{"user": "x", "agent": "Done.", "session_done": True}]}) == {
        "message": None, "done": True}
    assert simulated_user({"conversation": [{"user": "x", "agent": "Done."}]})["done"] is False
    assert simulated_user({"conversation": [{"user": "x", "agent": ""}]}) == {"message": None, "done": True}


def test_the_judge_grades_the_whole_session(session_project: Dict[str, pathlib.Path],
                                            capsys: pytest.CaptureFixture) -> None:
    with FakeChatServer() as judge:
        code, _, err = simulate_cli(capsys, "--csv", session_project["csv"], "--code", session_project["agent"],
                                    "--user-model", "scripted", "--judge", "j", "--judge-url", judge.base_url,
                                    "--no-model-cache")
        assert code == 0, err
        assert len(judge.requests) == 1  # once per session, not per turn
        case = json.loads(judge.requests[0].json["messages"][1]["content"])
    assert [(t["turn"], t["user"], t["agent"], t["tool_calls"]) for t in case["conversation"]] == [
        (1, "Is order 4521 cancelled yet?", "Order 4521 is paid. Shall I cancel it?", [1]),
        (2, "Yes, please go ahead.", "It is cancelled now.", [2])]
    assert case["final_response"] == "It is cancelled now." and len(case["trajectory"]) == 2


def test_a_flag_the_model_sets_arms_an_after_state_change_rule() -> None:
    """The model's effects are ledger changes like a fixture's: a later rule keyed on its flag fires."""
    rules = [{"trigger": "after_state_change", "tool": "get_order", "condition": "refund_issued", "duration": 1,
              "error": {"code": 200, "response": {"id": "4521", "status": "paid", "note": "replica lag"}}}]
    b = backend(rules=rules)
    refund = b.call("refund_order", {"order_id": "4521"}, ask=lambda q: {
        "response": {"id": "4521", "status": "refunded"},
        "effects": [{"update": "order.4521", "set": {"status": "refunded"}}, {"set_flag": "refund_issued"}]})
    assert [c["op"] for c in refund.changes] == ["update", "set_flag"] and b.ledger.flags == {"refund_issued": True}
    lagging = b.call("get_order", {"order_id": "4521"})
    assert lagging.source == "injected" and lagging.response["note"] == "replica lag"
    assert b.call("get_order", {"order_id": "4521"}).response["status"] == "refunded"  # the rule's one call is over
