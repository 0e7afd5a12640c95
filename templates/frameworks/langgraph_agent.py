"""A LangGraph agent (a ReAct loop on an OpenAI chat model), every tool through the proxy.

Needs ``langgraph``, ``langchain-core`` and ``langchain-openai`` beside ``pipelines_port.py``; the sandbox (code
mode) must ship them with the upload.  Copy this file as your ``agent.py``.  The agent is written as it would
be without the platform; the platform-specific lines are marked PLATFORM:

- the tools list for registration comes from the tools (``pp.tools_schema_from``);
- the tools are swapped for proxied ones, names, descriptions and argument schemas kept, so the model sees the
  same tools and the graph runs them in its own ``ToolNode``;
- the graph's final state becomes the response envelope (``pp.response_from``): answer, transcript, model, tokens.

Settings (environment): ``OPENAI_API_KEY`` (required), ``OPENAI_BASE_URL`` (default the OpenAI API),
``OPENAI_MODEL`` (default ``gpt-4.1``).  HTTP mode: ``python3 -m pipelines_port serve agent.py:agent``;
code mode: ``run`` below.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

import pipelines_port as pp
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

SYSTEM_PROMPT = ("You are a customer-support agent. Use the tools to look things up and act; never invent an "
                 "order's details. Answer the user in a few sentences.")


# -- the agent's tools, as they were ----------------------------------------------------------------------------


@tool
def get_order(order_id: str) -> Dict[str, Any]:
    """Look up an order: its status, amount and buyer."""
    raise NotImplementedError("the real backend; under test the proxy answers")


@tool
def refund_order(order_id: str, reason: str) -> Dict[str, Any]:
    """Refund a shipped or delivered order in full."""
    raise NotImplementedError("the real backend; under test the proxy answers")


TOOLS = [get_order, refund_order]


def tools_schema() -> List[Dict[str, Any]]:
    """PLATFORM: the tools to register on the platform."""
    return pp.tools_schema_from(TOOLS)


async def agent(envelope: pp.Envelope) -> Dict[str, Any]:
    """Run the graph on the dispatch's instruction; the response envelope.

    ``async def`` with ``await graph.ainvoke``: the kit's server (and uvicorn, hypercorn) runs every dispatch
    on one event loop, so a model built once and shared across runs works; the proxied tools await the
    kit's asyncio driver.  A sync agent (``graph.invoke``) runs on a thread per dispatch: keep what it
    builds per call, as here.
    """
    model = ChatOpenAI(model=os.environ.get("OPENAI_MODEL") or "gpt-4.1", max_retries=2)
    graph = create_react_agent(model, pp.proxied_tools(TOOLS, actor="support"), prompt=SYSTEM_PROMPT)  # PLATFORM
    state = await graph.ainvoke({"messages": [("user", envelope.user_instruction or "(no instruction)")]})
    return pp.response_from(state)  # PLATFORM


# What this agent needs in its environment (`pipelines-port doctor` checks each is set).
REQUIRED_ENV = ("OPENAI_API_KEY",)

# Code mode: the sandbox's entrypoint, the same agent unchanged.
run = pp.code_mode(agent)
