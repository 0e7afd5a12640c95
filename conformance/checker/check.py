"""``python3 -m conformance check URL``: does the agent endpoint at URL speak the contract?

    python3 -m conformance check URL [--token T] [--auth-header NAME] [--strict] [--profile wire|api]
                                     [--misconfigured] [--only CASE[,CASE]] [--skip CASE[,CASE]]
                                     [--json OUT|-] [--list] [--timeout SECONDS] [--workers N]

URL is a port's dispatch endpoint serving **the conformance agent**
(conformance/README.md).  The checker plays the platform: it starts a mock
per-run proxy on 127.0.0.1, posts dispatch envelopes pointing at it (one fresh
run and run token per case), scripts the proxy's replies, and compares what the
agent reports and what reached the proxy with CONTRACT.md.

**Levels.**  Every case checks rules of CONTRACT.md (ids such as
``auth-first``), and every failure names the rule it breaks; its level is that
rule's level (``rules.json``).  A broken MUST rule fails the case; a broken
SHOULD rule makes it a warning (a failure with ``--strict``); a broken MAY rule
(an optional feature done differently) a warning.  The default profile,
``wire``, holds a port to the platform's rules only; ``--profile api`` adds the
cases of pipelines_port's own choices (rules ``kit-*``, at level MUST there),
for ports that mirror its API.  ``--misconfigured`` runs the cases for an
endpoint started with its token variable unset instead.

Each case prints one line to stderr as it finishes.  The report ends with the
counts per level.  Exit status: 0 when no case failed, 1 when one did, 2 for
bad usage or an unreachable endpoint.  Tokens are never printed.
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
from urllib.parse import urlsplit

import pipelines_port as pp

from . import rules as contract
from . import vectorlib
from ..kit import prog
from ..harness.dispatcher import Dispatcher, DispatchError, Reply, Run, envelope_body, envelope_headers
from ..harness.mock_proxy import MockProxy, ProxyRun

__all__ = ["Case", "Finding", "Result", "Options", "all_cases", "select", "run_cases", "main"]

ISO_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|\+00:00)")
MIN_BACKOFF_S = 0.1  # the least wait that still counts as a backoff (§3.3)
BACKOFF_TRIES = 6  # fresh calls a short first wait gets before it counts as no backoff (full jitter can be short)
MAX_BACKOFF_S = 5.0  # the SDK caps each computed wait at 4 s, +25 % jitter at most
RETRY_SLACK_S = 2.0  # what a loaded machine may add to a wait before a retry counts as late
ENVELOPE_KEYS = ("tool_name", "source", "latency_ms", "matched_rule_index", "validation")
AGENT_SPEC = "README: the conformance agent"
RETRY_NOW = {"Retry-After": "0"}  # keeps the suite fast; the vectors check real waits
# A stack trace in a reply: Python's, a JavaScript one ("    at f (file.js:1:2)"), Go's, Java's.
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|File \"[^\"]+\", line \d+|\n\s+at \S+.*[:(]\d+|"
                       r"goroutine \d+ \[|\.(?:py|js|mjs|ts|go|rs|java):\d+")
_MISSING = object()


# ---------------------------------------------------------------------------
# Cases, findings and results
# ---------------------------------------------------------------------------


class Failed(Exception):
    """A case found the port off-contract: what was expected, what came back, and the rule it breaks.

    ``rule`` defaults to the case's first rule; ``hint`` is the likely cause, when one can be named.
    """

    def __init__(self, expected: str, got: str, rule: Optional[str] = None, hint: Optional[str] = None) -> None:
        super().__init__(f"expected {expected}, got {got}")
        self.expected = expected
        self.got = got
        self.rule = rule
        self.hint = hint


class Skipped(Exception):
    """A case that does not apply to this port or this run of the checker."""


class Finding(NamedTuple):
    """One broken rule: what was expected, what came back, and the likely cause."""

    rule: str
    level: str
    expected: str
    got: str
    hint: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        return {"rule": self.rule, "level": self.level, "kind": rule_kind(self.rule),
                "source": rule_source(self.rule), "section": contract.rule(self.rule).section,
                "expected": self.expected, "got": self.got, "hint": self.hint}


def rule_kind(rule_id: str) -> str:
    """``platform MUST``, ``platform SHOULD`` or ``kit`` (pipelines_port's own choice, ``--profile api``)."""
    rule = contract.rule(rule_id)
    return "kit" if rule_id.startswith("kit-") else f"platform {rule.level}"


def rule_source(rule_id: str) -> str:
    """Where a rule comes from: its own ``Source:`` sentence in CONTRACT.md, else the platform's documents (a
    platform rule) or the kit's choice (a ``kit-`` rule)."""
    text = contract.rule(rule_id).text
    if "Source: " in text:
        return text.split("Source: ", 1)[1].split(". ", 1)[0].rstrip(".")
    if rule_id.startswith("kit-"):
        return "pipelines_port's choice where the platform is silent (CONTRACT §7)"
    return "the platform's documents (the porting guide, the response schema)"


class Case(NamedTuple):
    id: str
    section: str  # the CONTRACT section it checks (or the agent spec)
    title: str
    run: Callable[[Check], None]
    rules: Tuple[str, ...] = ()  # the rules it checks, the main one first
    mode: str = "normal"  # "normal", or "misconfigured": for an endpoint whose token variable is unset

    @property
    def level(self) -> str:
        """The strongest level the case can fail at (its rules' strongest)."""
        return contract.level_of(self.rules)

    @property
    def profile(self) -> str:
        """``api`` for a case of pipelines_port's own choices (its main rule is ``kit-*``), else ``wire``."""
        return "api" if self.rules[0].startswith("kit-") else "wire"


class Options(NamedTuple):
    """How findings count: ``strict`` fails SHOULD rules too; ``profile`` api holds ports to the kit's rules."""

    strict: bool = False
    profile: str = "wire"

    def level(self, rule_id: str) -> str:
        """The level a broken ``rule_id`` counts at under these options."""
        if self.profile == "api" and rule_id.startswith("kit-"):
            return "MUST"
        return contract.rule(rule_id).level

    def status(self, level: str) -> str:
        return "fail" if level == "MUST" or (level == "SHOULD" and self.strict) else "warn"


DEFAULT_OPTIONS = Options()


class Result(NamedTuple):
    case: Case
    status: str  # "pass" | "fail" | "warn" | "skip"
    findings: Tuple[Finding, ...] = ()
    note: Optional[str] = None  # why a case was skipped
    cause: Optional[str] = None  # a cause several failures share (the proxy refused the run token, ...)
    duration_ms: float = 0.0

    @property
    def level(self) -> Optional[str]:
        """The strongest level among the findings (``None`` when there are none)."""
        return min((f.level for f in self.findings), key=contract.LEVELS.index) if self.findings else None

    @property
    def expected(self) -> Optional[str]:
        return self.findings[0].expected if self.findings else None

    @property
    def got(self) -> Optional[str]:
        return self.findings[0].got if self.findings else None

    def to_json(self) -> Dict[str, Any]:
        return {"id": self.case.id, "section": self.case.section, "title": self.case.title,
                "rules": list(self.case.rules), "level": self.case.level, "status": self.status,
                "failed_level": self.level, "findings": [f.to_json() for f in self.findings],
                "expected": self.expected, "got": self.got, "note": self.note, "cause": self.cause,
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


# A run token's random part is hex (the mock proxy's tokens): this many of its characters in a row, found in a
# reply, are a leak.  Twelve hex characters are 48 random bits: the hashes and ids a reply carries do not share
# them by chance (a 64-character hash against a whole check's tokens: about 1 in 10^8).
TOKEN_PART = 12
_HEX_RUN = re.compile(f"[0-9a-fA-F]{{{TOKEN_PART},}}")


class Platform:
    """What the checker shares between cases: the mock proxy, the dispatcher and the secrets."""

    def __init__(self, dispatcher: Dispatcher, proxy: MockProxy, agent_token: Optional[str],
                 options: Options = DEFAULT_OPTIONS) -> None:
        self.dispatcher = dispatcher
        self.proxy = proxy
        self.agent_token = agent_token
        self.options = options
        self._secrets: List[Tuple[str, str]] = [("the agent token", agent_token)] if agent_token else []
        self._token_parts: Dict[str, str] = {}  # every TOKEN_PART-long run of a run token's random part
        self._lock = threading.Lock()
        self._ids = iter(range(1000, 10 ** 9))
        self.bodies_seen = 0
        self.leaks: List[str] = []

    def new_run(self, **body_ids: Any) -> Tuple[Run, ProxyRun]:
        """A fresh run on the mock proxy, its run token registered as a secret."""
        proxy_run = self.proxy.new_run()
        random_part = proxy_run.token.rsplit("-", 1)[-1]
        with self._lock:
            number = next(self._ids)
            self._secrets.append(("a run token", proxy_run.token))
            for start in range(len(random_part) - TOKEN_PART + 1):
                self._token_parts[random_part[start:start + TOKEN_PART].lower()] = proxy_run.token
        ids = {"run_id": number, "task_id": number + 1, "agent_id": 8, "run_token_jti": uuid.uuid4().hex}
        ids.update(body_ids)
        return Run(run_token=proxy_run.token, proxy_url=proxy_run.url, **ids), proxy_run

    def leak_in(self, reply: Reply, case_id: str) -> Optional[str]:
        """Which secret ``reply`` shows in its body or headers, if any (remembered for the final scan).

        A run token shows when the whole of it does, or any ``TOKEN_PART`` characters of its random part (a
        token cut in two by a length limit still leaks)."""
        headers = "\n".join(reply.headers.values()).encode("utf-8", "replace")
        text = reply.body.decode("latin-1") + "\n" + headers.decode("latin-1")
        with self._lock:
            self.bodies_seen += 1
            found = next((what for what, secret in self._secrets
                          if secret.encode() in reply.body or secret.encode() in headers), None)
            if found is None and self._token_part(text):
                found = "a part of a run token"
            if found:
                self.leaks.append(f"{case_id}: HTTP {reply.status} showed {found}")
            return found

    def token_part_in(self, text: str) -> Optional[str]:
        """The first ``TOKEN_PART`` characters of a run token's random part that ``text`` shows, or None."""
        with self._lock:
            return self._token_part(text)

    def _token_part(self, text: str) -> Optional[str]:
        for match in _HEX_RUN.finditer(text):
            run = match.group(0).lower()
            for start in range(len(run) - TOKEN_PART + 1):
                if run[start:start + TOKEN_PART] in self._token_parts:
                    return run[start:start + TOKEN_PART]
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
        self.findings: List[Finding] = []
        self.proxy_runs: List[ProxyRun] = []  # every proxy run the case used (to explain refusals)

    def finding(self, expected: str, got: str, rule: Optional[str] = None, hint: Optional[str] = None) -> Finding:
        rule = rule or self.case.rules[0]
        return Finding(rule, self.platform.options.level(rule), expected, got, hint)

    def soft(self, expected: str, got: str, rule: str, hint: Optional[str] = None) -> None:
        """Record a broken rule and go on checking (for a rule weaker than what the case checks next)."""
        self.findings.append(self.finding(expected, got, rule, hint))

    # -- talking to the endpoint ---------------------------------------------------------

    def post(self, body: Any, headers: Mapping[str, str], repeated: Sequence[Tuple[str, str]] = ()) -> Reply:
        """POST ``body`` with exactly these headers (plus framing); every reply is scanned for secrets."""
        try:
            reply = self.platform.dispatcher.post(body, headers=headers, repeated=repeated)
        except DispatchError as exc:
            raise Failed("a reply", f"none: {exc}") from None
        self.scan(reply)
        return reply

    def scan(self, reply: Reply) -> None:
        leaked = self.platform.leak_in(reply, self.case.id)
        if leaked:
            rule = AGENT_TEXT_RULE if self.case.rules[0] == AGENT_TEXT_RULE else "run-token-secret"
            raise Failed("no run token or agent token in any response",
                         f"HTTP {reply.status} whose body or headers show {leaked}", rule)

    def credential(self, token: Optional[str] = None) -> Dict[str, str]:
        return self.platform.dispatcher.credential(token)

    def need_token(self) -> str:
        if not self.platform.agent_token:
            raise Skipped("no --token given: inbound auth is not checked")
        return self.platform.agent_token

    def new_run(self, **body_ids: Any) -> Tuple[Run, ProxyRun]:
        run, proxy_run = self.platform.new_run(**body_ids)
        self.proxy_runs.append(proxy_run)
        return run, proxy_run

    def dispatch(self, run: Run, body: Any = None, *, header_only: bool = False,
                 headers: Optional[Mapping[str, str]] = None, credential: bool = True, run_headers: bool = True,
                 **fields: Any) -> Reply:
        """A dispatch of ``run`` as the platform sends it (see :mod:`conformance.harness.dispatcher`).

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
               ran: Optional[Tuple[Run, ProxyRun]] = None, turn: Optional[Mapping[str, Any]] = None) -> Ran:
        """Dispatch a script (a fresh run unless ``ran`` is given); ``setup`` scripts the proxy first; ``turn`` (the
        multi-turn fields of §2.2) makes the dispatch a turn of a multi-turn run."""
        run, proxy_run = ran or self.new_run()
        if setup is not None:
            setup(proxy_run)
        body = envelope_body(run, user_instruction=compact({"steps": steps}))
        body["input"].update(turn or {})
        reply = self.dispatch(run, body)
        return Ran(run, proxy_run, reply)

    # -- reading what came back -------------------------------------------------------------

    def response(self, reply: Reply, what: str = "the agent's response") -> Dict[str, Any]:
        """The 200 body, checked against §4 and the seed schema (pp.validate_response)."""
        if reply.status != 200:
            raise Failed(f"HTTP 200 with {what}", describe(reply))
        if not isinstance(reply.json, dict):
            raise Failed(f"a JSON object body with {what} (CONTRACT §4)", describe(reply), "final-response-required")
        problems = [p for p in pp.validate_response(reply.json) if not p.startswith("warning:")]
        if any(vectorlib.path_of(p) in ("final_response", "body") for p in problems):
            raise Failed("a non-empty string final_response (§4)", "; ".join(problems[:3]), "final-response-required")
        if problems:
            raise Failed("a response body valid under §4's JSON Schema (§4.1)", "; ".join(problems[:3]),
                         "message-shape")
        return reply.json

    def turn_reply(self, reply: Reply, built: Mapping[str, Any], what: str) -> None:
        """The 200 body is the turn reply ``built`` as the agent built it (§4.2 turn-reply-as-built); keys beyond it
        are allowed, except with ``--profile api``."""
        if reply.status != 200:
            raise Failed(f"HTTP 200 with {what}", describe(reply))
        body = reply.json if isinstance(reply.json, dict) else None
        if body is None:
            raise Failed(f"a JSON object body with {what} (CONTRACT §4.2)", describe(reply))
        shown = body if self.platform.options.profile == "api" else {k: v for k, v in body.items() if k in built}
        if same_json(shown, built):
            return
        folded = "final_response" in body and "message" not in body
        raise Failed(f"{what} as built: {show(built)}", show(body), hint=(
            "the response builder folded the turn reply into a response envelope, losing session_done and its "
            "metadata: when the dispatch carries session_id or turn_id, send a value built by the turn-reply "
            "builder (or a mapping with message and session_done) as it is" if folded else None))

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


def expect_ok(outcome: Any, value: Any = _MISSING, what: str = "the call", rule: Optional[str] = None) -> Any:
    if not (isinstance(outcome, dict) and outcome.get("ok") is True and "value" in outcome):
        raise Failed(f"{what} to succeed", show(outcome), rule)
    if value is not _MISSING and not same_json(outcome["value"], value):
        raise Failed(f"{what} to give {show(value)}", show(outcome["value"]), rule)
    return outcome["value"]


def expect_error(outcome: Any, kind: str, status_code: Any = _MISSING, error_class: Any = _MISSING,
                 what: str = "the call", rule: Optional[str] = None) -> None:
    error = outcome.get("error") if isinstance(outcome, dict) and outcome.get("ok") is False else None
    wanted = f"{what} to fail with kind {kind!r}"
    if status_code is not _MISSING:
        wanted += f", status_code {show(status_code)}"
    if error_class is not _MISSING:
        wanted += f", error_class {show(error_class)}"
    got_kind = error.get("kind") if isinstance(error, dict) else None
    if got_kind != kind:
        if {got_kind, kind} == {"proxy", "stale_run_token"}:
            raise Failed(wanted, show(outcome), "stale-token-distinct",
                         "a 401 with run_token_expired / _invalid / _rejected is its own error kind; "
                         "any other 401 is an ordinary proxy error")
        raise Failed(wanted, show(outcome), rule)
    if status_code is not _MISSING and error.get("status_code") != status_code:
        raise Failed(wanted, show(outcome), rule)
    if error_class is not _MISSING and error.get("error_class") != error_class:
        raise Failed(wanted, show(outcome), "error-body-shapes",
                     "error_class may come as detail.error_class, error_class or detail (a string) (§3.3)")


def expect_requests(proxy_run: ProxyRun, count: int, why: str, rule: Optional[str] = None) -> List[Any]:
    """The run's requests, exactly ``count`` of them."""
    requests = list(proxy_run.requests)
    if len(requests) != count:
        raise Failed(f"{count} request(s) at the proxy ({why})", f"{len(requests)}: {paths(proxy_run, requests)}",
                     rule)
    return requests


def expect_nothing_sent(proxy_run: ProxyRun, rule: Optional[str] = None) -> None:
    if proxy_run.requests:
        raise Failed("nothing sent: refused locally, before any request",
                     f"{len(proxy_run.requests)} request(s): {paths(proxy_run, proxy_run.requests)}", rule)


def paths(proxy_run: ProxyRun, requests: Sequence[Any]) -> str:
    shown = [f"{r.path[len(proxy_run.base_path):] or r.path} -> {r.reply_status}" for r in requests[:6]]
    return ", ".join(shown) + (" …" if len(requests) > 6 else "")


def expect_same_key(requests: Sequence[Any], why: str, rule: str = "idempotency-key-reuse",
                    c: Optional[Check] = None) -> None:
    """One Idempotency-Key on every attempt; given ``c``, a missing or changing key is noted and checking goes on."""
    keys = [r.idempotency_key for r in requests]
    if not keys[0] or len(set(keys)) != 1:
        failure = Failed(f"one Idempotency-Key on every attempt ({why})", f"keys {show(keys)}", rule,
                         "make the key once per logical call, before the retry loop")
        if c is None:
            raise failure
        c.soft(failure.expected, failure.got, rule, failure.hint)


def is_uuid(text: Optional[str]) -> bool:
    try:
        uuid.UUID(text or "")
        return True
    except ValueError:
        return False


def expect_run_token(request: Any, run_token: str, c: Optional[Check] = None) -> None:
    """§3.1: the run token in ``Authorization: Bearer <t>`` or ``X-Pipelines-Run-Token: <t>``.

    Given ``c``, both headers at once (agreeing) are noted under ``one-token-header``.
    """
    wanted = "the run token in Authorization: Bearer <t> or X-Pipelines-Run-Token: <t>"
    auth = request.headers.get("authorization")
    header = request.headers.get("x-pipelines-run-token")
    if auth is None and header is None:
        raise Failed(wanted, "neither header sent", "run-token-auth")
    if auth is not None and request.bearer is None and header is None:
        raise Failed(wanted, "an Authorization header that is not Bearer <token>", "run-token-auth")
    if request.bearer is not None and header is not None and request.bearer != header:
        raise Failed("one run token: both headers sent, and they disagree", "two different values",
                     "run-token-auth", "the proxy refuses a request whose two token headers disagree (401 "
                     "run_token_invalid), so every call fails as stale_run_token: send one header only, "
                     "from this run's envelope")
    if request.run_token != run_token:
        raise Failed(wanted, "another token", "per-request-binding",  # never shown: it may be another run's
                     "the token of another run: is the envelope bound per request?")
    if c is not None and auth is not None and header is not None:
        c.soft("the run token in one of the two headers only", "both headers sent (with the same token)",
               "one-token-header")


def expect_request_shape(c: Check, request: Any, proxy_run: ProxyRun, run: Run, suffix: str) -> None:
    """§3.1: path, the run token, JSON content type; a UUID Idempotency-Key on a tool call (SHOULD: noted)."""
    if request.path != proxy_run.base_path + suffix:
        rule = "trace-endpoint" if suffix.startswith("/traces/") else "tool-endpoint"
        raise Failed(f"POST {{proxy_url}}{suffix}", f"POST {request.path} (proxy base {proxy_run.base_path})", rule,
                     "append /tools/{name} (or /traces/{type}) to the proxy URL, its trailing / stripped")
    expect_run_token(request, run.run_token, c)
    if not request.headers.get("content-type", "").startswith("application/json"):
        raise Failed("Content-Type: application/json", show(request.headers.get("content-type")), "args-object-body")
    if suffix.startswith("/tools/") and not is_uuid(request.idempotency_key):
        c.soft("an Idempotency-Key holding a UUID on a tool call", show(request.idempotency_key),
               "idempotency-key-per-call", "without a key, a retried call may run a mutating tool twice")


def expect_refused(ran: Ran, outcome: Any, what: str, *, or_by_proxy: bool = False,
                   rule: Optional[str] = None) -> None:
    """Refused locally: kind ``request``, nothing sent.

    With ``or_by_proxy`` (the contract does not ask for a local check) the
    proxy's refusal passes too: one request under ``/tools/`` or ``/traces/``
    (no further path segment), answered with a 4xx the call reports as kind
    ``proxy`` with that status.
    """
    error = outcome.get("error") if isinstance(outcome, dict) and outcome.get("ok") is False else None
    if not or_by_proxy or not isinstance(error, dict) or error.get("kind") != "proxy":
        expect_error(outcome, "request", what=what, rule=rule)
        expect_nothing_sent(ran.proxy, rule)
        return
    wanted = f"{what} refused: locally (kind request, nothing sent) or by the proxy (kind proxy, its 4xx)"
    requests = list(ran.proxy.requests)
    tail = requests[0].path[len(ran.proxy.base_path):] if len(requests) == 1 else ""
    kind, _, name = tail.lstrip("/").partition("/")
    if len(requests) != 1 or kind not in ("tools", "traces") or "/" in name:
        raise Failed(wanted + ", one request to {proxy_url}/tools/<name> (or /traces/<type>), the name percent-encoded",
                     f"{len(requests)} request(s): {paths(ran.proxy, requests)}", rule,
                     "a name with / or .. in it reached another path: check names locally, or percent-encode them")
    status = requests[0].reply_status
    if not (isinstance(status, int) and 400 <= status < 500 and error.get("status_code") == status):
        raise Failed(wanted, f"the proxy answered {status}, the call reported {show(outcome)}", rule)


# ---------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------

CASES: List[Case] = []
AGENT_TEXT_RULE = "agent-text-scrubbed"  # a token in text the agent wrote: SHOULD; one the wrapper adds: MUST


def case(case_id: str, section: str, title: str, rules: Sequence[str],
         mode: str = "normal") -> Callable[[Callable[[Check], None]], Callable[[Check], None]]:
    """Register a case checking ``rules`` (the main one first; each must be a rule of CONTRACT.md)."""
    for rule_id in rules:
        contract.rule(rule_id)

    def register(fn: Callable[[Check], None]) -> Callable[[Check], None]:
        CASES.append(Case(case_id, section, title, fn, tuple(rules), mode))
        return fn
    return register


def keywords_in(text: str, words: str) -> bool:
    """``words`` in ``text``, case-insensitively, ``_``, ``-`` and spaces alike ("proxy URL" ~ "proxy_url")."""
    def fold(s: str) -> str:
        return re.sub(r"[\s_-]+", " ", s.lower())
    return fold(words) in fold(text)


# -- §2 inbound: auth, ping, the 400s ---------------------------------------------------------


# Letters that are neither hex digits nor vowels: no id, hash or English word in a reply contains five in a row.
_ECHO_ALPHABET = "ghjkmnpqrstvwxz"
ECHO_WINDOW = 5


def echoed_part(sent: str, text: str) -> Optional[str]:
    """A run of ``ECHO_WINDOW`` characters of ``sent`` that ``text`` shows, or None."""
    for start in range(len(sent) - ECHO_WINDOW + 1):
        if sent[start:start + ECHO_WINDOW] in text:
            return sent[start:start + ECHO_WINDOW]
    return None


@case("auth.ping_wrong_credential", "§2 step 1", "a ping with a wrong or missing credential gets 401, before the ping",
      ["auth-first", "auth-401-no-echo"])
def _(c: Check) -> None:
    c.need_token()
    wrong = "".join(secrets.choice(_ECHO_ALPHABET) for _ in range(32))
    for label, headers in (("a wrong credential", c.credential(wrong)), ("no credential", {})):
        reply = c.post({"ping": True}, headers)
        if reply.status != 401:
            raise Failed(f"401 for a ping with {label} (auth comes first)", describe(reply))
        shown = echoed_part(wrong, reply.text)
        if shown:
            raise Failed("a 401 body that never echoes the credential received, not even a part of it",
                         f"{describe(reply)} (shows {shown!r} of the credential sent)", "auth-401-no-echo",
                         hint="say which header was wrong, never what it held: a part of a near miss is a part of "
                              "the real token")


def credential_variants(token: str, header: str) -> List[Tuple[str, Dict[str, str]]]:
    """Credentials that differ from the configured one in one way each, as header sets."""
    bearer = header.lower() == "authorization"
    value = (lambda t: f"Bearer {t}") if bearer else (lambda t: t)
    middle = len(token) // 2
    variants = [
        ("one character short", {header: value(token[:-1])}),
        ("one character longer", {header: value(token + "x")}),
        ("the token with a second word after it", {header: value(token + " x")}),
        ("a prefix of the token", {header: value(token[:max(1, middle)])}),
        ("the token with a space inside", {header: value(token[:middle] + " " + token[middle:])}),
        ("an empty value", {header: value("")}),
        ("the token in another header", {("X-API-Key" if bearer else "Authorization"):
                                         (token if bearer else f"Bearer {token}")}),
    ]
    if token.swapcase() != token:
        variants.append(("the token in another case", {header: value(token.swapcase())}))
    if bearer:
        variants += [("the bare token, no scheme", {header: token}),
                     ("another scheme (Basic)", {header: f"Basic {token}"}),
                     ("another scheme (Token)", {header: f"Token {token}"}),
                     ("the scheme alone", {header: "Bearer"})]
    return variants


@case("auth.credential_variants", "§2 step 1",
      "a credential that differs from the configured one in any way (length, case, scheme, header) gets 401",
      ["auth-401-no-echo", "auth-first"])
def _(c: Check) -> None:
    token = c.need_token()
    header = c.platform.dispatcher.auth_header
    accepted = [label for label, headers in credential_variants(token, header)
                if c.post({"ping": True}, headers).status == 200]
    if accepted:
        raise Failed("401 for every credential other than the configured one",
                     f"200 for {len(accepted)}: " + "; ".join(accepted), hint=(
                         "compare the whole value byte for byte (constant time), after the scheme; "
                         "no prefix match, no case folding, no whitespace removal"))
    right, wrong = c.credential()[header], next(iter(c.credential("wrong-" + secrets.token_hex(6)).values()))
    both = [c.post({"ping": True}, {}, repeated=[(header, first), (header, second)]).status
            for first, second in ((right, wrong), (wrong, right))]
    if both == [200, 200]:
        raise Failed(f"two {header} headers, one wrong: refused in at least one order (401 or 400)",
                     "200 whichever comes first", hint="a request carries one credential: do not accept it when "
                     "any of several values matches")


@case("auth.dispatch_without_credential", "§2 step 1", "a dispatch without the credential gets 401 and runs nothing",
      ["auth-401-no-echo"])
def _(c: Check) -> None:
    c.need_token()
    run, proxy_run = c.new_run()
    reply = c.dispatch(run, credential=False, user_instruction=compact({"steps": [{"call": "get_order", "args": {}}]}))
    if reply.status != 401:
        raise Failed("401 for a dispatch without the credential", describe(reply))
    expect_nothing_sent(proxy_run)


@case("ping.exact", "§2 step 3", 'the ping {"ping": true} with the credential gets 200 {"ok": true}',
      ["ping-exact", "ping-ok-body"])
def _(c: Check) -> None:
    reply = c.post({"ping": True}, c.credential())
    if reply.status != 200:
        raise Failed("HTTP 200, the agent not run", describe(reply))
    if not isinstance(reply.json, dict) or reply.json.get("ok") is not True:
        raise Failed('the body {"ok": true} (the porting guide\'s reference wrapper)', describe(reply), "ping-ok-body")


@case("ping.strict", "§2 step 3", '{"ping": true, "x": 1} and {"ping": 1} are dispatches, not pings', ["ping-strict"])
def _(c: Check) -> None:
    for body in ({"ping": True, "x": 1}, {"ping": 1}):
        run, _ = c.new_run()
        reply = c.dispatch(run, body)
        if reply.status != 200 or not isinstance(reply.json, dict) or "final_response" not in reply.json:
            raise Failed(f"{show(body)} dispatched to the agent (echo mode), not answered as a ping", describe(reply))
        echoed = c.echo(reply)
        if not same_json(echoed.get("raw"), body):
            raise Failed(f"the agent to see the body {show(body)}", show(echoed.get("raw")), "unknown-fields-available")


@case("auth.invalid_json_without_credential", "§2 steps 1-2",
      "a body that is not JSON, without the credential, gets 401: auth comes before parsing", ["auth-first"])
def _(c: Check) -> None:
    c.need_token()
    run, _ = c.new_run()
    reply = c.dispatch(run, b'{"input": {"user_instruction": "x"}, oops', credential=False)
    if reply.status != 401:
        raise Failed("401 for invalid JSON without the credential (auth runs before the body is parsed)",
                     describe(reply))


@case("http.invalid_json", "§2 step 2", "a body that is not JSON gets 400", ["invalid-json-400"])
def _(c: Check) -> None:
    run, _ = c.new_run()
    reply = c.dispatch(run, b'{"input": {"user_instruction": "x"}, oops')
    if reply.status != 400:
        raise Failed("400 for invalid JSON", describe(reply))


@case("http.non_object_body", "§2 steps 2-5", "a JSON body that is not an object gets 400", ["kit-non-object-body-400"])
def _(c: Check) -> None:
    for body in ([{"ping": True}], "hello", 3, None):
        run, _ = c.new_run()
        reply = c.dispatch(run, json.dumps(body).encode())
        if reply.status != 400:
            raise Failed(f"400 for the JSON body {show(body)}", describe(reply))


# Request heads a front end and a lenient parser could frame differently (RFC 9112 sections 2.2, 5.1, 5.2, 6.1, 6.3):
# each is sent with a whole second dispatch as its body, which must never run.
SMUGGLING_HEADS: List[Tuple[str, List[str]]] = [
    ("whitespace before a colon", ["Content-Length : {n}"]),
    ("a tab before a colon", ["Content-Length: {n}", "Transfer-Encoding\t: chunked"]),
    ("a field line without a colon", ["NoColonHere", "Content-Length: {n}"]),
    ("a bare CR in a value", ["X-Note: a\rContent-Length: {n}"]),
    ("obs-fold", ["X-Note: a", " Content-Length: {n}"]),
    ("Transfer-Encoding with Content-Length", ["Content-Length: {n}", "Transfer-Encoding: chunked"]),
    ("two different Content-Lengths", ["Content-Length: {n}", "Content-Length: 0"]),
]


@case("http.no_smuggling", "§2.3 step 0", "a head a front end could frame differently gets a whole refusal and a "
      "close; the request hidden in its body never runs", ["no-request-smuggling"])
def _(c: Check) -> None:
    dispatcher = c.platform.dispatcher
    host = f"Host: {urlsplit(dispatcher.url).netloc}"
    credential = [f"{k}: {v}" for k, v in c.credential().items()]
    problems: List[str] = []
    for what, fields in SMUGGLING_HEADS:
        run, proxy_run = c.new_run()
        body = json.dumps(envelope_body(run, user_instruction=compact({"steps": [
            {"call": "smuggled", "args": {}}]}))).encode()
        inner_lines = [f"POST {dispatcher.path} HTTP/1.1", host, *credential, "Content-Type: application/json",
                       *(f"{k}: {v}" for k, v in envelope_headers(run).items()), f"Content-Length: {len(body)}"]
        inner = ("\r\n".join(inner_lines) + "\r\n\r\n").encode("latin-1") + body
        outer = [f"POST {dispatcher.path} HTTP/1.1", host, *credential, *(f.replace("{n}", str(len(inner)))
                                                                         for f in fields)]
        reply = dispatcher.raw(("\r\n".join(outer) + "\r\n\r\n").encode("latin-1") + inner)
        for _ in range(10):  # a hidden request parsed after the reply runs a moment later
            if proxy_run.calls():
                break
            time.sleep(0.05)
        if proxy_run.calls():
            problems.append(f"{what}: the dispatch hidden in its body ran (its run reached the proxy)")
        elif reply.status == 0:
            problems.append(f"{what}: " + (f"a reply without a status line ({reply.data[:40]!r})" if reply.data
                                             else "no reply at all"))
        elif not 400 <= reply.status < 600:
            problems.append(f"{what}: answered {reply.status}, not a refusal")
        elif not reply.closed:
            problems.append(f"{what}: {reply.status}, and the connection stayed open for more requests")
    if problems:
        raise Failed("each refused (400, 411 or 501) with a status line, then the connection closed",
                     "; ".join(problems),
                     hint="use a strict HTTP/1.1 parser (Node's and Go's servers refuse these by default)")


@case("envelope.missing_proxy_url", "§2 step 5", "a dispatch without a proxy URL gets 400 naming it",
      ["envelope-missing-400", "envelope-missing-named"])
def _(c: Check) -> None:
    run, proxy_run = c.new_run()
    steps = compact({"steps": [{"call": "get_order", "args": {}}]})
    body = {"run_id": run.run_id, "input": {"user_instruction": steps}}
    reply = c.post(body, {"X-Pipelines-Run-Token": run.run_token, **c.credential()})
    if reply.status != 400:
        raise Failed("400 for a dispatch without a proxy URL", describe(reply))
    expect_nothing_sent(proxy_run)
    if not keywords_in(reply.text, "proxy"):
        c.soft("a 400 message naming what is missing: the proxy URL", describe(reply), "envelope-missing-named")


@case("envelope.missing_run_token", "§2 step 5", "a dispatch without X-Pipelines-Run-Token gets 400 naming it",
      ["envelope-missing-400", "envelope-missing-named"])
def _(c: Check) -> None:
    run, proxy_run = c.new_run()
    headers = {"X-Pipelines-Odyssey-Proxy-Url": run.proxy_url, "X-Pipelines-Run-Id": str(run.run_id)}
    reply = c.dispatch(run, run_headers=False, headers=headers,
                       user_instruction=compact({"steps": [{"call": "get_order", "args": {}}]}))
    if reply.status != 400:
        raise Failed("400 for a dispatch without a run token", describe(reply))
    expect_nothing_sent(proxy_run)
    if not keywords_in(reply.text, "token"):
        c.soft("a 400 message naming what is missing: the run token", describe(reply), "envelope-missing-named")


# -- the misconfigured endpoint (--misconfigured: started with its token variable unset) ------------------------


@case("misconfigured.refuses_everything", "§2 step 1",
      "an endpoint whose token variable is unset answers 503 to everything, and runs nothing",
      ["auth-first", "auth-env-unset-503", "auth-disable-explicit"], mode="misconfigured")
def _(c: Check) -> None:
    run, proxy_run = c.new_run()
    script = compact({"steps": [{"call": "get_order", "args": {}}]})
    tries = [("a ping without a credential", lambda: c.post({"ping": True}, {})),
             ("a ping with a credential", lambda: c.post({"ping": True}, c.credential("any-" + secrets.token_hex(4)))),
             ("a dispatch", lambda: c.dispatch(run, user_instruction=script))]
    for label, send in tries:
        reply = send()
        if 200 <= reply.status < 300:
            raise Failed(f"{label} refused: no token is configured, so no credential can be checked",
                         describe(reply), "auth-first", "with the token variable unset the endpoint must not run "
                         "open; disabling auth is an explicit operator choice")
        if reply.status != 503:
            c.soft(f"503 for {label}: the wrapper is misconfigured (not 401: the caller did nothing wrong)",
                   describe(reply), "auth-env-unset-503")
            break
    expect_nothing_sent(proxy_run, "auth-first")


# -- §2 the envelope --------------------------------------------------------------------------

# The rule each echoed envelope field is read by (§2.2).
FIELD_RULES = {
    "proxy_url": "proxy-url-source", "run_token": "envelope-missing-400", "run_token_sha256": "envelope-missing-400",
    "run_id": "ids-body-then-headers", "task_id": "ids-body-then-headers", "agent_id": "native-id-types",
    "run_token_jti": "ids-body-then-headers", "user_instruction": "prompt-field", "task_input": "task-input-nesting",
    "latest_user_prompt": "multi-turn-fields", "session_id": "multi-turn-fields", "turn_id": "multi-turn-fields",
    "messages": "multi-turn-fields", "scenario_state": "multi-turn-fields", "workspace": "workspace-field",
    "tools_schema": "tools-schema-inline", "sub_agents": "kit-sub-agents-catalog", "api_url": "proxy-url-source",
    "raw": "unknown-fields-available",
}


def field_rule(c: Check, path: str, wanted: Any, got: Any) -> str:
    """The rule an echoed field breaks: the field's own, capped at the case's level ("min" of the two)."""
    rule = FIELD_RULES.get(path.split(".")[0], c.case.rules[0])
    if path.split(".")[0] in ("run_id", "task_id", "agent_id") and str(got) == str(wanted):
        rule = "native-id-types"  # the value arrived, with another type
    levels = contract.LEVELS
    main = c.case.rules[0]
    return rule if levels.index(contract.rule(rule).level) >= levels.index(contract.rule(main).level) else main


def compare_echo(c: Check, echoed: Mapping[str, Any], wanted: Mapping[str, Any]) -> None:
    """Each field as wanted; a field read by a weaker rule than the case's is noted and the rest compared."""
    for path, value in wanted.items():
        got: Any = echoed
        for part in path.split("."):
            got = got.get(part, "<absent>") if isinstance(got, dict) else "<absent>"
        if not same_json(got, value):
            rule = field_rule(c, path, value, got)
            expected = f"{path} = {show(value, 200)}"
            if contract.rule(rule).level == "MUST":
                raise Failed(expected, show(got, 200), rule)
            c.soft(expected, show(got, 200), rule)


@case("envelope.echo", "§2", "every envelope field reaches the agent with its native type; unknown fields kept",
      ["unknown-fields-tolerated", "prompt-field", "task-input-nesting", "proxy-url-source", "native-id-types",
       "kit-sub-agents-catalog", "unknown-fields-available", "tools-schema-inline"])
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
    compare_echo(c, echoed, wanted)


@case("envelope.header_fallback", "§2", "proxy URL, ids and jti come from the headers when the body lacks them",
      ["proxy-url-source", "ids-body-then-headers"])
def _(c: Check) -> None:
    run, proxy_run = c.new_run()
    run = run._replace(proxy_url=run.proxy_url + "/")
    echoed = c.echo(c.dispatch(run, header_only=True, user_instruction="hello"))
    compare_echo(c, echoed, {"proxy_url": proxy_run.url, "run_token_sha256": sha256(run.run_token),
                             "run_id": str(run.run_id), "task_id": str(run.task_id),
                             "run_token_jti": run.run_token_jti})


@case("envelope.header_names_any_case", "§2.1", "header names are matched in any case",
      ["headers-case-insensitive"])
def _(c: Check) -> None:
    run, proxy_run = c.new_run()
    headers = {"x-pipelines-run-token": run.run_token, "X-PIPELINES-ODYSSEY-PROXY-URL": run.proxy_url,
               "x-Pipelines-Run-Id": str(run.run_id)}
    body = envelope_body(run, header_only=True, user_instruction="hello")
    echoed = c.echo(c.dispatch(run, body, run_headers=False, headers=headers))
    compare_echo(c, echoed, {"proxy_url": proxy_run.url, "run_token_sha256": sha256(run.run_token)})


@case("envelope.sub_agents_catalog", "§2.2", "the declared sub_agents: labels and {actor_id} objects, trimmed, "
      "malformed entries skipped", ["kit-sub-agents-catalog", "actor-label-trim"])
def _(c: Check) -> None:
    run, _ = c.new_run()
    declared = ["  triage ", {"actor_id": " billing/refunds"}, 7, {"name": "x"}, "", None, "triage"]
    echoed = c.echo(c.dispatch(run, user_instruction="hello", sub_agents=declared))
    got = echoed.get("sub_agents")
    if not isinstance(got, list) or not all(isinstance(label, str) for label in got):
        raise Failed('sub_agents as a list of label strings (["triage", "billing/refunds"])', show(got))
    unique = list(dict.fromkeys(label.strip() for label in got))
    if unique != ["triage", "billing/refunds"]:
        raise Failed('the labels "triage" and "billing/refunds", malformed entries skipped', show(got))
    if any(label != label.strip() for label in got):
        c.soft("labels trimmed before use", show(got), "actor-label-trim")


# -- §3.1 the request a tool call sends --------------------------------------------------------


@case("proxy.request_shape", "§3.1",
      "POST {proxy_url}/tools/{name}, the run token in one header, the args as the JSON body",
      ["tool-endpoint", "run-token-auth", "args-object-body", "one-token-header", "idempotency-key-per-call",
       "actor-absent-no-header"])
def _(c: Check) -> None:
    args = {"order_id": "4521", "n": 2, "nested": {"tags": ["a", "ü"]}}
    ran = c.script([{"call": "get_order", "args": args}])
    results = c.results(ran, 1)
    requests = list(ran.proxy.requests)
    if requests:  # the request's shape first: it explains a refused call better than the outcome does
        expect_request_shape(c, requests[0], ran.proxy, ran.run, "/tools/get_order")
    expect_ok(results[0])
    (request,) = expect_requests(ran.proxy, 1, "one call")
    if request.json != args:
        raise Failed(f"the JSON body {show(args)}", show(request.json) if request.json is not None
                     else repr(request.body[:200]), "args-object-body")
    if request.actor is not None:
        raise Failed("no X-Pipelines-Actor-Id without an actor", show(request.actor), "actor-absent-no-header")


@case("proxy.idempotency_fresh", "§3.1", "one fresh Idempotency-Key per logical tool call",
      ["idempotency-key-per-call"])
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {"order_id": "1"}}, {"call": "get_order", "args": {"order_id": "1"}}])
    for outcome in c.results(ran, 2):
        expect_ok(outcome)
    first, second = expect_requests(ran.proxy, 2, "two calls")
    if not first.idempotency_key or not second.idempotency_key:
        raise Failed("an Idempotency-Key on each of two calls", f"{show(first.idempotency_key)} and "
                     f"{show(second.idempotency_key)}", hint="without a key, a retried call may run a mutating "
                     "tool twice: make a fresh UUID per logical call")
    if first.idempotency_key == second.idempotency_key:
        raise Failed("a different Idempotency-Key on each of two calls",
                     f"{show(first.idempotency_key)} and {show(second.idempotency_key)}",
                     hint="a repeated key makes the proxy replay the first call's result to the second call")


