"""templates/frameworks/openai_agents.py end to end, in code mode, against the fake Responses API and a MockProxy.

The OpenAI Agents SDK runs the template's two agents for real: the triage agent hands off to the refunds agent
(the SDK's ``transfer_to_refunds`` tool), which looks the order up and refunds it.  Every tool call reaches the
proxy labelled with its agent (``X-Pipelines-Actor-Id: refunds``), the handoff is a ``handoff`` trace event,
nothing runs the original tool bodies, and the response envelope carries the transcript.  Skipped without
``openai-agents``.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Iterator

import pytest

import pipelines_port as pp
from conformance.harness.mock_proxy import MockProxy
from tests.fake_model_apis import FakeResponsesAPI, Turn
from tests.interop.hosts import ROOT

pytest.importorskip("agents", reason="needs openai-agents")

TOKEN = "agents-template-run-token-0123"
TEMPLATE = ROOT / "templates" / "frameworks" / "openai_agents.py"


def load() -> Any:
    spec = importlib.util.spec_from_file_location("template_openai_agents", TEMPLATE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[TOKEN]) as p:
        p.script("get_order", [{"response": {"id": "4521", "status": "shipped", "amount": 79.5}}])
        p.script("refund_order", [{"response": {"order_id": "4521", "status": "refunded"}}])
        yield p


def test_the_agents_template_hands_off_and_calls_tools_through_the_proxy_with_actors(
        proxy: MockProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    template = load()
    schema = template.tools_schema()
    assert sorted(e["name"] for e in schema) == ["get_order", "refund_order"]
    assert all(e["input_schema"]["type"] == "object" for e in schema)
    with FakeResponsesAPI() as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", fake.api_key)
        monkeypatch.setenv("OPENAI_MODEL", "test-model-7")
        fake.script([Turn(tool_calls=[("transfer_to_refunds", {})]),
                     Turn(tool_calls=[("get_order", {"order_id": "4521"})]),
                     Turn(tool_calls=[("refund_order", {"order_id": "4521", "reason": "damaged"})]),
                     Turn(text="Order 4521 is refunded.")])
        body = template.run({"user_instruction": "Refund order 4521, it arrived damaged.", "input": {},
                             "task_id": 7}, proxy_url=proxy.url, run_token=TOKEN)
    assert body["final_response"] == "Order 4521 is refunded." and pp.validate_response(body) == []
    calls = [(r.name, r.actor, r.json) for r in proxy.calls()]
    assert calls == [("get_order", "refunds", {"order_id": "4521"}),
                     ("refund_order", "refunds", {"order_id": "4521", "reason": "damaged"})]
    (handoff,) = [r.json for r in proxy.calls(kind="traces")]
    assert (handoff["from_sub_agent"], handoff["to_sub_agent"]) == ("triage", "refunds")
    names = [c["name"] for m in body["messages"] for c in m.get("tool_calls") or []]
    assert names == ["transfer_to_refunds", "get_order", "refund_order"]
    assert all(r.run_token == TOKEN for r in proxy.requests)


def test_the_langgraph_template_runs_a_react_agent_through_the_proxy(proxy: MockProxy,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("langgraph.prebuilt", reason="needs langgraph")
    pytest.importorskip("langchain_openai", reason="needs langchain-openai")
    from tests.fake_model_apis import FakeChatAPI

    spec = importlib.util.spec_from_file_location("template_langgraph", ROOT / "templates" / "frameworks" /
                                                  "langgraph_agent.py")
    assert spec is not None and spec.loader is not None
    template = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(template)
    assert sorted(e["name"] for e in template.tools_schema()) == ["get_order", "refund_order"]
    with FakeChatAPI() as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", fake.api_key)
        monkeypatch.setenv("OPENAI_MODEL", "test-model-7")
        fake.script([Turn(tool_calls=[("get_order", {"order_id": "4521"})]),
                     Turn(tool_calls=[("refund_order", {"order_id": "4521", "reason": "damaged"})]),
                     Turn(text="Order 4521 is refunded.")])
        body = template.run({"user_instruction": "Refund order 4521, it arrived damaged.", "input": {},
                             "task_id": 7}, proxy_url=proxy.url, run_token=TOKEN)
        model_turns = len(fake.answered())
    assert body["final_response"] == "Order 4521 is refunded." and pp.validate_response(body) == []
    assert [(r.name, r.actor, r.json) for r in proxy.calls()] == [
        ("get_order", "support", {"order_id": "4521"}),
        ("refund_order", "support", {"order_id": "4521", "reason": "damaged"})]
    assert model_turns == 3 and [m["role"] for m in body["messages"]] == [
        "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert body["metadata"]["total_input_tokens"] == 300 and body["metadata"]["model"] == "test-model-7"
