"""Run every JSON vector in conformance/checker/vectors/ against pipelines_port.

The vectors are the single source of truth for contract cases; a port in
another language loads the same files (see conformance/checker/vectors/README.md).
"""

from __future__ import annotations

import json
import re
import types
from typing import Any, Dict, List

import pytest

import pipelines_port as pp
from conformance.checker import vectorlib
from conformance.harness.mock_proxy import MockProxy
from tests.conftest import Driver, FakeSleep

ERROR_KINDS = {
    "envelope": pp.EnvelopeError,
    "proxy": pp.ProxyError,
    "proxy_request": pp.ProxyRequestError,
    "stale_run_token": pp.StaleRunTokenError,
    "response": pp.ResponseError,
}


def ids(cases: List[Dict[str, Any]]) -> List[str]:
    return [c["name"] for c in cases]


def same_json(got: Any, wanted: Any) -> bool:
    """Equal as JSON values, types included (17 is not "17", 1 is not true)."""
    return json.dumps(got, sort_keys=True) == json.dumps(wanted, sort_keys=True)


def check_error(exc: BaseException, expect: Dict[str, Any]) -> None:
    kind = ERROR_KINDS[expect["error"]]
    assert isinstance(exc, kind), f"expected {kind.__name__}, got {type(exc).__name__}: {exc}"
    if expect["error"] == "proxy":
        assert not isinstance(exc, (pp.StaleRunTokenError, pp.ProxyRequestError, pp.ProxyTransportError))
    for key in ("status_code", "error_class"):
        if key in expect:
            assert getattr(exc, key) == expect[key]
    for text in expect.get("mentions", []) + expect.get("our_mentions", []):  # ours: pipelines_port's own wording
        assert text in str(exc), f"{text!r} not in {str(exc)!r}"
    for text in expect.get("never_mentions", []):
        assert text not in str(exc) and text not in repr(exc)
        assert text not in json.dumps(getattr(exc, "body", None), default=str)


# -- envelope (§2, §5) -------------------------------------------------------------

ENVELOPE = vectorlib.cases("envelope")


def build_envelope(case: Dict[str, Any]) -> pp.Envelope:
    if case["from"] == "dispatch":
        body = case["body_text"] if "body_text" in case else case["body"]
        return pp.Envelope.from_dispatch(body, case.get("headers", {}))
    if case["from"] == "run":
        return pp.Envelope.from_run(
            case["task_input"], proxy_url=case["proxy_url"], run_token=case["run_token"], environ=case["environ"]
        )
    return pp.Envelope.from_env(case["environ"])


def field(envelope: pp.Envelope, path: str) -> Any:
    value: Any = envelope
    for part in path.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("case", ENVELOPE, ids=ids(ENVELOPE))
def test_envelope_vectors(case: Dict[str, Any]) -> None:
    expect = case["expect"]
    if "error" in expect:
        with pytest.raises(pp.PipelinesError) as info:
            build_envelope(case)
        check_error(info.value, expect)
        return
    envelope = build_envelope(case)
    for path, wanted in expect["fields"].items():
        got = field(envelope, path)
        assert same_json(got, wanted), f"{path}: {got!r} != {wanted!r}"


# -- labels, names, inbound checks ---------------------------------------------------

LABELS = vectorlib.cases("actor_labels")


@pytest.mark.parametrize("case", LABELS, ids=ids(LABELS))
def test_actor_label_vectors(case: Dict[str, Any]) -> None:
    if "error" in case["expect"]:
        with pytest.raises(pp.ProxyError) as info:
            pp.validate_actor_label(case["label"])
        check_error(info.value, case["expect"])
    else:
        assert pp.validate_actor_label(case["label"]) == case["expect"]["label"]


NAMES = vectorlib.cases("tool_names")


@pytest.mark.parametrize("case", NAMES, ids=ids(NAMES))
def test_tool_name_vectors(case: Dict[str, Any]) -> None:
    if case["valid"]:
        assert pp.validate_tool_name(case["tool_name"]) == case["tool_name"]
    else:
        with pytest.raises(pp.ProxyRequestError):
            pp.validate_tool_name(case["tool_name"])


INBOUND = vectorlib.cases("inbound")