@case("proxy.idempotency_reused_on_retry", "§3.1, §3.3", "a retried call reuses its Idempotency-Key",
      ["idempotency-key-reuse", "retry-429"])
def _(c: Check) -> None:
    ran = c.script([{"call": "refund_order", "args": {"order_id": "1"}}], setup=lambda p: p.script(
        "refund_order", [{"status": 429, "headers": RETRY_NOW, "error_class": "rate_limited", "message": "slow down"},
                         {"response": {"refunded": True}}]))
    expect_ok(c.outcome(ran), {"refunded": True}, rule="retry-429")
    expect_same_key(expect_requests(ran.proxy, 2, "a 429, then the retry", "retry-429"),
                    "a retry must never re-run a mutating tool")


# -- §3.2 reading the reply ------------------------------------------------------------------------


@case("proxy.unwrap", "§3.2", "the agent gets the response, never the trace envelope around it", ["unwrap-response"])
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {}}], setup=lambda p: p.script(
        "get_order", [{"response": {"status": "shipped"}, "latency_ms": 412}]))
    value = expect_ok(c.outcome(ran))
    leaked = [k for k in ENVELOPE_KEYS if isinstance(value, dict) and k in value]
    if leaked or not same_json(value, {"status": "shipped"}):
        raise Failed('the unwrapped response {"status":"shipped"}', show(value))


