"""Agent-loop helpers: tool formats, tools schema loading, bounded output, concurrent calls, post_json."""

from __future__ import annotations

import base64
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Iterator, List

import pytest

import pipelines_port as pp
from conformance.harness.mock_proxy import MockProxy
from tests.conftest import FakeSleep, Together, envelope_for

PLATFORM_TOOL = {"name": "get_order", "description": "Look up an order.",
                 "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
                 "default_execution_mode": "sandbox"}


def test_convert_tools_to_every_format_from_every_shape() -> None:
    schema = PLATFORM_TOOL["input_schema"]
    shapes = [
        PLATFORM_TOOL,
        {"name": "get_order", "description": "Look up an order.", "parameters": schema},
        {"type": "function", "function": {"name": "get_order", "description": "Look up an order.", "parameters": schema}},
    ]
    for shape in shapes:
        assert pp.convert_tools([shape], "openai_chat") == [
            {"type": "function", "function": {"name": "get_order", "description": "Look up an order.", "parameters": schema}}]
        assert pp.convert_tools([shape], "openai_responses") == [  # strict off: optional fields stay optional
            {"type": "function", "name": "get_order", "description": "Look up an order.", "parameters": schema,
             "strict": False}]
        assert pp.convert_tools([shape], "anthropic") == [
            {"name": "get_order", "description": "Look up an order.", "input_schema": schema}]
    assert pp.convert_tools([PLATFORM_TOOL], "platform") == [PLATFORM_TOOL]
    assert pp.convert_tools([{"name": "ping"}], "anthropic") == [
        {"name": "ping", "description": "", "input_schema": {"type": "object", "properties": {}}}]


