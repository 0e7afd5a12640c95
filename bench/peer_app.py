"""The peer of bench_server.py: a FastAPI dispatch wrapper shaped like the platform docs' reference wrapper.

Runs under uvicorn in bench/.venv (fastapi, uvicorn and httpx are no
dependency of the project).  Environment:

- ``AGENT_TOKEN``: the inbound bearer (required).
- ``PEER_STYLE``: how the agent reaches the proxy.
  ``reference`` (default) is the docs' wrapper as written: a synchronous
  ``httpx.post`` per tool call (a fresh client and connection each time) from
  a plain function called inside the ``async def`` route, so each dispatch
  holds the event loop while its tool calls run.  ``tuned`` is what a careful
  FastAPI user writes instead: one ``httpx.AsyncClient`` (keep-alive pool)
  created once, and an async agent that awaits its calls.

The route follows the documented order: bearer check with
``secrets.compare_digest`` first, then JSON, then the ping short-circuit, then
the proxy URL and run token, then the agent, then ``{"final_response": ...}``.
"""

from __future__ import annotations

import os
import secrets
from typing import Any, Callable, Dict, Optional

import httpx
from fastapi import FastAPI, Header, HTTPException, Request

AGENT_TOKEN = os.environ["AGENT_TOKEN"]
PEER_STYLE = os.environ.get("PEER_STYLE", "reference")
if PEER_STYLE not in ("reference", "tuned"):
    raise SystemExit(f"PEER_STYLE must be 'reference' or 'tuned', got {PEER_STYLE!r}")
PROXY_TIMEOUT_S = 120.0

app = FastAPI()


def check_bearer(authorization: Optional[str]) -> None:
    """401 unless the Authorization header carries the agent token (constant time)."""
    if not authorization or not secrets.compare_digest(authorization, f"Bearer {AGENT_TOKEN}"):
        raise HTTPException(status_code=401, detail="missing or invalid bearer token")


# -- reference style: httpx.post per call, synchronous agent ----------------------


def sync_proxy_call(proxy_url: str, run_token: str, name: str, args: Dict[str, Any]) -> Any:
    """POST one tool call to the proxy with a throw-away client; return its ``response``."""
    reply = httpx.post(
        f"{proxy_url.rstrip('/')}/tools/{name}",
        json=args,
        headers={"Authorization": f"Bearer {run_token}"},
        timeout=PROXY_TIMEOUT_S,
    )
    if reply.is_error:
        return {"error": reply.text}
    return reply.json()["response"]


def three_calls_sync(user_instruction: str, task_input: Dict[str, Any],
                     call: Callable[[str, Dict[str, Any]], Any]) -> str:
    """The benchmark agent: three tool calls, one after another."""
    order = call("get_order", {"order_id": task_input.get("order_id")})
    customer = call("get_customer", {"customer_id": task_input.get("customer_id")})
    refund = call("issue_refund", {"order_id": order["args"]["order_id"], "reason": user_instruction})
    return f"{refund['tool']} done for order {order['args']['order_id']} of {customer['args']['customer_id']}"


# -- tuned style: one AsyncClient, async agent ---------------------------------------

_client: Optional[httpx.AsyncClient] = None


def async_client() -> httpx.AsyncClient:
    """The app's one AsyncClient, created on first use inside the event loop."""
    global _client
    if _client is None:
        _client = httpx.AsyncClient(timeout=PROXY_TIMEOUT_S)
    return _client


async def async_proxy_call(proxy_url: str, run_token: str, name: str, args: Dict[str, Any]) -> Any:
    """POST one tool call over the shared keep-alive client; return its ``response``."""
    reply = await async_client().post(
        f"{proxy_url.rstrip('/')}/tools/{name}",
        json=args,
        headers={"Authorization": f"Bearer {run_token}"},
    )
    if reply.is_error:
        return {"error": reply.text}
    return reply.json()["response"]


async def three_calls_async(user_instruction: str, task_input: Dict[str, Any], proxy_url: str,
                            run_token: str) -> str:
    """The same agent, awaiting each call."""
    order = await async_proxy_call(proxy_url, run_token, "get_order", {"order_id": task_input.get("order_id")})
    customer = await async_proxy_call(proxy_url, run_token, "get_customer",
                                      {"customer_id": task_input.get("customer_id")})
    refund = await async_proxy_call(proxy_url, run_token, "issue_refund",
                                    {"order_id": order["args"]["order_id"], "reason": user_instruction})
    return f"{refund['tool']} done for order {order['args']['order_id']} of {customer['args']['customer_id']}"


# -- the route -----------------------------------------------------------------------


@app.post("/dispatch")
async def dispatch(
    request: Request,
    authorization: Optional[str] = Header(default=None),
    x_pipelines_run_token: Optional[str] = Header(default=None),
    x_pipelines_odyssey_proxy_url: Optional[str] = Header(default=None),
) -> Dict[str, Any]:
    check_bearer(authorization)
    body = await request.json()
    if body == {"ping": True}:
        return {"ok": True}
    proxy_url = body.get("odyssey_proxy_url") or x_pipelines_odyssey_proxy_url
    run_token = x_pipelines_run_token
    if not proxy_url or not run_token:
        raise HTTPException(400, "missing proxy URL or run token")
    inner = body.get("input") or {}
    user_instruction = inner.get("user_instruction") or ""
    task_input = inner.get("input") or {}
    if PEER_STYLE == "reference":
        final_response = three_calls_sync(
            user_instruction, task_input, lambda name, args: sync_proxy_call(proxy_url, run_token, name, args))
    else:
        final_response = await three_calls_async(user_instruction, task_input, proxy_url, run_token)
    return {"final_response": final_response or "(no final response)"}
