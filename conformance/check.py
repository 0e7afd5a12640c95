"""``python3 -m conformance check URL``: does the agent endpoint at URL speak the contract?

    python3 -m conformance check URL [--token T] [--auth-header NAME] [--only CASE[,CASE]]
                                     [--skip CASE[,CASE]] [--json OUT|-] [--list] [--timeout SECONDS] [--workers N]

URL is a port's dispatch endpoint serving **the conformance agent**
(conformance/README.md).  The checker plays the platform: it starts a mock
per-run proxy on 127.0.0.1, posts dispatch envelopes pointing at it (one fresh
run and run token per case), scripts the proxy's replies, and compares what the
agent reports and what reached the proxy with CONTRACT.md.

Each case prints one line to stderr as it finishes.  The report ends with
``N passed, N failed, N skipped``.  Exit status: 0 when no case failed, 1 when
one did, 2 for bad usage or an unreachable endpoint.  Tokens are never printed.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import hashlib
import json
import re
import secrets
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import pipelines_port as pp

from . import vectorlib
from .cli import prog
from .dispatcher import Dispatcher, DispatchError, Reply, Run, envelope_body, envelope_headers
from .mock_proxy import MockProxy, ProxyRun

__all__ = ["Case", "Result", "all_cases", "select", "run_cases", "main"]

ISO_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|\+00:00)")
TYPED_DETAIL = re.compile(r"^[A-Za-z_][\w.]*: ", re.M)  # "ValueError: boom", "Error: boom"
MIN_BACKOFF_S = 0.1  # the least wait that still counts as a backoff (§3.3)
ENVELOPE_KEYS = ("tool_name", "source", "latency_ms", "matched_rule_index", "validation")
AGENT_SPEC = "README: the conformance agent"
RETRY_NOW = {"Retry-After": "0"}  # keeps the suite fast; the vectors check real waits
_MISSING = object()


# ---------------------------------------------------------------------------
# Cases and results
# ---------------------------------------------------------------------------


class Failed(Exception):
    """A case found the port off-contract: what was expected, and what came back."""

    def __init__(self, expected: str, got: str) -> None:
        super().__init__(f"expected {expected}, got {got}")
        self.expected = expected
        self.got = got


class Skipped(Exception):
    """A case that does not apply to this port or this run of the checker."""


class Case(NamedTuple):
    id: str
    section: str  # the CONTRACT section it checks (or the agent spec)
    title: str
    run: Callable[[Check], None]


class Result(NamedTuple):
    case: Case
    status: str  # "pass" | "fail" | "skip"
    expected: Optional[str] = None
    got: Optional[str] = None
    note: Optional[str] = None
    duration_ms: float = 0.0

    def to_json(self) -> Dict[str, Any]:
        return {"id": self.case.id, "section": self.case.section, "title": self.case.title, "status": self.status,
                "expected": self.expected, "got": self.got, "note": self.note,
                "duration_ms": round(self.duration_ms, 1)}


def show(value: Any, limit: int = 300) -> str:
    """Compact JSON of ``value``, cut to ``limit`` characters."""
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: types matter (17 is not "17", 1 is not true), 1 and 1.0 are one number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def strings_in(value: Any) -> str:
    """Every string inside a JSON value, one per line (to look for words in an error body)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return "\n".join(strings_in(k) + "\n" + strings_in(v) for k, v in value.items())
    if isinstance(value, list):
        return "\n".join(strings_in(v) for v in value)
    return ""


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------
# The mock platform: one proxy, one dispatcher, every secret it handed out
# ---------------------------------------------------------------------------


class Platform:
    """What the checker shares between cases: the mock proxy, the dispatcher and the secrets."""

    def __init__(self, dispatcher: Dispatcher, proxy: MockProxy, agent_token: Optional[str]) -> None:
        self.dispatcher = dispatcher
        self.proxy = proxy
        self.agent_token = agent_token
        self._secrets: List[Tuple[str, str]] = [("the agent token", agent_token)] if agent_token else []
        self._lock = threading.Lock()
        self._ids = iter(range(1000, 10 ** 9))
        self.bodies_seen = 0
        self.leaks: List[str] = []

    def new_run(self, **body_ids: Any) -> Tuple[Run, ProxyRun]:
        """A fresh run on the mock proxy, its run token registered as a secret."""
        proxy_run = self.proxy.new_run()
        with self._lock:
            number = next(self._ids)
            self._secrets.append(("a run token", proxy_run.token))
        ids = {"run_id": number, "task_id": number + 1, "agent_id": 8, "run_token_jti": uuid.uuid4().hex}
        ids.update(body_ids)
        return Run(run_token=proxy_run.token, proxy_url=proxy_run.url, **ids), proxy_run

    def leak_in(self, reply: Reply, case_id: str) -> Optional[str]:
        """Which secret ``reply`` shows in its body or headers, if any (remembered for the final scan)."""
        headers = "\n".join(reply.headers.values()).encode("utf-8", "replace")
        with self._lock:
            self.bodies_seen += 1
            for what, secret in self._secrets:
                if secret.encode() in reply.body or secret.encode() in headers:
                    self.leaks.append(f"{case_id}: HTTP {reply.status} showed {what}")
                    return what
        return None

    def redact(self, text: str) -> str:
        with self._lock:
            for _, secret in self._secrets:
                text = text.replace(secret, "[redacted]")
        return text


class Ran(NamedTuple):
    """One dispatched run: the platform's view of it and the proxy's."""

    run: Run
    proxy: ProxyRun
    reply: Reply


class Check:
    """What a case function gets: the platform, plus helpers that fail the case with a clear message."""

    def __init__(self, platform: Platform, case: Case) -> None:
        self.platform = platform
        self.case = case

    # -- talking to the endpoint ---------------------------------------------------------

    def post(self, body: Any, headers: Mapping[str, str]) -> Reply:
        """POST ``body`` with exactly these headers (plus framing); every reply is scanned for secrets."""
        try:
            reply = self.platform.dispatcher.post(body, headers=headers)
        except DispatchError as exc:
            raise Failed("a reply", f"none: {exc}") from None
        self.scan(reply)
        return reply

    def scan(self, reply: Reply) -> None:
        leaked = self.platform.leak_in(reply, self.case.id)
        if leaked:
            raise Failed("no run token or agent token in any response",
                         f"HTTP {reply.status} whose body or headers show {leaked}")

    def credential(self, token: Optional[str] = None) -> Dict[str, str]:
        return self.platform.dispatcher.credential(token)

    def need_token(self) -> str:
        if not self.platform.agent_token:
            raise Skipped("no --token given: inbound auth is not checked")
        return self.platform.agent_token

    def new_run(self, **body_ids: Any) -> Tuple[Run, ProxyRun]:
        return self.platform.new_run(**body_ids)

    def dispatch(self, run: Run, body: Any = None, *, header_only: bool = False,
                 headers: Optional[Mapping[str, str]] = None, credential: bool = True, run_headers: bool = True,
                 **fields: Any) -> Reply:
        """A dispatch of ``run`` as the platform sends it (see :mod:`conformance.dispatcher`).

        ``body`` replaces the built body; ``headers`` add to the run's headers.
        """
        sent: Dict[str, str] = envelope_headers(run) if run_headers else {}
        if body is None:
            body = envelope_body(run, header_only=header_only, **fields)
        sent.update(headers or {})
        if credential:
            sent.update(self.credential())
        return self.post(body, sent)

    def script(self, steps: List[Any], *, setup: Optional[Callable[[ProxyRun], None]] = None,
               ran: Optional[Tuple[Run, ProxyRun]] = None) -> Ran:
        """Dispatch a script (a fresh run unless ``ran`` is given); ``setup`` scripts the proxy first."""
        run, proxy_run = ran or self.new_run()
        if setup is not None:
            setup(proxy_run)
        reply = self.dispatch(run, user_instruction=compact({"steps": steps}))
        return Ran(run, proxy_run, reply)

    # -- reading what came back -------------------------------------------------------------

    def response(self, reply: Reply, what: str = "the agent's response") -> Dict[str, Any]:
        """The 200 body, checked against §4 and the seed schema (pp.validate_response)."""
        if reply.status != 200:
            raise Failed(f"HTTP 200 with {what}", describe(reply))
        if not isinstance(reply.json, dict):
            raise Failed(f"a JSON object body with {what} (CONTRACT §4)", describe(reply))
        problems = [p for p in pp.validate_response(reply.json) if not p.startswith("warning:")]
        if problems:
            raise Failed("a response body valid under §4 and seeds/002 (agent-response.json)",
                         "; ".join(problems[:3]))
        return reply.json

    def results(self, ran: Ran, count: int) -> List[Any]:
        """The script's ``results`` (exactly ``count`` of them) from ``final_response``."""
        body = self.response(ran.reply, "the script's results")
        try:
            results = json.loads(body["final_response"])["results"]
        except (ValueError, KeyError, TypeError):
            raise Failed(f'final_response holding {{"results": [...]}} ({AGENT_SPEC})',
                         show(body["final_response"])) from None
        if not isinstance(results, list) or len(results) != count:
            raise Failed(f"{count} result(s), one per step ({AGENT_SPEC})", show(results))
        return results

    def outcome(self, ran: Ran) -> Any:
        """The only result of a one-step script."""
        return self.results(ran, 1)[0]

    def echo(self, reply: Reply) -> Dict[str, Any]:
        """The envelope the agent echoed (echo mode)."""
        body = self.response(reply, "the echoed envelope")
        try:
            echoed = json.loads(body["final_response"])["envelope"]
        except (ValueError, KeyError, TypeError):
            raise Failed(f'final_response holding {{"envelope": {{...}}}} ({AGENT_SPEC}, echo mode)',
                         show(body.get("final_response"))) from None
        if not isinstance(echoed, dict):
            raise Failed(f"the echoed envelope as an object ({AGENT_SPEC})", show(echoed))
        return echoed


