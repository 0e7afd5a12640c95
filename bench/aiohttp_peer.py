"""The aiohttp peer of bench_fanout.py: an aiohttp server and one ``aiohttp.ClientSession``, the same agent.

    AGENT_TOKEN=... bench/.venv/bin/python bench/aiohttp_peer.py --port P

What a careful aiohttp user writes: the route checks the bearer (constant time), reads the JSON, answers the
ping, finds the proxy URL and run token, then awaits three tool calls one after another over the app's one
keep-alive ``ClientSession``, and answers ``{"final_response": ...}``.  No validation, retries or pacing:
the lower bound of what a dispatch wrapper on aiohttp costs.
"""

from __future__ import annotations

import argparse
import os
import secrets
from typing import Any, Dict

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

AGENT_TOKEN = os.environ["AGENT_TOKEN"]
SESSION = web.AppKey("session", ClientSession)


async def proxy_call(session: ClientSession, proxy_url: str, run_token: str, name: str,
                     args: Dict[str, Any]) -> Any:
    async with session.post(f"{proxy_url.rstrip('/')}/tools/{name}", json=args,
                            headers={"Authorization": f"Bearer {run_token}"}) as reply:
        body = await reply.json()
        return body["response"] if reply.status < 400 else {"error": body}


async def dispatch(request: web.Request) -> web.Response:
    authorization = request.headers.get("Authorization") or ""
    if not secrets.compare_digest(authorization, f"Bearer {AGENT_TOKEN}"):
        return web.json_response({"detail": "missing or invalid bearer token"}, status=401)
    body = await request.json()
    if body == {"ping": True}:
        return web.json_response({"ok": True})
    proxy_url = body.get("odyssey_proxy_url") or request.headers.get("X-Pipelines-Odyssey-Proxy-Url")
    run_token = request.headers.get("X-Pipelines-Run-Token")
    if not proxy_url or not run_token:
        return web.json_response({"detail": "missing proxy URL or run token"}, status=400)
    inner = body.get("input") or {}
    task_input = inner.get("input") or {}
    session = request.app[SESSION]
    order = await proxy_call(session, proxy_url, run_token, "get_order", {"order_id": task_input.get("order_id")})
    customer = await proxy_call(session, proxy_url, run_token, "get_customer",
                                {"customer_id": task_input.get("customer_id")})
    refund = await proxy_call(session, proxy_url, run_token, "issue_refund",
                              {"order_id": order["args"]["order_id"], "reason": inner.get("user_instruction")})
    final = f"{refund['tool']} done for order {order['args']['order_id']} of {customer['args']['customer_id']}"
    return web.json_response({"final_response": final})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def session_context(app: web.Application) -> Any:
    app[SESSION] = ClientSession(timeout=ClientTimeout(total=120), connector=TCPConnector(limit=0))
    yield
    await app[SESSION].close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = web.Application()
    app.router.add_post("/dispatch", dispatch)
    app.router.add_get("/healthz", healthz)
    app.cleanup_ctx.append(session_context)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None, backlog=4096)


if __name__ == "__main__":
    main()