@case("proxy.string_not_decoded_twice", "§3.2", 'a string response stays a string: "{\\"a\\": 1}" is not decoded again',
      ["no-double-decode"])
def _(c: Check) -> None:
    ran = c.script([{"call": "a", "args": {}}, {"call": "b", "args": {}}], setup=lambda p: (
        p.script("a", [{"response": '{"a": 1}'}]), p.script("b", [{"response": "pong"}])))
    first, second = c.results(ran, 2)
    expect_ok(first, '{"a": 1}', "a tool answering the string '{\"a\": 1}'")
    expect_ok(second, "pong", "a tool answering the string 'pong'")


@case("proxy.non_json_reply", "§3.2", "a non-JSON 200 body (an older proxy) arrives as the original text",
      ["kit-legacy-whole-body"])
def _(c: Check) -> None:
    ran = c.script([{"call": "export_csv", "args": {}}], setup=lambda p: p.script(
        "export_csv", [{"body": "id,total\n1,9.5\n", "headers": {"Content-Type": "text/csv"}}]))
    expect_ok(c.outcome(ran), "id,total\n1,9.5\n")


@case("proxy.tool_error_is_value", "§3.2", "a tool-level error (200, source error) is a result, not an exception",
      ["tool-errors-are-values"])
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {}}], setup=lambda p: p.script(
        "get_order", [{"response": {"error": "order not found"}, "source": "error"}]))
    expect_ok(c.outcome(ran), {"error": "order not found"})


