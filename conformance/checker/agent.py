"""The conformance agent on pipelines_port (spec: conformance/README.md, "The conformance agent").

A tiny scripted agent that ``python3 -m conformance check`` drives through a
port's ordinary dispatch server.  Serve it with::

    AGENT_TOKEN=secret python3 pipelines_port.py serve conformance/checker/agent.py:agent --port 8080

The agent reads ``user_instruction``: a JSON object with a ``steps`` array is a
script, anything else asks for an echo of the envelope.  Everything goes
through pipelines_port's own code (proxy shim, trace client, response builder),
so the checker sees exactly what the port does.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Dict, List, Mapping, Optional, Tuple

import pipelines_port as pp

__all__ = ["agent", "agent_async", "ScriptError", "echo", "outcome_of_error"]

MODEL = "conformance-agent"
STEP_KINDS = ("call", "parallel", "trace", "handoff", "sleep_ms", "raise", "return", "turn_reply")


class ScriptError(ValueError):
    """The instruction is a script, but a step is unknown or misses a field."""


def agent(envelope: pp.Envelope) -> Any:
    """Echo the envelope, or run the script in ``user_instruction``."""
    steps = _script_steps(envelope.user_instruction)
    if steps is None:
        return compact({"envelope": echo(envelope)})
    return Script(envelope.user_instruction).run(steps)


async def agent_async(envelope: pp.Envelope) -> Any:
    """The same agent as ``async def``: its calls on the asyncio driver, on the serving event loop."""
    steps = _script_steps(envelope.user_instruction)
    if steps is None:
        return compact({"envelope": echo(envelope)})
    return await Script(envelope.user_instruction).arun(steps)


def compact(value: Any) -> str:
    """The compact JSON text of ``value``."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _script_steps(instruction: str) -> Optional[List[Any]]:
    try:
        parsed = json.loads(instruction)
    except ValueError:
        return None
    if isinstance(parsed, dict) and isinstance(parsed.get("steps"), list):
        return parsed["steps"]
    return None


# -- echo mode ----------------------------------------------------------------------


def echo(envelope: pp.Envelope) -> Dict[str, Any]:
    """The envelope as the port parsed it; the run token only as its SHA-256."""
    return {
        "proxy_url": envelope.proxy_url,
        "run_token_sha256": hashlib.sha256(envelope.run_token.encode("utf-8")).hexdigest(),
        "run_id": envelope.run_id,
        "task_id": envelope.task_id,
        "agent_id": envelope.agent_id,
        "run_token_jti": envelope.run_token_jti,
        "user_instruction": envelope.user_instruction,
        "task_input": envelope.task_input,
        "latest_user_prompt": envelope.latest_user_prompt,
        "session_id": envelope.session_id,
        "turn_id": envelope.turn_id,
        "messages": envelope.messages,
        "scenario_state": envelope.scenario_state,
        "workspace": envelope.workspace,
        "tools_schema": envelope.tools_schema,
        "sub_agents": list(envelope.sub_agents),
        "api_url": envelope.api_url,
        "raw": envelope.raw,
    }


# -- script mode --------------------------------------------------------------------


def outcome_of_error(exc: pp.ProxyError) -> Dict[str, Any]:
    """``{"ok": false, "error": {kind, status_code, error_class}}`` for a failed call or trace."""
    if isinstance(exc, pp.StaleRunTokenError):
        kind = "stale_run_token"
    elif isinstance(exc, pp.ProxyRequestError):
        kind = "request"
    elif isinstance(exc, pp.ProxyTransportError):
        kind = "transport"
    else:
        kind = "proxy"
    return {"ok": False, "error": {"kind": kind, "status_code": exc.status_code, "error_class": exc.error_class}}


def _ok(value: Any) -> Dict[str, Any]:
    return {"ok": True, "value": value}


class _Return(Exception):
    """A ``return`` step: end the run with this value."""

    def __init__(self, value: Any) -> None:
        super().__init__("return step")
        self.value = value