def describe(reply: Reply) -> str:
    """A reply in one short line: status and body."""
    body = show(reply.json) if reply.json is not None else repr(reply.text[:200])
    return f"HTTP {reply.status} {body}"


# -- outcome and request expectations -----------------------------------------------------------


def expect_ok(outcome: Any, value: Any = _MISSING, what: str = "the call") -> Any:
    if not (isinstance(outcome, dict) and outcome.get("ok") is True and "value" in outcome):
        raise Failed(f"{what} to succeed", show(outcome))
    if value is not _MISSING and not same_json(outcome["value"], value):
        raise Failed(f"{what} to give {show(value)}", show(outcome["value"]))
    return outcome["value"]


def expect_error(outcome: Any, kind: str, status_code: Any = _MISSING, error_class: Any = _MISSING,
                 what: str = "the call") -> None:
    error = outcome.get("error") if isinstance(outcome, dict) and outcome.get("ok") is False else None
    wanted = f"{what} to fail with kind {kind!r}"
    if status_code is not _MISSING:
        wanted += f", status_code {show(status_code)}"
    if error_class is not _MISSING:
        wanted += f", error_class {show(error_class)}"
    if not isinstance(error, dict) or error.get("kind") != kind:
        raise Failed(wanted, show(outcome))
    if status_code is not _MISSING and error.get("status_code") != status_code:
        raise Failed(wanted, show(outcome))
    if error_class is not _MISSING and error.get("error_class") != error_class:
        raise Failed(wanted, show(outcome))


def expect_requests(proxy_run: ProxyRun, count: int, why: str) -> List[Any]:
    """The run's requests, exactly ``count`` of them."""
    requests = list(proxy_run.requests)
    if len(requests) != count:
        raise Failed(f"{count} request(s) at the proxy ({why})", f"{len(requests)}: {paths(proxy_run, requests)}")
    return requests


def expect_nothing_sent(proxy_run: ProxyRun) -> None:
    if proxy_run.requests:
        raise Failed("nothing sent: refused locally, before any request",
                     f"{len(proxy_run.requests)} request(s): {paths(proxy_run, proxy_run.requests)}")


def paths(proxy_run: ProxyRun, requests: Sequence[Any]) -> str:
    shown = [f"{r.path[len(proxy_run.base_path):] or r.path} -> {r.reply_status}" for r in requests[:6]]
    return ", ".join(shown) + (" …" if len(requests) > 6 else "")


def expect_same_key(requests: Sequence[Any], why: str) -> None:
    keys = [r.idempotency_key for r in requests]
    if not keys[0] or len(set(keys)) != 1:
        raise Failed(f"one Idempotency-Key on every attempt ({why})", f"keys {show(keys)}")


def is_uuid(text: Optional[str]) -> bool:
    try:
        uuid.UUID(text or "")
        return True
    except ValueError:
        return False


def expect_run_token(request: Any, run_token: str) -> None:
    """§3.1: the run token in exactly one of ``Authorization: Bearer <t>`` and ``X-Pipelines-Run-Token: <t>``."""
    wanted = "the run token in exactly one of Authorization: Bearer <t> and X-Pipelines-Run-Token: <t>"
    auth = request.headers.get("authorization")
    header = request.headers.get("x-pipelines-run-token")
    if auth is not None and header is not None:
        raise Failed(wanted, "both headers sent")
    if auth is None and header is None:
        raise Failed(wanted, "neither header sent")
    if auth is not None and request.bearer is None:
        raise Failed(wanted, "an Authorization header that is not Bearer <token>")
    if request.run_token != run_token:
        raise Failed(wanted, "another token")  # never shown: it may be another run's


def expect_request_shape(request: Any, proxy_run: ProxyRun, run: Run, suffix: str) -> None:
    """§3.1: path, the run token in one header, JSON content type; a UUID Idempotency-Key on a tool call."""
    if request.path != proxy_run.base_path + suffix:
        raise Failed(f"POST {{proxy_url}}{suffix}", f"POST {request.path} (proxy base {proxy_run.base_path})")
    expect_run_token(request, run.run_token)
    if not request.headers.get("content-type", "").startswith("application/json"):
        raise Failed("Content-Type: application/json", show(request.headers.get("content-type")))
    if suffix.startswith("/tools/") and not is_uuid(request.idempotency_key):
        raise Failed("an Idempotency-Key holding a UUID on a tool call", show(request.idempotency_key))


def expect_refused(ran: Ran, outcome: Any, what: str, *, or_by_proxy: bool = False) -> None:
    """Refused locally: kind ``request``, nothing sent.

    With ``or_by_proxy`` (the contract does not ask for a local check) the
    proxy's refusal passes too: one request under ``/tools/``, answered with a
    4xx the call reports as kind ``proxy`` with that status.
    """
    error = outcome.get("error") if isinstance(outcome, dict) and outcome.get("ok") is False else None
    if not or_by_proxy or not isinstance(error, dict) or error.get("kind") != "proxy":
        expect_error(outcome, "request", what=what)
        expect_nothing_sent(ran.proxy)
        return
    wanted = f"{what} refused: locally (kind request, nothing sent) or by the proxy (kind proxy, its 4xx)"
    requests = list(ran.proxy.requests)
    tools = ran.proxy.base_path + "/tools/"
    if len(requests) != 1 or not requests[0].path.startswith(tools) or "/" in requests[0].path[len(tools):]:
        raise Failed(wanted + ", one request to {proxy_url}/tools/<name>",
                     f"{len(requests)} request(s): {paths(ran.proxy, requests)}")
    status = requests[0].reply_status
    if not (isinstance(status, int) and 400 <= status < 500 and error.get("status_code") == status):
        raise Failed(wanted, f"the proxy answered {status}, the call reported {show(outcome)}")


# ---------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------

CASES: List[Case] = []


def case(case_id: str, section: str, title: str) -> Callable[[Callable[[Check], None]], Callable[[Check], None]]:
    def register(fn: Callable[[Check], None]) -> Callable[[Check], None]:
        CASES.append(Case(case_id, section, title, fn))
        return fn
    return register


# -- §2 inbound: auth, ping, the 400s ---------------------------------------------------------


@case("auth.ping_wrong_credential", "§2 step 1", "a ping with a wrong or missing credential gets 401, before the ping")
def _(c: Check) -> None:
    c.need_token()
    wrong = "wrong-" + secrets.token_hex(8)
    for label, headers in (("a wrong credential", c.credential(wrong)), ("no credential", {})):
        reply = c.post({"ping": True}, headers)
        if reply.status != 401:
            raise Failed(f"401 for a ping with {label} (auth comes first)", describe(reply))
        if wrong in reply.text:
            raise Failed("a 401 body that never echoes the credential received", describe(reply))


@case("auth.dispatch_without_credential", "§2 step 1", "a dispatch without the credential gets 401 and runs nothing")
def _(c: Check) -> None:
    c.need_token()
    run, proxy_run = c.new_run()
    reply = c.dispatch(run, credential=False, user_instruction=compact({"steps": [{"call": "get_order", "args": {}}]}))
    if reply.status != 401:
        raise Failed("401 for a dispatch without the credential", describe(reply))
    expect_nothing_sent(proxy_run)


@case("ping.exact", "§2 step 3", 'the ping {"ping": true} with the credential gets 200 {"ok": true}')
def _(c: Check) -> None:
    reply = c.post({"ping": True}, c.credential())
    if reply.status != 200 or not isinstance(reply.json, dict) or reply.json.get("ok") is not True:
        raise Failed('HTTP 200 {"ok": true}', describe(reply))