@case("proxy.slow_reply", "§3.1", "a slow tool (the simulator may take long) is waited for", ["generous-timeout"])
def _(c: Check) -> None:
    ran = c.script([{"call": "slow_tool", "args": {}}], setup=lambda p: p.script(
        "slow_tool", [{"response": "done", "delay_s": 0.5}]))
    expect_ok(c.outcome(ran), "done")


@case("proxy.oversized_reply", "§7.5", "a reply over the 1 MiB response cap is refused, not handed to the agent",
      ["kit-reply-cap"])
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


@case("proxy.retry_429", "§3.3", "429 is retried (Retry-After honoured)", ["retry-429", "idempotency-key-reuse"])
def _(c: Check) -> None:
    retried(c, {"status": 429, "headers": RETRY_NOW, "error_class": "rate_limited", "message": "slow down"}, "429")


for _class in sorted(pp.TRANSIENT_503_CLASSES):
    def _transient(c: Check, error_class: str = _class) -> None:
        retried(c, {"status": 503, "headers": RETRY_NOW, "error_class": error_class, "message": "try again"},
                f"503 {error_class}")
    case(f"proxy.retry_503_{_class}", "§3.3", f"503 {_class} is transient: retried",
         ["retry-transient", "idempotency-key-reuse"])(_transient)


# Twenty calls; their waits sorted, the 2nd to the 15th must spread by 40 ms.  A loaded machine delays some retries
# of a port without jitter by 40 ms and more (seen with four checks at once on 2 cores): the window leaves out the
# shortest wait and the five longest, so a few delayed ones do not pass it.  With the SDK's ±25 % on 0.5 s, those
# fourteen fall within 40 ms of each other less than once in a million.
JITTER_CALLS = 20
JITTER_WINDOW = slice(1, 15)
MIN_JITTER_SPREAD_S = 0.04


