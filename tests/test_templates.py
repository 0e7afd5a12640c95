"""The templates end to end over real sockets: each agent loop against a local fake of its model API and a MockProxy."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import pathlib
import queue
import re
import subprocess
import sys
import threading
import urllib.request
from types import ModuleType
from typing import Any, Dict, Iterator, List, NamedTuple, Type

import pytest

import pipelines_port as pp
from conformance.harness.mock_proxy import MockProxy
from tests.conftest import Together
from tests.fake_model_apis import (
    RATE_LIMITED,
    FakeAnthropicAPI,
    FakeChatAPI,
    FakeModelAPI,
    FakeResponsesAPI,
    Turn,
)
from tests.test_code_mode import fresh_token, in_running_loop

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "templates"
_loaded: Dict[str, ModuleType] = {}


def template(name: str) -> ModuleType:
    """Import ``templates/<name>.py`` from its path, the way a user's copy is loaded."""
    if name not in _loaded:
        spec = importlib.util.spec_from_file_location(f"template_{name}", TEMPLATES / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded[name] = module
    return _loaded[name]


class Loop(NamedTuple):
    """One agent-loop template and how to reach its model API."""

    name: str
    fake: Type[FakeModelAPI]
    base_url_env: str
    key_env: str
    model_env: str

    def call_id(self, turn: int, index: int) -> str:
        """The id the fake gives the ``index``-th tool call of model turn ``turn``."""
        return f"toolu_{turn}_{index}" if self.name == "anthropic_messages" else f"call_{turn}_{index}"

    def tools_sent(self, body: Dict[str, Any]) -> List[str]:
        """Tool names in a request body, in that API's tool shape."""
        if self.name == "openai_chat":
            return [t["function"]["name"] for t in body["tools"]]
        return [t["name"] for t in body["tools"]]

    def conversation_sent(self, body: Dict[str, Any]) -> List[Dict[str, Any]]:
        """The conversation in a first request body, without the system prompt."""
        if self.name == "openai_responses":
            return body["input"]
        return body["messages"][1:] if self.name == "openai_chat" else body["messages"]

    def results_sent(self, body: Dict[str, Any]) -> Dict[str, str]:
        """Tool results in a request body, by call id, in that API's shape."""
        if self.name == "openai_responses":
            return {i["call_id"]: i["output"] for i in body["input"] if i.get("type") == "function_call_output"}
        if self.name == "openai_chat":
            return {m["tool_call_id"]: m["content"] for m in body["messages"] if m["role"] == "tool"}
        return {b["tool_use_id"]: b["content"] for m in body["messages"] if isinstance(m["content"], list)
                for b in m["content"] if b.get("type") == "tool_result"}


LOOPS = [
    Loop("openai_responses", FakeResponsesAPI, "OPENAI_BASE_URL", "OPENAI_API_KEY", "OPENAI_MODEL"),
    Loop("openai_chat", FakeChatAPI, "OPENAI_BASE_URL", "OPENAI_API_KEY", "OPENAI_MODEL"),
    Loop("anthropic_messages", FakeAnthropicAPI, "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_MODEL"),
]
MODEL = "test-model-7"
TASK = {"user_instruction": "Refund order #4521 if it shipped more than 30 days ago.",
        "input": {"customer_id": "cust_99"}, "task_id": 42}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "OPENAI_MODEL", "OPENAI_REASONING_EFFORT",
                 "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_MODEL", "ANTHROPIC_MAX_TOKENS",
                 "ANTHROPIC_THINKING_BUDGET", "AGENT_MAX_TURNS",
                 "PIPELINES_TOOLS_SCHEMA_B64", "PIPELINES_TOOLS_SCHEMA_JSON"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def token() -> str:
    return fresh_token()


@pytest.fixture
def proxy(token: str) -> Iterator[MockProxy]:
    with MockProxy(tokens=[token]) as p:
        yield p


@pytest.fixture(params=LOOPS, ids=[loop.name for loop in LOOPS])
def loop(request: pytest.FixtureRequest) -> Loop:
    return request.param


@pytest.fixture
def api(loop: Loop, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeModelAPI]:
    with loop.fake() as fake:
        monkeypatch.setenv(loop.base_url_env, fake.base_url)
        monkeypatch.setenv(loop.key_env, fake.api_key)
        monkeypatch.setenv(loop.model_env, MODEL)
        yield fake


# -- the agent loops -------------------------------------------------------------

REASONING_1 = "Look up the order, its sibling and the refund policy, all at once."
REASONING_2 = "Order 4521 shipped 45 days ago and the policy allows a refund."
SAYS_2 = "Order 4521 qualifies; refunding it now."
FINAL = "I could not refund order #4521: the refund amount exceeds the order total."
POLICY = "POLICY-HEAD " + "Refunds are allowed within 30 days of delivery. " * 1000 + "POLICY-TAIL"
SCRIPT = [
    RATE_LIMITED,
    Turn(reasoning=REASONING_1, input_tokens=120, output_tokens=30, tool_calls=[
        ("get_order", {"order_id": "4521"}), ("get_order", {"order_id": "4522"}),
        ("search_kb", {"query": "refund policy"})]),
    Turn(reasoning=REASONING_2, text=SAYS_2, input_tokens=9000, output_tokens=25, tool_calls=[
        ("refund_order", {"order_id": "4521", "reason": "shipped 45 days ago"})]),
    Turn(text=FINAL, input_tokens=9100, output_tokens=40),
]


def script_the_proxy(proxy: MockProxy) -> None:
    """Tools of the scenario: slow lookups (to see them overlap), an oversized policy, a failing refund."""
    first_turn = Together(3)  # the first turn's three calls are answered only once all three are in flight
    proxy.script("get_order", first_turn(lambda r: {"response": {"order_id": r.json["order_id"], "status": "shipped"}}))
    proxy.script("search_kb", first_turn(lambda r: {"response": POLICY}))
    proxy.script("refund_order", [{"status": 422, "error_class": "validation_error",
                                   "message": "refund amount exceeds the order total"}])


def test_agent_loop_end_to_end_in_code_mode(loop: Loop, api: FakeModelAPI, proxy: MockProxy, token: str) -> None:
    api.script(SCRIPT)
    script_the_proxy(proxy)
    body = template(loop.name).run(TASK, proxy_url=proxy.url, run_token=token)

    assert pp.validate_response(body) == []
    assert body["final_response"] == FINAL
    metadata = body["metadata"]
    assert (metadata["model"], metadata["total_input_tokens"], metadata["total_output_tokens"]) == (MODEL, 18220, 95)
    assert isinstance(metadata["agent_runtime_ms"], int) and metadata["agent_runtime_ms"] >= 0

    # The model API: a 429 retried with the same body, then three turns, each offered the template's tools.
    assert [r.status for r in api.requests] == [429, 200, 200, 200]
    assert api.requests[0].json == api.requests[1].json
    first, second, third = (r.json for r in api.answered())
    assert loop.tools_sent(first) == ["get_order", "refund_order", "search_kb", "change_shipping_address"]
    assert "Refund order #4521" in json.dumps(first) and "cust_99" in json.dumps(first)

    # The proxy: every tool call with the run's bearer; the first turn's three calls overlapped.
    calls = sorted((r.name, json.dumps(r.json, sort_keys=True)) for r in proxy.calls())
    assert calls == sorted([("get_order", '{"order_id": "4521"}'), ("get_order", '{"order_id": "4522"}'),
                            ("search_kb", '{"query": "refund policy"}'),
                            ("refund_order", '{"order_id": "4521", "reason": "shipped 45 days ago"}')])
    assert {r.bearer for r in proxy.requests} == {token}
    assert proxy.max_in_flight == 3

    # What the model got back: results in its API's shape, the oversized one cut head and tail, errors as values.
    results = loop.results_sent(second)
    assert json.loads(results[loop.call_id(1, 1)]) == {"order_id": "4521", "status": "shipped"}
    assert json.loads(results[loop.call_id(1, 2)]) == {"order_id": "4522", "status": "shipped"}
    policy = results[loop.call_id(1, 3)]
    assert policy.startswith("POLICY-HEAD") and policy.endswith("POLICY-TAIL")
    assert "characters truncated]" in policy and len(policy) <= template(loop.name).TOOL_OUTPUT_LIMIT < len(POLICY)
    refund = json.loads(loop.results_sent(third)[loop.call_id(2, 1)])
    assert refund["error_class"] == "validation_error" and "exceeds the order total" in refund["error"]

    # The transcript: flat tool calls, tool results paired by id, reasoning as thinking.
    messages = body["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "tool",
                                             "assistant", "tool", "assistant"]
    turn_1, turn_2, final = messages[2], messages[6], messages[8]
    assert [c["name"] for c in turn_1["tool_calls"]] == ["get_order", "get_order", "search_kb"]
    assert [m["tool_call_id"] for m in messages[3:6]] == [c["id"] for c in turn_1["tool_calls"]]
    assert messages[5]["content"] == policy
    assert turn_2["content"] == SAYS_2 and messages[7]["tool_call_id"] == turn_2["tool_calls"][0]["id"]
    assert final == {"role": "assistant", "content": FINAL}
    assert [b["text"] for b in turn_1["thinking"]] == [REASONING_1]  # Chat: from reasoning_content
    assert [b["text"] for b in turn_2["thinking"]] == [REASONING_2]

    # Live trace events, best-effort, with the run's bearer.
    traces = [(r.name, r.json["text"]) for r in proxy.calls(kind="traces") if r.name != "custom"]
    assert traces == [("thinking", REASONING_1), ("thinking", REASONING_2),
                      ("assistant_message", SAYS_2), ("assistant_message", FINAL)]
    # One model_turn event per answered model call: its latency and tokens, for the report's trace view.
    turns = [r.json for r in proxy.calls(kind="traces") if r.name == "custom"]
    assert [t["turn"] for t in turns] == [1, 2, 3] and all(t["event"] == "model_turn" for t in turns)
    assert [(t["input_tokens"], t["output_tokens"]) for t in turns][0] == (120, 30)
    assert all(isinstance(t["latency_ms"], float) and t["latency_ms"] >= 0 for t in turns)


def test_reasoning_goes_back_to_the_model_in_each_api_shape(loop: Loop, api: FakeModelAPI, proxy: MockProxy,
                                                            token: str) -> None:
    """The fakes reject a lost reasoning item or thinking signature; here is what each template sends back."""
    api.script(SCRIPT[1:2] + [Turn(text="done")])
    template(loop.name).run(TASK, proxy_url=proxy.url, run_token=token)
    first, second = (r.json for r in api.answered())
    if loop.name == "openai_responses":
        assert first["reasoning"] == {"effort": "low", "summary": "auto"}
        # Nothing stored at OpenAI (zero data retention works): the reasoning goes back whole, encrypted content
        # included (the fake refuses a reasoning item without it when store is false).
        assert first["store"] is False and first["include"] == ["reasoning.encrypted_content"]
        (reasoning,) = [i for i in second["input"] if i.get("type") == "reasoning"]
        assert reasoning["id"] == "rs_1" and reasoning["encrypted_content"] == "gAAAA-encrypted-1"
        # strict off, said out loud: otherwise the API makes every property required
        assert first["tools"] and all(tool["strict"] is False for tool in first["tools"])
    elif loop.name == "anthropic_messages":
        headers = api.answered()[0].headers  # the key and the API version the template sends
        assert headers["x-api-key"] == api.api_key and headers["anthropic-version"] == "2023-06-01"
        assert first["thinking"] == {"type": "enabled", "budget_tokens": 2048} and first["max_tokens"] == 8192
        assistant = second["messages"][1]
        assert assistant["role"] == "assistant" and assistant["content"][0]["type"] == "thinking"
        assert assistant["content"][0]["signature"].startswith("sig-1-")
    else:
        assert second["messages"][2]["role"] == "assistant" and "reasoning_content" not in second["messages"][2]


def test_reasoning_can_be_turned_off(monkeypatch: pytest.MonkeyPatch, proxy: MockProxy, token: str) -> None:
    with FakeResponsesAPI() as openai, FakeAnthropicAPI() as anthropic:
        monkeypatch.setenv("OPENAI_BASE_URL", openai.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", openai.api_key)
        monkeypatch.setenv("OPENAI_REASONING_EFFORT", "off")
        monkeypatch.setenv("ANTHROPIC_BASE_URL", anthropic.base_url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", anthropic.api_key)
        monkeypatch.setenv("ANTHROPIC_THINKING_BUDGET", "0")
        openai.script([Turn(text="ok")])
        anthropic.script([Turn(text="ok")])
        template("openai_responses").run(TASK, proxy_url=proxy.url, run_token=token)
        template("anthropic_messages").run(TASK, proxy_url=proxy.url, run_token=token)
    assert "reasoning" not in openai.requests[0].json and "thinking" not in anthropic.requests[0].json


@pytest.mark.parametrize("prompt_in_history", [False, True], ids=["prompt-apart", "prompt-in-history"])
def test_a_multi_turn_run_replays_the_earlier_turns(loop: Loop, api: FakeModelAPI, proxy: MockProxy, token: str,
                                                    prompt_in_history: bool) -> None:
    history = [{"role": "user", "content": "Where is order 4521?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "t1", "name": "get_order"}]},
               {"role": "tool", "tool_call_id": "t1", "content": "{}"},
               {"role": "assistant", "content": "It shipped on May 2."}]
    if prompt_in_history:
        history.append({"role": "user", "content": "And order 4522?"})
    task = {"user_instruction": "Answer the customer.", "latest_user_prompt": "And order 4522?",
            "messages": history, "session_id": 7, "turn_id": "7-t1"}
    api.script([Turn(text="Order 4522 is still being packed.")])
    body = template(loop.name).run(task, proxy_url=proxy.url, run_token=token)
    assert body["final_response"] == "Order 4522 is still being packed."
    assert loop.conversation_sent(api.requests[0].json) == [
        {"role": "user", "content": "Where is order 4521?"},
        {"role": "assistant", "content": "It shipped on May 2."},
        {"role": "user", "content": "And order 4522?"}]


def test_turn_limit_still_gives_a_final_response(loop: Loop, api: FakeModelAPI, proxy: MockProxy, token: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_MAX_TURNS", "2")
    api.script([Turn(tool_calls=[("search_kb", {"query": "again"})])])  # the model never stops calling tools
    body = template(loop.name).run(TASK, proxy_url=proxy.url, run_token=token)
    assert pp.validate_response(body) == []
    assert "Stopped after 2 model turns" in body["final_response"] and "AGENT_MAX_TURNS" in body["final_response"]
    assert "search_kb" in body["final_response"]
    assert len(api.answered()) == 2 and len(proxy.calls("search_kb")) == 2


def test_a_blank_answer_gives_the_fallback_final_response(loop: Loop, api: FakeModelAPI, proxy: MockProxy,
                                                          token: str) -> None:
    api.script([Turn(text="\n \n")])  # the model ends its turn with whitespace only
    body = template(loop.name).run(TASK, proxy_url=proxy.url, run_token=token)
    assert pp.validate_response(body) == []
    assert body["final_response"].startswith("The model ended its turn without an answer (")
    assert body["messages"][-1] == {"role": "assistant", "content": None}
    assert [r.name for r in proxy.calls(kind="traces")] == ["custom"]  # no assistant_message trace of nothing


def test_anthropic_gets_no_empty_tool_result_and_no_blank_text_block(monkeypatch: pytest.MonkeyPatch,
                                                                      proxy: MockProxy, token: str) -> None:
    proxy.script("get_order", [{"response": ""}])  # a tool whose result is an empty string
    with FakeAnthropicAPI() as api:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", api.base_url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", api.api_key)
        api.script([Turn(text="  ", tool_calls=[("get_order", {"order_id": "1"})]), Turn(text="Nothing on file.")])
        body = template("anthropic_messages").run(TASK, proxy_url=proxy.url, run_token=token)
    assert body["final_response"] == "Nothing on file." and [r.status for r in api.requests] == [200, 200]
    assistant, results = api.requests[1].json["messages"][-2:]
    assert [b["type"] for b in assistant["content"]] == ["thinking", "tool_use"]  # the blank text block dropped
    assert results["content"] == [{"type": "tool_result", "tool_use_id": "toolu_1_1", "content": "(no output)"}]
    assert body["messages"][-2] == {"role": "tool", "tool_call_id": "toolu_1_1", "content": "(no output)"}


def test_missing_api_key_names_the_variable_and_calls_nothing(loop: Loop, api: FakeModelAPI, proxy: MockProxy,
                                                              token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(loop.key_env)
    with pytest.raises(pp.AgentError, match=loop.key_env) as info:
        template(loop.name).run(TASK, proxy_url=proxy.url, run_token=token)
    assert "\n" not in str(info.value)
    assert api.requests == [] and proxy.requests == []


def test_bad_settings_give_a_clear_error(monkeypatch: pytest.MonkeyPatch, proxy: MockProxy, token: str) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-unused")
    monkeypatch.setenv("AGENT_MAX_TURNS", "lots")
    with pytest.raises(pp.AgentError, match="AGENT_MAX_TURNS must be an integer of at least 1, got 'lots'"):
        template("anthropic_messages").run(TASK, proxy_url=proxy.url, run_token=token)
    monkeypatch.delenv("AGENT_MAX_TURNS")
    monkeypatch.setenv("ANTHROPIC_THINKING_BUDGET", "9000")
    with pytest.raises(pp.AgentError, match="ANTHROPIC_THINKING_BUDGET must be 0, or from 1024"):
        template("anthropic_messages").run(TASK, proxy_url=proxy.url, run_token=token)
    assert proxy.requests == []


def test_inline_tools_schema_wins_over_the_file(loop: Loop, api: FakeModelAPI, proxy: MockProxy, token: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    inline = [{"name": "lookup_weather", "description": "Weather for a city.",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    monkeypatch.setenv("PIPELINES_TOOLS_SCHEMA_B64", base64.b64encode(json.dumps(inline).encode()).decode())
    api.script([Turn(text="sunny")])
    template(loop.name).run(TASK, proxy_url=proxy.url, run_token=token)
    assert loop.tools_sent(api.requests[0].json) == ["lookup_weather"]


@pytest.mark.parametrize("name", ["openai_responses", "openai_chat"])
def test_arguments_that_are_not_a_json_object_come_back_as_an_error(
        name: str, monkeypatch: pytest.MonkeyPatch, proxy: MockProxy, token: str) -> None:
    loop = next(loop for loop in LOOPS if loop.name == name)
    with loop.fake() as api:
        monkeypatch.setenv(loop.base_url_env, api.base_url)
        monkeypatch.setenv(loop.key_env, api.api_key)
        api.script([Turn(tool_calls=[("get_order", "{not json"), ("search_kb", {"query": "x"})]), Turn(text="ok")])
        body = template(name).run(TASK, proxy_url=proxy.url, run_token=token)
    assert pp.validate_response(body) == []
    results = loop.results_sent(api.answered()[1].json)
    assert "must be a JSON object" in json.loads(results["call_1_1"])["error"]
    assert json.loads(results["call_1_2"]) == {"tool": "search_kb", "args": {"query": "x"}}
    assert [r.name for r in proxy.calls()] == ["search_kb"]


# -- minimal and async_framework ----------------------------------------------------


def test_minimal_calls_one_tool_and_returns_a_transcript(proxy: MockProxy, token: str) -> None:
    proxy.script("search_kb", [{"response": {"articles": ["Refunds within 30 days of delivery."]}}])
    body = template("minimal").run({"user_instruction": "What is the refund policy?"}, proxy_url=proxy.url,
                                   run_token=token)
    assert pp.validate_response(body) == []
    assert "Refunds within 30 days of delivery." in body["final_response"]
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert body["messages"][1]["tool_calls"] == [
        {"id": "call_1", "name": "search_kb", "arguments": {"query": "What is the refund policy?"}}]
    assert body["messages"][3]["content"] == body["final_response"]
    [call] = proxy.calls()
    assert (call.name, call.json, call.bearer) == ("search_kb", {"query": "What is the refund policy?"}, token)


def test_minimal_reports_a_failed_tool(proxy: MockProxy, token: str) -> None:
    proxy.script("search_kb", [{"status": 404, "error_class": "tool_not_found", "message": "no tool search_kb"}])
    body = template("minimal").run({}, proxy_url=proxy.url, run_token=token)
    assert pp.validate_response(body) == []
    assert body["final_response"].startswith("I could not search the knowledge base")
    assert "tool_not_found" in body["final_response"]


def test_async_framework_gathers_its_tools_under_a_running_loop(proxy: MockProxy, token: str) -> None:
    together = Together(3)
    proxy.script("get_order", together(lambda r: {"response": {"order_id": r.json["order_id"], "status": "shipped"}}))
    proxy.script("search_kb", together(lambda r: {"response": "Refunds within 30 days."}))
    task = {"user_instruction": "Compare orders 4521 and 4522 with the refund policy."}
    body = in_running_loop(template("async_framework").run, task, proxy_url=proxy.url, run_token=token)
    assert pp.validate_response(body) == []
    assert sorted((r.name, json.dumps(r.json)) for r in proxy.calls()) == [
        ("get_order", '{"order_id": "4521"}'), ("get_order", '{"order_id": "4522"}'),
        ("search_kb", json.dumps({"query": task["user_instruction"]}))]
    assert {r.bearer for r in proxy.calls()} == {token} and proxy.max_in_flight == 3
    calls = body["messages"][1]["tool_calls"]
    assert [m["tool_call_id"] for m in body["messages"][2:5]] == [c["id"] for c in calls]
    assert "Refunds within 30 days." in body["final_response"] and '"status": "shipped"' in body["final_response"]


# -- HTTP mode ----------------------------------------------------------------------


def test_a_template_served_over_http(proxy: MockProxy, token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeChatAPI() as api:
        monkeypatch.setenv("OPENAI_BASE_URL", api.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", api.api_key)
        api.script([Turn(tool_calls=[("get_order", {"order_id": "4521"})]), Turn(text="Order 4521 has shipped.")])
        server = pp.start_server(template("openai_chat").agent, host="127.0.0.1", port=0, no_auth=True)
        try:
            dispatch = {"odyssey_proxy_url": proxy.url, "run_id": 17, "task_id": 42,
                        "input": {"user_instruction": "Where is order 4521?"},
                        "tools_schema": json.loads((TEMPLATES / "tools_schema.json").read_text())[:1]}
            request = urllib.request.Request(server.url, data=json.dumps(dispatch).encode(), method="POST", headers={
                "Content-Type": "application/json", "X-Pipelines-Run-Token": token})
            with urllib.request.urlopen(request, timeout=20) as reply:
                status, body = reply.status, json.loads(reply.read())
        finally:
            server.close()
    assert status == 200 and pp.validate_response(body) == []
    assert body["final_response"] == "Order 4521 has shipped."
    assert [(r.name, r.json, r.bearer) for r in proxy.calls()] == [("get_order", {"order_id": "4521"}, token)]
    assert [t["function"]["name"] for t in api.requests[0].json["tools"]] == ["get_order"]


def test_a_template_served_by_the_command_line(proxy: MockProxy, token: str) -> None:
    """``python3 pipelines_port.py serve templates/X.py:agent``: the template's ``import pipelines_port``
    must share the server's envelope binding, or its tools find no envelope."""
    command = [sys.executable, str(ROOT / "pipelines_port.py"), "serve", "templates/async_framework.py:agent",
               "--host", "127.0.0.1", "--port", "0", "--no-auth"]
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: "queue.Queue[str]" = queue.Queue()
    output: List[str] = []

    def drain() -> None:  # keep reading, so a chatty server never blocks on a full pipe
        assert server.stdout is not None
        for line in server.stdout:
            output.append(line)
            lines.put(line)

    threading.Thread(target=drain, daemon=True).start()
    try:
        url = None
        while url is None:
            try:
                found = re.search(r"listening on (http://\S+)", lines.get(timeout=15))
            except queue.Empty:
                pytest.fail("the server printed no 'listening on' line:\n" + "".join(output))
            url = found.group(1) if found else None
        dispatch = {"odyssey_proxy_url": proxy.url, "run_id": 17, "task_id": 42,
                    "input": {"user_instruction": "Where is order 4521?"}}
        request = urllib.request.Request(url, data=json.dumps(dispatch).encode(), method="POST", headers={
            "Content-Type": "application/json", "X-Pipelines-Run-Token": token})
        with urllib.request.urlopen(request, timeout=20) as reply:
            status, body = reply.status, json.loads(reply.read())
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
    assert status == 200 and pp.validate_response(body) == []
    assert sorted(r.name for r in proxy.calls()) == ["get_order", "search_kb"]
    assert {r.bearer for r in proxy.calls()} == {token}
    assert token not in "".join(output)


def test_a_turn_cut_off_by_the_output_limit_is_marked_and_its_tool_calls_never_run(
        loop: Loop, api: FakeModelAPI, proxy: MockProxy, token: str) -> None:
    """finish_reason length / status incomplete / stop_reason max_tokens: the cut answer is marked as cut, and a
    tool call in that turn (its arguments may be cut mid-JSON) is not executed."""
    api.script([Turn(text="Refunding order 4521 now", tool_calls=[("refund_order", {"order_id": "4521"})],
                     stop="max_tokens")])
    body = template(loop.name).run(TASK, proxy_url=proxy.url, run_token=token)
    assert body["final_response"].startswith("Refunding order 4521 now\n\n[The answer was cut off (")
    assert "were not run" in body["final_response"]
    assert body["metadata"]["stop_reason"] in ("length", "max_output_tokens", "max_tokens")
    assert proxy.calls() == []  # refund_order never reached the proxy
    assert len(api.answered()) == 1


def test_anthropic_pause_turn_continues_the_turn(monkeypatch: pytest.MonkeyPatch, proxy: MockProxy,
                                                 token: str) -> None:
    with FakeAnthropicAPI() as api:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", api.base_url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", api.api_key)
        monkeypatch.setenv("ANTHROPIC_MODEL", MODEL)
        api.script([Turn(text="Still searching", stop="pause_turn"), Turn(text="Order 4521 is on its way.")])
        body = template("anthropic_messages").run(TASK, proxy_url=proxy.url, run_token=token)
        first, second = (r.json for r in api.answered())
    assert body["final_response"] == "Order 4521 is on its way."  # not the paused turn's text
    assert second["messages"][-1]["role"] == "assistant"  # the paused turn sent back as it was, to go on
    assert second["messages"][-1]["content"][-1] == {"type": "text", "text": "Still searching"}
