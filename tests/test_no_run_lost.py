"""No run lost: every value an agent returns gets a JSON reply the platform can parse (issue 24).

Each hostile value of tests/hostile_values.py is returned by an agent served by both built-in servers
(asyncio and threads), lenient and strict, over real sockets; and by code mode's ``run()``.  Lenient: 200 with a
body that is valid UTF-8 and JSON a default Python parser reads, that validates, and each change logged
(without the run token).  Strict: the documented status, a 500's detail naming the path.  Plus the last line of
defence: when building the reply fails anyway, the caller still gets a JSON 500, never a closed socket.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Dict, Iterator, List, Tuple

import pytest

import pipelines_port as pp
from conformance.harness.mock_proxy import MockProxy
from tests.hostile_values import FIXES, HOSTILE, keyed
from tests.interop.hosts import http_call

AGENT_TOKEN = "agent-token-hostile-0123456789"
RUN_TOKEN = "run-token-hostile-0123456789abc"
ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def agent(envelope: pp.Envelope) -> Any:
    return HOSTILE[envelope.user_instruction].make()


@pytest.fixture(scope="module")
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[RUN_TOKEN]) as p:
        yield p


@pytest.fixture(scope="module", params=[(server, strict) for server in pp.SERVERS for strict in (False, True)],
                ids=lambda p: f"{p[0]}-{'strict' if p[1] else 'lenient'}")
def served(request: pytest.FixtureRequest) -> Iterator[Tuple[str, bool]]:
    server_kind, strict = request.param
    server = pp.start_server(agent, token=AGENT_TOKEN, server=server_kind, strict=strict)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", strict
    finally:
        server.close(2)


def dispatch(base: str, proxy: MockProxy, case: str) -> Tuple[int, bytes]:
    body = json.dumps({"run_id": 5, "task_id": 6, "odyssey_proxy_url": proxy.url,
                       "input": {"user_instruction": case}}).encode()
    reply = http_call(base, "POST", "/dispatch", {"Authorization": f"Bearer {AGENT_TOKEN}",
                                                  "X-Pipelines-Run-Token": RUN_TOKEN,
                                                  "Content-Type": "application/json"}, body)
    assert reply.headers.get("content-type") == "application/json", reply
    return reply.status, reply.body


def parseable(raw: bytes) -> Dict[str, Any]:
    """What the platform does with the body: strict UTF-8, then JSON with a default parser's limits."""
    text = raw.decode("utf-8")  # strict: a lone surrogate would raise here
    assert not ESCAPED_SURROGATE.search(raw), raw[:200]
    return dict(json.loads(text))


@pytest.mark.parametrize("case", list(HOSTILE))
def test_every_hostile_value_gets_a_json_reply_from_the_built_in_servers(
        served: Tuple[str, bool], proxy: MockProxy, case: str, caplog: pytest.LogCaptureFixture) -> None:
    base, strict = served
    caplog.set_level(logging.WARNING, logger="pipelines_port")
    status, raw = dispatch(base, proxy, case)
    body = parseable(raw)
    if not strict:
        assert status == 200, body
        assert pp.validate_response(body) == [] and body["final_response"]
        if HOSTILE[case].strict_status == 500:  # something was changed: the log says where
            assert any(r.getMessage().startswith("response: ") for r in caplog.records), caplog.text
    else:
        assert status == HOSTILE[case].strict_status, body
        if status == 500:
            assert HOSTILE[case].where in body["detail"], body["detail"]
    assert RUN_TOKEN not in caplog.text and RUN_TOKEN.encode() not in raw


@pytest.mark.parametrize("case", list(HOSTILE))
def test_code_mode_returns_a_body_the_sandbox_can_serialise_or_a_clear_error(case: str, proxy: MockProxy) -> None:
    lenient = pp.code_mode(agent)({"user_instruction": case}, proxy_url=proxy.url, run_token=RUN_TOKEN)
    assert parseable(json.dumps(lenient, ensure_ascii=False, allow_nan=False).encode("utf-8")) == lenient
    assert pp.validate_response(lenient) == []
    run_strict = pp.code_mode(agent, strict=True)
    if HOSTILE[case].strict_status == 200:
        assert pp.validate_response(run_strict({"user_instruction": case}, proxy_url=proxy.url,
                                               run_token=RUN_TOKEN)) == []
    else:
        with pytest.raises(pp.ResponseError) as info:
            run_strict({"user_instruction": case}, proxy_url=proxy.url, run_token=RUN_TOKEN)
        assert HOSTILE[case].where in str(info.value)
        assert any(fix in str(info.value) for fix in FIXES), str(info.value)  # the path and the fix