@case("ping.strict", "§2 step 3", '{"ping": true, "x": 1} and {"ping": 1} are dispatches, not pings')
def _(c: Check) -> None:
    for body in ({"ping": True, "x": 1}, {"ping": 1}):
        run, _ = c.new_run()
        reply = c.dispatch(run, body)
        if reply.status != 200 or not isinstance(reply.json, dict) or "final_response" not in reply.json:
            raise Failed(f"{show(body)} dispatched to the agent (echo mode), not answered as a ping", describe(reply))
        echoed = c.echo(reply)
        if not same_json(echoed.get("raw"), body):
            raise Failed(f"the agent to see the body {show(body)}", show(echoed.get("raw")))


@case("auth.invalid_json_without_credential", "§2 steps 1-2",
      "a body that is not JSON, without the credential, gets 401: auth comes before parsing")
def _(c: Check) -> None:
    c.need_token()
    run, _ = c.new_run()
    reply = c.dispatch(run, b'{"input": {"user_instruction": "x"}, oops', credential=False)
    if reply.status != 401:
        raise Failed("401 for invalid JSON without the credential (auth runs before the body is parsed)",
                     describe(reply))


@case("http.invalid_json", "§2 step 2", "a body that is not JSON gets 400")
def _(c: Check) -> None:
    run, _ = c.new_run()
    reply = c.dispatch(run, b'{"input": {"user_instruction": "x"}, oops')
    if reply.status != 400:
        raise Failed("400 for invalid JSON", describe(reply))


@case("http.non_object_body", "§2 steps 2-5", "a JSON body that is not an object gets 400")
def _(c: Check) -> None:
    for body in ([{"ping": True}], "hello", 3, None):
        run, _ = c.new_run()
        reply = c.dispatch(run, json.dumps(body).encode())
        if reply.status != 400:
            raise Failed(f"400 for the JSON body {show(body)}", describe(reply))


@case("envelope.missing_proxy_url", "§2 step 5", "a dispatch without a proxy URL gets 400 naming it")
def _(c: Check) -> None:
    run, proxy_run = c.new_run()
    steps = compact({"steps": [{"call": "get_order", "args": {}}]})
    body = {"run_id": run.run_id, "input": {"user_instruction": steps}}
    reply = c.post(body, {"X-Pipelines-Run-Token": run.run_token, **c.credential()})
    if reply.status != 400 or "proxy" not in reply.text.lower():
        raise Failed("400 with a message naming the missing proxy URL", describe(reply))
    expect_nothing_sent(proxy_run)


@case("envelope.missing_run_token", "§2 step 5", "a dispatch without X-Pipelines-Run-Token gets 400 naming it")
def _(c: Check) -> None:
    run, proxy_run = c.new_run()
    headers = {"X-Pipelines-Odyssey-Proxy-Url": run.proxy_url, "X-Pipelines-Run-Id": str(run.run_id)}
    reply = c.dispatch(run, run_headers=False, headers=headers,
                       user_instruction=compact({"steps": [{"call": "get_order", "args": {}}]}))
    if reply.status != 400 or "token" not in reply.text.lower():
        raise Failed("400 with a message naming the missing run token", describe(reply))
    expect_nothing_sent(proxy_run)


# -- §2 the envelope --------------------------------------------------------------------------


@case("envelope.echo", "§2", "every envelope field reaches the agent with its native type; unknown fields kept")
def _(c: Check) -> None:
    run, _ = c.new_run()
    task_input = {"customer_id": "cust_99", "order_id": "4521"}
    extra = {"tools_schema": [{"name": "get_order", "input_schema": {"type": "object"}}],
             "sub_agents": [{"actor_id": "triage"}, "refunds", 7], "future_field": {"nested": [1, 2]}}
    body = envelope_body(run, user_instruction="Refund order #4521.", task_input=task_input, **extra)
    body["odyssey_proxy_url"] = run.proxy_url + "/"
    echoed = c.echo(c.dispatch(run, body))
    wanted = {
        "proxy_url": run.proxy_url, "run_token_sha256": sha256(run.run_token), "run_id": run.run_id,
        "task_id": run.task_id, "agent_id": run.agent_id, "run_token_jti": run.run_token_jti,
        "user_instruction": "Refund order #4521.", "task_input": task_input, "tools_schema": extra["tools_schema"],
        "sub_agents": ["triage", "refunds"], "api_url": c.platform.proxy.origin, "raw": body,
        "latest_user_prompt": None, "session_id": None, "messages": None, "workspace": None,
    }
    compare_echo(echoed, wanted)


def compare_echo(echoed: Mapping[str, Any], wanted: Mapping[str, Any]) -> None:
    for key, value in wanted.items():
        if key not in echoed or not same_json(echoed[key], value):
            raise Failed(f"{key} = {show(value, 200)}", show(echoed.get(key, "<absent>"), 200))


@case("envelope.header_fallback", "§2", "proxy URL, ids and jti come from the headers when the body lacks them")
def _(c: Check) -> None:
    run, proxy_run = c.new_run()
    run = run._replace(proxy_url=run.proxy_url + "/")
    echoed = c.echo(c.dispatch(run, header_only=True, user_instruction="hello"))
    compare_echo(echoed, {"proxy_url": proxy_run.url, "run_id": str(run.run_id), "task_id": str(run.task_id),
                          "run_token_jti": run.run_token_jti, "run_token_sha256": sha256(run.run_token)})


# -- §3.1 the request a tool call sends --------------------------------------------------------


@case("proxy.request_shape", "§3.1",
      "POST {proxy_url}/tools/{name}, the run token in one header, the args as the JSON body")
def _(c: Check) -> None:
    args = {"order_id": "4521", "n": 2, "nested": {"tags": ["a", "ü"]}}
    ran = c.script([{"call": "get_order", "args": args}])
    expect_ok(c.outcome(ran))
    (request,) = expect_requests(ran.proxy, 1, "one call")
    expect_request_shape(request, ran.proxy, ran.run, "/tools/get_order")
    if request.json != args:
        raise Failed(f"the JSON body {show(args)}", show(request.json) if request.json is not None
                     else repr(request.body[:200]))
    if request.actor is not None:
        raise Failed("no X-Pipelines-Actor-Id without an actor", show(request.actor))


@case("proxy.idempotency_fresh", "§3.1", "one fresh Idempotency-Key per logical tool call")
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {"order_id": "1"}}, {"call": "get_order", "args": {"order_id": "1"}}])
    for outcome in c.results(ran, 2):
        expect_ok(outcome)
    first, second = expect_requests(ran.proxy, 2, "two calls")
    if not first.idempotency_key or first.idempotency_key == second.idempotency_key:
        raise Failed("a different Idempotency-Key on each of two calls",
                     f"{show(first.idempotency_key)} and {show(second.idempotency_key)}")


@case("proxy.idempotency_reused_on_retry", "§3.1, §3.3", "a retried call reuses its Idempotency-Key")
def _(c: Check) -> None:
    ran = c.script([{"call": "refund_order", "args": {"order_id": "1"}}], setup=lambda p: p.script(
        "refund_order", [{"status": 429, "headers": RETRY_NOW, "error_class": "rate_limited", "message": "slow down"},
                         {"response": {"refunded": True}}]))
    expect_ok(c.outcome(ran), {"refunded": True})
    expect_same_key(expect_requests(ran.proxy, 2, "a 429, then the retry"), "a retry must never re-run a mutating tool")


# -- §3.2 reading the reply ------------------------------------------------------------------------


@case("proxy.unwrap", "§3.2", "the agent gets the response, never the trace envelope around it")
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {}}], setup=lambda p: p.script(
        "get_order", [{"response": {"status": "shipped"}, "latency_ms": 412}]))
    value = expect_ok(c.outcome(ran))
    leaked = [k for k in ENVELOPE_KEYS if isinstance(value, dict) and k in value]
    if leaked or not same_json(value, {"status": "shipped"}):
        raise Failed('the unwrapped response {"status":"shipped"}', show(value))


@case("proxy.string_not_decoded_twice", "§3.2", 'a string response stays a string: "{\\"a\\": 1}" is not decoded again')
def _(c: Check) -> None:
    ran = c.script([{"call": "a", "args": {}}, {"call": "b", "args": {}}], setup=lambda p: (
        p.script("a", [{"response": '{"a": 1}'}]), p.script("b", [{"response": "pong"}])))
    first, second = c.results(ran, 2)
    expect_ok(first, '{"a": 1}', "a tool answering the string '{\"a\": 1}'")
    expect_ok(second, "pong", "a tool answering the string 'pong'")


