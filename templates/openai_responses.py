"""A tool-calling agent loop on the OpenAI Responses API, standard library only.

The loop: send the conversation and the tools to the model; run the function
calls it asks for (one turn's calls concurrently, through the per-run proxy);
send back each result, cut to a bounded size keeping head and tail; repeat
until the model answers without calling a tool, or the turn limit is reached.
Edit SYSTEM_PROMPT and tools_schema.json (kept beside this file) for your agent.

Run it (PATH is this file: templates/openai_responses.py in the kit, agent.py in a
project made by ``pipelines-port init DIR --template openai_responses``):

- HTTP mode, the platform POSTs each run to your server (AGENT_TOKEN is the
  bearer it must send)::

      AGENT_TOKEN=... python3 pipelines_port.py serve PATH:agent --port 8080

- Code mode (sandbox upload): upload it with pipelines_port.py and
  tools_schema.json; the sandbox calls ``run(task_input, proxy_url=..., run_token=...)``.

Environment (read on every run, so a server answers ping before a key is set):

- ``OPENAI_API_KEY``: required.
- ``OPENAI_BASE_URL``: default ``https://api.openai.com/v1``.
- ``OPENAI_MODEL``: default ``gpt-5-mini``.
- ``OPENAI_REASONING_EFFORT``: default ``low``; ``off`` sends no ``reasoning``
  parameter (for models without reasoning, such as ``gpt-4.1``).
- ``AGENT_MAX_TURNS``: model turns before the loop gives up, default 10.
"""

from __future__ import annotations

import os
import pathlib
import time
from typing import Any, Dict, List, Sequence, Tuple

import pipelines_port as pp

SYSTEM_PROMPT = (
    "You are a customer-support agent. Use the tools to look things up and act; "
    "never invent an order's details. When you are done, answer the user in a few sentences."
)
TOOLS_FILE = pathlib.Path(__file__).with_name("tools_schema.json")
MAX_PARALLEL_TOOLS = 8  # one turn's tool calls in flight at once
TOOL_OUTPUT_LIMIT = 8000  # characters of one tool result the model sees


def setting(name: str, default: str) -> str:
    """An environment variable, or ``default`` when unset or blank."""
    return (os.environ.get(name) or "").strip() or default


def required_setting(name: str, what: str) -> str:
    """An environment variable that must be set; the error names it and says what to export."""
    value = setting(name, "")
    if not value:
        raise RuntimeError(f"{name} is not set: export {what} before running this agent")
    return value


def int_setting(name: str, default: int, minimum: int) -> int:
    """An integer environment variable of at least ``minimum``; a clear error otherwise."""
    text = setting(name, str(default))
    if not text.isdigit() or int(text) < minimum:
        raise RuntimeError(f"{name} must be an integer of at least {minimum}, got {text!r}")
    return int(text)


def tool_list(envelope: pp.Envelope) -> List[Dict[str, Any]]:
    """The run's tools: inlined in the dispatch when the platform sends them, else tools_schema.json."""
    if envelope.tools_schema:
        return list(envelope.tools_schema)
    return pp.load_tools_schema(TOOLS_FILE)


def run_tools(envelope: pp.Envelope, calls: Sequence[Tuple[str, str]]) -> List[str]:
    """One model turn's function calls, run concurrently through the proxy; bounded results in call order.

    ``calls`` holds ``(name, arguments)`` with the arguments as the model's
    JSON string (``call_tools`` decodes it).  A failed call, or arguments that
    are not a JSON object, give an ``{"error": ...}`` result for the model to read.
    """
    # The client paces calls under the proxy's 60/min limit and retries 429s.
    results = pp.call_tools(calls, max_concurrency=MAX_PARALLEL_TOOLS, envelope=envelope)
    return [pp.bound_output(value, TOOL_OUTPUT_LIMIT) for value in results]


def output_text(item: Dict[str, Any]) -> str:
    """The text of an output ``message`` item (its ``output_text`` and ``refusal`` parts)."""
    parts = [p.get("text") or p.get("refusal") or "" for p in item.get("content") or () if isinstance(p, dict)]
    return "".join(parts)


# A turn cut off by the output limit is never taken for a whole answer, and its tool calls never run.
TRUNCATED = ("[The answer was cut off ({reason}): the model reached its output token limit before it "
             "finished. Its tool calls, if any, were not run.]")


