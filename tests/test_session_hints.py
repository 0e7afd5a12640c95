"""The agent's ``session_done`` in a simulated session (issue #42): recorded per turn, shown per turn in the text and
HTML reports, given to the simulated user as a hint it may take or decline, and the session's end says who ended
it: the user, the agent's hint the user accepted, or the turn limit.

The agent runs behind the kit's asyncio server on 127.0.0.1 (so its turn replies leave as built); the user is the
scripted stand-in, or a chat server on 127.0.0.1 answering as scripted (``tests/fake_chat_server.py``).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

import pipelines_port as pp
from conformance.models.client import ChatClient, Endpoint
from conformance.models.scripted import scripted_endpoint
from conformance.models.scripted_roles import simulated_user
from conformance.simulator import dataset, report
from conformance.simulator.session import Conversation, UserModel, turn_reply
from tests.fake_chat_server import FakeChatServer, Reply
from tests.test_simulate import simulate_cli, write_csv

AGENT_TOKEN = "session-hints-token-0123"
TASK = dataset.Task(row=1, line=2, user_instruction="Cancel order 4521", behavior_instructions="", initial_state={},
                    failure_rules=[], expected_outcome="completion", expected_outcome_given=False, workspace={},
                    turn_mode="model_as_user")
USER_PROMPT = "Play the user."


def served(replies: List[Any]) -> Tuple[Any, List[Dict[str, Any]]]:
    """The kit's asyncio server on 127.0.0.1 whose agent answers turn n with ``replies[n]``; the dispatches it saw."""
    seen: List[Dict[str, Any]] = []

    def agent(env: pp.Envelope) -> Any:
        seen.append({"session_id": env.session_id, "turn_id": env.turn_id, "prompt": env.latest_user_prompt})
        return replies[min(len(seen), len(replies)) - 1]

    return pp.start_server(agent, token=AGENT_TOKEN), seen


def sender(server: Any) -> Any:
    """``send(fields) -> (body, error)`` for :meth:`Conversation.run`: one dispatch per turn over the socket."""
    from tests.test_server import http_call

    def send(fields: Dict[str, Any]) -> Tuple[Any, Optional[str]]:
        body = {"run_id": 1, "odyssey_proxy_url": "http://127.0.0.1:9/api/odyssey-proxy/runs/r",
                "input": {"user_instruction": TASK.user_instruction, "input": {}, **fields}}
        status, _, payload = http_call(server.url, "POST", "/dispatch", {
            "Authorization": f"Bearer {AGENT_TOKEN}", "X-Pipelines-Run-Token": "run-token-hints",
            "Content-Type": "application/json"}, json.dumps(body).encode())
        return (json.loads(payload), None) if status == 200 else (None, f"HTTP {status}")

    return send


@pytest.fixture
def scripted_user() -> Iterator[UserModel]:
    with scripted_endpoint() as endpoint:
        yield UserModel(ChatClient(endpoint), USER_PROMPT, max_turns=4)


def converse(user: UserModel, replies: List[Any]) -> Tuple[Conversation, List[Dict[str, Any]]]:
    server, seen = served(replies)
    try:
        conversation = Conversation(TASK, user, "sess-hints")
        conversation.run(sender(server), lambda: 0.0)
    finally:
        server.close(1)
    return conversation, seen


def test_the_user_takes_the_agents_hint(scripted_user: UserModel) -> None:
    conversation, seen = converse(scripted_user, [
        pp.build_turn_reply("Order 4521 is paid. Shall I cancel it?"),
        pp.build_turn_reply("It is cancelled now.", session_done=True, metadata={"model": "m"})])
    assert [t["session_done"] for t in conversation.turns] == [False, True]
    assert conversation.turns[1]["metadata"] == {"model": "m"}
    assert conversation.ended_by == "agent_hint"
    assert conversation.ended == "the agent's session_done hint (turn 2), accepted by the user"
    assert [s["turn_id"] for s in seen] == ["sess-hints-t0", "sess-hints-t1"]


def test_a_reply_without_a_hint_is_recorded_as_none_and_the_user_ends_it(scripted_user: UserModel) -> None:
    conversation, _ = converse(scripted_user, [{"final_response": "Order 4521 is paid."}, "Nothing else to do."])
    assert [t["session_done"] for t in conversation.turns] == [None, None]
    assert (conversation.ended_by, conversation.ended) == ("user", "the user was done")