@case("proxy.non_json_reply", "§3.2", "a non-JSON 200 body arrives as the original text")
def _(c: Check) -> None:
    ran = c.script([{"call": "export_csv", "args": {}}], setup=lambda p: p.script(
        "export_csv", [{"body": "id,total\n1,9.5\n", "headers": {"Content-Type": "text/csv"}}]))
    expect_ok(c.outcome(ran), "id,total\n1,9.5\n")


@case("proxy.tool_error_is_value", "§3.2", "a tool-level error (200, source error) is a result, not an exception")
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {}}], setup=lambda p: p.script(
        "get_order", [{"response": {"error": "order not found"}, "source": "error"}]))
    expect_ok(c.outcome(ran), {"error": "order not found"})


@case("proxy.slow_reply", "§3.1", "a slow tool (the simulator may take long) is waited for")
def _(c: Check) -> None:
    ran = c.script([{"call": "slow_tool", "args": {}}], setup=lambda p: p.script(
        "slow_tool", [{"response": "done", "delay_s": 0.5}]))
    expect_ok(c.outcome(ran), "done")


@case("proxy.oversized_reply", "§3.1", "a reply over the 1 MiB response cap is refused, not handed to the agent")
def _(c: Check) -> None:
    ran = c.script([{"call": "bulk", "args": {}}], setup=lambda p: p.script(
        "bulk", [{"response": "x" * (1 << 20)}]))
    outcome = c.outcome(ran)
    error = outcome.get("error") if isinstance(outcome, dict) and outcome.get("ok") is False else None
    if not isinstance(error, dict) or error.get("kind") not in ("proxy", "transport"):
        got = "the whole reply as the value" if isinstance(outcome, dict) and outcome.get("ok") else show(outcome)
        raise Failed("the call to fail (kind proxy or transport): the reply is over 1 MiB", got)


# -- §3.3 retries and errors ---------------------------------------------------------------------


def retried(c: Check, reply: Dict[str, Any], why: str) -> None:
    ran = c.script([{"call": "get_order", "args": {}}], setup=lambda p: p.script(
        "get_order", [reply, {"response": "after-retry"}]))
    expect_ok(c.outcome(ran), "after-retry", f"the call ({why}, then a success)")
    expect_same_key(expect_requests(ran.proxy, 2, f"{why}, then the retry"), "a retry reuses the key")


@case("proxy.retry_429", "§3.3", "429 is retried (Retry-After honoured)")
def _(c: Check) -> None:
    retried(c, {"status": 429, "headers": RETRY_NOW, "error_class": "rate_limited", "message": "slow down"}, "429")


for _class in sorted(pp.TRANSIENT_503_CLASSES):
    def _transient(c: Check, error_class: str = _class) -> None:
        retried(c, {"status": 503, "headers": RETRY_NOW, "error_class": error_class, "message": "try again"},
                f"503 {error_class}")
    case(f"proxy.retry_503_{_class}", "§3.3", f"503 {_class} is transient: retried")(_transient)


@case("proxy.retry_bounded", "§3.3", "a 429 that never clears ends in an error after a few attempts")
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {}}], setup=lambda p: p.script(
        "get_order", [{"status": 429, "headers": RETRY_NOW, "error_class": "rate_limited", "message": "slow down"}]))
    expect_error(c.outcome(ran), "proxy", 429, "rate_limited")
    count = len(ran.proxy.requests)
    if not 2 <= count <= 10:
        raise Failed("between 2 and 10 attempts (SDK policy: 4)", f"{count}")


TERMINAL = (
    (400, "invalid_args"), (401, None), (404, "unknown_tool"), (422, None), (500, "internal"),
    (503, "simulator_unavailable"),
)

for _status, _class in TERMINAL:
    def _terminal(c: Check, status: int = _status, error_class: Optional[str] = _class) -> None:
        reply: Dict[str, Any] = {"status": status, "headers": RETRY_NOW}
        if error_class:
            reply.update(error_class=error_class, message="no")
        else:
            detail = "Not authenticated" if status == 401 else [{"loc": ["body", "x"], "msg": "field required"}]
            reply["json"] = {"detail": detail}
        ran = c.script([{"call": "get_order", "args": {}}], setup=lambda p: p.script(
            "get_order", [reply, {"response": "after-retry"}]))
        expect_error(c.outcome(ran), "proxy", status, error_class)
        expect_requests(ran.proxy, 1, f"{status} is terminal: no retry")
    _name = f"proxy.terminal_{_status}" + (f"_{_class}" if _status == 503 else "")
    case(_name, "§3.3", f"{_status} {_class or '(no class)'} is terminal: no retry, a proxy error")(_terminal)


@case("proxy.stale_run_token", "§3.3", "401 run_token_expired / _invalid / _rejected is its own error kind")
def _(c: Check) -> None:
    classes = sorted(pp.STALE_TOKEN_CLASSES)
    ran = c.script([{"call": f"t_{i}", "args": {}} for i in range(len(classes))], setup=lambda p: [
        p.script(f"t_{i}", [{"status": 401, "error_class": cls, "message": "run is over"}, {"response": "x"}])
        for i, cls in enumerate(classes)])
    for outcome, cls in zip(c.results(ran, len(classes)), classes):
        expect_error(outcome, "stale_run_token", 401, cls, f"a call answered 401 {cls}")
    expect_requests(ran.proxy, len(classes), "a stale token is not retried")


def dead_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@case("proxy.transport_refused", "§3.3", "a refused connection is a transport error")
def _(c: Check) -> None:
    run, _ = c.new_run()
    run = run._replace(proxy_url=f"http://127.0.0.1:{dead_port()}/api/odyssey-proxy/runs/gone")
    ran = c.script([{"call": "get_order", "args": {}}], ran=(run, c.platform.proxy.new_run()))
    expect_error(c.outcome(ran), "transport", None)


@case("proxy.transport_dropped", "§3.3",
      "a connection dropped before the reply is a transport error; retries reuse the key")
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {}}], setup=lambda p: p.script("get_order", [{"drop": True}]))
    expect_error(c.outcome(ran), "transport", None)
    requests = ran.proxy.requests
    if not 1 <= len(requests) <= 4:
        raise Failed("1 to 4 attempts (the SDK raises at once; its MCP shim retries twice)", f"{len(requests)}")
    expect_same_key(requests, "transport retries are only safe with the same key")


@case("proxy.transport_retry_same_key", "§3.3",
      "a dropped connection, then a success: no retry, or one with the same key")
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {}}], setup=lambda p: p.script(
        "get_order", [{"drop": True}, {"response": "after-retry"}]))
    outcome = c.outcome(ran)
    if isinstance(outcome, dict) and outcome.get("ok") is True:
        expect_ok(outcome, "after-retry")
        expect_same_key(expect_requests(ran.proxy, 2, "the dropped attempt, then the retry"), "same logical call")
    else:
        expect_error(outcome, "transport", None)
        expect_requests(ran.proxy, 1, "no retry")


# -- §3.5 actor labels ---------------------------------------------------------------------------------


@case("actor.header", "§3.5", "an actor label is sent as X-Pipelines-Actor-Id; an actor_id argument passes untouched")
def _(c: Check) -> None:
    args = {"order_id": "1", "actor_id": "customer-7"}
    ran = c.script([{"call": "refund_order", "args": args, "actor": "supervisor/refunds"}])
    expect_ok(c.outcome(ran))
    (request,) = expect_requests(ran.proxy, 1, "one call")
    if request.actor != "supervisor/refunds":
        raise Failed("X-Pipelines-Actor-Id: supervisor/refunds", show(request.actor))
    if request.json != args:
        raise Failed(f"the arguments untouched: {show(args)}", show(request.json))


@case("actor.trimmed", "§3.5", "an actor label is trimmed")
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {}, "actor": "  refunds  "}])
    expect_ok(c.outcome(ran))
    (request,) = expect_requests(ran.proxy, 1, "one call")
    if request.actor != "refunds":
        raise Failed("X-Pipelines-Actor-Id: refunds", show(request.actor))


@case("actor.absent_when_empty", "§3.5", "no actor, or an empty one, sends no X-Pipelines-Actor-Id header")
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {}}, {"call": "get_order", "args": {}, "actor": "  "}])
    for outcome in c.results(ran, 2):
        expect_ok(outcome)
    for request in expect_requests(ran.proxy, 2, "two calls"):
        if "x-pipelines-actor-id" in request.headers:
            raise Failed("no X-Pipelines-Actor-Id header", show(request.headers["x-pipelines-actor-id"]))


@case("actor.malformed_refused", "§3.5", "a malformed actor label is refused locally: nothing sent")
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {}, "actor": "a//b"}])
    expect_error(c.outcome(ran), "request", what="a call with actor 'a//b'")
    expect_nothing_sent(ran.proxy)