@pytest.mark.parametrize("tools,needle", [
    ([{"name": "bad name"}], "tools[0].name"),
    ([{"name": "a"}, {"name": "a"}], "declared twice"),
    ([{"name": "a", "input_schema": "x"}], "input_schema"),
    (["a"], "tools[0]"),
])
def test_convert_tools_names_the_bad_entry(tools: List[Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        pp.convert_tools(tools, "openai_chat")
    with pytest.raises(ValueError, match="unknown tool format"):
        pp.convert_tools([], "gemini")


def test_load_tools_schema_from_files_and_environment(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    good = tmp_path / "tools_schema.json"
    good.write_text(json.dumps({"tools": [PLATFORM_TOOL]}))
    assert pp.load_tools_schema(good) == [PLATFORM_TOOL]
    monkeypatch.setenv("PIPELINES_TOOLS_SCHEMA_B64", base64.b64encode(json.dumps([PLATFORM_TOOL]).encode()).decode())
    assert pp.load_tools_schema() == [PLATFORM_TOOL]
    monkeypatch.delenv("PIPELINES_TOOLS_SCHEMA_B64")
    with pytest.raises(ValueError, match="no tools schema"):
        pp.load_tools_schema()
    for content, needle in (("{oops", "not valid JSON"), ('"x"', "JSON list"), ('[{"name": "a b"}]', "tools[0].name")):
        bad = tmp_path / "bad.json"
        bad.write_text(content)
        with pytest.raises(ValueError, match="bad.json") as info:
            pp.load_tools_schema(bad)
        assert needle in str(info.value)
    with pytest.raises(ValueError, match="cannot read"):
        pp.load_tools_schema(tmp_path / "missing.json")


def test_bound_output_keeps_head_and_tail_and_counts_the_cut() -> None:
    assert pp.bound_output("short", 100) == "short"
    assert pp.bound_output({"a": 1}, 100) == '{"a": 1}'
    text = "HEAD-" + "x" * 10_000 + "-TAIL"
    out = pp.bound_output(text, 1000)
    assert out.startswith("HEAD-") and out.endswith("-TAIL") and len(out) <= 1000
    head, marker_and_tail = out.split("\n...[", 1)
    cut = int(marker_and_tail.split(" characters truncated]", 1)[0])
    tail = marker_and_tail.split("]...\n", 1)[1]
    assert len(head) + cut + len(tail) == len(text)
    assert text.startswith(head) and text.endswith(tail)


def test_call_tools_overlaps_bounded_in_order_with_errors_as_values(proxy: MockProxy, client: pp.ProxyClient) -> None:
    proxy.script("slow", Together(3)(lambda r: {"response": r.json}))
    proxy.script("broken", [{"status": 500, "error_class": "internal", "message": "boom"}])
    with pp.bind_envelope(envelope_for(proxy)):
        calls = [("slow", {"i": i}) for i in range(6)] + [("broken", {})]
        results = pp.call_tools(calls, max_concurrency=3, client=client)
    assert results[:6] == [{"i": i} for i in range(6)]
    assert results[6]["error_class"] == "internal" and "boom" in results[6]["error"]
    assert proxy.max_in_flight == 3


def test_call_tools_decodes_model_json_arguments(proxy: MockProxy, client: pp.ProxyClient) -> None:
    with pp.bind_envelope(envelope_for(proxy)):
        results = pp.call_tools([("a", '{"x": 1}'), ("b", "{oops"), ("c", "[1, 2]"), ("d", ""), ("e", None)],
                                client=client)
        assert results[0] == {"tool": "a", "args": {"x": 1}}
        assert "invalid JSON" in results[1]["error"] and "must be a JSON object" in results[2]["error"]
        assert results[3] == {"tool": "d", "args": {}} and results[4] == {"tool": "e", "args": {}}
        with pytest.raises(pp.ProxyRequestError, match="invalid JSON"):
            pp.call_tools([("b", "{oops")], errors="raise", client=client)
    assert sorted(c.name for c in proxy.calls()) == ["a", "d", "e"]  # concurrent: any order


def test_call_tools_raises_on_a_stale_token(proxy: MockProxy, client: pp.ProxyClient) -> None:
    proxy.script("x", [{"status": 401, "error_class": "run_token_expired"}])
    with pp.bind_envelope(envelope_for(proxy)):
        with pytest.raises(pp.StaleRunTokenError):
            pp.call_tools([("x", {}), ("y", {})], client=client)
    assert pp.call_tools([]) == []


# -- post_json against a small scripted JSON API ------------------------------------------


class FakeAPI:
    def __init__(self) -> None:
        self.replies: List[Dict[str, Any]] = []
        self.requests: List[Dict[str, Any]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                api.requests.append({"path": self.path, "headers": dict(self.headers), "json": json.loads(body)})
                reply = api.replies.pop(0) if len(api.replies) > 1 else api.replies[0]
                payload = reply.get("raw", json.dumps(reply.get("json")).encode())
                self.send_response(reply.get("status", 200))
                for k, v in reply.get("headers", {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def api() -> Iterator[FakeAPI]:
    fake = FakeAPI()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def test_post_json_retries_then_returns_json(api: FakeAPI, fake_sleep: FakeSleep) -> None:
    api.replies = [{"status": 429, "headers": {"Retry-After": "2"}, "json": {"error": "rate"}},
                   {"status": 529, "json": {"type": "overloaded_error"}},
                   {"json": {"id": "msg_1", "content": []}}]
    got = pp.post_json(api.url + "/v1/messages?beta=1", {"model": "m"}, headers={"x-api-key": "sk-secret"},
                       sleep=fake_sleep)
    assert got == {"id": "msg_1", "content": []}
    assert [r["path"] for r in api.requests] == ["/v1/messages?beta=1"] * 3
    assert api.requests[0]["json"] == {"model": "m"} and api.requests[0]["headers"]["x-api-key"] == "sk-secret"
    assert fake_sleep.waits[0] == 2.0 and len(fake_sleep.waits) == 2


def test_post_json_terminal_errors_never_show_the_key(api: FakeAPI, fake_sleep: FakeSleep,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="pipelines_port")
    api.replies = [{"status": 401, "json": {"error": {"message": "invalid x-api-key"}}}]
    with pytest.raises(pp.HTTPStatusError) as info:
        pp.post_json(api.url + "/v1/messages", {}, headers={"x-api-key": "sk-secret-123"}, sleep=fake_sleep)
    assert info.value.status_code == 401 and "invalid x-api-key" in str(info.value)
    assert "sk-secret-123" not in str(info.value) and fake_sleep.waits == []
    assert caplog.records and all("sk-secret-123" not in r.getMessage() for r in caplog.records)
    api.replies = [{"status": 200, "raw": b"<html>oops</html>"}]
    with pytest.raises(pp.HTTPStatusError, match="not JSON"):
        pp.post_json(api.url + "/v1/x", {}, sleep=fake_sleep)
    with pytest.raises(ValueError, match="http"):
        pp.post_json("file:///etc/passwd", {})


def test_model_apis_get_tool_names_of_at_most_64_characters() -> None:
    long_name = "x" * 65
    assert pp.convert_tools([{"name": long_name}], "platform")[0]["name"] == long_name  # the platform allows 128
    for fmt in ("openai_chat", "openai_responses", "anthropic"):
        with pytest.raises(ValueError, match="at most 64"):
            pp.convert_tools([{"name": long_name}], fmt)
    assert pp.convert_tools([{"name": "y" * 64}], "anthropic")[0]["name"] == "y" * 64


@pytest.mark.parametrize("headers,wait", [
    ({"retry-after-ms": "250", "Retry-After": "7"}, 0.25),  # OpenAI's milliseconds first
    ({"Retry-After": "2"}, 2.0),
    ({"retry-after-ms": "soon", "Retry-After": "3"}, 3.0),  # an unreadable one falls back
])
def test_post_json_honours_retry_after_ms_then_retry_after(headers: Dict[str, str], wait: float) -> None:
    """A 429 from a model API: the wait it asks for, in either header, replaces the computed backoff."""
    answers = [(429, headers, {"error": {"message": "slow down"}}), (200, {}, {"ok": True})]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, extra, body = answers.pop(0)
            data = json.dumps(body).encode()
            self.send_response(status)
            for name, value in extra.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    waits: List[float] = []
    try:
        reply = pp.post_json(f"http://127.0.0.1:{server.server_address[1]}/v1/x", {"a": 1}, sleep=waits.append)
    finally:
        server.shutdown()
    assert reply == {"ok": True} and waits == [wait]