@pytest.mark.parametrize("case", INBOUND, ids=ids(INBOUND))
def test_inbound_vectors(case: Dict[str, Any]) -> None:
    if case["kind"] == "ping":
        assert pp.is_ping(case["body"]) is case["expect"]["is_ping"]
    else:
        got = pp.check_credential(case["headers"], case["expected"], header_name=case["header_name"])
        assert got is case["expect"]["ok"]


# -- proxy replies (§3.2, §3.3): pure decision, then the same over a socket through each driver ------------

REPLIES_DOC = vectorlib.load("proxy_replies")
REPLIES = REPLIES_DOC["cases"]


def reply_spec(case: Dict[str, Any]) -> Dict[str, Any]:
    spec: Dict[str, Any] = {"status": case["status"], "headers": dict(case["headers"])}
    if "body_json" in case:
        spec["json"] = case["body_json"]
    elif "body_text" in case:
        spec["body"] = case["body_text"]
    else:
        spec["body"] = b""
    return spec


def raw_body(case: Dict[str, Any]) -> bytes:
    if "body_json" in case:
        return json.dumps(case["body_json"]).encode()
    return case.get("body_text", "").encode()


@pytest.mark.parametrize("case", REPLIES, ids=ids(REPLIES))
def test_proxy_reply_vectors_pure(case: Dict[str, Any]) -> None:
    """The interpretation, then the retry policy's first step over it: what a driver does next."""
    outcome = pp.interpret_reply(
        case["status"], case["headers"], raw_body(case),
        tool_name=REPLIES_DOC["tool_name"], run_token=REPLIES_DOC["run_token"],
    )
    step = pp.RetryState(pp.RetryPolicy()).step(outcome)
    expect = case["expect"]
    if "value" in expect:
        assert outcome.kind == "value" and step.action == "return"
        assert same_json(step.value, expect["value"])
    elif expect.get("retry"):
        assert outcome.kind == "retry" and step.action == "retry"
        if expect["retry_after_s"] is None:
            assert outcome.retry_after is None
        else:
            assert outcome.retry_after == pytest.approx(expect["retry_after_s"], abs=0.01)
            assert step.wait_s == pytest.approx(expect["retry_after_s"], abs=0.01)
    else:
        assert step.action == "raise"
        check_error(step.error, expect)


@pytest.mark.parametrize("case", REPLIES, ids=ids(REPLIES))
def test_proxy_reply_vectors_over_socket(case: Dict[str, Any], fake_sleep: FakeSleep, driver: Driver) -> None:
    token = REPLIES_DOC["run_token"]
    client = pp.ProxyClient(timeout=10, rate_per_minute=0, sleep=fake_sleep)
    with MockProxy(tokens=[token]) as proxy:
        env = pp.Envelope.from_dispatch({"odyssey_proxy_url": proxy.url}, {"X-Pipelines-Run-Token": token})
        proxy.script(REPLIES_DOC["tool_name"], [reply_spec(case), {"response": "after-retry"}])
        expect = case["expect"]
        if expect.get("retry"):
            assert driver.call(client, env, REPLIES_DOC["tool_name"], {}) == "after-retry"
            calls = proxy.calls()
            assert len(calls) == 2
            assert calls[0].idempotency_key == calls[1].idempotency_key
            if expect["retry_after_s"] is not None:
                assert fake_sleep.waits == [pytest.approx(expect["retry_after_s"], abs=0.01)]
        elif "value" in expect:
            got = driver.call(client, env, REPLIES_DOC["tool_name"], {})
            assert same_json(got, expect["value"])
            assert len(proxy.calls()) == 1
        else:
            with pytest.raises(pp.ProxyError) as info:
                driver.call(client, env, REPLIES_DOC["tool_name"], {})
            check_error(info.value, expect)
            assert len(proxy.calls()) == 1, "terminal errors must not be retried"
    client.close()


# -- the request a call sends (§3.1, §3.5) and trace events (§3.4) ----------------------

REQUESTS_DOC = vectorlib.load("proxy_requests")
REQUESTS = REQUESTS_DOC["cases"]