# -- §3.4 trace events ---------------------------------------------------------------------------------


def expect_stamped(request: Any) -> str:
    stamp = request.json.get("__occurred_at") if isinstance(request.json, dict) else None
    if not isinstance(stamp, str) or not ISO_UTC.fullmatch(stamp):
        raise Failed("__occurred_at as ISO-8601 UTC (e.g. 2026-01-02T03:04:05.123Z)", show(stamp))
    return stamp


@case("trace.event_shape", "§3.4", "POST {proxy_url}/traces/{type}: the payload, __occurred_at, the proxy's reply")
def _(c: Check) -> None:
    ran = c.script([{"trace": "assistant_message", "payload": {"text": "working on it"}}])
    expect_ok(c.outcome(ran), {"accepted": True, "sequence": 1}, "the trace post")
    (request,) = expect_requests(ran.proxy, 1, "one trace event")
    expect_request_shape(request, ran.proxy, ran.run, "/traces/assistant_message")
    if not isinstance(request.json, dict) or request.json.get("text") != "working on it":
        raise Failed('a JSON body with "text": "working on it"', show(request.json))
    expect_stamped(request)


@case("trace.occurred_at_kept_on_retry", "§3.4", "__occurred_at is stamped once and kept across retries")
def _(c: Check) -> None:
    ran = c.script([{"trace": "custom", "payload": {"n": 1}}], setup=lambda p: p.script(
        "custom",
        [{"status": 503, "headers": RETRY_NOW, "error_class": "trace_sequence_contended", "message": "x"}, {}]))
    expect_ok(c.outcome(ran), what="the trace post")
    first, second = expect_requests(ran.proxy, 2, "a transient 503, then the retry")
    if expect_stamped(first) != expect_stamped(second):
        raise Failed("the same __occurred_at on both attempts",
                     f"{first.json['__occurred_at']} then {second.json['__occurred_at']}")


@case("trace.empty_reply", "§3.4", "an empty 200 reply (older platforms) is a success with value null")
def _(c: Check) -> None:
    ran = c.script([{"trace": "thinking", "payload": {"text": "hmm"}}],
                   setup=lambda p: p.script("thinking",
                                            [{"body": b"", "headers": {"Content-Type": "application/json"}}]))
    expect_ok(c.outcome(ran), None, "the trace post")


@case("trace.failure_reported", "§3.4", "a failed trace post is reported (the step is not best-effort)")
def _(c: Check) -> None:
    ran = c.script([{"trace": "custom", "payload": {}}], setup=lambda p: p.script(
        "custom", [{"status": 500, "error_class": "internal", "message": "boom"}]))
    expect_error(c.outcome(ran), "proxy", 500, "internal", "the trace post")


@case("trace.handoff", "§3.4", "a handoff is a handoff event with from_sub_agent / to_sub_agent")
def _(c: Check) -> None:
    ran = c.script([{"handoff": {"from": "triage", "to": "refunds", "reason": "refund asked"}}])
    expect_ok(c.outcome(ran), what="the handoff")
    (request,) = expect_requests(ran.proxy, 1, "one handoff event")
    expect_request_shape(request, ran.proxy, ran.run, "/traces/handoff")
    wanted = {"from_sub_agent": "triage", "to_sub_agent": "refunds", "reason": "refund asked"}
    body = request.json if isinstance(request.json, dict) else {}
    if any(body.get(k) != v for k, v in wanted.items()):
        raise Failed(f"a body with {show(wanted)}", show(request.json))
    expect_stamped(request)


@case("trace.self_handoff_dropped", "§3.4", "a self-handoff is dropped, not sent")
def _(c: Check) -> None:
    ran = c.script([{"handoff": {"from": "refunds", "to": "refunds"}}])
    expect_ok(c.outcome(ran), None, "the self-handoff")
    expect_nothing_sent(ran.proxy)


@case("trace.unknown_type_refused", "§3.4", "an unknown event type is refused locally")
def _(c: Check) -> None:
    ran = c.script([{"trace": "debug_dump", "payload": {}}])
    expect_error(c.outcome(ran), "request", what="a trace of type debug_dump")
    expect_nothing_sent(ran.proxy)


# -- §4 the response envelope; §2 step 8 agent errors ------------------------------------------------


@case("response.echo_valid", "§4", "the echo-mode response is a valid response envelope")
def _(c: Check) -> None:
    run, _ = c.new_run()
    c.echo(c.dispatch(run, user_instruction="hello"))


@case("response.script_transcript", "§4", "a script's response: results, a valid transcript, metadata")
def _(c: Check) -> None:
    steps = [{"call": "get_order", "args": {"order_id": "1"}},
             {"parallel": [{"call": "a", "args": {}}, {"call": "b", "args": {"k": [1]}}]},
             {"call": "get order", "args": {}},
             {"trace": "custom", "payload": {}}]
    ran = c.script(steps)
    results = c.results(ran, 4)
    body = ran.reply.json
    calls = [("get_order", {"order_id": "1"}, results[0]), ("a", {}, results[1]["parallel"][0]),
             ("b", {"k": [1]}, results[1]["parallel"][1]), ("get order", {}, results[2])]
    messages = body.get("messages")
    wanted_roles = ["user"] + ["assistant", "tool"] * len(calls) + ["assistant"]
    if not isinstance(messages, list) or [m.get("role") for m in messages if isinstance(m, dict)] != wanted_roles:
        raise Failed(f"messages with roles {wanted_roles} ({AGENT_SPEC})",
                     show([m.get("role") if isinstance(m, dict) else m for m in messages or []]))
    if messages[0].get("content") != compact({"steps": steps}) and not same_json(
            _json_or_none(messages[0].get("content")), {"steps": steps}):
        raise Failed("the user message holding the instruction", show(messages[0].get("content")))
    for n, (name, args, outcome) in enumerate(calls, start=1):
        call_message, tool_message = messages[2 * n - 1], messages[2 * n]
        tool_calls = call_message.get("tool_calls")
        wanted_call = {"id": f"call_{n}", "name": name, "arguments": args}
        if not (isinstance(tool_calls, list) and len(tool_calls) == 1 and same_json(tool_calls[0], wanted_call)):
            raise Failed(f"tool_calls [{show(wanted_call)}]", show(tool_calls))
        if tool_message.get("tool_call_id") != f"call_{n}" or not same_json(
                _json_or_none(tool_message.get("content")), outcome):
            raise Failed(f"a tool message for call_{n} holding the outcome", show(tool_message))
    if messages[-1].get("content") != body["final_response"]:
        raise Failed("a last assistant message holding the final_response text", show(messages[-1]))
    metadata = body.get("metadata")
    runtime = metadata.get("agent_runtime_ms") if isinstance(metadata, dict) else None
    if not (isinstance(metadata, dict) and metadata.get("model") == "conformance-agent"
            and isinstance(runtime, (int, float)) and not isinstance(runtime, bool) and runtime >= 0):
        raise Failed('metadata {"model": "conformance-agent", "agent_runtime_ms": <ms>}', show(metadata))


def _json_or_none(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None


@case("response.agent_error", "§2 step 8",
      "an agent that raises gets 500 whose detail names the exception type and message")
def _(c: Check) -> None:
    message = "conformance-boom-" + secrets.token_hex(4)
    ran = c.script([{"raise": message}])
    if ran.reply.status != 500 or not isinstance(ran.reply.json, dict) or "detail" not in ran.reply.json:
        raise Failed('500 with a JSON body {"detail": ...}', describe(ran.reply))
    detail = strings_in(ran.reply.json["detail"])
    if message not in detail:
        raise Failed(f"a detail naming the error message {message!r}", describe(ran.reply))
    if not any(TYPED_DETAIL.match(line) and message in line for line in detail.splitlines()):
        raise Failed(f"a detail naming the exception type before the message, e.g. 'RuntimeError: {message}'",
                     describe(ran.reply))


@case("response.empty_final_response", "§4", 'an empty final_response is never sent: "" becomes a 500')
def _(c: Check) -> None:
    for value in ("", {"final_response": ""}):
        ran = c.script([{"return": value}])
        if ran.reply.status != 500:
            raise Failed(f"500 when the agent returns {show(value)}", describe(ran.reply))
    # A blank one is not empty: the contract lets it through; pipelines_port refuses it (a stricter choice).
    ran = c.script([{"return": {"final_response": "   "}}])
    expect_blank_final_response(ran.reply, "   ")


def expect_blank_final_response(reply: Reply, blank: str) -> None:
    """A blank final_response: a 500, or (the contract only asks for a non-empty string) a 200 carrying it."""
    if reply.status == 500:
        return
    body = reply.json if isinstance(reply.json, dict) else {}
    if reply.status != 200 or body.get("final_response") != blank:
        raise Failed(f"500, or 200 with the final_response {show(blank)} (non-empty, so allowed by §4)",
                     describe(reply))


@case("agent.malformed_script", AGENT_SPEC, "a malformed script (unknown step) makes the agent raise: 500")
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {}}, {"bogus": 1}])
    if ran.reply.status != 500:
        raise Failed("500 for a script with an unknown step", describe(ran.reply))


