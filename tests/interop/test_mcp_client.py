"""The official MCP Python SDK client drives ``python3 -m pipelines_port mcp`` over stdio.

What an agent framework does with our MCP shim: initialize (protocol version negotiated), list the
run's tools (from ``PIPELINES_TOOLS_SCHEMA_B64``), call one through the per-run proxy (a local
MockProxy on 127.0.0.1), and see a proxy error as an ``isError`` result.  Skipped without ``mcp``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest

pytest.importorskip("mcp", reason="the MCP client tests need the official mcp package")

from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402

import pipelines_port as pp  # noqa: E402
from conformance.mock_proxy import MockProxy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RUN_TOKEN = "rt-mcp-client"
TOOLS = [
    {"name": "get_order", "description": "Look up an order",
     "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}},
    {"name": "issue_refund", "description": "Refund an order",
     "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}}}},
]


@pytest.fixture
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[RUN_TOKEN]) as p:
        p.script("get_order", [{"response": {"order_id": "4521", "status": "shipped"}}])
        p.script("issue_refund", [{"status": 422, "json": {"detail": {"error_class": "invalid_arguments",
                                                                        "message": "amount is required"}}}])
        yield p


def server(proxy: MockProxy) -> StdioServerParameters:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINES_")}
    env.update({"PYTHONPATH": str(ROOT), "PIPELINES_ODYSSEY_PROXY_URL": proxy.url, "PIPELINES_RUN_TOKEN": RUN_TOKEN,
                "PIPELINES_TOOLS_SCHEMA_B64": base64.b64encode(json.dumps(TOOLS).encode()).decode()})
    return StdioServerParameters(command=sys.executable, args=["-m", "pipelines_port", "mcp"], env=env, cwd=str(ROOT))


async def session_run(proxy: MockProxy) -> Dict[str, Any]:
    async with stdio_client(server(proxy)) as (read, write):
        async with ClientSession(read, write) as session:
            init = await session.initialize()
            listed = await session.list_tools()
            ok = await session.call_tool("get_order", {"order_id": "4521"})
            failed = await session.call_tool("issue_refund", {"order_id": "4521"})
            return {"init": init, "tools": listed.tools, "ok": ok, "failed": failed}


def field(obj: Any, snake: str, camel: str) -> Any:
    """A result field by its name in mcp 2 (snake_case) or mcp 1 (camelCase)."""
    return getattr(obj, snake) if hasattr(obj, snake) else getattr(obj, camel)


def test_the_official_client_lists_and_calls_tools_through_the_proxy(proxy: MockProxy) -> None:
    got = asyncio.run(asyncio.wait_for(session_run(proxy), 60))
    assert field(got["init"], "protocol_version", "protocolVersion") in pp.MCP_PROTOCOL_VERSIONS
    tools = [(t.name, field(t, "input_schema", "inputSchema")) for t in got["tools"]]
    assert tools == [(t["name"], t["input_schema"]) for t in TOOLS]
    ok = got["ok"]
    assert field(ok, "is_error", "isError") is False
    assert json.loads(ok.content[0].text) == {"order_id": "4521", "status": "shipped"}
    failed = got["failed"]
    assert field(failed, "is_error", "isError") is True and "invalid_arguments" in failed.content[0].text
    assert RUN_TOKEN not in failed.content[0].text
    (call,) = proxy.calls("get_order")
    assert call.headers.get("authorization") == f"Bearer {RUN_TOKEN}" and call.headers.get("idempotency-key")
    assert call.json == {"order_id": "4521"}
