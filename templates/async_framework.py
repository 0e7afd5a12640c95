"""An async agent framework's runner on Pipelines, standard library only.

Most agent frameworks (OpenAI Agents SDK, LangGraph, PydanticAI, ...) are
asyncio inside: an ``async`` runner awaits a model and ``async`` tools, often
several at once.  This file shows that shape with a tiny stand-in framework
(``TinyRunner``) and module-level async tools that call the per-run proxy with
``pp.aproxy_call``.  Swap ``TinyRunner`` for your framework's runner, e.g.
``await Runner.run(my_agent, prompt)``, and make each tool's body one
``await pp.aproxy_call(name, args)``.

Run it (PATH is this file: templates/async_framework.py in the kit, agent.py in a
project made by ``pipelines-port init DIR --template async_framework``):

- HTTP mode, the platform POSTs each run to your server (AGENT_TOKEN is the
  bearer it must send)::

      AGENT_TOKEN=... python3 pipelines_port.py serve PATH:agent --port 8080

- Code mode (sandbox upload): upload it with pipelines_port.py; the
  sandbox calls ``run(task_input, proxy_url=..., run_token=...)``.

Environment: none of its own.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Awaitable, Callable, Dict, List, Tuple

import pipelines_port as pp

# -- tools: module-level async functions, as frameworks register them --------
#
# A framework calls a tool with the model's arguments only; it has no way to hand
# it the run's proxy URL and token.  pp.aproxy_call finds them in the envelope
# bound to the current context, which asyncio copies into every task it starts.


async def get_order(order_id: str) -> Any:
    """Look up one order."""
    return await pp.aproxy_call("get_order", {"order_id": order_id}, errors="return")


async def search_kb(query: str) -> Any:
    """Search the support knowledge base."""
    return await pp.aproxy_call("search_kb", {"query": query}, errors="return")


TOOLS: Dict[str, Callable[..., Awaitable[Any]]] = {"get_order": get_order, "search_kb": search_kb}


# -- a tiny async "framework" --------------------------------------------------


class TinyRunner:
    """Runs one step of tool calls concurrently, then writes an answer: a stand-in for a real runner.

    A real runner asks a model which tools to call; this one plans from the
    instruction, so the template runs without a model API.
    """

    def __init__(self, tools: Dict[str, Callable[..., Awaitable[Any]]]) -> None:
        self.tools = tools

    def plan(self, instruction: str) -> List[Tuple[str, Dict[str, Any]]]:
        """The tool calls to make: every order number mentioned, plus a knowledge-base search."""
        calls: List[Tuple[str, Dict[str, Any]]] = [
            ("get_order", {"order_id": order_id}) for order_id in dict.fromkeys(re.findall(r"\b\d{3,}\b", instruction))
        ]
        calls.append(("search_kb", {"query": instruction or "refund policy"}))
        return calls

    async def run(self, instruction: str) -> Dict[str, Any]:
        """Await the planned tool calls together; return the answer and the transcript."""
        calls = self.plan(instruction)
        results = await asyncio.gather(*(self.tools[name](**args) for name, args in calls))
        call_ids = [f"call_{i}" for i in range(1, len(calls) + 1)]
        outputs = [pp.bound_output(result, 2000) for result in results]
        answer = "\n".join(f"{name} {json.dumps(args)}: {output}" for (name, args), output in zip(calls, outputs))
        messages: List[Dict[str, Any]] = [
            {"role": "user", "content": instruction},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "name": name, "arguments": args} for call_id, (name, args) in zip(call_ids, calls)]},
        ]
        messages += [{"role": "tool", "tool_call_id": call_id, "content": output}
                     for call_id, output in zip(call_ids, outputs)]
        messages.append({"role": "assistant", "content": answer})
        return {"final_output": answer, "messages": messages}


# -- the agent: the same async function serves HTTP mode and code mode --------


async def agent(envelope: pp.Envelope) -> Dict[str, Any]:
    """Run the framework on the instruction; return the response envelope."""
    result = await TinyRunner(TOOLS).run(envelope.user_instruction)
    return pp.build_response(result["final_output"], messages=result["messages"])


# Code mode.  The sandbox calls run() from a Jupyter kernel whose event loop is
# already running on the calling thread, so asyncio.run() (and a framework's
# run_sync) would raise "cannot be called from a running event loop" there.
# pp.code_mode runs the agent on a fresh thread with its own loop, and binds the
# run's envelope inside that thread: a ContextVar set on the kernel's thread
# would be invisible to it.
run = pp.code_mode(agent)