@case("proxy.backoff_jitter", "§3.3",
      f"{JITTER_CALLS} calls meeting a 429 at once do not all retry after the same wait", ["bounded-backoff"])
def _(c: Check) -> None:
    names = [f"busy_{n}" for n in range(JITTER_CALLS)]

    def setup(proxy_run: ProxyRun) -> None:
        for name in names:
            proxy_run.script(name, [{"status": 429, "error_class": "rate_limited", "message": "slow down"},
                                    {"response": "after-retry"}])

    ran = c.script([{"parallel": [{"call": name, "args": {}} for name in names]}], setup=setup)
    gaps = []
    for name in names:
        attempts = [r for r in ran.proxy.requests if r.name == name]
        if len(attempts) != 2:
            raise Failed(f"{name}: the 429, then one retry", f"{len(attempts)} request(s)", "retry-429")
        # From the moment the 429 was written: how long the proxy took to answer each call is not the port's wait.
        gaps.append(attempts[1].time - (attempts[0].replied or attempts[0].time))
    window = sorted(gaps)[JITTER_WINDOW]
    if window[-1] - window[0] < MIN_JITTER_SPREAD_S:
        raise Failed(f"retry waits spread by jitter (the SDK: 0.5 s ±25 %): the 2nd to the 15th shortest at least "
                     f"{MIN_JITTER_SPREAD_S * 1000:g} ms apart",
                     "waits of " + ", ".join(f"{g:.3f} s" for g in sorted(gaps)),
                     hint="without jitter, clients that met the same 429 retry together and meet it again")


@case("proxy.retry_bounded", "§3.3", "a 429 that never clears ends in an error after a few attempts",
      ["bounded-backoff"])
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
        outcome = c.outcome(ran)
        if isinstance(outcome, dict) and outcome.get("ok") is True:
            raise Failed(f"the call to fail: {status} is terminal", show(outcome), "terminal-no-retry",
                         "only 429 and the transient 503 classes are retried")
        expect_error(outcome, "proxy", status, error_class, rule="error-body-shapes")
        expect_requests(ran.proxy, 1, f"{status} is terminal: no retry")
    _name = f"proxy.terminal_{_status}" + (f"_{_class}" if _status == 503 else "")
    case(_name, "§3.3", f"{_status} {_class or '(no class)'} is terminal: no retry, a proxy error",
         ["terminal-no-retry", "error-body-shapes"])(_terminal)


@case("proxy.stale_run_token", "§3.3", "401 run_token_expired / _invalid / _rejected is its own error kind",
      ["stale-token-distinct"])
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


@case("proxy.transport_refused", "§3.3", "a refused connection is a transport error", ["transport-retry-with-key"])
def _(c: Check) -> None:
    run, _ = c.new_run()
    run = run._replace(proxy_url=f"http://127.0.0.1:{dead_port()}/api/odyssey-proxy/runs/gone")
    ran = c.script([{"call": "get_order", "args": {}}], ran=(run, c.platform.proxy.new_run()))
    expect_error(c.outcome(ran), "transport", None)


@case("proxy.transport_dropped", "§3.3",
      "a connection dropped before the reply is a transport error; retries reuse the key",
      ["transport-retry-with-key"])
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {}}], setup=lambda p: p.script("get_order", [{"drop": True}]))
    expect_error(c.outcome(ran), "transport", None)
    requests = ran.proxy.requests
    if not 1 <= len(requests) <= 4:
        raise Failed("1 to 4 attempts (the SDK raises at once; its MCP shim retries twice)", f"{len(requests)}")
    expect_same_key(requests, "transport retries are only safe with the same key", "transport-retry-with-key")


@case("proxy.transport_retry_same_key", "§3.3",
      "a dropped connection, then a success: no retry, or one with the same key", ["transport-retry-with-key"])
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {}}], setup=lambda p: p.script(
        "get_order", [{"drop": True}, {"response": "after-retry"}]))
    outcome = c.outcome(ran)
    if isinstance(outcome, dict) and outcome.get("ok") is True:
        expect_ok(outcome, "after-retry")
        expect_same_key(expect_requests(ran.proxy, 2, "the dropped attempt, then the retry"), "same logical call",
                        "transport-retry-with-key")
    else:
        expect_error(outcome, "transport", None)
        expect_requests(ran.proxy, 1, "no retry")


# -- §3.5 actor labels ---------------------------------------------------------------------------------


@case("actor.header", "§3.5", "an actor label is sent as X-Pipelines-Actor-Id; an actor_id argument passes untouched",
      ["actor-header-authoritative"])
def _(c: Check) -> None:
    args = {"order_id": "1", "actor_id": "customer-7"}
    ran = c.script([{"call": "refund_order", "args": args, "actor": "supervisor/refunds"}])
    expect_ok(c.outcome(ran))
    (request,) = expect_requests(ran.proxy, 1, "one call")
    if request.actor != "supervisor/refunds":
        raise Failed("X-Pipelines-Actor-Id: supervisor/refunds", show(request.actor))
    if request.json != args:
        raise Failed(f"the arguments untouched: {show(args)}", show(request.json))


@case("actor.trimmed", "§3.5", "an actor label is trimmed", ["actor-label-trim"])
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {}, "actor": "  refunds  "}])
    outcome = c.outcome(ran)
    requests = list(ran.proxy.requests)
    if requests and requests[0].actor is not None and requests[0].actor != "refunds":
        raise Failed("X-Pipelines-Actor-Id: refunds", show(requests[0].actor))
    expect_ok(outcome)
    (request,) = expect_requests(ran.proxy, 1, "one call")
    if request.actor != "refunds":
        raise Failed("X-Pipelines-Actor-Id: refunds", show(request.actor))


@case("actor.absent_when_empty", "§3.5", "no actor, or an empty one, sends no X-Pipelines-Actor-Id header",
      ["actor-absent-no-header", "actor-label-trim"])
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {}}, {"call": "get_order", "args": {}, "actor": ""},
                    {"call": "get_order", "args": {}, "actor": "  "}])
    results = c.results(ran, 3)
    for outcome in results[:2]:
        expect_ok(outcome)
    for request in list(ran.proxy.requests)[:2]:
        if "x-pipelines-actor-id" in request.headers:
            raise Failed("no X-Pipelines-Actor-Id header for no actor or an empty one",
                         show(request.headers["x-pipelines-actor-id"]))
    blank = list(ran.proxy.requests)[2:]
    if not (isinstance(results[2], dict) and results[2].get("ok")) or (
            blank and "x-pipelines-actor-id" in blank[0].headers):
        c.soft("a blank actor label trimmed to nothing: no header, the call made", show(results[2]),
               "actor-label-trim")


@case("actor.malformed_refused", "§3.5", "a malformed actor label is refused locally: nothing sent",
      ["actor-validate-locally"])
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {}, "actor": "a//b"}])
    expect_error(c.outcome(ran), "request", what="a call with actor 'a//b'")
    expect_nothing_sent(ran.proxy)


@case("actor.undeclared_allowed", "§3.5", "labels in and out of the declared sub_agents catalog are both sent",
      ["actor-undeclared-allowed", "actor-header-authoritative"])
def _(c: Check) -> None:
    run, proxy_run = c.new_run()
    steps = [{"call": "get_order", "args": {}, "actor": "triage"},
             {"call": "get_order", "args": {}, "actor": "billing/refunds"}]
    reply = c.dispatch(run, user_instruction=compact({"steps": steps}), sub_agents=["triage", {"actor_id": "support"}])
    ran = Ran(run, proxy_run, reply)
    declared, undeclared = c.results(ran, 2)
    expect_ok(declared, what="a call by the declared sub-agent 'triage'", rule="actor-header-authoritative")
    sent = {r.actor: r for r in proxy_run.requests}
    if "triage" not in sent:
        raise Failed("X-Pipelines-Actor-Id: triage on the declared sub-agent's call", show(list(sent)),
                     "actor-header-authoritative")
    if not (isinstance(undeclared, dict) and undeclared.get("ok")) or "billing/refunds" not in sent:
        raise Failed("a label outside the catalog sent as well (the platform shows it as undeclared)",
                     show(undeclared), hint="warn about an undeclared label; do not refuse the call")


# -- §3.4 trace events ---------------------------------------------------------------------------------


def expect_stamped(c: Check, request: Any) -> Optional[str]:
    """``__occurred_at`` as ISO-8601 UTC; a missing or malformed one is noted (SHOULD) and ``None`` returned."""
    stamp = request.json.get("__occurred_at") if isinstance(request.json, dict) else None
    if not isinstance(stamp, str) or not ISO_UTC.fullmatch(stamp):
        c.soft("__occurred_at as ISO-8601 UTC (e.g. 2026-01-02T03:04:05.123Z)", show(stamp), "trace-occurred-at")
        return None
    return stamp


def expect_trace_reply(outcome: Any, sequence: int, what: str = "the trace post") -> None:
    """The proxy's reply ``{"accepted": true, "sequence": N}`` as the value, or just N (a client that keeps only it)."""
    value = expect_ok(outcome, what=what)
    if not (same_json(value, {"accepted": True, "sequence": sequence}) or same_json(value, sequence)):
        raise Failed(f'{what} to give the proxy\'s reply {{"accepted": true, "sequence": {sequence}}} (or {sequence})',
                     show(value), "trace-reply")


@case("trace.event_shape", "§3.4", "POST {proxy_url}/traces/{type}: the payload, __occurred_at, the proxy's reply",
      ["trace-endpoint", "trace-occurred-at", "trace-reply"])
def _(c: Check) -> None:
    ran = c.script([{"trace": "assistant_message", "payload": {"text": "working on it"}}])
    outcome = c.outcome(ran)
    requests = list(ran.proxy.requests)
    if requests:
        expect_request_shape(c, requests[0], ran.proxy, ran.run, "/traces/assistant_message")
    expect_trace_reply(outcome, 1)
    (request,) = expect_requests(ran.proxy, 1, "one trace event")
    if not isinstance(request.json, dict) or request.json.get("text") != "working on it":
        raise Failed('a JSON body with "text": "working on it"', show(request.json))
    expect_stamped(c, request)


@case("trace.occurred_at_kept_on_retry", "§3.4", "__occurred_at is stamped once and kept across retries",
      ["trace-occurred-at", "trace-retry-policy"])
def _(c: Check) -> None:
    ran = c.script([{"trace": "custom", "payload": {"n": 1}}], setup=lambda p: p.script(
        "custom",
        [{"status": 503, "headers": RETRY_NOW, "error_class": "trace_sequence_contended", "message": "x"}, {}]))
    expect_ok(c.outcome(ran), what="the trace post", rule="trace-retry-policy")
    first, second = expect_requests(ran.proxy, 2, "a transient 503, then the retry", "trace-retry-policy")
    stamps = expect_stamped(c, first), expect_stamped(c, second)
    if None not in stamps and stamps[0] != stamps[1]:
        raise Failed("the same __occurred_at on both attempts", f"{stamps[0]} then {stamps[1]}",
                     hint="stamp the event once, before the retry loop")


@case("trace.empty_reply", "§3.4", "an empty 200 reply (older platforms) is a success with value null",
      ["trace-reply"])
def _(c: Check) -> None:
    ran = c.script([{"trace": "thinking", "payload": {"text": "hmm"}}],
                   setup=lambda p: p.script("thinking",
                                            [{"body": b"", "headers": {"Content-Type": "application/json"}}]))
    expect_ok(c.outcome(ran), None, "the trace post")


@case("trace.failure_reported", "§3.4", "a failed trace post is reported (the agent's step is not best-effort)",
      ["trace-best-effort"])
def _(c: Check) -> None:
    ran = c.script([{"trace": "custom", "payload": {}}], setup=lambda p: p.script(
        "custom", [{"status": 500, "error_class": "internal", "message": "boom"}]))
    expect_error(c.outcome(ran), "proxy", 500, "internal", "the trace post")