# -- secrets ------------------------------------------------------------------------------------------------


@case("secrets.agent_error_detail", "§2 step 8, §2 (run token: secret)",
      "a run token inside an agent's error never reaches the 500 body")
def _(c: Check) -> None:
    run, _proxy_run = c.new_run()
    reply = c.dispatch(run, user_instruction=compact({"steps": [{"raise": f"cannot use {run.run_token} here"}]}))
    if reply.status != 500:
        raise Failed("500 for an agent that raises", describe(reply))
    if "cannot use" not in reply.text:
        raise Failed("a detail keeping the rest of the message", describe(reply))


# -- §2 step 6 concurrency ----------------------------------------------------------------------------------

CONCURRENT_RUNS = 50


@case("concurrency.distinct_tokens", "§2 step 6", f"{CONCURRENT_RUNS} concurrent runs never see each other's token")
def _(c: Check) -> None:
    runs = [c.new_run() for _ in range(CONCURRENT_RUNS)]
    for index, (_, proxy_run) in enumerate(runs):
        proxy_run.script("whoami", lambda request, index=index: {"response": {"run": index}})
    # The sleep lets every dispatch start before any calls: a shared envelope would be overwritten by then.
    # One call per run keeps even a crossing port under the 60/min per-token rate limit (no minute-long waits).
    steps = [{"sleep_ms": 50}, {"call": "whoami", "args": {}}]
    with ThreadPoolExecutor(max_workers=CONCURRENT_RUNS) as pool:
        done = list(pool.map(lambda ran: c.script(steps, ran=ran), runs))
    for index, ran in enumerate(done):
        value = expect_ok(c.results(ran, len(steps))[1], what=f"run {index}'s call")
        if not same_json(value, {"run": index}):
            raise Failed(f"run {index}'s call to reach its own proxy run with its own token",
                         f"the reply of another run: {show(value)}")
        (request,) = expect_requests(ran.proxy, 1, f"run {index}: its own call only")
        if request.run_token != ran.run.run_token:
            raise Failed(f"run {index}'s call to carry its own run token",
                         "another run's token" if request.run_token else "no run token")
        expect_run_token(request, ran.run.run_token)


# -- §2 step 4 connectivity check (SDK extension) --------------------------------------------------------------


def connectivity(c: Check, proxy_url: str) -> Dict[str, Any]:
    """The ``outbound`` object, or skip when the port treats the check as an ordinary dispatch."""
    reply = c.post({"connectivity_check": True, "odyssey_proxy_url": proxy_url}, c.credential())
    body = reply.json if isinstance(reply.json, dict) else {}
    if reply.status == 200 and isinstance(body.get("outbound"), dict):
        return body["outbound"]
    if reply.status == 400 or (reply.status == 200 and "final_response" in body):
        raise Skipped(f"not implemented (answered as an ordinary dispatch: HTTP {reply.status}); "
                      "the connectivity check is an SDK extension")
    raise Failed('200 {"ok": true, "outbound": {...}}, or the answer to an ordinary dispatch', describe(reply))


@case("connectivity.reachable", "§2 step 4, §3.7", "the connectivity check probes the proxy: reachable")
def _(c: Check) -> None:
    _, proxy_run = c.new_run()
    outbound = connectivity(c, proxy_run.url)
    if outbound.get("reachable") is not True or not isinstance(outbound.get("status_code"), int):
        raise Failed("outbound.reachable true with the probe's status_code (401 here)", show(outbound))
    if not any(r.path.endswith("/tools/__reachability_probe__") for r in proxy_run.requests):
        raise Failed("a POST {proxy_url}/tools/__reachability_probe__ (§3.7)", paths(proxy_run, proxy_run.requests))


@case("connectivity.unreachable", "§2 step 4, §3.7", "the connectivity check reports an unreachable proxy")
def _(c: Check) -> None:
    outbound = connectivity(c, f"http://127.0.0.1:{dead_port()}/api/odyssey-proxy/runs/gone")
    if outbound.get("reachable") is not False:
        raise Failed("outbound.reachable false for a refused connection", show(outbound))


@case("connectivity.missing_url", "§2 step 4", "a connectivity check without a proxy URL gets 400")
def _(c: Check) -> None:
    reply = c.post({"connectivity_check": True}, c.credential())
    if reply.status != 400:
        raise Failed("400 (no proxy URL given)", describe(reply))


# ---------------------------------------------------------------------------
# The vectors, run through the agent
# ---------------------------------------------------------------------------


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def vector_cases() -> List[Case]:
    """One case per applicable vector (conformance/vectors/), ids ``vectors.FILE:SLUG``."""
    made: List[Case] = []
    for stem, build in VECTOR_BUILDERS:
        doc = vectorlib.load(stem)
        seen: set = set()
        for index, vector in enumerate(doc["cases"]):
            built = build(doc, vector)
            if built is None:
                continue
            name = slug(vector["name"]) or f"case-{index}"
            if name in seen:
                name = f"{name}-{index}"
            seen.add(name)
            made.append(Case(f"vectors.{stem}:{name}", doc["contract"], vector["name"], built))
    return made


def _envelope_vector(doc: Dict[str, Any], vector: Dict[str, Any]) -> Optional[Callable[[Check], None]]:
    if vector["from"] != "dispatch":
        return None  # code mode (§5): a port checks run()/environment cases in-process

    def run(c: Check) -> None:
        body = vector["body_text"].encode() if "body_text" in vector else json.dumps(vector["body"]).encode()
        credential = c.credential()
        headers = {k: v for k, v in vector.get("headers", {}).items()
                   if k.lower() not in {n.lower() for n in credential}}
        headers.update(credential)
        reply = c.post(body, headers)
        expect = vector["expect"]
        if "error" in expect:
            if reply.status != 400:
                raise Failed("400", describe(reply))
            words = strings_in(reply.json) if reply.json is not None else reply.text
            for text in expect.get("mentions", []):
                if text not in words:
                    raise Failed(f"a 400 message mentioning {text!r}", describe(reply))
            for text in expect.get("never_mentions", []):
                if text in reply.text:
                    raise Failed(f"a 400 body never showing {text!r}", "it does")
            return
        echoed = c.echo(reply)
        for path, wanted in expect["fields"].items():
            if path == "run_token":
                path, wanted = "run_token_sha256", sha256(wanted)
            got: Any = echoed
            for part in path.split("."):
                got = got.get(part, "<absent>") if isinstance(got, dict) else "<absent>"
            if not same_json(got, wanted):
                raise Failed(f"{path} = {show(wanted, 200)}", show(got, 200))
    return run


def _inbound_vector(doc: Dict[str, Any], vector: Dict[str, Any]) -> Callable[[Check], None]:
    if vector["kind"] == "ping":
        def ping(c: Check) -> None:
            body = vector["body"]
            if vector["expect"]["is_ping"]:
                reply = c.post(body, c.credential())
                if reply.status != 200 or not isinstance(reply.json, dict) or reply.json.get("ok") is not True:
                    raise Failed('the ping answered 200 {"ok": true}', describe(reply))
            elif isinstance(body, dict):
                run, _ = c.new_run()
                echoed = c.echo(c.dispatch(run, body))
                if not same_json(echoed.get("raw"), body):
                    raise Failed(f"a dispatch with the body {show(body)}", show(echoed.get("raw")))
            else:
                run, _ = c.new_run()
                reply = c.dispatch(run, json.dumps(body).encode())
                if reply.status != 400:
                    raise Failed(f"400 for the body {show(body)} (not an object: neither a ping nor a dispatch)",
                                 describe(reply))
        return ping

    def auth(c: Check) -> None:
        token = c.need_token()
        ours = c.platform.dispatcher.auth_header
        if vector["header_name"].lower() != ours.lower():
            raise Skipped(f"written for the {vector['header_name']} header; this endpoint was checked with {ours}")
        expected = vector["expected"]
        if not expected:
            raise Skipped("an endpoint with an empty token: not this one")
        upper = token.upper() if token.upper() != token else None

        def ours_for(value: str) -> str:
            if expected.upper() in value and expected not in value:
                if upper is None:
                    raise Skipped("the case-sensitivity case needs a token with letters")
                return value.replace(expected.upper(), upper)
            return value.replace(expected, token)

        headers = {name: ours_for(value) for name, value in vector["headers"].items()}
        reply = c.post({"ping": True}, headers)
        wanted = 200 if vector["expect"]["ok"] else 401
        if reply.status != wanted:
            raise Failed(f"{wanted} for a ping with this credential", describe(reply))
    return auth