class Script:
    """One script run: its results and its transcript.  :meth:`run` is the sync agent's, :meth:`arun` the
    ``async def`` agent's; both read each step with :meth:`plan`, so they differ only in how they wait."""

    def __init__(self, instruction: str) -> None:
        self.results: List[Any] = []
        self.messages: List[Dict[str, Any]] = [{"role": "user", "content": instruction}]
        self.calls_made = 0
        self.started = time.monotonic()

    def run(self, steps: List[Any]) -> Any:
        try:
            for index, step in enumerate(steps):
                self.results.append(self.step(*self.plan(index, step)))
        except _Return as returned:
            return returned.value
        return self.finish()

    async def arun(self, steps: List[Any]) -> Any:
        try:
            for index, step in enumerate(steps):
                self.results.append(await self.astep(*self.plan(index, step)))
        except _Return as returned:
            return returned.value
        return self.finish()

    def finish(self) -> Dict[str, Any]:
        final = compact({"results": self.results})
        self.messages.append({"role": "assistant", "content": final})
        runtime_ms = round((time.monotonic() - self.started) * 1000)
        return {"final_response": final, "messages": self.messages,
                "metadata": {"model": MODEL, "agent_runtime_ms": runtime_ms}}

    def plan(self, index: int, step: Any) -> Tuple[str, Any]:
        """What one step asks for, checked: ``(kind, what)``; ``raise`` and ``return`` steps end the run here."""
        where = f"steps[{index}]"
        kinds = [k for k in STEP_KINDS if isinstance(step, dict) and k in step]
        if len(kinds) != 1:
            raise ScriptError(f"{where}: a step is an object with exactly one of {', '.join(STEP_KINDS)}")
        kind = kinds[0]
        if kind == "call":
            return "call", [_call_step(step, where)]
        if kind == "parallel":
            calls = step["parallel"]
            if not isinstance(calls, list):
                raise ScriptError(f"{where}.parallel: must be an array of call steps")
            return "parallel", [_call_step(c, f"{where}.parallel[{i}]") for i, c in enumerate(calls)]
        if kind == "trace":
            if "payload" not in step:
                raise ScriptError(f"{where}: a trace step needs 'payload'")
            return "trace", step
        if kind == "handoff":
            handoff = step["handoff"]
            if not isinstance(handoff, dict) or "from" not in handoff or "to" not in handoff:
                raise ScriptError(f"{where}.handoff: must be an object with 'from' and 'to'")
            return "handoff", handoff
        if kind == "sleep_ms":
            millis = step["sleep_ms"]
            if isinstance(millis, bool) or not isinstance(millis, (int, float)) or millis < 0:
                raise ScriptError(f"{where}.sleep_ms: must be a non-negative number")
            return "sleep", millis / 1000
        if kind == "raise":
            if not isinstance(step["raise"], str):
                raise ScriptError(f"{where}.raise: must be a string")
            raise RuntimeError(step["raise"])
        if kind == "turn_reply":
            spec = step["turn_reply"]
            if not isinstance(spec, dict) or "message" not in spec:
                raise ScriptError(f"{where}.turn_reply: must be an object with 'message'")
            raise _Return(pp.build_turn_reply(spec["message"], metadata=spec.get("metadata"),
                                              session_done=spec.get("session_done", False)))
        raise _Return(step["return"])

    def step(self, kind: str, what: Any) -> Any:
        """Carry one planned step out, blocking."""
        if kind in ("call", "parallel"):
            outcomes = self.record(what, self.calls(what))
            return outcomes[0] if kind == "call" else {"parallel": outcomes}
        if kind == "trace":
            return _attempt(lambda: pp.post_trace(what["trace"], what["payload"], actor=what.get("actor")))
        if kind == "handoff":
            return _attempt(lambda: pp.post_handoff(what["from"], what["to"], reason=what.get("reason"),
                                                    payload_preview=what.get("payload_preview")))
        time.sleep(what)
        return _ok(None)

    async def astep(self, kind: str, what: Any) -> Any:
        """Carry one planned step out on the event loop (the asyncio driver; parallel calls as tasks)."""
        if kind in ("call", "parallel"):
            outcomes = self.record(what, await asyncio.gather(*(_atool_call(c) for c in what)))
            return outcomes[0] if kind == "call" else {"parallel": outcomes}
        if kind == "trace":
            return await _aattempt(pp.apost_trace(what["trace"], what["payload"], actor=what.get("actor")))
        if kind == "handoff":
            return await _aattempt(pp.apost_handoff(what["from"], what["to"], reason=what.get("reason"),
                                                    payload_preview=what.get("payload_preview")))
        await asyncio.sleep(what)
        return _ok(None)

    def calls(self, calls: List[Mapping[str, Any]]) -> List[Dict[str, Any]]:
        """Tool calls started together and awaited together; outcomes in the listed order."""
        if len(calls) <= 1:
            return [_tool_call(c) for c in calls]
        with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="conformance-call") as pool:
            futures = [pool.submit(contextvars.copy_context().run, _tool_call, c) for c in calls]
            return [f.result() for f in futures]

    def record(self, calls: List[Mapping[str, Any]], outcomes: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """Add the calls and their outcomes to the transcript, in the listed order."""
        for call, outcome in zip(calls, outcomes):
            self.calls_made += 1
            call_id = f"call_{self.calls_made}"
            self.messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "name": _transcript_name(call["call"]),
                 "arguments": call["args"] if isinstance(call["args"], dict) else compact(call["args"])}]})
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": compact(outcome)})
        return list(outcomes)


def _call_step(step: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(step, dict) or "call" not in step or "args" not in step:
        raise ScriptError(f"{where}: a call step is an object with 'call' and 'args'")
    return step


def _tool_call(call: Mapping[str, Any]) -> Dict[str, Any]:
    if call.get("raise_on_error") is True:  # the call's error leaves the agent as it is: a 500 with its text
        return _ok(pp.proxy_call(call["call"], call["args"], actor=call.get("actor")))
    return _attempt(lambda: pp.proxy_call(call["call"], call["args"], actor=call.get("actor")))


async def _atool_call(call: Mapping[str, Any]) -> Dict[str, Any]:
    if call.get("raise_on_error") is True:
        return _ok(await pp.aproxy_call(call["call"], call["args"], actor=call.get("actor")))
    return await _aattempt(pp.aproxy_call(call["call"], call["args"], actor=call.get("actor")))


async def _aattempt(pending: Awaitable[Any]) -> Dict[str, Any]:
    try:
        return _ok(await pending)
    except pp.ProxyError as exc:
        return outcome_of_error(exc)


def _attempt(fn: Any) -> Dict[str, Any]:
    try:
        return _ok(fn())
    except pp.ProxyError as exc:
        return outcome_of_error(exc)


def _transcript_name(name: Any) -> str:
    """The tool name as the transcript shows it: a non-empty string, else its JSON text."""
    return name if isinstance(name, str) and name else compact(name)
