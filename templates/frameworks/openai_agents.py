"""An OpenAI Agents SDK agent: a triage agent handing refunds to a refunds agent, every tool through the proxy.

Needs the ``openai-agents`` package (``pip install openai-agents``) beside ``pipelines_port.py``; the sandbox
(code mode) must ship it with the upload.  Copy this file as your ``agent.py`` (``init`` offers the
standard-library templates only).  The agent is written as it would be without the platform; the only
platform-specific lines are marked PLATFORM:

- the tools list for registration comes from the agents (``pp.tools_schema_from``);
- each agent's tools are swapped for proxied ones, names, descriptions and schemas kept, each labelled with
  its agent as the acting sub-agent (``X-Pipelines-Actor-Id``);
- a control transfer between agents is posted as a ``handoff`` trace event (``pp.Handoffs().agents_hooks()``);
- the run's result becomes the response envelope (``pp.response_from``): answer, transcript, model, tokens.

Settings (environment):

- ``OPENAI_API_KEY``: required (the SDK's client reads it).
- ``OPENAI_BASE_URL``: default ``https://api.openai.com/v1``.
- ``OPENAI_MODEL``: default ``gpt-4.1``.

HTTP mode: ``python3 -m pipelines_port serve agent.py:agent``; code mode: ``run`` below.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

import pipelines_port as pp
from agents import Agent, Runner, function_tool, set_tracing_disabled

set_tracing_disabled(True)  # PLATFORM: the platform records the run; no trace export to OpenAI


# -- the agent, as it was --------------------------------------------------------------------------------------


@function_tool
def get_order(order_id: str) -> Dict[str, Any]:
    """Look up an order: its status, amount and buyer."""
    raise NotImplementedError("the real backend; under test the proxy answers")


@function_tool
def refund_order(order_id: str, reason: str) -> Dict[str, Any]:
    """Refund a shipped or delivered order in full."""
    raise NotImplementedError("the real backend; under test the proxy answers")


def build_agents() -> Agent:
    model = os.environ.get("OPENAI_MODEL") or "gpt-4.1"
    refunds = Agent(name="refunds", model=model, tools=[get_order, refund_order],
                    instructions="You handle refunds. Check the order first; refund only what the policy allows.")
    return Agent(name="triage", model=model, tools=[get_order], handoffs=[refunds],
                 instructions="You answer order questions; hand refunds to the refunds agent.")


# -- PLATFORM: the same agents, their tools through the run's proxy --------------------------------------------


def proxied(agent: Agent, seen: Dict[str, Agent]) -> Agent:
    """``agent`` and the agents it hands off to, each tool proxied and labelled with its agent's name."""
    if agent.name not in seen:
        seen[agent.name] = agent  # a placeholder while its handoffs are rebuilt (cycles)
        clone = agent.clone(tools=pp.proxied_tools(agent, actor=agent.name))
        seen[agent.name] = clone
        clone.handoffs = [proxied(h, seen) if isinstance(h, Agent) else h for h in agent.handoffs]
    return seen[agent.name]


def tools_schema() -> List[Dict[str, Any]]:
    """The tools to register: every agent's, once each."""
    entry = build_agents()
    tools = list(entry.tools) + [t for h in entry.handoffs if isinstance(h, Agent) for t in h.tools]
    unique = {t.name: t for t in tools}
    return pp.tools_schema_from(list(unique.values()))


async def agent(envelope: pp.Envelope) -> Dict[str, Any]:
    """Run the agents on the dispatch's instruction; the response envelope.

    ``async def`` with ``await Runner.run``: the kit's server (and uvicorn, hypercorn) runs every dispatch on
    one event loop, where the SDK's shared OpenAI client lives.  A sync agent calling ``Runner.run_sync``
    gets a loop of its own per dispatch: it must then build everything that holds a client (an
    ``OpenAIResponsesModel(openai_client=AsyncOpenAI())`` passed as each agent's ``model``) inside the call,
    or concurrent dispatches fail with "bound to a different event loop".
    """
    entry = proxied(build_agents(), {})
    hooks = pp.Handoffs().agents_hooks()  # PLATFORM: each control transfer as a handoff trace event
    result = await Runner.run(entry, envelope.user_instruction or "(no instruction)", hooks=hooks)
    return pp.response_from(result)


# What this agent needs in its environment (`pipelines-port doctor` checks each is set).
REQUIRED_ENV = ("OPENAI_API_KEY",)

# Code mode: the sandbox's entrypoint, the same agent unchanged (run on an event loop of its own).
run = pp.code_mode(agent)