def _tool_name_vector(doc: Dict[str, Any], vector: Dict[str, Any]) -> Callable[[Check], None]:
    def run(c: Check) -> None:
        ran = c.script([{"call": vector["tool_name"], "args": {}}])
        outcome = c.outcome(ran)
        if vector["valid"]:
            expect_ok(outcome, what=f"a call to {vector['tool_name']!r}")
            (request,) = expect_requests(ran.proxy, 1, "one call")
            if request.path != f"{ran.proxy.base_path}/tools/{vector['tool_name']}":
                raise Failed(f"POST {{proxy_url}}/tools/{vector['tool_name']}", request.path)
        else:
            expect_refused(ran, outcome, f"a call to {show(vector['tool_name'], 60)}",
                           or_by_proxy=bool(vector.get("stricter_than_contract")))
    return run


def _actor_label_vector(doc: Dict[str, Any], vector: Dict[str, Any]) -> Callable[[Check], None]:
    def run(c: Check) -> None:
        ran = c.script([{"call": "get_order", "args": {}, "actor": vector["label"]}])
        outcome = c.outcome(ran)
        expect = vector["expect"]
        if "error" in expect:
            expect_error(outcome, "request", what=f"a call with actor {show(vector['label'], 60)}")
            expect_nothing_sent(ran.proxy)
            return
        expect_ok(outcome)
        (request,) = expect_requests(ran.proxy, 1, "one call")
        if request.actor != expect["label"]:
            raise Failed("no X-Pipelines-Actor-Id header" if expect["label"] is None
                         else f"X-Pipelines-Actor-Id: {expect['label']}", show(request.actor, 80))
    return run


def _proxy_request_vector(doc: Dict[str, Any], vector: Dict[str, Any]) -> Callable[[Check], None]:
    def run(c: Check) -> None:
        step: Dict[str, Any] = {"call": vector["tool_name"], "args": vector["args"]}
        if "actor" in vector:
            step["actor"] = vector["actor"]
        ran = c.script([step])
        outcome = c.outcome(ran)
        expect = vector["expect"]
        if "error" in expect:
            expect_refused(ran, outcome, f"a call to {show(vector['tool_name'], 60)}",
                           or_by_proxy=bool(vector.get("stricter_than_contract")))
            return
        expect_ok(outcome)
        (request,) = expect_requests(ran.proxy, 1, "one call")
        check_request(request, ran, expect)
    return run


def check_request(request: Any, ran: Ran, expect: Mapping[str, Any]) -> None:
    """The vectors' request expectations: path_suffix, body_json, headers, headers_absent, run_token_sent;
    and an Idempotency-Key on a tool call."""
    if "path_suffix" in expect and request.path != ran.proxy.base_path + expect["path_suffix"]:
        raise Failed(f"POST {{proxy_url}}{expect['path_suffix']}", request.path)
    if "body_json" in expect and not same_json(request.json, expect["body_json"]):
        raise Failed(f"the JSON body {show(expect['body_json'])}", show(request.json))
    for name, value in expect.get("headers", {}).items():
        wanted = value.replace("{run_token}", ran.run.run_token)
        if request.headers.get(name.lower()) != wanted:
            shown = value if "{run_token}" in value else wanted
            got = request.headers.get(name.lower())
            raise Failed(f"{name}: {shown}", "absent" if got is None else (
                "another value" if "{run_token}" in value else show(got)))
    for name in expect.get("headers_absent", []):
        if name.lower() in request.headers:
            raise Failed(f"no {name} header", "one sent")
    if expect.get("run_token_sent"):
        expect_run_token(request, ran.run.run_token)
    if request.kind == "tools" and not request.idempotency_key:
        raise Failed("an Idempotency-Key on every tool call", "none")


def _proxy_reply_vector(doc: Dict[str, Any], vector: Dict[str, Any]) -> Callable[[Check], None]:
    def run(c: Check) -> None:
        expect = vector["expect"]

        def setup(proxy_run: ProxyRun) -> None:
            mine = lambda text: text.replace(doc["run_token"], proxy_run.token)  # noqa: E731
            reply: Dict[str, Any] = {"status": vector["status"], "headers": dict(vector["headers"])}
            if "body_json" in vector:
                reply["json"] = json.loads(mine(json.dumps(vector["body_json"])))
            else:
                reply["body"] = mine(vector.get("body_text", ""))
            proxy_run.script(doc["tool_name"], [reply, {"response": "after-retry"}])

        ran = c.script([{"call": doc["tool_name"], "args": {}}], setup=setup)
        outcome = c.outcome(ran)
        if expect.get("retry"):
            expect_ok(outcome, "after-retry", "the call (retried, then a success)")
            first, second = expect_requests(ran.proxy, 2, "the reply, then one retry")
            expect_same_key([first, second], "a retry reuses the key")
            wait, gap = expect.get("retry_after_s"), second.time - first.time
            if wait and gap < 0.9 * wait:
                raise Failed(f"a retry after the Retry-After wait of {wait} s", f"a retry after {gap:.2f} s")
            if wait is None and gap < MIN_BACKOFF_S:
                raise Failed(f"a retry after a backoff wait of at least {MIN_BACKOFF_S} s (§3.3: retry with backoff)",
                             f"a retry after {gap:.3f} s")
        elif "value" in expect:
            expect_ok(outcome, expect["value"])
            expect_requests(ran.proxy, 1, "a success is not retried")
        else:
            kwargs = {k: expect[k] for k in ("status_code", "error_class") if k in expect}
            expect_error(outcome, expect["error"], **kwargs)
            expect_requests(ran.proxy, 1, "a terminal error is not retried")
    return run


def _trace_vector(doc: Dict[str, Any], vector: Dict[str, Any]) -> Callable[[Check], None]:
    def run(c: Check) -> None:
        if vector["kind"] == "trace":
            step: Dict[str, Any] = {"trace": vector["event_type"], "payload": vector["payload"]}
        else:
            handoff = {"from": vector["from"], "to": vector["to"]}
            handoff.update({k: vector[k] for k in ("reason", "payload_preview") if k in vector})
            step = {"handoff": handoff}
        ran = c.script([step])
        outcome = c.outcome(ran)
        expect = vector["expect"]
        if "error" in expect:
            expect_error(outcome, "request")
            expect_nothing_sent(ran.proxy)
            return
        if expect.get("dropped"):
            expect_ok(outcome, None, "the dropped event")
            expect_nothing_sent(ran.proxy)
            return
        expect_ok(outcome, {"accepted": True, "sequence": 1}, "the trace post")
        (request,) = expect_requests(ran.proxy, 1, "one trace event")
        check_request(request, ran, expect)
        body = request.json if isinstance(request.json, dict) else {}
        for key, value in expect.get("body_has", {}).items():
            if not same_json(body.get(key, "<absent>"), value):
                raise Failed(f"{key} = {show(value)} in the body", show(body.get(key, "<absent>")))
        if expect.get("stamped"):
            expect_stamped(request)
    return run


def _build_response_vector(doc: Dict[str, Any], vector: Dict[str, Any]) -> Optional[Callable[[Check], None]]:
    given = vector["input"]
    if "object" in given:
        return None  # a result *object* is Python-specific
    if given.get("strict"):
        return None  # strict mode is a pipelines_port option a port need not have
    value = given["value"]
    overrides = {k: given[k] for k in ("messages", "metadata") if k in given}
    if overrides:  # a return step has no separate overrides: fold them into an envelope mapping
        value = dict(value, **overrides) if isinstance(value, dict) else dict({"final_response": value}, **overrides)

    def run(c: Check) -> None:
        ran = c.script([{"return": value}])
        expect = vector["expect"]
        if "error" in expect and vector.get("stricter_than_contract") and ran.reply.status != 500:
            # A blank final_response is not empty: a port may send it (§4 asks for a non-empty string).
            expect_blank_final_response(ran.reply, value if isinstance(value, str) else value.get("final_response"))
            return
        if "error" in expect:
            if ran.reply.status != 500:
                raise Failed("500: the returned value cannot become a response", describe(ran.reply))
            words = strings_in(ran.reply.json) if ran.reply.json is not None else ran.reply.text
            for text in expect.get("mentions", []):
                if text not in words:
                    raise Failed(f"a 500 detail mentioning {text!r}", describe(ran.reply))
            return
        if vector.get("a_port_may_refuse") and ran.reply.status == 500:
            return  # a port that refuses what the platform would only soften (a strict port) keeps the contract
        body = c.response(ran.reply)
        if not same_json(body, expect["body"]):
            raise Failed(f"the body {show(expect['body'])}", show(body))
    return run


