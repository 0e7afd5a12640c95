"""The framework bridges against the real frameworks: tools_schema, proxied tools ("swap the body, keep the tool")
and the run result as the response envelope.

- OpenAI Agents SDK: a real ``Agent`` with a ``@function_tool`` runs under ``Runner.run_sync`` against the fake
  Responses API, served by pipelines_port's dispatch server and dispatched to as the platform does: model →
  tool call → the proxied tool → the MockProxy → model → answer.  The original tool body never runs.
- LangChain / LangGraph: a real ``@tool`` proxied, invoked sync and async and through LangGraph's own
  ``ToolNode``, and a LangGraph-style message state turned into the response envelope.

Skipped when the framework is missing (``.ci/run`` installs them in the interop venv).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Dict, Iterator, List

import pytest

import pipelines_port as pp
from conformance.harness.dispatcher import Dispatcher, Run
from conformance.harness.mock_proxy import MockProxy
from tests.fake_model_apis import FakeResponsesAPI, Turn

TOKEN = "framework-run-token-0123456789"


@pytest.fixture
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[TOKEN]) as p:
        p.script("get_order", [{"response": {"id": "4521", "status": "shipped"}}])
        yield p


# -- OpenAI Agents SDK -------------------------------------------------------------------------------------------


def test_openai_agents_sdk_agent_runs_through_the_proxy_in_a_dispatch(proxy: MockProxy) -> None:
    agents = pytest.importorskip("agents", reason="needs openai-agents")
    openai = pytest.importorskip("openai", reason="needs openai")
    agents.set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI
    ran_locally: List[str] = []

    @agents.function_tool
    def get_order(order_id: str) -> Dict[str, Any]:
        """Look up an order by its id."""
        ran_locally.append(order_id)  # the original body: must never run once proxied
        return {"id": order_id, "status": "local"}

    with FakeResponsesAPI() as fake:
        fake.script([Turn(tool_calls=[("get_order", {"order_id": "4521"})]), Turn(text="Order 4521 has shipped.")])
        model = agents.OpenAIResponsesModel(model="test-model-7", openai_client=openai.AsyncOpenAI(
            base_url=fake.base_url, api_key=fake.api_key, max_retries=0))
        agent = agents.Agent(name="support", instructions="Answer with the tools.", tools=[get_order], model=model)

        (entry,) = pp.tools_schema_from(agent)  # step 1: the tools list to register
        assert entry["name"] == "get_order" and entry["description"] == "Look up an order by its id."
        assert entry["input_schema"]["required"] == ["order_id"] and entry["default_execution_mode"] == "sandbox"

        proxied = agent.clone(tools=pp.proxied_tools(agent))  # step 2: same tool, body through the proxy
        (tool,) = proxied.tools
        assert (tool.name, tool.description, tool.params_json_schema) == (
            get_order.name, get_order.description, get_order.params_json_schema)

        def dispatch_agent(envelope: pp.Envelope) -> Dict[str, Any]:
            result = agents.Runner.run_sync(proxied, envelope.user_instruction)
            return pp.response_from(result)

        server = pp.start_server(dispatch_agent, no_auth=True)
        dispatcher = Dispatcher(server.url, timeout=30)
        try:
            reply = dispatcher.dispatch(Run(run_token=TOKEN, proxy_url=proxy.url, run_id=1, task_id=2),
                                        user_instruction="Where is order 4521?")
        finally:
            dispatcher.close()
            server.close(1)
    assert reply.status == 200, reply.text
    body = reply.json
    assert body["final_response"] == "Order 4521 has shipped." and pp.validate_response(body) == []
    (call,) = proxy.calls("get_order")
    assert call.json == {"order_id": "4521"} and call.run_token == TOKEN
    assert ran_locally == []
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert body["messages"][1]["tool_calls"][0]["name"] == "get_order"
    assert '"status": "shipped"' in body["messages"][2]["content"]
    assert body["metadata"]["total_input_tokens"] == 200 and body["metadata"]["model"] == "test-model-7"


def test_openai_agents_sdk_handoffs_are_posted_by_the_run_hooks(proxy: MockProxy) -> None:
    """``Handoffs.agents_hooks()`` posts the SDK's own handoff (triage to refunds) once, and the handoff call and
    its output reach the transcript as a tool call and its result."""
    agents = pytest.importorskip("agents", reason="needs openai-agents")
    openai = pytest.importorskip("openai", reason="needs openai")
    agents.set_tracing_disabled(True)
    with FakeResponsesAPI() as fake:
        fake.script([Turn(tool_calls=[("transfer_to_refunds", {})]), Turn(text="Refunded.")])
        model = agents.OpenAIResponsesModel(model="test-model-7", openai_client=openai.AsyncOpenAI(
            base_url=fake.base_url, api_key=fake.api_key, max_retries=0))
        refunds = agents.Agent(name="refunds", instructions="Refund the order.", model=model)
        triage = agents.Agent(name="triage", instructions="Route the request.", handoffs=[refunds], model=model)
        with pp.bind_envelope(pp.Envelope.from_run({"user_instruction": "x"}, proxy_url=proxy.url, run_token=TOKEN)):
            hooks = pp.Handoffs().agents_hooks()
        result = agents.Runner.run_sync(triage, "Refund order 4521", hooks=hooks)
    assert result.final_output == "Refunded."
    assert [(r.json["from_sub_agent"], r.json["to_sub_agent"]) for r in proxy.calls(kind="traces")] == [
        ("triage", "refunds")]
    body = pp.response_from(result)
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert body["messages"][1]["tool_calls"][0]["name"] == "transfer_to_refunds"
    assert body["final_response"] == "Refunded." and pp.validate_response(body) == []


# -- LangChain and LangGraph -----------------------------------------------------------------------------------


def test_langchain_tools_are_proxied_sync_async_and_through_langgraph(proxy: MockProxy) -> None:
    tools = pytest.importorskip("langchain_core.tools", reason="needs langchain-core")
    messages = pytest.importorskip("langchain_core.messages", reason="needs langchain-core")
    prebuilt = pytest.importorskip("langgraph.prebuilt", reason="needs langgraph")
    graphs = pytest.importorskip("langgraph.graph", reason="needs langgraph")
    ran_locally: List[str] = []

    @tools.tool
    def get_order(order_id: str) -> str:
        """Look up an order by its id."""
        ran_locally.append(order_id)
        return "local"

    (entry,) = pp.tools_schema_from([get_order])
    assert entry["name"] == "get_order" and entry["input_schema"]["properties"]["order_id"]["type"] == "string"
    assert entry["input_schema"]["required"] == ["order_id"]
    (tool,) = pp.proxied_tools([get_order])
    assert type(tool).__name__ == "StructuredTool" and tool.name == "get_order"
    assert tool.description == get_order.description and tool.args == get_order.args

    envelope = pp.Envelope.from_run({"user_instruction": "x"}, proxy_url=proxy.url, run_token=TOKEN)
    proxy.script("get_order", [{"response": {"id": "4521", "status": "shipped"}}])
    with pp.bind_envelope(envelope):
        sync = tool.invoke({"order_id": "4521"})
        asynchronous = asyncio.run(tool.ainvoke({"order_id": "4522"}))
        graph = graphs.StateGraph(graphs.MessagesState)  # LangGraph runs the tool in its own ToolNode
        graph.add_node("tools", prebuilt.ToolNode([tool]))
        graph.add_edge(graphs.START, "tools")
        graph.add_edge("tools", graphs.END)
        asked = messages.AIMessage(content="", tool_calls=[{"id": "call_1", "name": "get_order",
                                                             "args": {"order_id": "4523"}}])
        state = graph.compile().invoke({"messages": [asked]})
    assert '"status": "shipped"' in sync and '"status": "shipped"' in asynchronous
    answer = state["messages"][-1]
    assert answer.tool_call_id == "call_1" and '"shipped"' in answer.content
    assert [c.json for c in proxy.calls("get_order")] == [{"order_id": "4521"}, {"order_id": "4522"},
                                                         {"order_id": "4523"}]
    assert all(c.run_token == TOKEN for c in proxy.calls()) and ran_locally == []

    conversation = {"messages": [messages.HumanMessage(content="Where is order 4523?"), asked, answer,
                                 messages.AIMessage(content="It has shipped.", usage_metadata={
                                     "input_tokens": 30, "output_tokens": 5, "total_tokens": 35},
                                     response_metadata={"model_name": "test-model-7"})]}
    body = pp.response_from(conversation)
    assert body["final_response"] == "It has shipped." and pp.validate_response(body) == []
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert body["messages"][1]["tool_calls"] == [{"id": "call_1", "name": "get_order",
                                                  "arguments": {"order_id": "4523"}}]
    assert body["metadata"] == {"total_input_tokens": 30, "total_output_tokens": 5, "model": "test-model-7"}


def test_langgraph_nodes_post_a_handoff_when_control_moves(proxy: MockProxy) -> None:
    graphs = pytest.importorskip("langgraph.graph", reason="needs langgraph")
    envelope = pp.Envelope.from_run({"user_instruction": "x"}, proxy_url=proxy.url, run_token=TOKEN)
    visited: List[str] = []

    def triage(state: Dict[str, Any]) -> Dict[str, Any]:
        visited.append("triage")
        return {"messages": [("ai", "a refund: over to refunds")]}

    async def refunds(state: Dict[str, Any]) -> Dict[str, Any]:
        visited.append("refunds")
        return {"messages": [("ai", "refunded")]}

    with pp.bind_envelope(envelope):
        handoffs = pp.Handoffs()
        graph = graphs.StateGraph(graphs.MessagesState)
        graph.add_node("triage", handoffs.node("triage", triage))
        graph.add_node("refunds", handoffs.node("refunds", refunds))
        graph.add_edge(graphs.START, "triage")
        graph.add_edge("triage", "refunds")
        graph.add_edge("refunds", graphs.END)
        asyncio.run(graph.compile().ainvoke({"messages": [("user", "Refund order 4521")]}))
    assert visited == ["triage", "refunds"]
    (event,) = [r.json for r in proxy.calls(kind="traces")]
    assert (event["from_sub_agent"], event["to_sub_agent"]) == ("triage", "refunds")


# -- the Anthropic SDK's own Message objects -------------------------------------------------------------------


def test_anthropic_sdk_messages_become_the_response_envelope() -> None:
    types = pytest.importorskip("anthropic.types", reason="needs anthropic")
    usage = {"input_tokens": 50, "output_tokens": 9}
    asked = types.Message.model_validate({
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test", "stop_reason": "tool_use",
        "stop_sequence": None, "usage": usage,
        "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_order", "input": {"order_id": "4521"}}]})
    answered = types.Message.model_validate({
        "id": "msg_2", "type": "message", "role": "assistant", "model": "claude-test", "stop_reason": "end_turn",
        "stop_sequence": None, "usage": usage, "content": [{"type": "text", "text": "It has shipped."}]})
    conversation = [{"role": "user", "content": "Where is order 4521?"}, asked,
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                  "content": '{"status": "shipped"}'}]}, answered]
    body = pp.response_from(conversation)
    assert body["final_response"] == "It has shipped." and pp.validate_response(body) == []
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert body["metadata"] == {"total_input_tokens": 100, "total_output_tokens": 18, "model": "claude-test"}


# -- Strands ----------------------------------------------------------------------------------------------------


def test_a_strands_agent_runs_through_the_proxy(proxy: MockProxy) -> None:
    strands = pytest.importorskip("strands", reason="needs strands-agents")
    models = pytest.importorskip("strands.models.openai", reason="needs strands-agents' OpenAI provider")
    from tests.fake_model_apis import FakeChatAPI

    ran_locally: List[str] = []

    @strands.tool
    def get_order(order_id: str) -> Dict[str, Any]:
        """Look up an order by its id."""
        ran_locally.append(order_id)
        return {"status": "local"}

    (entry,) = pp.tools_schema_from([get_order])
    assert entry["name"] == "get_order" and entry["input_schema"]["required"] == ["order_id"]
    envelope = pp.Envelope.from_run({"user_instruction": "x"}, proxy_url=proxy.url, run_token=TOKEN)
    with FakeChatAPI() as fake:
        fake.script([Turn(tool_calls=[("get_order", {"order_id": "4521"})]), Turn(text="Order 4521 has shipped.")])
        model = models.OpenAIModel(client_args={"base_url": fake.base_url, "api_key": fake.api_key},
                                   model_id="test-model-7")
        with pp.bind_envelope(envelope):  # as in a dispatch: the proxied tools take this run with them
            tools = pp.proxied_tools([get_order], actor="support")
            agent = strands.Agent(model=model, tools=tools, callback_handler=None)
            result = agent("Where is order 4521?")
    assert "shipped" in str(result)
    (call,) = proxy.calls("get_order")
    assert (call.json, call.actor, call.run_token) == ({"order_id": "4521"}, "support", TOKEN)
    assert ran_locally == []
    body = pp.response_from(agent)
    assert body["final_response"] == "Order 4521 has shipped." and pp.validate_response(body) == []
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert body["messages"][1]["tool_calls"][0]["name"] == "get_order"
    assert '"status": "shipped"' in body["messages"][2]["content"]
    assert body["metadata"]["total_input_tokens"] == 200 and body["metadata"]["model"] == "test-model-7"


# -- the Anthropic SDK's own client, in a hand-written loop -------------------------------------------------------


def test_an_anthropic_sdk_loop_runs_through_the_proxy(proxy: MockProxy) -> None:
    anthropic = pytest.importorskip("anthropic", reason="needs anthropic")
    from tests.fake_model_apis import FakeAnthropicAPI

    tools = [{"name": "get_order", "description": "Look up an order by its id.",
              "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}},
                               "required": ["order_id"]}}]
    assert pp.tools_schema_from(tools)[0]["name"] == "get_order"  # the same array messages.create takes
    envelope = pp.Envelope.from_run({"user_instruction": "x"}, proxy_url=proxy.url, run_token=TOKEN)
    with FakeAnthropicAPI() as fake:
        fake.script([Turn(tool_calls=[("get_order", {"order_id": "4521"})]), Turn(text="Order 4521 has shipped.")])
        client = anthropic.Anthropic(base_url=fake.base_url, api_key=fake.api_key, max_retries=0)
        conversation: List[Any] = [{"role": "user", "content": "Where is order 4521?"}]
        with pp.bind_envelope(envelope):
            while True:
                message = client.messages.create(model="test-model-7", max_tokens=1024, tools=tools,
                                                 messages=conversation)
                conversation.append(message)  # the SDK's own Message object
                uses = [b for b in message.content if b.type == "tool_use"]
                if not uses:
                    break
                conversation.append({"role": "user", "content": [  # step 2: the tool body is a proxy call
                    {"type": "tool_result", "tool_use_id": u.id,
                     "content": json.dumps(pp.proxy_call(u.name, u.input, errors="return"))} for u in uses]})
    body = pp.response_from(conversation)
    assert body["final_response"] == "Order 4521 has shipped." and pp.validate_response(body) == []
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool", "assistant"]
    (call,) = proxy.calls("get_order")
    assert call.json == {"order_id": "4521"} and call.run_token == TOKEN
    assert body["metadata"]["model"] == "test-model-7" and body["metadata"]["total_input_tokens"] == 200


def test_an_mcp_tool_list_is_a_tools_schema() -> None:
    types = pytest.importorskip("mcp.types", reason="needs mcp")
    listed = [types.Tool(name="get_order", description="Look up an order.",
                         inputSchema={"type": "object", "properties": {"order_id": {"type": "string"}},
                                      "required": ["order_id"]})]
    assert pp.tools_schema_from(listed) == [{
        "name": "get_order", "description": "Look up an order.", "default_execution_mode": "sandbox",
        "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}]
