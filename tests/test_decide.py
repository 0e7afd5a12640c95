"""The one inbound decision (§2 order of handling) from the shared vectors: pure, then over a real socket.

``conformance/checker/vectors/dispatch.json`` is the single source of these cases: ``pp.decide``
must give each expected decision with no I/O, and the http.server adapter must send the
same status for the same bytes on the wire.
"""

from __future__ import annotations

import json
import socket
from typing import Any, Dict, Iterator, Optional

import pytest

import pipelines_port as pp
from conformance.checker import vectorlib

DOC = vectorlib.load("dispatch")
CASES = DOC["cases"]


def ids(cases: Any) -> Any:
    return [c["name"] for c in cases]


def endpoint_for(case: Dict[str, Any]) -> pp.Endpoint:
    return pp.Endpoint(**case.get("endpoint", {}))


def check_reply(reply: pp.HttpReply, expect: Dict[str, Any]) -> None:
    assert reply.status == expect["status"], reply
    payload = json.loads(reply.body)
    if "body" in expect:
        assert payload == expect["body"]
    for key, value in expect.get("body_has", {}).items():
        assert payload[key] == value
    headers = {k.lower(): v for k, v in reply.headers}
    for name, value in expect.get("headers", {}).items():
        assert headers[name.lower()] == value
    detail = str(payload.get("detail", "")).lower()
    if reply.status >= 400:
        assert detail and "\n" not in detail and "traceback" not in detail
    for word in expect.get("detail_mentions", []):
        assert word.lower() in detail, (word, detail)
    for word in expect.get("detail_never_mentions", []):
        assert word.lower() not in detail, (word, detail)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_decide_vectors(case: Dict[str, Any]) -> None:
    body = case["body_read"]
    decision = pp.decide(endpoint_for(case), case["method"], case["target"], case["headers"],
                         None if body is None else body.encode(), expected_token=case["expected_token"])
    expect = case["expect"]
    assert decision.action == expect["action"], decision
    if expect["action"] == "reply":
        assert decision.reply is not None
        check_reply(decision.reply, expect)
    elif expect["action"] == "probe":
        assert decision.proxy_url == expect["proxy_url"]
    else:
        assert decision.envelope is not None
        for field, value in expect["fields"].items():
            assert getattr(decision.envelope, field) == value, field


def test_each_refusal_is_an_error_class_with_its_status() -> None:
    """One table: every inbound refusal's status comes from its error class."""
    table = {pp.RequestError: 400, pp.EnvelopeError: 400, pp.AuthError: 401, pp.NotFoundError: 404,
             pp.LengthRequiredError: 411, pp.BodyTooLargeError: 413, pp.AgentError: 500, pp.ResponseError: 500,
             pp.MisconfiguredError: 503, pp.ShuttingDownError: 503, pp.RunTimeoutError: 504}
    for error_class, status in table.items():
        reply = pp.error_reply(error_class("why"))
        assert reply.status == status and json.loads(reply.body) == {"detail": "why"}
    allowed = pp.error_reply(pp.MethodNotAllowedError("no", ["POST"]))
    assert allowed.status == 405 and ("Allow", "POST") in allowed.headers
    other = pp.error_reply(KeyError("k"))  # not ours: a 500 describing the type
    assert other.status == 500 and json.loads(other.body) == {"detail": "KeyError: 'k'"}


def test_request_body_length_is_the_one_framing_rule() -> None:
    assert pp.request_body_length({"content-length": "10"}, 100) == 10
    assert pp.request_body_length({}, 100) == 0
    assert pp.request_body_length({"content-length": "101"}, 100) is None
    assert pp.request_body_length({"content-length": "1e3"}, 100) is None
    assert pp.request_body_length({"content-length": "5", "transfer-encoding": "chunked"}, 100) is None


# -- the same cases over a socket: the http.server adapter carries the decision out ----------------

AGENT_TOKEN = "s3cret-agent-token"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Any]]:
    made: Dict[str, Any] = {}
    try:
        yield made
    finally:
        for server in made.values():
            server.close(1)


def server_for(servers: Dict[str, Any], case: Dict[str, Any]) -> Any:
    endpoint = case.get("endpoint", {})
    key = json.dumps([endpoint, case["expected_token"]], sort_keys=True)
    if key not in servers:
        options: Dict[str, Any] = {"max_body": endpoint.get("max_body", pp.DEFAULT_MAX_BODY_BYTES),
                                   "auth_header": endpoint.get("auth_header", "Authorization"),
                                   "tools_schema": endpoint.get("tools_schema")}
        if case["expected_token"] is None:
            options["no_auth"] = True
        elif case["expected_token"] == "":
            options["token_env"] = "PIPELINES_PORT_TEST_UNSET_TOKEN_VARIABLE"
        else:
            options["token"] = case["expected_token"]
        # The agent never runs here: a "run" decision would reach the proxy. It answers from the envelope.
        servers[key] = pp.start_server(lambda env: f"ran for run {env.run_id}", **options)
    return servers[key]


def send(port: int, case: Dict[str, Any]) -> bytes:
    head = f"{case['method']} {case['target']} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in case["headers"].items())
    body: Optional[str] = case["body_read"]
    data = (head + "\r\n").encode() + (body or "").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)  # a short body ends here, as a client that gave up would
        chunks = []
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


WIRE = [c for c in CASES if c["expect"]["action"] == "reply"]


@pytest.mark.parametrize("case", WIRE, ids=ids(WIRE))
def test_decide_vectors_over_a_socket(case: Dict[str, Any], servers: Dict[str, Any]) -> None:
    server = server_for(servers, case)
    raw = send(server.server_address[1], case)
    status = int(raw.split(b" ", 2)[1])
    assert status == case["expect"]["status"], raw[:300]
    head, _, body = raw.partition(b"\r\n\r\n")
    if body:
        payload = json.loads(body.split(b"HTTP/1.1")[0])
        if "body" in case["expect"]:
            assert payload == case["expect"]["body"]
        for word in case["expect"].get("detail_mentions", []):
            assert word.lower() in str(payload.get("detail", "")).lower()


def _loads_outcome(loads: Any, data: bytes) -> Any:
    try:
        return "ok", loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        return type(exc).__name__, str(exc)


BODIES = [b'{"a": 1}', b"{}", b"{", b'{"a": "\xed\xa0\x80"}', b'{"a": "\xff"}', b'{"a": "caf\xc3\xa9"}',
          b'\xef\xbb\xbf{"a": 1}', '{"a": 1}'.encode("utf-16"), '{"a": 1}'.encode("utf-16-le"),
          '{"a": 1}'.encode("utf-32"), '{"a": 1}'.encode("utf-32-le"), b"{\x00", b'{"a": NaN}', b"[1]", b'"x"',
          b"1", b"", b" {}", b'{"a": "\\ud800"}', b"{\x00\x00\x00"]


@pytest.mark.parametrize("data", BODIES, ids=[repr(b)[:40] for b in BODIES])
def test_json_bodies_read_as_json_loads_reads_them(data: bytes) -> None:
    """The shortcut past json.loads's encoding sniff gives its result, or its error, for every body."""
    assert _loads_outcome(pp._json_from_bytes, data) == _loads_outcome(json.loads, data)