@case("trace.handoff", "§3.4", "a handoff is a handoff event with from_sub_agent / to_sub_agent",
      ["handoff-shape", "trace-occurred-at"])
def _(c: Check) -> None:
    ran = c.script([{"handoff": {"from": "triage", "to": "refunds", "reason": "refund asked"}}])
    expect_ok(c.outcome(ran), what="the handoff")
    (request,) = expect_requests(ran.proxy, 1, "one handoff event")
    expect_request_shape(c, request, ran.proxy, ran.run, "/traces/handoff")
    wanted = {"from_sub_agent": "triage", "to_sub_agent": "refunds", "reason": "refund asked"}
    body = request.json if isinstance(request.json, dict) else {}
    if any(body.get(k) != v for k, v in wanted.items()):
        raise Failed(f"a body with {show(wanted)}", show(request.json))
    expect_stamped(c, request)


@case("trace.self_handoff_dropped", "§3.4", "a self-handoff is dropped, not sent", ["self-handoff-dropped"])
def _(c: Check) -> None:
    ran = c.script([{"handoff": {"from": "refunds", "to": "refunds"}}])
    expect_ok(c.outcome(ran), None, "the self-handoff")
    expect_nothing_sent(ran.proxy)


@case("trace.unknown_type_refused", "§3.4", "an unknown event type is refused (locally, or by the proxy)",
      ["trace-event-types"])
def _(c: Check) -> None:
    ran = c.script([{"trace": "debug_dump", "payload": {}}])
    expect_refused(ran, c.outcome(ran), "a trace of type debug_dump", or_by_proxy=True)


# -- §4 the response envelope; §2 step 8 agent errors ------------------------------------------------


@case("response.echo_valid", "§4", "the echo-mode response is a valid response envelope", ["final-response-required"])
def _(c: Check) -> None:
    run, _ = c.new_run()
    c.echo(c.dispatch(run, user_instruction="hello"))


@case("response.script_transcript", "§4", "a script's response: results, a valid transcript, metadata",
      ["response-as-built"])
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


def turn_fields(run: Run, turn: int = 0) -> Dict[str, Any]:
    """The multi-turn fields of a dispatch (§2.2 multi-turn-fields): turn ``turn`` of a session of ``run``'s own."""
    session = f"conformance-session-{run.run_id}"
    return {"latest_user_prompt": "Which order do you mean?", "session_id": session, "turn_id": f"{session}-t{turn}",
            "messages": [{"role": "user", "content": "Cancel my order"},
                         {"role": "assistant", "content": "Which one?"}][:2 * turn], "scenario_state": {}}


@case("response.turn_reply", "§4.2",
      "a multi-turn dispatch whose agent returns a turn reply gets it back as built: message, session_done, metadata",
      ["turn-reply-as-built", "turn-reply-shape"])
def _(c: Check) -> None:
    """The agent builds the reply with the port's turn-reply builder (the ``turn_reply`` step), then returns a
    hand-built one (a ``return`` step): both leave the port unchanged, ``session_done`` true and false."""
    for turn, step, built in (
        (0, {"turn_reply": {"message": "Which order do you mean?", "session_done": False}},
         {"message": "Which order do you mean?", "session_done": False}),
        (1, {"turn_reply": {"message": "Order 4521 is cancelled.", "metadata": {"model": "conformance-agent",
                                                                                 "total_input_tokens": 12},
                            "session_done": True}},
         {"message": "Order 4521 is cancelled.", "metadata": {"model": "conformance-agent", "total_input_tokens": 12},
          "session_done": True}),
        (2, {"return": {"message": "Anything else?", "metadata": {"model": "m"}, "session_done": False}},
         {"message": "Anything else?", "metadata": {"model": "m"}, "session_done": False}),
    ):
        run, proxy_run = c.new_run()
        ran = c.script([step], ran=(run, proxy_run), turn=turn_fields(run, turn))
        how = "built by the port's turn-reply builder" if "turn_reply" in step else "built by hand"
        c.turn_reply(ran.reply, built, f"the turn reply {how}")


def _json_or_none(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None


def error_detail(c: Check, reply: Reply, message: str) -> str:
    """The 500's ``detail`` text (agent-error-500, MUST); its wording is checked by the callers (SHOULD)."""
    if reply.status != 500:
        raise Failed("500 for an agent that raised", describe(reply), "agent-error-500",
                     "an agent's exception is never a 200 answer" if reply.status == 200 else None)
    if not isinstance(reply.json, dict) or "detail" not in reply.json:
        c.soft('a JSON body {"detail": ...}', describe(reply), "agent-error-detail")
        return reply.text
    return strings_in(reply.json["detail"])


@case("response.agent_error", "§2 step 8",
      "an agent that raises gets 500 whose detail names the exception type and message",
      ["agent-error-500", "agent-error-detail"])
def _(c: Check) -> None:
    message = "conformance-boom-" + secrets.token_hex(4)
    ran = c.script([{"raise": message}])
    detail = error_detail(c, ran.reply, message)
    if not re.search(r"\b[A-Za-z_][\w.]*:\s*" + re.escape(message), detail):
        c.soft(f"a detail naming the exception type, then the message (e.g. 'RuntimeError: {message}')",
               describe(ran.reply), "agent-error-detail")


@case("response.no_traceback", "§2 step 8", "a 500 detail shows no stack trace and no source file positions",
      ["no-traceback-in-body"])
def _(c: Check) -> None:
    message = "conformance-deep-" + secrets.token_hex(4)
    ran = c.script([{"raise": message}])
    error_detail(c, ran.reply, message)
    if TRACEBACK.search(ran.reply.text):  # traceback text only: a framework's detail list ({"detail": [...]}) is fine
        raise Failed("a detail without a stack trace (keep the traceback in the server log)",
                     show(ran.reply.text[:300]), hint="send type and message only; log the stack trace")


@case("response.empty_final_response", "§4", 'an empty final_response is never sent: "" becomes a 500',
      ["final-response-required"])
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
                     describe(reply), "final-response-required")


@case("agent.malformed_script", AGENT_SPEC, "a malformed script (unknown step) makes the agent raise: 500",
      ["agent-error-500"])
def _(c: Check) -> None:
    ran = c.script([{"call": "get_order", "args": {}}, {"bogus": 1}])
    if ran.reply.status != 500:
        raise Failed("500 for a script with an unknown step", describe(ran.reply))


# -- secrets ------------------------------------------------------------------------------------------------


@case("secrets.agent_error_detail", "§2 step 8, §2 (run token: secret)",
      "a run token inside an agent's error never reaches the 500 body", [AGENT_TEXT_RULE, "agent-error-500"])
def _(c: Check) -> None:
    run, _proxy_run = c.new_run()
    reply = c.dispatch(run, user_instruction=compact({"steps": [{"raise": f"cannot use {run.run_token} here"}]}))
    if reply.status != 500:
        raise Failed("500 for an agent that raises", describe(reply), "agent-error-500")
    if "cannot use" not in reply.text:
        c.soft("a detail keeping the rest of the message", describe(reply), "agent-error-detail",
               "redact the token, keep the message")
    # The agent token is as secret as the run token (every reply is scanned for both).
    if c.platform.agent_token:
        reply = c.dispatch(run, user_instruction=compact({"steps": [{"raise": f"auth {c.platform.agent_token}"}]}))
        if reply.status != 500:
            raise Failed("500 for an agent that raises", describe(reply), "agent-error-500")
    # A token where the detail is cut (at most 500 characters, §7): redacted before the cut, no part of it shows.
    # Three offsets 14 characters apart: whatever the port's prefix, one cuts a 42-character copy at least 28 in,
    # past its "run-token-" and TOKEN_PART characters of its random part.
    for offset in (0, 14, 28):
        message = "x" * (440 + offset) + run.run_token * 4
        reply = c.dispatch(run, user_instruction=compact({"steps": [{"raise": message}]}))
        shown = c.platform.token_part_in(reply.text)
        if shown:
            raise Failed("no part of a run token in the 500 detail, wherever the detail is cut",
                         f"HTTP {reply.status} showing {shown!r} of the run token", AGENT_TEXT_RULE,
                         hint="redact the whole message first, then shorten it")


@case("secrets.agent_response", "§2 (run token: secret)",
      "a response the agent built around its run token goes out without it (redacted, or refused)",
      [AGENT_TEXT_RULE])