def run_token_sent(recorded: Any, token: str) -> bool:
    """The run token in exactly one of ``Authorization: Bearer <t>`` and ``X-Pipelines-Run-Token: <t>``."""
    sent = [name for name in ("authorization", "x-pipelines-run-token") if name in recorded.headers]
    return len(sent) == 1 and recorded.run_token == token and (sent != ["authorization"] or recorded.bearer == token)


def check_request(recorded: Any, proxy: MockProxy, expect: Dict[str, Any], token: str) -> None:
    if "path_suffix" in expect:
        assert recorded.path == proxy.base_path + expect["path_suffix"]
    if "body_json" in expect:
        assert recorded.json == expect["body_json"]
    for name, value in expect.get("headers", {}).items():
        assert recorded.headers.get(name.lower()) == value.replace("{run_token}", token)
    for name in expect.get("headers_absent", []):
        assert name.lower() not in recorded.headers
    if expect.get("run_token_sent"):
        assert run_token_sent(recorded, token)
    if recorded.kind == "tools":  # §3.1's key is per tool call; a trace event need not carry one
        assert re.fullmatch(r"[0-9a-f-]{36}", recorded.idempotency_key or "")


@pytest.mark.parametrize("case", REQUESTS, ids=ids(REQUESTS))
def test_proxy_request_vectors(case: Dict[str, Any], fake_sleep: FakeSleep, driver: Driver) -> None:
    token = REQUESTS_DOC["run_token"]
    client = pp.ProxyClient(rate_per_minute=0, sleep=fake_sleep)
    with MockProxy(tokens=[token]) as proxy:
        env = pp.Envelope.from_dispatch({"odyssey_proxy_url": proxy.url}, {"X-Pipelines-Run-Token": token})
        expect = case["expect"]
        if "error" in expect:
            with pytest.raises(pp.ProxyRequestError) as info:
                driver.call(client, env, case["tool_name"], case["args"], actor=case.get("actor"))
            check_error(info.value, expect)
            assert proxy.requests == [], "a refused call must send nothing"
        else:
            driver.call(client, env, case["tool_name"], case["args"], actor=case.get("actor"))
            (recorded,) = proxy.requests
            check_request(recorded, proxy, expect, token)
    client.close()


TRACES_DOC = vectorlib.load("trace_events")
TRACES = TRACES_DOC["cases"]
ISO_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|\+00:00)")


@pytest.mark.parametrize("case", TRACES, ids=ids(TRACES))
def test_trace_event_vectors(case: Dict[str, Any], fake_sleep: FakeSleep, driver: Driver) -> None:
    token = TRACES_DOC["run_token"]
    client = pp.ProxyClient(rate_per_minute=0, sleep=fake_sleep)
    with MockProxy(tokens=[token]) as proxy:
        env = pp.Envelope.from_dispatch({"odyssey_proxy_url": proxy.url}, {"X-Pipelines-Run-Token": token})

        def post() -> Any:
            if case["kind"] == "trace":
                return driver.trace(client, env, case["event_type"], case["payload"])
            extra = {k: case[k] for k in ("reason", "payload_preview") if k in case}
            return driver.handoff(case["from"], case["to"], envelope=env, client=client, **extra)

        expect = case["expect"]
        if "error" in expect:
            with pytest.raises(pp.ProxyRequestError) as info:
                post()
            check_error(info.value, expect)
            assert proxy.requests == []
        elif expect.get("dropped"):
            assert post() is None
            assert proxy.requests == []
        else:
            reply = post()
            assert reply == {"accepted": True, "sequence": 1}
            (recorded,) = proxy.requests
            check_request(recorded, proxy, expect, token)
            for key, value in expect.get("body_has", {}).items():
                assert recorded.json[key] == value
            if expect.get("stamped"):
                assert ISO_UTC.fullmatch(recorded.json["__occurred_at"])
    client.close()


# -- response envelope (§4) ------------------------------------------------------------

BUILD = vectorlib.cases("build_response")


