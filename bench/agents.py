"""Agents that bench_server.py serves with ``python3 pipelines_port.py serve bench/agents.py:FUNCTION``."""

from __future__ import annotations

from typing import Any, Dict

import pipelines_port as pp


def three_calls(envelope: pp.Envelope) -> Dict[str, Any]:
    """Three tool calls through the proxy, one after another, then the response envelope.

    The same calls, arguments and answer as the peer's agent in peer_app.py.
    """
    task_input = envelope.task_input
    order = pp.proxy_call("get_order", {"order_id": task_input.get("order_id")})
    customer = pp.proxy_call("get_customer", {"customer_id": task_input.get("customer_id")})
    refund = pp.proxy_call("issue_refund", {"order_id": order["args"]["order_id"],
                                            "reason": envelope.user_instruction})
    return pp.build_response(
        f"{refund['tool']} done for order {order['args']['order_id']} of {customer['args']['customer_id']}")


async def three_calls_async(envelope: pp.Envelope) -> Dict[str, Any]:
    """The same agent, ``async def``: each call awaited on the server's event loop."""
    task_input = envelope.task_input
    order = await pp.aproxy_call("get_order", {"order_id": task_input.get("order_id")})
    customer = await pp.aproxy_call("get_customer", {"customer_id": task_input.get("customer_id")})
    refund = await pp.aproxy_call("issue_refund", {"order_id": order["args"]["order_id"],
                                                   "reason": envelope.user_instruction})
    return pp.build_response(
        f"{refund['tool']} done for order {order['args']['order_id']} of {customer['args']['customer_id']}")
