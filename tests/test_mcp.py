"""`pipelines_port.py mcp`: a stdio MCP server, driven as a subprocess over pipes."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

from conformance.harness.mock_proxy import MockProxy
from tests.conftest import Together

ROOT = Path(__file__).resolve().parent.parent
RUN_TOKEN = "mcp-run-token-31415"
TOOLS = [{"name": "get_order", "description": "Look up an order.",
          "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}}}},
         {"name": "search_kb", "input_schema": {"type": "object"}}]


class Shim:
    """The shim as a child process; ``ask`` sends one line and reads the reply with that id."""

    def __init__(self, env: Dict[str, str]) -> None:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINES_")}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "pipelines_port.py"), "mcp"], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1, env={**clean, **env})
        self.pending: Dict[Any, Dict[str, Any]] = {}

    def send(self, message: Any) -> None:
        line = message if isinstance(message, str) else json.dumps(message)
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self) -> Dict[str, Any]:
        line = self.proc.stdout.readline()
        assert line, f"the shim closed stdout: {self.proc.stderr.read()}"
        return json.loads(line)

    def ask(self, message: Any, reply_id: Any = "same") -> Dict[str, Any]:
        self.send(message)
        wanted = message.get("id") if reply_id == "same" else reply_id
        while wanted not in self.pending:
            reply = self.read()
            self.pending[reply.get("id")] = reply
        return self.pending.pop(wanted)

    def close(self) -> str:
        self.proc.stdin.close()
        rest = self.proc.stdout.read()
        err = self.proc.stderr.read()
        self.proc.wait(timeout=20)
        assert rest == "", f"unexpected output: {rest!r}"
        return err


def request(i: int, method: str, params: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    return {"jsonrpc": "2.0", "id": i, "method": method, **({"params": params} if params is not None else {})}


@pytest.fixture
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[RUN_TOKEN]) as p:
        yield p


def run_env(proxy: MockProxy, **extra: str) -> Dict[str, str]:
    return {"PIPELINES_ODYSSEY_PROXY_URL": proxy.url, "PIPELINES_RUN_TOKEN": RUN_TOKEN,
            "PIPELINES_PROXY_RATE_PER_MINUTE": "0", **extra}


def test_initialize_list_and_call(proxy: MockProxy) -> None:
    proxy.script("get_order", [{"response": {"status": "shipped"}}])
    proxy.script("search_kb", [{"response": "plain text answer"}])
    shim = Shim(run_env(proxy, PIPELINES_TOOLS_SCHEMA_B64=base64.b64encode(json.dumps(TOOLS).encode()).decode()))
    init = shim.ask(request(1, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                              "clientInfo": {"name": "test", "version": "1"}}))
    assert init["result"]["protocolVersion"] == "2025-06-18"
    assert init["result"]["capabilities"]["tools"] == {"listChanged": False}
    shim.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
    assert shim.ask(request(2, "ping")) == {"jsonrpc": "2.0", "id": 2, "result": {}}
    listed = shim.ask(request(3, "tools/list"))["result"]["tools"]
    assert listed == [{"name": "get_order", "description": "Look up an order.", "inputSchema": TOOLS[0]["input_schema"]},
                      {"name": "search_kb", "description": "", "inputSchema": {"type": "object"}}]
    call = shim.ask(request(4, "tools/call", {"name": "get_order", "arguments": {"order_id": "4521"}}))["result"]
    assert call == {"content": [{"type": "text", "text": '{"status": "shipped"}'}], "isError": False,
                    "structuredContent": {"status": "shipped"}}
    text = shim.ask(request(5, "tools/call", {"name": "search_kb"}))["result"]
    assert text == {"content": [{"type": "text", "text": "plain text answer"}], "isError": False}
    err = shim.close()
    (first,) = proxy.calls("get_order")
    assert first.bearer == RUN_TOKEN and first.json == {"order_id": "4521"} and first.idempotency_key
    assert proxy.calls("search_kb")[0].json == {}
    assert RUN_TOKEN not in err


def test_unknown_protocol_version_gets_the_newest() -> None:
    shim = Shim({})
    assert shim.ask(request(1, "initialize", {"protocolVersion": "1999-01-01"}))["result"]["protocolVersion"] == "2025-11-25"
    shim.close()


def test_tool_failures_are_is_error_results_and_retries_reuse_one_key(proxy: MockProxy) -> None:
    proxy.script("flaky", [{"status": 429, "headers": {"Retry-After": "0"}}, {"drop": True},
                           {"response": {"ok": True}}])
    proxy.script("broken", [{"status": 500, "error_class": "internal", "message": "kaput"}])
    proxy.script("stale", [{"status": 401, "error_class": "run_token_expired", "message": "gone"}])
    shim = Shim(run_env(proxy, PIPELINES_TOOLS_SCHEMA_JSON=json.dumps(TOOLS)))
    ok = shim.ask(request(1, "tools/call", {"name": "flaky", "arguments": {}}))["result"]
    assert ok["isError"] is False and ok["structuredContent"] == {"ok": True}
    calls = proxy.calls("flaky")
    assert len(calls) == 3 and len({c.idempotency_key for c in calls}) == 1
    broken = shim.ask(request(2, "tools/call", {"name": "broken", "arguments": {}}))["result"]
    assert broken["isError"] is True and "kaput" in broken["content"][0]["text"]
    stale = shim.ask(request(3, "tools/call", {"name": "stale", "arguments": {}}))["result"]
    assert stale["isError"] is True and "run is over" in stale["content"][0]["text"]
    bad_name = shim.ask(request(4, "tools/call", {"name": "no such tool!", "arguments": {}}))["result"]
    assert bad_name["isError"] is True and "tool name" in bad_name["content"][0]["text"]
    assert proxy.calls("no such tool!") == []
    shim.close()


def test_malformed_input_gets_json_rpc_errors_and_never_a_crash(proxy: MockProxy) -> None:
    shim = Shim(run_env(proxy, PIPELINES_TOOLS_SCHEMA_JSON=json.dumps(TOOLS)))
    assert shim.ask("this is not json", reply_id=None)["error"]["code"] == -32700
    assert shim.ask("[1, 2]", reply_id=None)["error"]["code"] == -32600
    assert shim.ask('"just a string"', reply_id=None)["error"]["code"] == -32600
    assert shim.ask({"id": 7, "method": "ping"})["error"]["code"] == -32600  # no jsonrpc: "2.0"
    assert shim.ask({"jsonrpc": "2.0", "id": True, "method": "ping"}, reply_id=None)["error"]["code"] == -32600
    assert shim.ask(request(8, "resources/list"))["error"]["code"] == -32601
    assert shim.ask(request(9, "tools/call", {"arguments": {}}))["error"]["code"] == -32602
    assert shim.ask(request(10, "tools/call", {"name": "get_order", "arguments": [1]}))["error"]["code"] == -32602
    assert shim.ask({"jsonrpc": "2.0", "id": 11, "method": "ping", "params": [1]})["error"]["code"] == -32602
    shim.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 3}})
    shim.send({"jsonrpc": "2.0", "method": "unknown/notification"})
    shim.send({"jsonrpc": "2.0", "id": 99, "result": {}})  # a stray response
    shim.send("")
    assert shim.ask(request(12, "ping"))["result"] == {}  # still alive, and nothing answered the four above
    shim.close()


def test_missing_run_environment_is_an_error_not_a_crash() -> None:
    shim = Shim({"PIPELINES_TOOLS_SCHEMA_JSON": json.dumps(TOOLS)})
    reply = shim.ask(request(1, "tools/call", {"name": "get_order", "arguments": {}}))
    assert reply["error"]["code"] == -32603 and "PIPELINES_RUN_TOKEN" in reply["error"]["message"]
    assert len(shim.ask(request(2, "tools/list"))["result"]["tools"]) == 2
    shim.close()
    shim = Shim({})
    reply = shim.ask(request(1, "tools/list"))
    assert reply["error"]["code"] == -32603 and "PIPELINES_TOOLS_SCHEMA_B64" in reply["error"]["message"]
    shim.close()


class ToolsSchemaAPI:
    """The platform's GET /api/agents/{id}/tools-schema, recording who asked."""

    def __init__(self) -> None:
        self.seen: List[Dict[str, str]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                api.seen.append({"path": self.path, "authorization": self.headers.get("Authorization", "")})
                body = json.dumps({"tools": TOOLS}).encode()
                self.send_response(200 if self.path == "/api/agents/8/tools-schema" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_tools_list_fetched_from_the_platform_with_the_run_token(proxy: MockProxy) -> None:
    api = ToolsSchemaAPI()
    try:
        shim = Shim(run_env(proxy, PIPELINES_AGENT_ID="8", PIPELINES_API_URL=api.url))
        names = [t["name"] for t in shim.ask(request(1, "tools/list"))["result"]["tools"]]
        assert names == ["get_order", "search_kb"]
        shim.ask(request(2, "tools/list"))
        shim.close()
        assert api.seen == [{"path": "/api/agents/8/tools-schema", "authorization": f"Bearer {RUN_TOKEN}"}]  # once
        shim = Shim(run_env(proxy, PIPELINES_AGENT_ID="9", PIPELINES_API_URL=api.url))
        reply = shim.ask(request(1, "tools/list"))
        assert reply["error"]["code"] == -32603 and "HTTP 404" in reply["error"]["message"]
        assert RUN_TOKEN not in reply["error"]["message"]
        shim.close()
    finally:
        api.server.shutdown()
        api.server.server_close()


def test_tool_calls_run_concurrently(proxy: MockProxy) -> None:
    proxy.script("slow", Together(4)(lambda r: {"response": r.json}))
    shim = Shim(run_env(proxy, PIPELINES_TOOLS_SCHEMA_JSON=json.dumps(TOOLS)))
    for i in range(4):
        shim.send(request(i, "tools/call", {"name": "slow", "arguments": {"i": i}}))
    replies = {r["id"]: r for r in (shim.read() for _ in range(4))}
    assert {i: replies[i]["result"]["structuredContent"] for i in range(4)} == {i: {"i": i} for i in range(4)}
    assert proxy.max_in_flight == 4
    shim.close()