@pytest.mark.parametrize("case", BUILD, ids=ids(BUILD))
def test_build_response_vectors(case: Dict[str, Any]) -> None:
    inp = case["input"]
    value = types.SimpleNamespace(**inp["object"]) if "object" in inp else inp["value"]
    kwargs = {k: inp[k] for k in ("messages", "metadata", "strict") if k in inp}
    expect = case["expect"]
    if "error" in expect:
        with pytest.raises(pp.ResponseError) as info:
            pp.build_response(value, **kwargs)
        check_error(info.value, expect)
    else:
        body = pp.build_response(value, **kwargs)
        assert body == expect["body"]
        assert [p for p in pp.validate_response(body) if not p.startswith("warning:")] == []
        json.dumps(body, allow_nan=False)  # always strict JSON


TURN_REPLY = vectorlib.cases("turn_reply")


@pytest.mark.parametrize("case", TURN_REPLY, ids=ids(TURN_REPLY))
def test_turn_reply_vectors(case: Dict[str, Any]) -> None:
    """What a dispatch sends for what the agent returned, multi-turn or not (``response_envelope(multi_turn=...)``,
    the one place every server and ``run()`` build their bodies): the exact body, or the refusal."""
    inp = case["input"]
    expect = case["expect"]
    if "error" in expect:
        with pytest.raises(pp.ResponseError) as info:
            pp.response_envelope(inp["value"], multi_turn=inp["multi_turn"], strict=inp.get("strict", False))
        check_error(info.value, expect)
        return
    body, _ = pp.response_envelope(inp["value"], multi_turn=inp["multi_turn"], strict=inp.get("strict", False))
    assert same_json(body, expect["body"]), body
    json.dumps(body, allow_nan=False)


VALIDATE = vectorlib.cases("validate_response")


@pytest.mark.parametrize("case", VALIDATE, ids=ids(VALIDATE))
def test_validate_response_vectors(case: Dict[str, Any]) -> None:
    problems = pp.validate_response(case["body"])
    errors = {vectorlib.path_of(p) for p in problems if not p.startswith("warning:")}
    warnings = {vectorlib.path_of(p) for p in problems if p.startswith("warning:")}
    assert errors == set(case["expect"]["error_paths"]), problems
    assert warnings == set(case["expect"]["warning_paths"]), problems
    assert all(isinstance(p, str) and ": " in p for p in problems)


# -- the markers for what only pipelines_port holds itself to -------------------------------

def test_the_stricter_than_contract_marks_and_our_mentions_sit_on_error_cases_only() -> None:
    marked = {}
    for stem in ("tool_names", "proxy_requests", "build_response", "envelope", "trace_events"):
        for case in vectorlib.cases(stem):
            expect = case.get("expect", {})
            is_error = "error" in expect or case.get("valid") is False
            if case.get("stricter_than_contract"):
                assert is_error, case["name"]
                marked.setdefault(stem, []).append(case["name"])
            if "our_mentions" in expect:
                assert is_error and expect["our_mentions"], case["name"]
    assert marked["build_response"] == ["strict: a blank string is refused"]
    assert marked["proxy_requests"] == ["arguments that are an array are refused", "arguments that are a string are refused",
                                        "an invalid tool name is refused", "a path-traversal tool name is refused",
                                        "arguments over the 1 MiB request cap are refused"]
    assert marked["trace_events"] == ["an unknown event type is refused", "a path-like event type is refused",
                                      "a payload that is not an object is refused"]
    assert len(marked["tool_names"]) == sum(1 for c in vectorlib.cases("tool_names") if not c["valid"])
    (missing_url,) = [c for c in ENVELOPE if c["name"] == "missing proxy URL is named"]
    assert missing_url["expect"]["mentions"] == ["proxy URL"]  # all the contract asks; the rest is ours


def test_every_vector_names_a_rule_of_the_contract_and_so_a_level() -> None:
    """Each case carries ``rule``: an id of CONTRACT.md (via conformance/checker/rules.json), which gives its level."""
    from conformance.checker import rules

    levels: Dict[str, int] = {}
    for path in sorted(vectorlib.VECTORS_DIR.glob("*.json")):
        for case in vectorlib.cases(path.stem):
            rule = rules.rule(case["rule"])  # a KeyError naming it otherwise
            levels[rule.level] = levels.get(rule.level, 0) + 1
            if rule.id.startswith("kit-"):  # a kit choice: a port mirroring our API holds itself to it
                assert rule.level == "MAY"
    assert set(levels) == {"MUST", "SHOULD", "MAY"} and sum(levels.values()) > 250
