"""A tool-calling agent loop on the Anthropic Messages API, standard library only.

The loop: send the messages and the tools to the model; run the ``tool_use``
blocks it returns (one turn's calls concurrently, through the per-run proxy);
send back each result as a ``tool_result`` block, cut to a bounded size keeping
head and tail; repeat until the model answers without using a tool, or the turn
limit is reached.  Extended thinking is on by default and its ``thinking``
blocks show in the trace.  Edit SYSTEM_PROMPT and tools_schema.json (kept beside
this file) for your agent.

Run it (PATH is this file: templates/anthropic_messages.py in the kit, agent.py in a
project made by ``pipelines-port init DIR --template anthropic_messages``):

- HTTP mode, the platform POSTs each run to your server (AGENT_TOKEN is the
  bearer it must send)::

      AGENT_TOKEN=... python3 pipelines_port.py serve PATH:agent --port 8080

- Code mode (sandbox upload): upload it with pipelines_port.py and
  tools_schema.json; the sandbox calls ``run(task_input, proxy_url=..., run_token=...)``.

Environment (read on every run, so a server answers ping before a key is set):

- ``ANTHROPIC_API_KEY``: required.
- ``ANTHROPIC_BASE_URL``: default ``https://api.anthropic.com``.
- ``ANTHROPIC_MODEL``: default ``claude-sonnet-4-5``.
- ``ANTHROPIC_MAX_TOKENS``: output tokens per model turn, default 8192.
- ``ANTHROPIC_THINKING_BUDGET``: thinking tokens per turn, default 2048 (at
  least 1024, below ANTHROPIC_MAX_TOKENS); ``0`` turns extended thinking off.
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
ANTHROPIC_VERSION = "2023-06-01"


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


def run_tools(envelope: pp.Envelope, calls: Sequence[Tuple[str, Any]]) -> List[Tuple[str, bool]]:
    """One model turn's ``tool_use`` blocks, run concurrently through the proxy.

    Returns ``(bounded result, is_error)`` per call, in call order.  A failed
    call, or an input that is not an object, gives an ``{"error": ...}`` result
    for the model to read (``call_tools`` refuses it before sending).
    """
    # The client paces calls under the proxy's 60/min limit and retries 429s.
    results = pp.call_tools(calls, max_concurrency=MAX_PARALLEL_TOOLS, envelope=envelope)
    return [(pp.bound_output(value, TOOL_OUTPUT_LIMIT), isinstance(value, dict) and "error" in value)
            for value in results]


# A turn cut off by the output limit is never taken for a whole answer, and its tool calls never run.
TRUNCATED = ("[The answer was cut off ({reason}): the model reached its output token limit before it "
             "finished. Its tool calls, if any, were not run.]")


def agent(envelope: pp.Envelope) -> Dict[str, Any]:
    """Run the Messages API tool loop for one dispatch; return the response envelope."""
    started = time.monotonic()
    api_key = required_setting("ANTHROPIC_API_KEY", "your Anthropic API key")
    url = setting("ANTHROPIC_BASE_URL", "https://api.anthropic.com").rstrip("/") + "/v1/messages"
    model = setting("ANTHROPIC_MODEL", "claude-sonnet-4-5")
    max_tokens = int_setting("ANTHROPIC_MAX_TOKENS", 8192, 1)
    budget = int_setting("ANTHROPIC_THINKING_BUDGET", 2048, 0)
    if budget and not 1024 <= budget < max_tokens:
        raise RuntimeError(f"ANTHROPIC_THINKING_BUDGET must be 0, or from 1024 to below ANTHROPIC_MAX_TOKENS "
                           f"({max_tokens}), got {budget}")
    max_turns = int_setting("AGENT_MAX_TURNS", 10, 1)
    tools = pp.convert_tools(tool_list(envelope), to="anthropic")
    headers = {"x-api-key": api_key, "anthropic-version": ANTHROPIC_VERSION}

    messages: List[Dict[str, Any]] = envelope.conversation()
    transcript: List[Dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}, *messages]
    input_tokens = output_tokens = 0
    final = ""
    stopped = None  # why the model stopped early, when it did
    for turn in range(1, max_turns + 1):
        request: Dict[str, Any] = {"model": model, "max_tokens": max_tokens, "system": SYSTEM_PROMPT,
                                   "messages": messages}
        if tools:
            request["tools"] = tools
        if budget:
            request["thinking"] = {"type": "enabled", "budget_tokens": budget}
        # post_json retries 429, 529 (overloaded), 5xx and dropped connections with backoff, honouring Retry-After.
        asked = time.monotonic()
        reply = pp.post_json(url, request, headers=headers)
        latency_ms = round((time.monotonic() - asked) * 1000, 1)
        usage = reply.get("usage") or {}
        input_tokens += usage.get("input_tokens") or 0
        output_tokens += usage.get("output_tokens") or 0
        # Per-turn figures for the trace view (the report shows latency and tokens per model turn).
        pp.post_trace("custom", {"event": "model_turn", "turn": turn, "latency_ms": latency_ms,
                                  "input_tokens": usage.get("input_tokens") or 0,
                                  "output_tokens": usage.get("output_tokens") or 0},
                      envelope=envelope, best_effort=True)

        blocks = [b for b in reply.get("content") or () if isinstance(b, dict)]
        # Send the turn back as it came (with thinking on, the API requires the signed
        # thinking blocks before the tool_use blocks they led to), less any blank text
        # block: the API refuses a text block without non-whitespace text.
        messages.append({"role": "assistant", "content": [
            b for b in blocks if b.get("type") != "text" or (b.get("text") or "").strip()]})
        thinking = [b["thinking"] for b in blocks if b.get("type") == "thinking" and b.get("thinking")]
        redacted = sum(1 for b in blocks if b.get("type") == "redacted_thinking")
        text = "".join(b.get("text") or "" for b in blocks if b.get("type") == "text")
        text = text if text.strip() else ""  # whitespace only is no answer (build_response refuses a blank one)
        uses = [b for b in blocks if b.get("type") == "tool_use"]

        for thought in thinking:
            pp.post_trace("thinking", {"text": thought, "turn": turn}, envelope=envelope, best_effort=True)
        if text:
            pp.post_trace("assistant_message", {"text": text, "turn": turn}, envelope=envelope, best_effort=True)
        message: Dict[str, Any] = {"role": "assistant", "content": text or None}
        if thinking or redacted:
            message["thinking"] = [{"type": "thinking", "text": thought} for thought in thinking]
            message["thinking"] += [{"type": "redacted_thinking", "text": "(redacted by the API)"}] * redacted
        if uses:
            message["tool_calls"] = [{"id": u["id"], "name": u["name"], "arguments": u.get("input") or {}}
                                     for u in uses]
        transcript.append(message)
        reason = reply.get("stop_reason")
        if reason == "pause_turn":  # a long turn the API paused: send it back as it is and let the model go on
            continue
        if reason == "max_tokens":  # cut off by max_tokens: a tool_use in it may be cut too, so none runs
            stopped = reason
            final = (text + "\n\n" if text else "") + TRUNCATED.format(reason="stop_reason 'max_tokens'")
            break
        if not uses:
            final = text or f"The model ended its turn without an answer (stop_reason {reason!r})."
            break

        results = run_tools(envelope, [(u["name"], u.get("input", {})) for u in uses])
        tool_results: List[Dict[str, Any]] = []
        for use, (result, is_error) in zip(uses, results):
            result = result if result.strip() else "(no output)"  # the API refuses an empty tool_result
            block: Dict[str, Any] = {"type": "tool_result", "tool_use_id": use["id"], "content": result}
            if is_error:
                block["is_error"] = True
            tool_results.append(block)
            transcript.append({"role": "tool", "tool_call_id": use["id"], "content": result})
        messages.append({"role": "user", "content": tool_results})
    else:
        names = ", ".join(u["name"] for u in uses)
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
REQUIRED_ENV = ("ANTHROPIC_API_KEY",)

run = pp.code_mode(agent)
