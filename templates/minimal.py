"""The smallest honest Pipelines agent, standard library only.

It reads the user's instruction, calls one tool (``search_kb`` from
tools_schema.json) through the per-run proxy, and answers with what the tool
said, returning a transcript the platform renders in the trace tab.  Replace
the body of ``agent`` with your own logic; keep every tool call going through
the proxy.

Run it (PATH is this file: templates/minimal.py in the kit, agent.py in a
project made by ``pipelines-port init DIR --template minimal``):

- HTTP mode, the platform POSTs each run to your server (AGENT_TOKEN is the
  bearer it must send)::

      AGENT_TOKEN=... python3 pipelines_port.py serve PATH:agent --port 8080

- Code mode (sandbox upload): upload it with pipelines_port.py; the
  sandbox calls ``run(task_input, proxy_url=..., run_token=...)``.

Environment: none of its own.
"""

from __future__ import annotations

from typing import Any, Dict

import pipelines_port as pp


def agent(envelope: pp.Envelope) -> Dict[str, Any]:
    """Look the instruction up in the knowledge base and report what came back."""
    question = envelope.user_instruction.strip() or "(no instruction given)"
    arguments = {"query": question}
    # The proxy answers with the tool's result (unwrapped); a failed call comes
    # back as {"error": ...} so the answer can say what went wrong.
    result = pp.proxy_call("search_kb", arguments, envelope=envelope, errors="return")
    result_text = pp.bound_output(result, 2000)
    if isinstance(result, dict) and "error" in result:
        answer = f"I could not search the knowledge base: {result_text}"
    else:
        answer = f"The knowledge base says:\n{result_text}"
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "name": "search_kb", "arguments": arguments}]},
        {"role": "tool", "tool_call_id": "call_1", "content": result_text},
        {"role": "assistant", "content": answer},
    ]
    return pp.build_response(answer, messages=messages)


# Code mode: the sandbox's entrypoint, the same agent unchanged.
run = pp.code_mode(agent)
