"""The conformance agent on the platform's own Python SDK, used only as a library.

An independent implementation of the agent that ``python3 -m conformance check`` drives (spec:
``conformance/README.md``, "The conformance agent"), written on ``pipelines-sdk`` (import name
``pipelines``, see ``tests/interop/requirements.txt``) and on nothing of this repository: it does
not import ``pipelines_port``.  Everything the checker observes is the SDK's own doing:

- the server: FastAPI with ``pipelines.odyssey.register_dispatch_route`` (inbound auth, the ping,
  the connectivity check, envelope parsing, response building and the 500 for an agent error);
- tool calls: ``proxy_call_with`` (no actor) or ``ScopedProxy.call`` (an actor label checked first
  with ``validate_actor_label``), with the SDK's own HTTP client and retry policy;
- trace events and handoffs: ``post_trace_event_with`` and ``post_handoff_with``.

This module only maps what the SDK returns or raises to the spec's outcomes:

======================================================  ===================
the SDK                                                 outcome kind
======================================================  ===================
``StaleRunTokenError``                                  ``stale_run_token``
``ProxyCallError`` / ``TraceForwardError``, a status    ``proxy``
``ProxyCallError`` without a status                     ``transport``
``TraceForwardError`` without a status, caused by a     ``transport``
failed request (it is raised ``from`` the HTTP error)
``TraceForwardError`` without a status and no cause     ``request``
(the SDK's own check of the event type or payload,
before anything is sent)
``ActorLabelError`` / ``ValueError`` (local checks)     ``request``
======================================================  ===================

Anything else the SDK raises is not caught: the run ends with the SDK's 500, which is what the
SDK does.  A trace step's value: the SDK hands back only the sequence number, reported as
``{"accepted": true, "sequence": N}`` when it is an int, else ``null``.  Arguments that are not an
object are passed to the SDK as they are (the spec asks a port to refuse them; the SDK decides).

Serve it from the repository root (``api_key_app`` registers the ``X-API-Key`` header instead)::

    AGENT_TOKEN=s3cret /tmp/interop2/bin/python -m uvicorn tests.interop.sdk_port:app --port 8123
    python3 -m conformance check http://127.0.0.1:8123/dispatch --token s3cret
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Mapping, Optional
from urllib.parse import urlsplit

from fastapi import FastAPI
from pipelines.odyssey import (
    ActorLabelError,
    Envelope,
    ProxyCallError,
    ScopedProxy,
    StaleRunTokenError,
    TraceForwardError,
    post_handoff_with,
    post_trace_event_with,
    proxy_call_with,
    register_dispatch_route,
    set_actor_id,
    validate_actor_label,
)

__all__ = ["make_app", "app", "api_key_app", "conformance_agent", "MalformedScript"]

MODEL = "conformance-agent"
STEP_KINDS = ("call", "parallel", "trace", "handoff", "sleep_ms", "raise", "return")


class MalformedScript(ValueError):
    """The instruction is a script whose step is unknown or misses a field (the SDK answers 500)."""


def make_app(token_env: str = "AGENT_TOKEN", auth_header_name: str = "Authorization") -> FastAPI:
    """A FastAPI app whose ``POST /dispatch`` is the SDK's route running :func:`conformance_agent`.

    ``GET /healthz`` (open, ``{"ok": true}``) only tells a test harness that the server is up.
    """
    application = FastAPI(title="conformance agent on pipelines-sdk")

    @application.get("/healthz")
    def healthz() -> Dict[str, bool]:
        return {"ok": True}

    register_dispatch_route(application, agent_token_env=token_env, auth_header_name=auth_header_name)(
        conformance_agent)
    return application


def conformance_agent(envelope: Envelope) -> Any:
    """Echo the envelope, or run the script held in ``user_instruction`` (sync: the SDK runs it on a thread)."""
    steps = _steps_of(envelope.user_instruction)
    if steps is None:
        return _compact({"envelope": _echo(envelope)})
    return _Script(envelope).run(steps)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _steps_of(instruction: str) -> Optional[List[Any]]:
    try:
        parsed = json.loads(instruction)
    except (ValueError, RecursionError):
        return None
    if isinstance(parsed, dict) and isinstance(parsed.get("steps"), list):
        return parsed["steps"]
    return None


# -- echo mode -------------------------------------------------------------------------------------


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"


def _plain(value: Any) -> Any:
    """A Mapping the SDK hands out (a dict today) as a dict, so it serialises whatever its type."""
    return dict(value) if isinstance(value, Mapping) else value


def _echo(envelope: Envelope) -> Dict[str, Any]:
    """The envelope as the SDK parsed it; the run token only as its SHA-256.

    ``sub_agents`` is the SDK's declared catalog (``declared_actor_ids``), a set: listed sorted, since
    the SDK keeps no order (and ``[]`` when the SDK found none).
    """
    return {
        "proxy_url": envelope.proxy_url,
        "run_token_sha256": hashlib.sha256(envelope.run_token.encode("utf-8")).hexdigest(),
        "run_id": envelope.run_id,
        "task_id": envelope.task_id,
        "agent_id": envelope.agent_id,
        "run_token_jti": envelope.run_token_jti,
        "user_instruction": envelope.user_instruction,
        "task_input": _plain(envelope.task_input),
        "latest_user_prompt": envelope.latest_user_prompt,
        "session_id": envelope.session_id,
        "turn_id": envelope.turn_id,
        "messages": envelope.messages,
        "scenario_state": _plain(envelope.scenario_state),
        "workspace": _plain(envelope.workspace),
        "tools_schema": envelope.tools_schema,
        "sub_agents": sorted(envelope.declared_actor_ids or ()),
        "api_url": _origin(envelope.proxy_url),
        "raw": _plain(envelope.raw),
    }


# -- outcomes --------------------------------------------------------------------------------------


def _ok(value: Any) -> Dict[str, Any]:
    return {"ok": True, "value": value}


def _failed(kind: str, status_code: Any = None, error_class: Any = None) -> Dict[str, Any]:
    return {"ok": False, "error": {"kind": kind, "status_code": status_code, "error_class": error_class}}


def _attempt(action: Callable[[], Any]) -> Dict[str, Any]:
    """Run one SDK call; its value, or its exception mapped to an outcome (see the module docstring)."""
    try:
        return _ok(action())
    except StaleRunTokenError as exc:
        return _failed("stale_run_token", exc.status_code, exc.error_class)
    except (ProxyCallError, TraceForwardError) as exc:
        error_class = getattr(exc, "error_class", None)
        if exc.status_code is not None:
            return _failed("proxy", exc.status_code, error_class)
        if isinstance(exc, TraceForwardError) and exc.__cause__ is None:
            return _failed("request")  # refused by the SDK before sending: event type or payload
        return _failed("transport", None, error_class)
    except ActorLabelError:
        return _failed("request")
    except ValueError:  # the SDK's other local checks (a handoff without a label)
        return _failed("request")


def _sequence_reply(sequence: Any) -> Any:
    if isinstance(sequence, int) and not isinstance(sequence, bool):
        return {"accepted": True, "sequence": sequence}
    return None


# -- script mode -----------------------------------------------------------------------------------


class _Return(Exception):
    def __init__(self, value: Any) -> None:
        super().__init__("return step")
        self.value = value


class _Script:
    """One script run over one envelope: its results and its transcript."""

    def __init__(self, envelope: Envelope) -> None:
        self.envelope = envelope
        self.results: List[Any] = []
        self.messages: List[Dict[str, Any]] = [{"role": "user", "content": envelope.user_instruction}]
        self.call_count = 0

    def run(self, steps: List[Any]) -> Any:
        started = time.monotonic()
        try:
            for index, step in enumerate(steps):
                self.results.append(self._step(index, step))
        except _Return as returned:
            return returned.value
        final = _compact({"results": self.results})
        self.messages.append({"role": "assistant", "content": final})
        return {"final_response": final, "messages": self.messages,
                "metadata": {"model": MODEL, "agent_runtime_ms": round((time.monotonic() - started) * 1000)}}

    def _step(self, index: int, step: Any) -> Any:
        where = f"steps[{index}]"
        kinds = [k for k in STEP_KINDS if k in step] if isinstance(step, dict) else []
        if len(kinds) != 1:
            raise MalformedScript(f"{where}: a step must be an object with exactly one of {', '.join(STEP_KINDS)}")
        kind = kinds[0]
        if kind == "call":
            return self._calls([_call_step(step, where)])[0]
        if kind == "parallel":
            listed = step["parallel"]
            if not isinstance(listed, list):
                raise MalformedScript(f"{where}.parallel: must be an array of call steps")
            return {"parallel": self._calls([_call_step(c, f"{where}.parallel[{i}]") for i, c in enumerate(listed)])}
        if kind == "trace":
            if "payload" not in step:
                raise MalformedScript(f"{where}: a trace step needs 'payload'")
            return _attempt(lambda: self._trace(step["trace"], step["payload"], step.get("actor")))
        if kind == "handoff":
            handoff = step["handoff"]
            if not isinstance(handoff, dict) or "from" not in handoff or "to" not in handoff:
                raise MalformedScript(f"{where}.handoff: must be an object with 'from' and 'to'")
            return _attempt(lambda: _sequence_reply(post_handoff_with(
                self.envelope, handoff["from"], handoff["to"], reason=handoff.get("reason"),
                payload_preview=handoff.get("payload_preview"))))
        if kind == "sleep_ms":
            millis = step["sleep_ms"]
            if isinstance(millis, bool) or not isinstance(millis, (int, float)) or millis < 0:
                raise MalformedScript(f"{where}.sleep_ms: must be a non-negative number")
            time.sleep(millis / 1000)
            return _ok(None)
        if kind == "raise":
            message = step["raise"]
            if not isinstance(message, str):
                raise MalformedScript(f"{where}.raise: must be a string")
            raise RuntimeError(message)
        raise _Return(step["return"])

    def _trace(self, event_type: Any, payload: Any, actor: Any) -> Any:
        label = validate_actor_label(actor)  # a bad label: ActorLabelError, kind request
        with set_actor_id(label):  # bound as for a tool call; whether the SDK sends it is its business
            return _sequence_reply(post_trace_event_with(self.envelope, event_type, payload))

    def _calls(self, calls: List[Mapping[str, Any]]) -> List[Dict[str, Any]]:
        """Tool calls started together and awaited together; outcomes in the listed order."""
        ids = []
        for _ in calls:
            self.call_count += 1
            ids.append(f"call_{self.call_count}")
        if len(calls) == 1:
            outcomes = [self._tool_call(calls[0])]
        elif calls:
            with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="sdk-port-call") as pool:
                futures = [pool.submit(contextvars.copy_context().run, self._tool_call, c) for c in calls]
                outcomes = [f.result() for f in futures]
        else:
            outcomes = []
        for call_id, call, outcome in zip(ids, calls, outcomes):
            name, args = call["call"], call["args"]
            self.messages.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id,
                "name": name if isinstance(name, str) and name else _compact(name),
                "arguments": args if isinstance(args, dict) else _compact(args)}]})
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": _compact(outcome)})
        return outcomes

    def _tool_call(self, call: Mapping[str, Any]) -> Dict[str, Any]:
        def send() -> Any:
            label = validate_actor_label(call.get("actor"))  # a bad label: ActorLabelError, kind request
            if label is None:
                return proxy_call_with(self.envelope, call["call"], call["args"])
            return ScopedProxy(self.envelope, label).call(call["call"], call["args"])
        return _attempt(send)


def _call_step(step: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(step, dict) or "call" not in step or "args" not in step:
        raise MalformedScript(f"{where}: a call step is an object with 'call' and 'args'")
    return step


app = make_app()
api_key_app = make_app(auth_header_name="X-API-Key")