VECTOR_BUILDERS: List[Tuple[str, Callable[[Dict[str, Any], Dict[str, Any]], Optional[Callable[[Check], None]]]]] = [
    ("envelope", _envelope_vector),
    ("inbound", _inbound_vector),
    ("tool_names", _tool_name_vector),
    ("actor_labels", _actor_label_vector),
    ("proxy_requests", _proxy_request_vector),
    ("proxy_replies", _proxy_reply_vector),
    ("trace_events", _trace_vector),
    ("build_response", _build_response_vector),
]


# -- the last case: every body the suite received ---------------------------------------------------------------


def _no_token_anywhere(c: Check) -> None:
    if c.platform.leaks:
        raise Failed(f"no secret in any of the {c.platform.bodies_seen} responses received",
                     f"{len(c.platform.leaks)}: " + "; ".join(c.platform.leaks[:5]))


SCAN_CASE = Case("secrets.no_token_in_any_body", "§2 (run token: secret)",
                 "no run token or agent token in any response the suite received, any status", _no_token_anywhere)


def all_cases() -> List[Case]:
    """Every case, in the order they run; the secrets scan last."""
    return CASES + vector_cases() + [SCAN_CASE]


# ---------------------------------------------------------------------------
# Running: selection, a worker pool, progress, the report
# ---------------------------------------------------------------------------


def select(cases: Sequence[Case], only: Sequence[str] = (), skip: Sequence[str] = ()) -> List[Case]:
    """Cases matching ``only`` (all when empty) and no ``skip`` pattern.

    A pattern is an id, a group (``proxy``, ``vectors.proxy_replies``) or a glob (``proxy.retry_*``).
    """
    def matches(case_id: str, pattern: str) -> bool:
        return (case_id == pattern or case_id.startswith((pattern + ".", pattern + ":"))
                or fnmatch.fnmatchcase(case_id, pattern))

    return [c for c in cases if (not only or any(matches(c.id, p) for p in only))
            and not any(matches(c.id, p) for p in skip)]


def run_one(platform: Platform, case: Case) -> Result:
    started = time.monotonic()
    try:
        case.run(Check(platform, case))
        status, expected, got, note = "pass", None, None, None
    except Failed as failure:
        status, expected, got, note = "fail", failure.expected, failure.got, None
    except Skipped as skipped:
        status, expected, got, note = "skip", None, None, str(skipped)
    except Exception as exc:  # noqa: BLE001 - a checker bug must not hide the other results
        status, expected, got, note = "fail", "the case to run", f"a checker error: {type(exc).__name__}: {exc}", None
    redact = platform.redact
    return Result(case, status, expected and redact(expected), got and redact(got), note and redact(note),
                  (time.monotonic() - started) * 1000)


def run_cases(platform: Platform, cases: Sequence[Case], *, workers: int = 8,
              progress: Callable[[Result], None] = lambda r: None) -> List[Result]:
    """Run ``cases`` on a pool (the secrets scan after the others); results and progress in case order."""
    first = [c for c in cases if c is not SCAN_CASE]
    results: List[Result] = []
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="conformance-case") as pool:
        for future in [pool.submit(run_one, platform, c) for c in first]:
            results.append(future.result())
            progress(results[-1])
    if len(first) < len(cases):
        results.append(run_one(platform, SCAN_CASE))
        progress(results[-1])
    return results


def progress_line(result: Result) -> str:
    line = f"{result.status.upper():<4} {result.case.id}"
    if result.status == "fail":
        line += f": expected {result.expected} (CONTRACT {result.case.section}), got {result.got}"
    elif result.status == "skip":
        line += f": {result.note}"
    return line


def report(results: Sequence[Result]) -> str:
    """The failures, each with what was expected, what came back and the section; then the counts."""
    lines = []
    for result in results:
        if result.status == "fail":
            lines += [f"FAILED {result.case.id}: {result.case.title} (CONTRACT {result.case.section})",
                      f"  expected: {result.expected}", f"  got:      {result.got}"]
    counts = {s: sum(1 for r in results if r.status == s) for s in ("pass", "fail", "skip")}
    lines.append(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


class _UsageError(Exception):
    pass


def _patterns(text: Optional[str]) -> List[str]:
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog("check"),
        description="Check a port's dispatch endpoint (serving the conformance agent) against CONTRACT.md.",
    )
    parser.add_argument("url", nargs="?", metavar="URL", help="the dispatch endpoint, e.g. http://127.0.0.1:8080/dispatch")
    parser.add_argument("--token", metavar="T", help="the agent token the endpoint expects (default: $AGENT_TOKEN; "
                                                     "without one, the auth cases are skipped)")
    parser.add_argument("--auth-header", default="Authorization", metavar="NAME",
                        help="the registered auth header: Authorization (Bearer T) or a custom one with the raw value")
    parser.add_argument("--only", metavar="CASE[,CASE]", help="run only these cases (ids, groups or globs)")
    parser.add_argument("--skip", metavar="CASE[,CASE]", help="leave these cases out (ids, groups or globs)")
    parser.add_argument("--json", metavar="OUT|-", help="also write the results as JSON to OUT (- for stdout)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="per-request timeout (default 60)")
    parser.add_argument("--workers", type=int, default=8, metavar="N", help="cases run at once (default 8)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exit_:  # argparse printed its one-line error (or --help)
        return int(exit_.code or 0)
    try:
        return _run(args)
    except _UsageError as exc:
        print(f"conformance check: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("conformance check: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `... --list | head`: stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback (cases catch their own errors)
        print(f"conformance check: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import os

    cases = select(all_cases(), _patterns(args.only), _patterns(args.skip))
    if args.list:
        for c in cases:
            print(f"{c.id}\t{c.section}\t{c.title}")
        return 0
    if not args.url:
        raise _UsageError(f"give the dispatch endpoint URL ({prog('check')} URL), or --list")
    if not cases:
        raise _UsageError("--only/--skip leave no case to run (see --list)")
    if not re.fullmatch(r"[A-Za-z0-9-]+", args.auth_header):
        raise _UsageError(f"--auth-header must be an HTTP header name, got {args.auth_header!r}")
    if not 0 < args.timeout <= 3600 or not 1 <= args.workers <= 64:
        raise _UsageError("--timeout must be in (0, 3600] seconds and --workers in 1..64")
    token = args.token if args.token is not None else (os.environ.get("AGENT_TOKEN") or None)
    try:
        dispatcher = Dispatcher(args.url, token=token, auth_header=args.auth_header, timeout=args.timeout)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None
    with contextlib.ExitStack() as stack:
        proxy = stack.enter_context(MockProxy())
        stack.callback(dispatcher.close)
        _preflight(dispatcher, token)
        platform = Platform(dispatcher, proxy, token)
        out = sys.stderr
        print(f"conformance check: {len(cases)} cases against {args.url} (mock proxy at {proxy.origin})", file=out)
        results = run_cases(platform, cases, workers=args.workers,
                            progress=lambda r: print(platform.redact(progress_line(r)), file=out, flush=True))
        summary = report(results)
        if args.json:
            _write_json(args.json, args.url, results)
        print(summary, file=sys.stderr if args.json == "-" else sys.stdout, flush=True)
    return 1 if any(r.status == "fail" for r in results) else 0


def _preflight(dispatcher: Dispatcher, token: Optional[str]) -> None:
    """One ping first: an unreachable endpoint is one clear line (exit 2), not a page of failures."""
    try:
        reply = dispatcher.ping()
    except DispatchError as exc:
        raise _UsageError(str(exc)) from None
    if reply.status == 401 and not token:
        print("conformance check: warning: the endpoint wants a credential: pass --token (or set AGENT_TOKEN)",
              file=sys.stderr)
    elif reply.status in (404, 405):
        print(f"conformance check: warning: the ping got HTTP {reply.status}: is {dispatcher.url} the dispatch path?",
              file=sys.stderr)


def _write_json(where: str, url: str, results: Sequence[Result]) -> None:
    counts = {s: sum(1 for r in results if r.status == s) for s in ("pass", "fail", "skip")}
    doc = {"url": url, "passed": counts["pass"], "failed": counts["fail"], "skipped": counts["skip"],
           "cases": [r.to_json() for r in results]}
    text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    if where == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        with open(where, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise _UsageError(f"cannot write {where}: {exc.strerror or exc}") from None


if __name__ == "__main__":
    sys.exit(main())