def test_a_declined_hint_then_the_turn_limit() -> None:
    """The user model sees each turn's hint (``null`` for none) and may go on; the session then ends at the
    turn limit, which the report says, with the declined hint shown on its turn."""
    keep_going = json.dumps({"message": "Wait, one more thing.", "done": False})
    with FakeChatServer([Reply(keep_going)]) as chat:
        user = UserModel(ChatClient(Endpoint(chat.base_url, "u", None)), USER_PROMPT, max_turns=3)
        conversation, _ = converse(user, [pp.build_turn_reply("Done, goodbye.", session_done=True),
                                          {"final_response": "Anything else?"},
                                          pp.build_turn_reply("Bye.", session_done=False)])
        cases = [json.loads(r.json["messages"][-1]["content"]) for r in chat.requests]
    assert [t["session_done"] for t in conversation.turns] == [True, None, False]
    assert (conversation.ended_by, conversation.ended) == ("turn_limit", "the turn limit: --max-turns 3 reached")
    assert [[t["session_done"] for t in case["conversation"]] for case in cases] == [[True], [True, None]]
    run = {"session": {"session_id": "sess-hints", "turns": 3, "ended": conversation.ended},
           "conversation": conversation.turns}
    text = "\n".join(report._conversation_text(run))
    assert "ended: the turn limit: --max-turns 3 reached" in text
    assert "[session_done: true, the user went on]" in text
    assert "[no session_done (a response envelope)]" in text and "[session_done: false]" in text
    page = report._conversation_html(run)
    assert "agent · session_done: true, the user went on" in page and "agent · session_done: false" in page


def test_turn_reply_reads_the_hint_or_says_why_not() -> None:
    assert turn_reply({"message": "Hi", "session_done": True}) == ("Hi", True, None)
    assert turn_reply({"final_response": "Hi"}) == ("Hi", None, None)
    assert turn_reply({"message": "Hi", "session_done": "yes"}).error == "session_done must be a boolean, got \"yes\""
    assert turn_reply({"message": "Hi", "session_done": None}).error == "session_done must be a boolean, got null"
    assert "non-empty" in str(turn_reply({"message": " ", "session_done": False}).error)


def test_the_scripted_user_takes_the_hint_before_anything_else() -> None:
    asks_and_ends = {"conversation": [{"user": "x", "agent": "Done. Anything else?", "session_done": True}]}
    assert simulated_user(asks_and_ends) == {"message": None, "done": True}
    asks = {"conversation": [{"user": "x", "agent": "Shall I?", "session_done": False}]}
    assert simulated_user(asks) == {"message": "Yes, please go ahead.", "done": False}
    no_hint = {"conversation": [{"user": "x", "agent": "Done.", "session_done": None}]}
    assert simulated_user(no_hint)["done"] is False  # a follow-up: every session has a second turn


def test_simulate_reports_each_turns_hint_and_who_ended_it(tmp_path: pathlib.Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    """The whole path: simulate --url against the kit's server, the scripted user, text and HTML reports."""
    def agent(env: pp.Envelope) -> Any:
        if not env.messages:
            return pp.build_turn_reply("Shall I cancel order 4521?")
        return pp.build_turn_reply("Cancelled. Goodbye!", session_done=True)

    csv = write_csv(tmp_path / "rows.csv", [{"user": "Cancel order 4521", "turn_mode": "model_as_user"}])
    server = pp.start_server(agent, token=AGENT_TOKEN)
    try:
        code, text, err = simulate_cli(capsys, "--csv", csv, "--url", server.url, "--token", AGENT_TOKEN,
                                       "--user-model", "scripted", "--json", tmp_path / "r.json",
                                       "--html", tmp_path / "r.html")
    finally:
        server.close(1)
    assert code == 0, err
    run = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))["runs"][0]
    assert [t["session_done"] for t in run["conversation"]] == [False, True]
    assert run["session"]["ended"] == "the agent's session_done hint (turn 2), accepted by the user"
    assert "[session_done: false]" in text and "[session_done: true]" in text
    assert "ended: the agent's session_done hint (turn 2), accepted by the user" in text
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "agent · session_done: true" in page and "accepted by the user" in page
