"""The official MCP Python SDK client drives ``python3 -m pipelines_port mcp`` over stdio.

What an agent framework does with our MCP shim (``pp.McpShim``): ``initialize`` (the protocol version
negotiated), ``list_tools`` (the run's tools from ``PIPELINES_TOOLS_SCHEMA_B64``), ``call_tool`` through
the per-run proxy (a local ``MockProxy`` on 127.0.0.1, reached with ``PIPELINES_ODYSSEY_PROXY_URL`` and
``PIPELINES_RUN_TOKEN``), a proxy error as an ``isError`` result, and two calls in flight at once with
their replies out of order.  Skipped without the ``mcp`` package (pins: tests/interop/requirements-hosts.txt).
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import threading
from typing import Any, Awaitable, Callable, Dict, Iterator, Optional, TypeVar

import pytest

pytest.importorskip("mcp", reason="the MCP client tests need the official mcp package")

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

import pipelines_port as pp
from conformance.harness.mock_proxy import MockProxy
from tests.interop.hosts import ROOT, subprocess_env

RUN_TOKEN = "run-token-mcp-5c1d9e77"
SESSION_S = 30.0  # a whole session's bound, start to exit
TOOLS = [
    {"name": "get_order", "description": "Look up an order",
     "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}},
    {"name": "issue_refund", "description": "Refund an order",
     "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"},
                                                       "amount": {"type": "number"}}}},
]
ORDER = {"order_id": "4521", "status": "shipped"}

T = TypeVar("T")


@pytest.fixture
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[RUN_TOKEN]) as p:
        p.script("get_order", [{"response": ORDER}])
        p.script("issue_refund", [{"status": 422, "error_class": "invalid_arguments", "message": "amount is required"}])
        yield p


def server(proxy: MockProxy) -> StdioServerParameters:
    env = subprocess_env(PIPELINES_ODYSSEY_PROXY_URL=proxy.url, PIPELINES_RUN_TOKEN=RUN_TOKEN,
                         PIPELINES_TOOLS_SCHEMA_B64=base64.b64encode(json.dumps(TOOLS).encode()).decode())
    return StdioServerParameters(command=sys.executable, args=["-m", "pipelines_port", "mcp"], env=env, cwd=str(ROOT))


def in_session(proxy: MockProxy, body: Callable[[ClientSession, Any], Awaitable[T]]) -> T:
    """``body(session, init)`` in a session over a fresh ``pipelines_port mcp`` process, bounded in time."""
    async def run() -> T:
        async with stdio_client(server(proxy)) as (read, write):
            async with ClientSession(read, write) as session:
                init = await session.initialize()
                return await body(session, init)

    async def bounded() -> T:
        return await asyncio.wait_for(run(), SESSION_S)

    return asyncio.run(bounded())


def field(obj: Any, snake: str, camel: str) -> Any:
    """A result field by its name in mcp 2 (snake_case) or mcp 1 (camelCase)."""
    return getattr(obj, snake) if hasattr(obj, snake) else getattr(obj, camel)


def client_offer() -> Optional[str]:
    """The protocol version this SDK's client offers in ``initialize`` (None: not found in this SDK)."""
    try:
        from mcp_types.version import LATEST_HANDSHAKE_VERSION  # mcp 2

        return str(LATEST_HANDSHAKE_VERSION)
    except ImportError:
        pass
    try:
        from mcp.types import LATEST_PROTOCOL_VERSION  # mcp 1

        return str(LATEST_PROTOCOL_VERSION)
    except ImportError:
        return None


def test_the_official_client_initializes_lists_and_calls_tools(proxy: MockProxy) -> None:
    async def body(session: ClientSession, init: Any) -> Dict[str, Any]:
        await session.send_ping()
        listed = await session.list_tools()
        ok = await session.call_tool("get_order", {"order_id": "4521"})
        failed = await session.call_tool("issue_refund", {"order_id": "4521"})
        return {"tools": listed.tools, "ok": ok, "failed": failed, "init": init}

    got = in_session(proxy, body)

    init = got["init"]
    version = field(init, "protocol_version", "protocolVersion")
    assert version in pp.MCP_PROTOCOL_VERSIONS
    offer = client_offer()
    if offer is not None:  # the shim takes the client's offer when it knows it, else proposes its newest
        assert version == (offer if offer in pp.MCP_PROTOCOL_VERSIONS else pp.MCP_PROTOCOL_VERSIONS[0])
    assert field(init, "server_info", "serverInfo").name == "pipelines_port"
    assert init.capabilities.tools is not None

    tools = {t.name: (t.description, field(t, "input_schema", "inputSchema")) for t in got["tools"]}
    assert tools == {t["name"]: (t["description"], t["input_schema"]) for t in TOOLS}

    ok = got["ok"]
    assert field(ok, "is_error", "isError") is False
    assert [c.type for c in ok.content] == ["text"] and json.loads(ok.content[0].text) == ORDER
    assert field(ok, "structured_content", "structuredContent") == ORDER

    failed = got["failed"]
    assert field(failed, "is_error", "isError") is True
    assert "invalid_arguments" in failed.content[0].text and "amount is required" in failed.content[0].text
    assert RUN_TOKEN not in failed.content[0].text

    (call,) = proxy.calls("get_order")
    assert call.run_token == RUN_TOKEN and call.bearer == RUN_TOKEN
    assert call.idempotency_key
    assert call.json == {"order_id": "4521"}
    (refused,) = proxy.calls("issue_refund")  # a 422 is final: no retry
    assert refused.run_token == RUN_TOKEN and refused.idempotency_key
    assert refused.idempotency_key != call.idempotency_key


def test_two_calls_in_flight_come_back_out_of_order(proxy: MockProxy) -> None:
    """The shim runs ``tools/call`` concurrently and may answer out of order; the client matches them by id.

    The proxy holds the first call (order 1) until the second (order 2) has been answered."""
    second_answered = threading.Event()

    def reply(request: Any) -> Dict[str, Any]:
        order_id = (request.json or {}).get("order_id")
        if order_id == "1":
            if not second_answered.wait(10):
                return {"status": 500, "error_class": "not_concurrent", "message": "the second call never came"}
        else:
            second_answered.set()
        return {"response": {"order_id": order_id, "status": "shipped"}}

    proxy.script("get_order", reply)

    async def body(session: ClientSession, init: Any) -> Any:
        first = asyncio.ensure_future(session.call_tool("get_order", {"order_id": "1"}))
        await asyncio.sleep(0.2)  # the first is on its way before the second is sent
        second = await session.call_tool("get_order", {"order_id": "2"})
        return await first, second

    first, second = in_session(proxy, body)
    assert field(first, "is_error", "isError") is False, first.content
    assert field(second, "is_error", "isError") is False, second.content
    assert json.loads(first.content[0].text) == {"order_id": "1", "status": "shipped"}
    assert json.loads(second.content[0].text) == {"order_id": "2", "status": "shipped"}
    keys = [r.idempotency_key for r in proxy.calls("get_order")]
    assert len(keys) == 2 and all(keys) and keys[0] != keys[1]
