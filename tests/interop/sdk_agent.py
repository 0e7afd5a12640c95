"""The conformance agent (conformance/README.md) on the platform's own SDK, used only as a library.

    AGENT_TOKEN=t uvicorn tests.interop.sdk_agent:app --port 8123

An independent implementation for the conformance suite to measure: FastAPI and
``pipelines.odyssey.register_dispatch_route`` do auth, ping, envelope parsing
and response building; ``proxy_call_with`` (with ``set_actor_id``),
``post_trace_event_with`` and ``post_handoff_with`` do every proxy call, with
the SDK's own HTTP client and retry policy.  Nothing here re-implements them,
and nothing imports pipelines_port: what the check finds is the SDK's
behaviour.  ``tests/interop/test_sdk_agent.py`` runs the check against it.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Mapping, Optional
from urllib.parse import urlsplit

from fastapi import FastAPI
from pipelines.odyssey import register_dispatch_route
from pipelines.odyssey.context import set_actor_id
from pipelines.odyssey.labels import validate_actor_label
from pipelines.odyssey.proxy import ProxyCallError, StaleRunTokenError, proxy_call_with
from pipelines.odyssey.traces import TraceForwardError, post_handoff_with, post_trace_event_with

STEPS = ("call", "parallel", "trace", "handoff", "sleep_ms", "raise", "return")


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def echo(envelope: Any) -> Dict[str, Any]:
    """The envelope as the SDK parsed it (the token as its SHA-256)."""
    raw = dict(envelope.raw or {})
    declared = envelope.declared_actor_ids or frozenset()
    listed = raw.get("sub_agents") if isinstance(raw.get("sub_agents"), list) else []
    labels = [e.get("actor_id") if isinstance(e, dict) else e for e in listed]
    origin = urlsplit(envelope.proxy_url)
    return {
        "proxy_url": envelope.proxy_url,
        "run_token_sha256": hashlib.sha256(envelope.run_token.encode("utf-8")).hexdigest(),
        "run_id": envelope.run_id, "task_id": envelope.task_id, "agent_id": envelope.agent_id,
        "run_token_jti": envelope.run_token_jti, "user_instruction": envelope.user_instruction,
        "task_input": dict(envelope.task_input or {}), "latest_user_prompt": envelope.latest_user_prompt,
        "session_id": envelope.session_id, "turn_id": envelope.turn_id, "messages": envelope.messages,
        "scenario_state": envelope.scenario_state, "workspace": envelope.workspace,
        "tools_schema": envelope.tools_schema,
        # The SDK keeps the catalog as a set: list it in the body's order, as the SDK normalised each label.
        "sub_agents": list(dict.fromkeys(label.strip() for label in labels
                                         if isinstance(label, str) and label.strip() in declared)),
        "api_url": f"{origin.scheme}://{origin.netloc}",
        "raw": raw,
    }


def outcome(fn: Callable[[], Any]) -> Dict[str, Any]:
    """Run one proxy call or trace post; its outcome as the agent spec words it."""
    try:
        return {"ok": True, "value": fn()}
    except StaleRunTokenError as exc:
        return failed("stale_run_token", exc)
    except (ProxyCallError, TraceForwardError) as exc:
        if exc.status_code is not None:
            return failed("proxy", exc)
        # One exception type for both: a network failure chains the HTTP client's error, a local check does not.
        return failed("transport" if exc.__cause__ is not None else "request", exc)
    except ValueError as exc:  # the SDK's local checks: ActorLabelError, an unknown trace type
        return {"ok": False, "error": {"kind": "request", "status_code": None, "error_class": None,
                                       "message": str(exc)[:200]}}


def failed(kind: str, exc: Any) -> Dict[str, Any]:
    return {"ok": False, "error": {"kind": kind, "status_code": exc.status_code,
                                   "error_class": getattr(exc, "error_class", None)}}


class Returned(Exception):
    def __init__(self, value: Any) -> None:
        super().__init__("return step")
        self.value = value


class Script:
    def __init__(self, envelope: Any) -> None:
        self.envelope = envelope
        self.messages: List[Dict[str, Any]] = [{"role": "user", "content": envelope.user_instruction}]
        self.count = 0

    def run(self, steps: List[Any]) -> Any:
        started = time.monotonic()
        results = []
        try:
            for index, step in enumerate(steps):
                results.append(self.step(index, step))
        except Returned as returned:
            return returned.value
        final = compact({"results": results})
        self.messages.append({"role": "assistant", "content": final})
        runtime_ms = round((time.monotonic() - started) * 1000)
        return {"final_response": final, "messages": self.messages,
                "metadata": {"model": "conformance-agent", "agent_runtime_ms": runtime_ms}}

    def step(self, index: int, step: Any) -> Any:
        kinds = [k for k in STEPS if isinstance(step, dict) and k in step]
        if len(kinds) != 1:
            raise ValueError(f"steps[{index}]: a step has exactly one of {', '.join(STEPS)}")
        kind = kinds[0]
        if kind == "call":
            return self.calls([self.call_step(step, index)])[0]
        if kind == "parallel":
            if not isinstance(step["parallel"], list):
                raise ValueError(f"steps[{index}].parallel: must be an array")
            return {"parallel": self.calls([self.call_step(c, index) for c in step["parallel"]])}
        if kind == "trace":
            if "payload" not in step:
                raise ValueError(f"steps[{index}]: a trace step needs 'payload'")
            return outcome(lambda: post_trace_event_with(self.envelope, step["trace"], step["payload"]))
        if kind == "handoff":
            h = step["handoff"]
            if not isinstance(h, dict) or "from" not in h or "to" not in h:
                raise ValueError(f"steps[{index}].handoff: needs 'from' and 'to'")
            return outcome(lambda: post_handoff_with(self.envelope, h["from"], h["to"], reason=h.get("reason"),
                                                     payload_preview=h.get("payload_preview")))
        if kind == "sleep_ms":
            time.sleep(float(step["sleep_ms"]) / 1000)
            return {"ok": True, "value": None}
        if kind == "raise":
            raise RuntimeError(step["raise"])
        raise Returned(step["return"])

    @staticmethod
    def call_step(step: Any, index: int) -> Mapping[str, Any]:
        if not isinstance(step, dict) or "call" not in step or "args" not in step:
            raise ValueError(f"steps[{index}]: a call step needs 'call' and 'args'")
        return step

    def one_call(self, call: Mapping[str, Any]) -> Dict[str, Any]:
        def send() -> Any:
            label = validate_actor_label(call.get("actor"))
            with set_actor_id(label):
                return proxy_call_with(self.envelope, call["call"], call["args"])
        if call.get("raise_on_error") is True:  # the SDK's error leaves the agent as the SDK raised it
            return {"ok": True, "value": send()}
        return outcome(send)

    def calls(self, calls: List[Mapping[str, Any]]) -> List[Dict[str, Any]]:
        ids = []
        for _ in calls:
            self.count += 1
            ids.append(f"call_{self.count}")
        with ThreadPoolExecutor(max_workers=max(1, len(calls))) as pool:
            futures = [pool.submit(contextvars.copy_context().run, self.one_call, c) for c in calls]
            results = [f.result() for f in futures]
        for call_id, call, result in zip(ids, calls, results):
            name = call["call"] if isinstance(call["call"], str) and call["call"] else compact(call["call"])
            args = call["args"] if isinstance(call["args"], dict) else compact(call["args"])
            self.messages.append({"role": "assistant", "content": None,
                                  "tool_calls": [{"id": call_id, "name": name, "arguments": args}]})
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": compact(result)})
        return results


def run_agent(envelope: Any) -> Any:
    try:
        parsed = json.loads(envelope.user_instruction)
    except ValueError:
        parsed = None
    if not (isinstance(parsed, dict) and isinstance(parsed.get("steps"), list)):
        return compact({"envelope": echo(envelope)})
    return Script(envelope).run(parsed["steps"])


def make_app(token_env: str = "AGENT_TOKEN", auth_header: Optional[str] = None) -> FastAPI:
    app = FastAPI()
    header = auth_header or os.environ.get("SDK_AGENT_AUTH_HEADER") or "Authorization"

    @app.get("/healthz")
    def healthz() -> Dict[str, bool]:  # for the test harness's readiness poll; not part of the SDK
        return {"ok": True}

    @register_dispatch_route(app, agent_token_env=token_env, auth_header_name=header)
    def dispatch(envelope: Any) -> Any:  # a sync handler: FastAPI runs it on its thread pool
        return run_agent(envelope)

    return app


app = make_app()