def test_specific_conversions_are_what_the_documents_say() -> None:
    body, notes = pp.response_envelope({"final_response": "cut \ud83d", "metadata": {
        1: "int", "1": "str", "n": 10 ** 5000, "pair": "\ud83d\ude00"}})
    assert body["final_response"] == "cut \ufffd"
    assert body["metadata"]["1"] == "str" and body["metadata"]["1 (int)"] == "int"  # both kept
    assert body["metadata"]["n"] == "1" + "0" * 5000  # the decimal text, not a number no parser reads
    assert body["metadata"]["pair"] == "\U0001f600"  # a split pair joined, not replaced
    assert any("1 (int)" in n for n in notes) and any("metadata.n" in n for n in notes)
    # the same key rules at the top level; keys that collide once their lone surrogates are replaced all kept
    body, notes = pp.response_envelope(keyed(("final_response", "x"), (1, "int"), ("1", "str"), ("k\ud800", "a"),
                                             ("k\ud801", "b"), ("k\ufffd", "c"), ("metadata", {10 ** 5000: "big"})))
    assert body["1"] == "str" and body["1 (int)"] == "int"
    assert {body["k\ufffd"], body["k\ufffd 2"], body["k\ufffd 3"]} == {"a", "b", "c"}
    assert sum("would collide" in n for n in notes) == 2
    assert body["metadata"] == {"1" + "0" * 5000: "big"}  # the key's plain decimal text


def test_validate_response_reports_lone_surrogates_and_out_of_range_integers() -> None:
    assert any("lone surrogate" in p and p.startswith("final_response")
               for p in pp.validate_response({"final_response": "x \udfff"}))
    assert any("4300 digits" in p and p.startswith("metadata.n")
               for p in pp.validate_response({"final_response": "x", "metadata": {"n": 10 ** 4400}}))
    assert pp.validate_response({"final_response": "x", "metadata": {"n": 10 ** 4000}}) == []