def agent(envelope: pp.Envelope) -> Dict[str, Any]:
    """Run the Responses API tool loop for one dispatch; return the response envelope."""
    started = time.monotonic()
    api_key = required_setting("OPENAI_API_KEY", "your OpenAI API key")
    url = setting("OPENAI_BASE_URL", "https://api.openai.com/v1").rstrip("/") + "/responses"
    model = setting("OPENAI_MODEL", "gpt-5-mini")
    effort = setting("OPENAI_REASONING_EFFORT", "low")
    max_turns = int_setting("AGENT_MAX_TURNS", 10, 1)
    tools = pp.convert_tools(tool_list(envelope), to="openai_responses")

    inputs: List[Dict[str, Any]] = envelope.conversation()  # the model's context, in Responses items
    transcript: List[Dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}, *inputs]
    input_tokens = output_tokens = 0
    final = ""
    stopped = None  # why the model stopped early, when it did
    for turn in range(1, max_turns + 1):
        # store false: nothing of the run is kept at OpenAI, so zero-data-retention organisations work too;
        # reasoning then comes back encrypted, and goes back whole (below) to keep the chain of thought.
        request: Dict[str, Any] = {"model": model, "instructions": SYSTEM_PROMPT, "input": inputs, "store": False,
                                   "include": ["reasoning.encrypted_content"]}
        if tools:
            request["tools"] = tools
        if effort.lower() != "off":
            request["reasoning"] = {"effort": effort, "summary": "auto"}
        # post_json retries 429, 5xx and dropped connections with backoff, honouring Retry-After.
        asked = time.monotonic()
        reply = pp.post_json(url, request, headers={"Authorization": f"Bearer {api_key}"})
        latency_ms = round((time.monotonic() - asked) * 1000, 1)
        usage = reply.get("usage") or {}
        input_tokens += usage.get("input_tokens") or 0
        output_tokens += usage.get("output_tokens") or 0
        # Per-turn figures for the trace view (the report shows latency and tokens per model turn).
        pp.post_trace("custom", {"event": "model_turn", "turn": turn, "latency_ms": latency_ms,
                                  "input_tokens": usage.get("input_tokens") or 0,
                                  "output_tokens": usage.get("output_tokens") or 0},
                      envelope=envelope, best_effort=True)

        output = [item for item in reply.get("output") or () if isinstance(item, dict)]
        # Send every output item back next turn, whole: reasoning items carry their encrypted content.
        inputs.extend(output)
        thinking = [s["text"] for item in output if item.get("type") == "reasoning"
                    for s in item.get("summary") or () if isinstance(s, dict) and s.get("text")]
        text = "".join(output_text(item) for item in output if item.get("type") == "message")
        text = text if text.strip() else ""  # whitespace only is no answer (build_response refuses a blank one)
        calls = [item for item in output if item.get("type") == "function_call"]

        for summary in thinking:
            pp.post_trace("thinking", {"text": summary, "turn": turn}, envelope=envelope, best_effort=True)
        if text:
            pp.post_trace("assistant_message", {"text": text, "turn": turn}, envelope=envelope, best_effort=True)
        message: Dict[str, Any] = {"role": "assistant", "content": text or None}
        if thinking:
            message["thinking"] = [{"type": "text", "text": summary} for summary in thinking]
        if calls:
            message["tool_calls"] = [{"id": c["call_id"], "name": c["name"], "arguments": c.get("arguments") or "{}"}
                                     for c in calls]
        transcript.append(message)
        if reply.get("status") == "incomplete":  # cut off (output limit, content filter): no tool call runs
            stopped = (reply.get("incomplete_details") or {}).get("reason") or "incomplete"
            final = (text + "\n\n" if text else "") + TRUNCATED.format(reason=f"status incomplete, {stopped}")
            break
        if not calls:
            final = text or f"The model ended its turn without an answer (status {reply.get('status')!r})."
            break

        results = run_tools(envelope, [(c["name"], c.get("arguments") or "{}") for c in calls])
        for call, result in zip(calls, results):
            inputs.append({"type": "function_call_output", "call_id": call["call_id"], "output": result})
            transcript.append({"role": "tool", "tool_call_id": call["call_id"], "content": result})
    else:
        names = ", ".join(c["name"] for c in calls)
        final = (f"Stopped after {max_turns} model turns (the AGENT_MAX_TURNS limit) without a final answer; "
                 f"the model was still calling tools ({names}).")

    metadata = {
        "model": model,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "agent_runtime_ms": int((time.monotonic() - started) * 1000),
    }
    if stopped:
        metadata["stop_reason"] = stopped
    return pp.build_response(final, messages=transcript, metadata=metadata)


# Code mode: the sandbox's entrypoint, the same agent unchanged.
# What this agent needs in its environment (`pipelines-port doctor` checks each is set).
REQUIRED_ENV = ("OPENAI_API_KEY",)

run = pp.code_mode(agent)