def _(c: Check) -> None:
    run, _proxy_run = c.new_run()
    token = run.run_token
    for where, value in (
        ("final_response", {"final_response": f"the run token is {token}"}),
        ("messages", {"final_response": "done", "messages": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": f"token {token}"}]}),
        ("metadata", {"final_response": "done", "metadata": {"model": "m", "note": f"token {token}"}}),
        ("an extra top-level key", {"final_response": "done", "debug": {"headers": [f"Bearer {token}"]}}),
    ):
        reply = c.dispatch(run, user_instruction=compact({"steps": [{"return": value}]}))  # scanned
        if reply.status not in (200, 500):
            raise Failed(f"200 with the token in {where} redacted, or 500", describe(reply))


@case("secrets.proxy_error_echo", "§2 (run token: secret), §3.3",
      "a proxy error body that echoes the run token never reaches a reply through the port's own error text",
      ["run-token-secret", "agent-error-500"])
def _(c: Check) -> None:
    """The proxy answers an error whose body shows the run token (a proxy may echo what it refused); the agent
    lets the client's error leave it (``raise_on_error``), so the 500 detail is the text the port's client wrote:
    the wrapper holds the token and must not show it (MUST)."""
    for status, reply in (
        (400, lambda token: {"status": 400, "error_class": "bad_request", "message": f"refused Bearer {token}"}),
        (502, lambda token: {"status": 502, "body": f"<html>upstream said: token {token} rejected</html>"}),
    ):
        run, proxy_run = c.new_run()
        proxy_run.script("echoing_tool", [reply(proxy_run.token)])
        answer = c.dispatch(run, user_instruction=compact({"steps": [  # every reply is scanned (run-token-secret)
            {"call": "echoing_tool", "args": {}, "raise_on_error": True}]}))
        if answer.status != 500:
            raise Failed(f"500 for an agent whose call failed with HTTP {status} and raised", describe(answer),
                         "agent-error-500", "the conformance agent's raise_on_error: let the call's error leave it")


# -- §2 step 6 concurrency ----------------------------------------------------------------------------------

CONCURRENT_RUNS = 50
ISOLATION_CASE = "concurrency.distinct_tokens"
FIRST_CASE = "proxy.request_shape"  # runs first, alone: its failure explains what every later call will meet


@case(ISOLATION_CASE, "§2 step 6", f"{CONCURRENT_RUNS} concurrent runs never see each other's token",
      ["per-request-binding"])
def _(c: Check) -> None:
    runs = [c.new_run() for _ in range(CONCURRENT_RUNS)]
    for index, (_, proxy_run) in enumerate(runs):
        proxy_run.script("whoami", lambda request, index=index: {"response": {"run": index}})
    # The sleep lets every dispatch start before any calls: a shared envelope would be overwritten by then.
    # One call per run keeps even a crossing port under the 60/min per-token rate limit (no minute-long waits).
    steps = [{"sleep_ms": 50}, {"call": "whoami", "args": {}}]
    hint = ("bind each dispatch's envelope to that request (a request-scoped context, or build the tools inside "
            "the handler), never to a module-level variable")
    with ThreadPoolExecutor(max_workers=CONCURRENT_RUNS) as pool:
        done = list(pool.map(lambda ran: c.script(steps, ran=ran), runs))
    for index, ran in enumerate(done):
        requests = list(ran.proxy.requests)
        if any(r.run_token != ran.run.run_token for r in requests) or len(requests) != 1:
            raise Failed(f"run {index}'s call to reach its own proxy run with its own token",
                         f"{len(requests)} request(s) at its proxy run, "
                         f"{sum(r.run_token != ran.run.run_token for r in requests)} with another run's token",
                         hint=hint)
        value = expect_ok(c.results(ran, len(steps))[1], what=f"run {index}'s call")
        if not same_json(value, {"run": index}):
            raise Failed(f"run {index}'s call to reach its own proxy run with its own token",
                         f"the reply of another run: {show(value)}", hint=hint)
        expect_run_token(requests[0], ran.run.run_token)


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


@case("connectivity.reachable", "§2 step 4, §3.7", "the connectivity check probes the proxy: reachable",
      ["connectivity-check", "reachability-probe"])
def _(c: Check) -> None:
    _, proxy_run = c.new_run()
    outbound = connectivity(c, proxy_run.url)
    if outbound.get("reachable") is not True or not isinstance(outbound.get("status_code"), int):
        raise Failed("outbound.reachable true with the probe's status_code (401 here)", show(outbound))
    if not any(r.path.endswith("/tools/__reachability_probe__") for r in proxy_run.requests):
        raise Failed("a POST {proxy_url}/tools/__reachability_probe__ (§3.7)", paths(proxy_run, proxy_run.requests),
                     "reachability-probe")


@case("connectivity.unreachable", "§2 step 4, §3.7", "the connectivity check reports an unreachable proxy",
      ["connectivity-check"])
def _(c: Check) -> None:
    outbound = connectivity(c, f"http://127.0.0.1:{dead_port()}/api/odyssey-proxy/runs/gone")
    if outbound.get("reachable") is not False:
        raise Failed("outbound.reachable false for a refused connection", show(outbound))


@case("connectivity.missing_url", "§2 step 4", "a connectivity check without a proxy URL gets 400",
      ["connectivity-check"])
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
    """One case per applicable vector (checker/vectors/), ids ``vectors.FILE:SLUG``, checking the vector's rule."""
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
            rule = vector["rule"]
            made.append(Case(f"vectors.{stem}:{name}", contract.rule(rule).section, vector["name"], built, (rule,)))
    return made


def expect_words(c: Check, reply: Reply, words: Sequence[str], rule: str, what: str) -> None:
    """The reply's message names each of ``words`` (case-insensitively, as keywords); noted under ``rule``."""
    text = strings_in(reply.json) if reply.json is not None else reply.text
    missing = [w for w in words if not keywords_in(text, w)]
    if missing:
        c.soft(f"{what} naming {', '.join(repr(w) for w in missing)}", describe(reply), rule)


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
            for text in expect.get("never_mentions", []):
                if text in reply.text:
                    raise Failed(f"a 400 body never showing {text!r}", "it does", "run-token-secret")
            named = "envelope-missing-named" if vector["rule"] == "envelope-missing-400" else vector["rule"]
            expect_words(c, reply, expect.get("mentions", []), named, "a 400 message")
            if c.platform.options.profile == "api":
                expect_words(c, reply, expect.get("our_mentions", []), "kit-missing-says-where", "a 400 message")
            return
        wanted = {path: value for path, value in expect["fields"].items() if path != "run_token"}
        if "run_token" in expect["fields"]:
            wanted["run_token_sha256"] = sha256(expect["fields"]["run_token"])
        compare_echo(c, c.echo(reply), wanted)
    return run


def _inbound_vector(doc: Dict[str, Any], vector: Dict[str, Any]) -> Callable[[Check], None]:
    if vector["kind"] == "ping":
        def ping(c: Check) -> None:
            body = vector["body"]
            if vector["expect"]["is_ping"]:
                reply = c.post(body, c.credential())
                if reply.status != 200:
                    raise Failed("the ping answered 200", describe(reply))
                if not isinstance(reply.json, dict) or reply.json.get("ok") is not True:
                    raise Failed('the ping answered {"ok": true}', describe(reply), "ping-ok-body")
            elif isinstance(body, dict):
                run, _ = c.new_run()
                reply = c.dispatch(run, body)
                if reply.status == 200 and isinstance(reply.json, dict) and "final_response" not in reply.json:
                    raise Failed(f"{show(body)} dispatched to the agent, not answered as a ping", describe(reply))
                echoed = c.echo(reply)
                if not same_json(echoed.get("raw"), body):
                    raise Failed(f"a dispatch with the body {show(body)}", show(echoed.get("raw")),
                                 "unknown-fields-available")
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
                           or_by_proxy=stricter(c, vector))
    return run


def stricter(c: Check, vector: Mapping[str, Any]) -> bool:
    """Whether the contract's way passes too: a ``stricter_than_contract`` vector, outside the api profile."""
    return bool(vector.get("stricter_than_contract")) and c.platform.options.profile != "api"


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
            expect_refused(ran, outcome, f"a call to {show(vector['tool_name'], 60)}", or_by_proxy=stricter(c, vector))
            return
        expect_ok(outcome)
        (request,) = expect_requests(ran.proxy, 1, "one call")
        check_request(c, request, ran, expect)
    return run


def check_request(c: Check, request: Any, ran: Ran, expect: Mapping[str, Any]) -> None:
    """The vectors' request expectations: path_suffix, body_json, headers, headers_absent, run_token_sent;
    and an Idempotency-Key on a tool call (SHOULD: noted)."""
    if "path_suffix" in expect and request.path != ran.proxy.base_path + expect["path_suffix"]:
        raise Failed(f"POST {{proxy_url}}{expect['path_suffix']}", request.path)
    if expect.get("run_token_sent"):
        expect_run_token(request, ran.run.run_token, c)
    if "body_json" in expect and not same_json(request.json, expect["body_json"]):
        raise Failed(f"the JSON body {show(expect['body_json'])}", show(request.json))
    for name, value in expect.get("headers", {}).items():
        wanted = value.replace("{run_token}", ran.run.run_token)
        got = request.headers.get(name.lower())
        if got == wanted:
            continue
        if "{run_token}" in value:  # the token may travel in the other header (§3.1): checked above
            continue
        raise Failed(f"{name}: {wanted}", "absent" if got is None else show(got))
    for name in expect.get("headers_absent", []):
        if name.lower() in request.headers:
            raise Failed(f"no {name} header", "one sent")
    if request.kind == "tools" and not request.idempotency_key:
        c.soft("an Idempotency-Key on every tool call", "none", "idempotency-key-per-call",
               "without a key, a retried call may run a mutating tool twice")


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

        try:
            ran = c.script([{"call": doc["tool_name"], "args": {}}], setup=setup)
            outcome = c.outcome(ran)
        except Failed as failed:
            if vector["rule"] == "kit-retry-after-cap" and failed.hint is None:
                failed.hint = (f"the port waited out a Retry-After of {vector['headers']['Retry-After']} s: past "
                               "the 60 s cap the call must fail at once, not sleep (or retry early)")
            raise
        if expect.get("retry") and expect.get("retry_after_s") is None:
            # Full jitter (a wait anywhere in [0, cap]) is a correct backoff whose one wait may be short: a port
            # fails only when every one of several fresh calls retried faster than MIN_BACKOFF_S.
            for _ in range(BACKOFF_TRIES - 1):
                requests = list(ran.proxy.requests)
                if len(requests) != 2 or requests[1].time - requests[0].time >= MIN_BACKOFF_S:
                    break
                ran = c.script([{"call": doc["tool_name"], "args": {}}], setup=setup)
                outcome = c.outcome(ran)
        if expect.get("retry"):
            expect_ok(outcome, "after-retry", "the call (retried, then a success)")
            first, second = expect_requests(ran.proxy, 2, "the reply, then one retry")
            expect_same_key([first, second], "a retry reuses the key", c=c)
            wait, gap = expect.get("retry_after_s"), second.time - first.time
            if wait and gap < 0.9 * wait:
                raise Failed(f"a retry after the Retry-After wait of {wait} s", f"a retry after {gap:.2f} s",
                             "honour-retry-after")
            if wait is None and gap < MIN_BACKOFF_S:
                raise Failed(f"a retry after a backoff wait of at least {MIN_BACKOFF_S} s in one of {BACKOFF_TRIES} "
                             "calls (§3.3: retry with backoff)", f"every retry within {MIN_BACKOFF_S} s, the last "
                             f"after {gap:.3f} s", "bounded-backoff")
            longest = (MAX_BACKOFF_S if wait is None else wait) + RETRY_SLACK_S
            if gap > longest:
                raise Failed(f"a retry within {longest:g} s ({'Retry-After' if wait is not None else 'the backoff cap'}"
                             f" plus {RETRY_SLACK_S:g} s)", f"a retry after {gap:.2f} s",
                             "honour-retry-after" if wait is not None else "bounded-backoff",
                             hint="a Retry-After date in the past means retry now (a date minus now, not now minus "
                                  "a date)" if wait == 0 else None)
        elif "value" in expect:
            expect_ok(outcome, expect["value"])
            expect_requests(ran.proxy, 1, "a success is not retried")
        else:
            if isinstance(outcome, dict) and outcome.get("ok") is True and len(ran.proxy.requests) > 1:
                raise Failed(f"the call to fail: {vector['status']} is terminal", show(outcome), "terminal-no-retry")
            kwargs = {k: expect[k] for k in ("status_code", "error_class") if k in expect}
            expect_error(outcome, expect["error"], **kwargs)
            rule = vector["rule"] if vector["rule"].startswith("kit-") else "terminal-no-retry"
            expect_requests(ran.proxy, 1, "a terminal error is not retried" if rule == "terminal-no-retry" else
                            "no retry: a Retry-After past the cap fails the call at once", rule)
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
            expect_refused(ran, outcome, f"a {vector['kind']} event", or_by_proxy=stricter(c, vector))
            return
        if expect.get("dropped"):
            expect_ok(outcome, None, "the dropped event")
            expect_nothing_sent(ran.proxy)
            return
        expect_trace_reply(outcome, 1)
        (request,) = expect_requests(ran.proxy, 1, "one trace event")
        check_request(c, request, ran, expect)
        body = request.json if isinstance(request.json, dict) else {}
        for key, value in expect.get("body_has", {}).items():
            if not same_json(body.get(key, "<absent>"), value):
                raise Failed(f"{key} = {show(value)} in the body", show(body.get(key, "<absent>")))
        if expect.get("stamped"):
            expect_stamped(c, request)
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
            expect_words(c, ran.reply, expect.get("mentions", []), "kit-unbuildable-result-500", "a 500 detail")
            return
        if vector.get("a_port_may_refuse") and ran.reply.status == 500:
            return  # a port that refuses what the platform would only soften (a strict port) keeps the contract
        body = c.response(ran.reply)
        wanted = expect["body"]
        if c.platform.options.profile != "api":  # extra top-level keys are allowed (§4 extra-top-level-keys)
            body = {k: v for k, v in body.items() if k in wanted}
        if not same_json(body, wanted):
            raise Failed(f"the body {show(wanted)}", show(body))
    return run


def _turn_reply_vector(doc: Dict[str, Any], vector: Dict[str, Any]) -> Optional[Callable[[Check], None]]:
    given = vector["input"]
    if given.get("strict"):
        return None  # strict mode is a pipelines_port option a port need not have
    value = given["value"]
    expect = vector["expect"]

    def run(c: Check) -> None:
        run_, proxy_run = c.new_run()
        turn = turn_fields(run_) if given["multi_turn"] else None
        ran = c.script([{"return": value}], ran=(run_, proxy_run), turn=turn)
        if "error" in expect:
            if ran.reply.status != 500:
                raise Failed("500: the returned value cannot become a reply", describe(ran.reply))
            expect_words(c, ran.reply, expect.get("mentions", []), "kit-unbuildable-result-500", "a 500 detail")
            return
        if vector.get("a_port_may_refuse") and ran.reply.status == 500:
            return  # a port that refuses what the platform would only soften (a strict port) keeps the contract
        wanted = expect["body"]
        if "final_response" in wanted:
            body = c.response(ran.reply)
            if c.platform.options.profile != "api":  # extra top-level keys are allowed (§4 extra-top-level-keys)
                body = {k: v for k, v in body.items() if k in wanted}
            if not same_json(body, wanted):
                raise Failed(f"the body {show(wanted)}", show(body))
        else:
            c.turn_reply(ran.reply, wanted, "the turn reply")
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
    ("turn_reply", _turn_reply_vector),
]