@pytest.mark.parametrize("server_kind", pp.SERVERS)
def test_when_building_the_reply_fails_anyway_the_caller_gets_a_json_500(
        server_kind: str, proxy: MockProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last line of defence: a bug past the builder still answers JSON, never a closed socket."""
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise UnicodeEncodeError("utf-8", "\ud83d", 0, 1, "surrogates not allowed")

    server = pp.start_server(agent, token=AGENT_TOKEN, server=server_kind)
    try:
        monkeypatch.setattr(pp, "decide", broken)
        status, raw = dispatch(f"http://127.0.0.1:{server.server_address[1]}", proxy, "tuple")
    finally:
        server.close(2)
    assert status == 500 and "UnicodeEncodeError" in parseable(raw)["detail"]


def test_wsgi_and_asgi_answer_json_when_building_the_reply_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import io

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")

    app = pp.DispatchApp(agent, no_auth=True)
    monkeypatch.setattr(pp, "decide", broken)
    started: Dict[str, Any] = {}
    wsgi_body = b"".join(app.wsgi({"REQUEST_METHOD": "POST", "PATH_INFO": "/dispatch", "CONTENT_LENGTH": "2",
                                   "wsgi.input": io.BytesIO(b"{}")},
                                  lambda status, headers: started.update(status=status, headers=headers)))
    assert started["status"].startswith("500") and "ValueError" in json.loads(wsgi_body)["detail"]
    sent = []

    async def receive() -> Dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app.asgi({"type": "http", "method": "POST", "path": "/dispatch",
                          "headers": [(b"content-length", b"2")]}, receive, send))
    assert sent[0]["status"] == 500 and "ValueError" in json.loads(sent[1]["body"])["detail"]


TOKEN_KEYED = {"final_response": "done", RUN_TOKEN + "\ud800": 10 ** 5000,
               "metadata": {RUN_TOKEN: float("nan"), (RUN_TOKEN,): 1, "n": {RUN_TOKEN: {1, 2}}}}


def token_keyed_agent(envelope: pp.Envelope) -> Any:
    return TOKEN_KEYED


@pytest.mark.parametrize("server_kind", pp.SERVERS)
def test_what_the_builder_changed_is_logged_without_the_run_token(
        server_kind: str, proxy: MockProxy, caplog: pytest.LogCaptureFixture) -> None:
    """The warnings name paths, and the agent may have put the run token in a key: it never reaches the log."""
    caplog.set_level(logging.DEBUG, logger="pipelines_port")
    server = pp.start_server(token_keyed_agent, token=AGENT_TOKEN, server=server_kind)
    try:
        status, raw = dispatch(f"http://127.0.0.1:{server.server_address[1]}", proxy, "tuple")
    finally:
        server.close(2)
    changes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("response: ")]
    assert status == 200 and len(changes) >= 4, changes  # each change logged, the token redacted from each
    assert sum("[redacted]" in c for c in changes) >= 4, changes  # the key holding the token is named, redacted
    assert RUN_TOKEN not in caplog.text and RUN_TOKEN.encode() not in raw
    caplog.clear()
    body = pp.code_mode(token_keyed_agent)({"user_instruction": "x"}, proxy_url=proxy.url, run_token=RUN_TOKEN)
    assert any(r.getMessage().startswith("response: ") for r in caplog.records)
    assert RUN_TOKEN not in caplog.text and RUN_TOKEN not in json.dumps(body)
    with pytest.raises(pp.ResponseError) as info:
        pp.code_mode(token_keyed_agent, strict=True)({"user_instruction": "x"}, proxy_url=proxy.url,
                                                     run_token=RUN_TOKEN)
    assert "[redacted]" in str(info.value) and RUN_TOKEN not in str(info.value)


class _JsonThatCannotEncode:
    """``pipelines_port``'s ``json`` with an encoder that fails: any failure while encoding a reply."""

    def __init__(self) -> None:
        self.__dict__.update({k: v for k, v in vars(json).items() if not k.startswith("__") and k != "dumps"})

    @staticmethod
    def dumps(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("the encoder broke")

    encode = dumps  # as the module's encoders made once (_COMPACT_JSON, _STRICT_COMPACT_JSON) are called


def _break_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way ``pipelines_port`` encodes JSON fails from now on."""
    broken = _JsonThatCannotEncode()
    monkeypatch.setattr(pp, "json", broken)
    monkeypatch.setattr(pp, "_COMPACT_JSON", broken)
    monkeypatch.setattr(pp, "_STRICT_COMPACT_JSON", broken)


@pytest.mark.parametrize("server_kind", pp.SERVERS)
def test_when_json_encoding_itself_fails_the_servers_still_answer_a_json_500(
        server_kind: str, proxy: MockProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    server = pp.start_server(agent, token=AGENT_TOKEN, server=server_kind)
    try:
        _break_json(monkeypatch)
        status, raw = dispatch(f"http://127.0.0.1:{server.server_address[1]}", proxy, "tuple")
    finally:
        monkeypatch.undo()
        server.close(2)
    assert status == 500 and parseable(raw)["detail"].endswith("RuntimeError"), raw


def test_when_json_encoding_itself_fails_wsgi_asgi_and_code_mode_answer_json(
        proxy: MockProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import io

    app = pp.DispatchApp(agent, token=AGENT_TOKEN)
    request = json.dumps({"run_id": 5, "odyssey_proxy_url": proxy.url, "input": {"user_instruction": "tuple"}})
    _break_json(monkeypatch)
    started: Dict[str, Any] = {}
    wsgi_body = b"".join(app.wsgi({"REQUEST_METHOD": "POST", "PATH_INFO": "/dispatch",
                                   "CONTENT_LENGTH": str(len(request)), "HTTP_AUTHORIZATION": f"Bearer {AGENT_TOKEN}",
                                   "HTTP_X_PIPELINES_RUN_TOKEN": RUN_TOKEN, "wsgi.input": io.BytesIO(request.encode())},
                                  lambda status, headers: started.update(status=status, headers=dict(headers))))
    assert started["status"].startswith("500") and started["headers"]["Content-Type"] == "application/json"
    assert "RuntimeError" in json.loads(wsgi_body)["detail"]
    for headers in ([(b"authorization", f"Bearer {AGENT_TOKEN}".encode()),  # the agent ran: encoding its reply failed
                     (b"x-pipelines-run-token", RUN_TOKEN.encode())],
                    []):  # refused before any agent ran (401): encoding the refusal failed
        sent: List[Dict[str, Any]] = []

        async def receive() -> Dict[str, Any]:
            return {"type": "http.request", "body": request.encode(), "more_body": False}

        async def send(message: Dict[str, Any], sent: List[Dict[str, Any]] = sent) -> None:
            sent.append(message)

        asyncio.run(app.asgi({"type": "http", "method": "POST", "path": "/dispatch",
                              "headers": [(b"content-length", str(len(request)).encode()), *headers]}, receive, send))
        assert sent[0]["status"] == 500 and (b"content-type", b"application/json") in sent[0]["headers"]
        assert "RuntimeError" in json.loads(sent[1]["body"])["detail"]
    with pytest.raises(pp.ResponseError) as info:  # code mode: a clear error, never a half-built dict
        pp.code_mode(agent)({"user_instruction": "tuple"}, proxy_url=proxy.url, run_token=RUN_TOKEN)
    assert "cannot be sent as JSON: RuntimeError: the encoder broke" in str(info.value)
