"""Async framework agents for the concurrency tests (tests/interop/test_framework_concurrency.py).

Each agent is built once and shares its model client across every dispatch, as a real service does: that
client binds to the first event loop that uses it, so the agent only works when every dispatch runs on the
same loop.  Imported by the test itself (the kit's own server) and, as ``concurrent_agents:app``, by
uvicorn and hypercorn, which read ``CONCURRENT_FRAMEWORK``, ``MODEL_BASE_URL`` and ``MODEL_API_KEY``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Coroutine, Dict

import pipelines_port as pp

Agent = Callable[[pp.Envelope], Coroutine[Any, Any, Dict[str, Any]]]
INSTRUCTIONS = "Answer with the tools: look the order up, then its refund."


def openai_agents_agent(model_base_url: str, api_key: str) -> Agent:
    """An OpenAI Agents SDK agent with two proxied tools, run with ``await Runner.run(...)``."""
    import agents
    import openai

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_order(order_id: str) -> Dict[str, Any]:
        """Look up an order by its id."""
        raise AssertionError("proxied: the original body never runs")

    @agents.function_tool
    def get_refund(order_id: str) -> Dict[str, Any]:
        """Look up an order's refund."""
        raise AssertionError("proxied: the original body never runs")

    client = openai.AsyncOpenAI(base_url=model_base_url, api_key=api_key, max_retries=0)
    model = agents.OpenAIResponsesModel(model="test-model-7", openai_client=client)
    agent = agents.Agent(name="support", instructions=INSTRUCTIONS, tools=[get_order, get_refund], model=model)
    proxied = agent.clone(tools=pp.proxied_tools(agent))

    async def dispatch(envelope: pp.Envelope) -> Dict[str, Any]:
        result = await agents.Runner.run(proxied, envelope.user_instruction or "")
        return pp.response_from(result)

    return dispatch


def langgraph_agent(model_base_url: str, api_key: str) -> Agent:
    """A LangGraph ReAct agent on a shared ``ChatOpenAI`` with two proxied tools, run with ``await ainvoke``."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def get_order(order_id: str) -> Dict[str, Any]:
        """Look up an order by its id."""
        raise AssertionError("proxied: the original body never runs")

    @tool
    def get_refund(order_id: str) -> Dict[str, Any]:
        """Look up an order's refund."""
        raise AssertionError("proxied: the original body never runs")

    model = ChatOpenAI(model="test-model-7", base_url=model_base_url, api_key=api_key,  # type: ignore[arg-type]
                       max_retries=0)
    graph = create_react_agent(model, pp.proxied_tools([get_order, get_refund]), prompt=INSTRUCTIONS)

    async def dispatch(envelope: pp.Envelope) -> Dict[str, Any]:
        state = await graph.ainvoke({"messages": [("user", envelope.user_instruction or "")]})
        return pp.response_from(state)

    return dispatch


FRAMEWORKS: Dict[str, Callable[[str, str], Agent]] = {
    "openai-agents": openai_agents_agent,
    "langgraph": langgraph_agent,
}


if "CONCURRENT_FRAMEWORK" in os.environ:  # under uvicorn/hypercorn: ``concurrent_agents:app``
    app = pp.DispatchApp(FRAMEWORKS[os.environ["CONCURRENT_FRAMEWORK"]](
        os.environ["MODEL_BASE_URL"], os.environ["MODEL_API_KEY"]), no_auth=True)