# -- the last case: every body the suite received ---------------------------------------------------------------


def _no_token_anywhere(c: Check) -> None:
    agent_text = {case.id for case in CASES if case.rules[0] == AGENT_TEXT_RULE}
    leaks = [leak for leak in c.platform.leaks if leak.split(":", 1)[0] not in agent_text]
    if leaks:
        raise Failed(f"no secret in any of the {c.platform.bodies_seen} responses received",
                     f"{len(leaks)}: " + "; ".join(leaks[:5]))


SCAN_CASE = Case("secrets.no_token_in_any_body", "§2 (run token: secret)",
                 "no run token or agent token in any response the suite received, any status", _no_token_anywhere,
                 ("run-token-secret",))


def all_cases() -> List[Case]:
    """Every case, in the order they run; the secrets scan last."""
    return CASES + vector_cases() + [SCAN_CASE]


# ---------------------------------------------------------------------------
# Running: selection, a worker pool, progress, the report
# ---------------------------------------------------------------------------


def select(cases: Sequence[Case], only: Sequence[str] = (), skip: Sequence[str] = (), *,
           options: Options = DEFAULT_OPTIONS, mode: str = "normal") -> List[Case]:
    """Cases of ``mode`` and ``options.profile`` matching ``only`` (all when empty) and no ``skip`` pattern.

    A pattern is an id, a group (``proxy``, ``vectors.proxy_replies``) or a glob (``proxy.retry_*``).
    The ``wire`` profile leaves out the cases of pipelines_port's own choices (``kit-*`` rules).
    """
    def matches(case_id: str, pattern: str) -> bool:
        return (case_id == pattern or case_id.startswith((pattern + ".", pattern + ":"))
                or fnmatch.fnmatchcase(case_id, pattern))

    return [c for c in cases if c.mode == mode and (options.profile == "api" or c.profile == "wire")
            and (not only or any(matches(c.id, p) for p in only)) and not any(matches(c.id, p) for p in skip)]


def run_one(platform: Platform, case: Case) -> Result:
    """Run one case: its findings (a raised failure last), the status they add up to, a cause they share."""
    started = time.monotonic()
    check = Check(platform, case)
    note = None
    try:
        case.run(check)
    except Failed as failure:
        check.findings.append(check.finding(failure.expected, failure.got, failure.rule, failure.hint))
    except Skipped as skipped:
        note = str(skipped)
    except Exception as exc:  # noqa: BLE001 - a checker bug must not hide the other results
        check.findings.append(check.finding("the case to run", f"a checker error: {type(exc).__name__}: {exc}"))
    redact = platform.redact
    findings = tuple(f._replace(expected=redact(f.expected), got=redact(f.got)) for f in check.findings)
    if note is not None:
        status = "skip"
    elif findings:
        status = "fail" if any(platform.options.status(f.level) == "fail" for f in findings) else "warn"
    else:
        status = "pass"
    cause = refusal_cause(check.proxy_runs) if status in ("fail", "warn") else None
    return Result(case, status, findings, note and redact(note), cause, (time.monotonic() - started) * 1000)


def refusal_cause(proxy_runs: Sequence[ProxyRun]) -> Optional[str]:
    """Why the mock proxy refused the case's calls, when it refused any run token (one cause many cases share)."""
    reasons = sorted({r.refusal for run in proxy_runs for r in list(run.requests) if r.refusal})
    if not reasons:
        return None
    return f"the proxy refused the run token: {reasons[0]} (see {FIRST_CASE})"


def run_cases(platform: Platform, cases: Sequence[Case], *, workers: int = 8,
              progress: Callable[[Result], None] = lambda r: None,
              notice: Callable[[str], None] = lambda line: None) -> List[Result]:
    """Run ``cases``; results and progress in case order.

    The request-shape case runs first and the isolation case second, each alone:
    when the isolation case fails (runs see each other's envelope), the rest run
    one at a time, so a cross-run leak is reported once, not as noise in every
    case that happened to overlap another.  The secrets scan runs last.
    """
    ordered = sorted((c for c in cases if c is not SCAN_CASE),
                     key=lambda c: {FIRST_CASE: 0, ISOLATION_CASE: 1}.get(c.id, 2))
    results: List[Result] = []
    leading = [c for c in ordered if c.id in (FIRST_CASE, ISOLATION_CASE)]
    for case_ in leading:
        results.append(run_one(platform, case_))
        progress(results[-1])
    if any(r.case.id == ISOLATION_CASE and r.status == "fail" for r in results) and workers > 1:
        notice(f"{ISOLATION_CASE} failed: the other cases run one at a time, so the leak between runs "
               "does not show up in them as well")
        workers = 1
    rest = ordered[len(leading):]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="conformance-case") as pool:
        for future in [pool.submit(run_one, platform, c) for c in rest]:
            results.append(future.result())
            progress(results[-1])
    if SCAN_CASE in cases:
        results.append(run_one(platform, SCAN_CASE))
        progress(results[-1])
    order = {c.id: i for i, c in enumerate(cases)}
    return sorted(results, key=lambda r: order[r.case.id])


def tag(finding: Finding) -> str:
    return f"[{finding.level} {finding.rule} {contract.rule(finding.rule).section}]"


def progress_line(result: Result) -> str:
    line = f"{result.status.upper():<4} {result.case.id}"
    if result.status in ("fail", "warn"):
        first = result.findings[0]
        line += f" {tag(first)}: expected {first.expected}, got {first.got}"
        if len(result.findings) > 1:
            line += f" (+{len(result.findings) - 1} more)"
    elif result.status == "skip":
        line += f": {result.note}"
    return line


def counts_by_level(results: Sequence[Result]) -> Dict[str, Dict[str, int]]:
    """Per level of the cases: how many passed, failed, warned and were skipped."""
    table = {level: {"passed": 0, "failed": 0, "warned": 0, "skipped": 0} for level in contract.LEVELS}
    names = {"pass": "passed", "fail": "failed", "warn": "warned", "skip": "skipped"}
    for result in results:
        table[result.case.level][names[result.status]] += 1
    return table


def level_met(results: Sequence[Result]) -> str:
    """``MUST+SHOULD`` when no rule of either level is broken, ``MUST`` when only SHOULD/MAY ones are, else ``none``."""
    broken = {f.level for r in results for f in r.findings}
    if "MUST" in broken:
        return "none"
    return "MUST" if "SHOULD" in broken else "MUST+SHOULD"


def levels_by_profile(results: Sequence[Result]) -> Dict[str, str]:
    """The level met on the platform's rules (``wire``) and, when the kit's rules ran, on those too (``api``)."""
    wire = [r._replace(findings=tuple(f for f in r.findings if not f.rule.startswith("kit-"))) for r in results]
    met = {"wire": level_met(wire)}
    if any(r.case.rules and r.case.rules[0].startswith("kit-") for r in results):
        met["api"] = level_met(results)
    return met


def advice(results: Sequence[Result]) -> List[str]:
    """One line per broken rule, strongest first: the rule, the cases that broke it, the likely cause."""
    by_rule: Dict[str, List[Tuple[Result, Finding]]] = {}
    for result in results:
        for finding in result.findings:
            by_rule.setdefault(finding.rule, []).append((result, finding))
    causes: Dict[str, int] = {}
    for result in results:
        if result.cause:
            causes[result.cause] = causes.get(result.cause, 0) + 1
    lines = [f"Fix this first: {count} case(s) failed because {cause}." for cause, count in causes.items()]
    for rule_id, hits in sorted(by_rule.items(), key=lambda kv: (contract.LEVELS.index(kv[1][0][1].level), kv[0])):
        rule = contract.rule(rule_id)
        hints = sorted({f.hint for _, f in hits if f.hint})
        ids = [r.case.id for r, _ in hits]
        shown = ", ".join(ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")
        line = f"{hits[0][1].level} {rule_id} ({rule.section}): {rule.text} Broken in {shown}."
        if hints:
            line += " Likely cause: " + "; ".join(hints)
        lines.append(line)
    return lines


def report(results: Sequence[Result], options: Options = DEFAULT_OPTIONS) -> str:
    """Failures and warnings (expected, got, rule, likely cause), shared causes once, then the counts per level."""
    lines: List[str] = []
    causes: Dict[str, List[str]] = {}
    for result in results:
        if result.status not in ("fail", "warn"):
            continue
        word = "FAILED" if result.status == "fail" else "WARNING"
        lines.append(f"{word} {result.case.id}: {result.case.title}")
        if result.cause:
            causes.setdefault(result.cause, []).append(result.case.id)
            if len(causes[result.cause]) > 3:
                lines.append("  (the same cause as the cases above: see the end of this report)")
                continue
        for finding in result.findings:
            lines += [f"  {tag(finding)} {contract.rule(finding.rule).text}",
                      f"    expected: {finding.expected}", f"    got:      {finding.got}"]
            if finding.hint:
                lines.append(f"    likely cause: {finding.hint}")
    for cause, ids in causes.items():
        lines.append(f"{len(ids)} case(s) share one cause: {cause}")
    table = counts_by_level(results)
    for level in contract.LEVELS:
        row = table[level]
        if sum(row.values()):
            lines.append(f"{level:<6} {row['passed']} passed, {row['failed']} failed, {row['warned']} warned, "
                         f"{row['skipped']} skipped")
    total = {s: sum(1 for r in results if r.status == s) for s in ("pass", "fail", "warn", "skip")}
    met = level_met(results)
    verdict = {"none": "the port does not conform (a MUST rule is broken)",
               "MUST": "every MUST rule holds; SHOULD rules are broken (warnings; --strict fails them)",
               "MUST+SHOULD": "every MUST and SHOULD rule holds"}[met]
    lines.append(f"profile {options.profile}{', strict' if options.strict else ''}: {verdict}")
    lines.append(f"{total['pass']} passed, {total['fail']} failed, {total['warn']} warned, {total['skip']} skipped")
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
    parser.add_argument("--strict", action="store_true",
                        help="fail on broken SHOULD rules too (by default they are warnings)")
    parser.add_argument("--profile", choices=("wire", "api"), default="wire",
                        help="wire (default): the platform's rules; api: also pipelines_port's own choices "
                             "(kit-* rules, held as MUST), for ports that mirror its API")
    parser.add_argument("--misconfigured", action="store_true",
                        help="run the cases for an endpoint started with its token variable unset (it must answer 503)")
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

    options = Options(strict=args.strict, profile=args.profile)
    mode = "misconfigured" if args.misconfigured else "normal"
    cases = select(all_cases(), _patterns(args.only), _patterns(args.skip), options=options, mode=mode)
    if args.list:
        for c in cases:
            print(f"{c.id}\t{c.level}\t{','.join(c.rules)}\t{c.section}\t{c.title}")
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
        if mode == "normal":
            _preflight(dispatcher, token)
        platform = Platform(dispatcher, proxy, token, options)
        out = sys.stderr
        print(f"conformance check: {len(cases)} cases against {args.url} (profile {options.profile}"
              f"{', strict' if options.strict else ''}{', misconfigured' if args.misconfigured else ''}; "
              f"mock proxy at {proxy.origin})", file=out)
        results = run_cases(platform, cases, workers=args.workers,
                            progress=lambda r: print(platform.redact(progress_line(r)), file=out, flush=True),
                            notice=lambda line: print(f"conformance check: {line}", file=out, flush=True))
        summary = report(results, options)
        if args.json:
            _write_json(args.json, args.url, results, options, mode)
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


def _write_json(where: str, url: str, results: Sequence[Result], options: Options, mode: str) -> None:
    counts = {s: sum(1 for r in results if r.status == s) for s in ("pass", "fail", "warn", "skip")}
    doc = {"url": url, "profile": options.profile, "strict": options.strict, "mode": mode,
           "level_met": level_met(results), "level_met_by_profile": levels_by_profile(results),
           "passed": counts["pass"], "failed": counts["fail"],
           "warned": counts["warn"], "skipped": counts["skip"], "by_level": counts_by_level(results),
           "advice": advice(results), "cases": [r.to_json() for r in results]}
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
