"""Deliberately broken ports: our server and conformance agent with one contract rule broken.

    python3 tests/broken_ports.py VARIANT [--port 0] [--token T]

prints ``listening on URL`` and serves until SIGTERM.  Each variant patches
pipelines_port in its own process only (so nothing leaks into the checker) and
names the case ``python3 -m conformance check --strict`` must not pass (the
bug breaks a MUST or a SHOULD rule).  ``correct`` patches nothing.  A *legal
variation* (``fails`` is None) changes something the contract leaves open,
where pipelines_port made one choice: the whole check must pass it, warnings
included.  Together they are the Python half of the mutation set
(``tests/js_mutants.py`` is the Node half): ``tests/test_conformance.py``
runs the whole check against each and reports the score.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import pathlib
import re
import sys
import uuid
from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pipelines_port as pp  # noqa: E402


class Variant(NamedTuple):
    fails: Optional[str]  # the case check --strict must not pass; None for a port that keeps the contract
    patch: Callable[[], Optional[Dict[str, Any]]]  # may return options for pp.serve (auth settings)
    mode: str = "normal"  # "misconfigured": served with its token variable unset, checked with --misconfigured


VARIANTS: Dict[str, Variant] = {}


def variant(name: str, fails: Optional[str], mode: str = "normal") -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    def register(patch: Callable[[], Any]) -> Callable[[], Any]:
        VARIANTS[name] = Variant(fails, patch, mode)
        return patch
    return register


def wrap_replies(change: Callable[[int, bytes, Any], Any]) -> None:
    """Change how proxy replies are read: ``change(status, body, outcome) -> outcome`` (the interpret seam)."""
    class Client(pp.ProxyClient):
        def interpret(self, status: int, headers: Any, body: bytes, **kwargs: Any) -> Any:
            return change(status, body, super().interpret(status, headers, body, **kwargs))

    pp.set_default_client(Client())


def wrap_sent_headers(change: Callable[[Dict[str, str], str], Dict[str, str]]) -> None:
    """Change the headers of every proxy request: ``change(headers, path) -> headers`` (the exchange seam)."""
    class Client(pp.ProxyClient):
        def exchange(self, base: Any, method: str, path: str, headers: Any, *rest: Any) -> Any:
            return super().exchange(base, method, path, change(dict(headers), path), *rest)

    pp.set_default_client(Client())


@variant("correct", None)
def correct() -> None:
    pass


@variant("auth_after_ping", "auth.ping_wrong_credential")
def auth_after_ping() -> None:
    original = pp.DispatchApp.handle

    def handle(self: Any, method: str, target: str, headers: Any, body: bytes) -> Any:
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        if pp.is_ping(payload):  # answered before the credential is looked at
            return pp.json_reply(200, {"ok": True})
        return original(self, method, target, headers, body)

    pp.DispatchApp.handle = handle


@variant("envelope_unwrapped", "proxy.unwrap")
def envelope_unwrapped() -> None:
    def whole_body(status: int, body: bytes, reply: Any) -> Any:
        if reply.kind == "value":
            with contextlib.suppress(ValueError):
                return reply._replace(value=json.loads(body))  # the trace envelope itself
        return reply

    wrap_replies(whole_body)


@variant("no_retry_429", "proxy.retry_429")
def no_retry_429() -> None:
    wrap_replies(lambda status, body, reply: pp.ProxyOutcome("error", error=reply.error)
                 if status == 429 and reply.kind == "retry" else reply)


@variant("new_key_per_retry", "proxy.idempotency_reused_on_retry")
def new_key_per_retry() -> None:
    wrap_sent_headers(lambda headers, path: dict(headers, **{"Idempotency-Key": str(uuid.uuid4())})
                      if "Idempotency-Key" in headers else headers)


@variant("string_decoded_twice", "proxy.string_not_decoded_twice")
def string_decoded_twice() -> None:
    def decode_again(status: int, body: bytes, reply: Any) -> Any:
        if reply.kind == "value" and isinstance(reply.value, str):
            with contextlib.suppress(ValueError):
                return reply._replace(value=json.loads(reply.value))
        return reply

    wrap_replies(decode_again)


@variant("token_in_error_detail", "secrets.agent_error_detail")
def token_in_error_detail() -> None:
    pp.DispatchApp.secrets = lambda self, envelope: (None, None)  # type: ignore[method-assign]


@variant("proxy_error_body_unscrubbed", "secrets.proxy_error_echo")
def proxy_error_body_unscrubbed() -> None:
    """The client keeps a proxy error body as it came, run token included, and the 500 detail is not scrubbed."""
    class Client(pp.ProxyClient):
        def interpret(self, status: int, headers: Any, body: bytes, **kwargs: Any) -> Any:
            return super().interpret(status, headers, body, **dict(kwargs, run_token=None))

    pp.set_default_client(Client())
    pp.DispatchApp.secrets = lambda self, envelope: (None, None)  # type: ignore[method-assign]


@variant("empty_final_response", "response.empty_final_response")
def empty_final_response() -> None:
    original = pp._built  # what DispatchApp builds its replies with (build_response, its warnings redacted)

    def built(value: Any, **kwargs: Any) -> Any:
        try:
            return original(value, **kwargs)
        except pp.ResponseError:
            return {"final_response": ""}

    pp._built = built


@variant("global_envelope", "concurrency.distinct_tokens")
def global_envelope() -> None:
    current: Dict[str, pp.Envelope] = {}

    @contextlib.contextmanager
    def bind_envelope(envelope: pp.Envelope) -> Iterator[pp.Envelope]:
        current["envelope"] = envelope  # one global for every concurrent dispatch
        yield envelope

    pp.bind_envelope = bind_envelope
    pp.current_envelope = lambda: current["envelope"]


@variant("loose_ping", "ping.strict")
def loose_ping() -> None:
    pp.is_ping = lambda body: isinstance(body, dict) and bool(body.get("ping"))


@variant("stale_not_distinguished", "proxy.stale_run_token")
def stale_not_distinguished() -> None:
    def plain(status: int, body: bytes, reply: Any) -> Any:
        error = reply.error
        if isinstance(error, pp.StaleRunTokenError):
            return reply._replace(error=pp.ProxyError(error.message, status_code=error.status_code,
                                                      error_class=error.error_class, tool_name=error.tool_name))
        return reply

    wrap_replies(plain)


@variant("actor_not_validated", "actor.malformed_refused")
def actor_not_validated() -> None:
    pp.validate_actor_label = lambda label: (label.strip() or None) if isinstance(label, str) else label


@variant("retries_terminal_500", "proxy.terminal_500")
def retries_terminal_500() -> None:
    wrap_replies(lambda status, body, reply: reply._replace(kind="retry") if status == 500 else reply)


@variant("header_fallback_ignored", "envelope.header_fallback")
def header_fallback_ignored() -> None:
    original = pp.Envelope.from_dispatch.__func__

    def from_dispatch(cls: Any, body: Any, headers: Any = None) -> pp.Envelope:
        token = {str(k).lower(): v for k, v in dict(headers or {}).items()}.get("x-pipelines-run-token")
        return original(cls, body, {"X-Pipelines-Run-Token": token} if token is not None else {})

    pp.Envelope.from_dispatch = classmethod(from_dispatch)


@variant("no_occurred_at", "trace.event_shape")
def no_occurred_at() -> None:
    class Client(pp.ProxyClient):
        def exchange(self, base: Any, method: str, path: str, headers: Any, body: bytes, *rest: Any) -> Any:
            if "/traces/" in path:
                event = json.loads(body)
                event.pop("__occurred_at", None)
                body = json.dumps(event).encode()
            return super().exchange(base, method, path, headers, body, *rest)

    pp.set_default_client(Client())


@variant("both_token_headers", "proxy.request_shape")
def both_token_headers() -> None:
    def add(headers: Dict[str, str], path: str) -> Dict[str, str]:
        auth = headers.get("Authorization", "")
        if auth.startswith("Bearer ") and "Idempotency-Key" in headers:
            headers["X-Pipelines-Run-Token"] = auth[7:]
        return headers

    wrap_sent_headers(add)


@variant("no_key_on_tool_calls", "proxy.idempotency_fresh")
def no_key_on_tool_calls() -> None:
    wrap_sent_headers(lambda headers, path: {k: v for k, v in headers.items() if k != "Idempotency-Key"})


@variant("no_backoff", "vectors.proxy_replies:429-without-retry-after-is-retried-with-backoff")
def no_backoff() -> None:
    original = pp.RetryPolicy.delay

    def delay(self: Any, retry_number: int, retry_after: Optional[float] = None) -> float:
        return original(self, retry_number, retry_after) if retry_after is not None else 0.0  # hammers the proxy

    pp.RetryPolicy.delay = delay


@variant("json_before_auth", "auth.invalid_json_without_credential")
def json_before_auth() -> None:
    original = pp.DispatchApp.handle

    def handle(self: Any, method: str, target: str, headers: Any, body: bytes) -> Any:
        try:
            json.loads(body)
        except ValueError:  # a 400 before the credential is looked at
            return pp.error_reply(pp.RequestError("body is not valid JSON"))
        return original(self, method, target, headers, body)

    pp.DispatchApp.handle = handle


@variant("untyped_error_detail", "response.agent_error")
def untyped_error_detail() -> None:
    pp.describe_error = lambda exc, limit=pp.DETAIL_LIMIT, *secrets: pp.redact(str(exc), *secrets)[:limit]  # no type


# -- legal variations: what the contract leaves open ------------------------------------------



@variant("chunked_requests", None)
def chunked_requests() -> None:
    """Every proxy request body in chunked transfer coding, as a streaming HTTP/1.1 client sends it."""
    import http.client

    original = http.client.HTTPConnection.request

    def request(self: Any, method: str, url: str, body: Any = None, headers: Any = None, **kwargs: Any) -> Any:
        headers = dict(headers or {})
        if isinstance(body, bytes) and body:
            headers = {k: v for k, v in headers.items() if k.lower() != "content-length"}
            body = iter([body[i:i + 4096] for i in range(0, len(body), 4096)])  # no length: http.client chunks it
        return original(self, method, url, body, headers, **kwargs)

    http.client.HTTPConnection.request = request


@variant("run_token_header", None)
def run_token_header() -> None:
    """The run token as X-Pipelines-Run-Token instead of Authorization: Bearer (§3.1 allows either)."""
    def swap(headers: Dict[str, str], path: str) -> Dict[str, str]:
        if headers.get("Authorization", "").startswith("Bearer "):
            headers["X-Pipelines-Run-Token"] = headers.pop("Authorization")[len("Bearer "):]
        return headers

    wrap_sent_headers(swap)


@variant("lowercase_bearer", None)
def lowercase_bearer() -> None:
    """``authorization: bearer <t>``: the scheme is case-insensitive."""
    def lower(headers: Dict[str, str], path: str) -> Dict[str, str]:
        if headers.get("Authorization", "").startswith("Bearer "):
            headers["authorization"] = "bearer " + headers.pop("Authorization")[len("Bearer "):]
        return headers

    wrap_sent_headers(lower)


@variant("no_key_on_traces", None)
def no_key_on_traces() -> None:
    """No Idempotency-Key on trace events: §3.1's key is for tool calls."""
    wrap_sent_headers(lambda headers, path: {k: v for k, v in headers.items() if k != "Idempotency-Key"}
                      if "/traces/" in path else headers)


@variant("refusals_left_to_the_proxy", None)
def refusals_left_to_the_proxy() -> None:
    """Tool names and argument sizes not checked locally: the proxy's 4xx reports them."""
    original = pp.ProxyClient.call

    def call(self: Any, envelope: Any, name: Any, args: Any, **kwargs: Any) -> Any:
        return original(self, envelope, name if isinstance(name, str) else json.dumps(name), args, **kwargs)

    pp.ProxyClient.call = call
    pp.validate_tool_name = lambda name: name
    pp.MAX_REQUEST_BYTES = 1 << 30


@variant("terse_missing_proxy_url", None)
def terse_missing_proxy_url() -> None:
    """A 400 that names the missing proxy URL and not every place looked for it."""
    original = pp.Envelope.from_dispatch.__func__

    def from_dispatch(cls: Any, body: Any, headers: Any = None) -> pp.Envelope:
        try:
            return original(cls, body, headers)
        except pp.EnvelopeError as exc:
            raise pp.EnvelopeError(re.sub(r"proxy URL \(looked for [^)]*\)", "proxy URL", str(exc))) from None

    pp.Envelope.from_dispatch = classmethod(from_dispatch)


@variant("blank_final_response_sent", None)
def blank_final_response_sent() -> None:
    """A blank final_response answered as is: §4 asks only for a non-empty string."""
    original = pp._built  # what DispatchApp builds its replies with

    def build_response(value: Any, **kwargs: Any) -> Any:
        final = value.get("final_response") if isinstance(value, dict) else value
        if isinstance(final, str) and final and not final.strip():
            return {"final_response": final}
        return original(value, **kwargs)

    pp._built = build_response


# -- more porting bugs: auth compared loosely, misconfiguration, normalisation, errors, the transcript -----------


def loose_credential(compare: Callable[[str, str], bool], any_scheme: bool = False) -> None:
    """Inbound auth that compares the received credential with ``compare(received, expected)``."""
    def check_credential(headers: Any, expected: str, *, header_name: str = "Authorization") -> bool:
        received = {str(k).lower(): v for k, v in dict(headers or {}).items()}.get(header_name.lower())
        if not received or not expected:
            return False
        if header_name.lower() == "authorization":
            scheme, _, received = received.strip().partition(" ")
            if scheme.lower() != "bearer" and not any_scheme:
                return False
        return compare(received.strip(), expected)

    pp.check_credential = check_credential


@variant("auth_prefix_match", "auth.credential_variants")
def auth_prefix_match() -> None:
    loose_credential(lambda got, want: bool(got) and want.startswith(got))


@variant("auth_startswith_expected", "auth.credential_variants")
def auth_startswith_expected() -> None:
    loose_credential(lambda got, want: got.startswith(want))


@variant("auth_case_insensitive", "auth.credential_variants")
def auth_case_insensitive() -> None:
    loose_credential(lambda got, want: got.lower() == want.lower())


@variant("auth_whitespace_removed", "auth.credential_variants")
def auth_whitespace_removed() -> None:
    loose_credential(lambda got, want: "".join(got.split()) == want)


@variant("auth_any_scheme", "auth.credential_variants")
def auth_any_scheme() -> None:
    loose_credential(lambda got, want: got == want, any_scheme=True)


@variant("misconfigured_runs_open", "misconfigured.refuses_everything", mode="misconfigured")
def misconfigured_runs_open() -> Dict[str, Any]:
    return {"no_auth": True}  # the token variable is unset, and the port silently serves without auth


@variant("misconfigured_401", "misconfigured.refuses_everything", mode="misconfigured")
def misconfigured_401() -> None:
    pp.MisconfiguredError.http_status = 401  # type: ignore[misc]  # blames the caller for the operator's mistake


@variant("response_token_not_redacted", "secrets.agent_response")
def response_token_not_redacted() -> None:
    pp._without_run_token = lambda body, envelope, encoded=None: body  # the agent's own answer sent as it is


@variant("traceback_in_detail", "response.no_traceback")
def traceback_in_detail() -> None:
    import traceback

    pp.describe_error = lambda exc, limit=pp.DETAIL_LIMIT, *secrets: pp.redact("".join(
        traceback.format_exception(type(exc), exc, exc.__traceback__)), *secrets)


@variant("agent_error_200", "response.agent_error")
def agent_error_200() -> None:
    original = pp.error_reply

    def error_reply(exc: BaseException) -> Any:
        if isinstance(exc, pp.AgentError):  # the failure handed to the judge as if it were an answer
            return pp.json_reply(200, {"final_response": f"The agent failed: {exc}"})
        return original(exc)

    pp.error_reply = error_reply


@variant("sub_agents_untrimmed", "envelope.sub_agents_catalog")
def sub_agents_untrimmed() -> None:
    def catalog(entries: Any) -> Any:
        labels = [e.get("actor_id") if isinstance(e, dict) else e for e in entries]
        return tuple(dict.fromkeys(label for label in labels if isinstance(label, str) and label.strip()))

    pp._sub_agent_catalog = catalog


@variant("undeclared_actor_refused", "actor.undeclared_allowed")
def undeclared_actor_refused() -> None:
    original = pp.ProxyClient.call

    def call(self: Any, envelope: Any, name: Any, args: Any, *, actor: Any = None, **kwargs: Any) -> Any:
        label = actor.strip() if isinstance(actor, str) else actor
        if label and envelope.sub_agents and label not in envelope.sub_agents:
            raise pp.ProxyRequestError(f"actor {label!r} is not a declared sub-agent", tool_name=name)
        return original(self, envelope, name, args, actor=actor, **kwargs)

    pp.ProxyClient.call = call


@variant("actor_not_trimmed", "actor.trimmed")
def actor_not_trimmed() -> None:
    original = pp.validate_actor_label
    pp.validate_actor_label = lambda label: label if original(label) else None


@variant("actor_header_when_empty", "actor.absent_when_empty")
def actor_header_when_empty() -> None:
    wrap_sent_headers(lambda headers, path: headers if "X-Pipelines-Actor-Id" in headers
                      else dict(headers, **{"X-Pipelines-Actor-Id": ""}))


@variant("occurred_at_per_attempt", "trace.occurred_at_kept_on_retry")
def occurred_at_per_attempt() -> None:
    import datetime

    class Client(pp.ProxyClient):
        def exchange(self, base: Any, method: str, path: str, headers: Any, body: bytes, *rest: Any) -> Any:
            if "/traces/" in path:  # stamped per attempt instead of once per event
                event = json.loads(body)
                event["__occurred_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="microseconds").replace("+00:00", "Z")
                body = json.dumps(event).encode()
            return super().exchange(base, method, path, headers, body, *rest)

    pp.set_default_client(Client())


@variant("retry_after_ignored", "vectors.proxy_replies:429-with-retry-after-seconds-is-retried")
def retry_after_ignored() -> None:
    original = pp.RetryPolicy.delay
    pp.RetryPolicy.delay = lambda self, retry_number, retry_after=None: original(self, retry_number, None)


@variant("retry_after_unbounded",
         "vectors.proxy_replies:429-with-a-retry-after-of-an-hour-is-not-waited-the-call-fails-at-once")
def retry_after_unbounded() -> None:
    """Honours any Retry-After, an hour included: the run sleeps past its end (a kit rule, --profile api)."""
    pp.RetryPolicy.max_retry_after_s = float("inf")


@variant("retries_unbounded", "proxy.retry_bounded")
def retries_unbounded() -> None:
    pp.RetryPolicy.max_attempts = 25  # "retry until it works"


@variant("no_retry_transient_503", "proxy.retry_503_lock_contention")
def no_retry_transient_503() -> None:
    wrap_replies(lambda status, body, reply: pp.ProxyOutcome("error", error=reply.error)
                 if status == 503 and reply.kind == "retry" else reply)


@variant("tool_error_raises", "proxy.tool_error_is_value")
def tool_error_raises() -> None:
    def raise_it(status: int, body: bytes, reply: Any) -> Any:
        if reply.kind == "value" and isinstance(reply.value, dict) and "error" in reply.value:
            return pp.ProxyOutcome("error", error=pp.ProxyError(str(reply.value["error"]), status_code=status))
        return reply

    wrap_replies(raise_it)


@variant("timestamp_idempotency_key", "proxy.idempotency_fresh")
def timestamp_idempotency_key() -> None:
    import time

    wrap_sent_headers(lambda headers, path: dict(headers, **{"Idempotency-Key": str(int(time.time()))})
                      if "Idempotency-Key" in headers else headers)


@variant("transcript_dropped", "response.script_transcript")
def transcript_dropped() -> None:
    original = pp._built  # what DispatchApp builds its replies with

    def build_response(value: Any, **kwargs: Any) -> Any:
        body = original(value, **kwargs)
        return {"final_response": body["final_response"]}  # messages and metadata lost on the way

    pp._built = build_response


@variant("turn_reply_folded", "response.turn_reply")
def turn_reply_folded() -> None:
    """A turn reply read as a framework result (the module before issue #42): its message becomes final_response,
    session_done and metadata are lost."""
    original = pp._built

    def built(value: Any, **kwargs: Any) -> Any:
        kwargs.pop("multi_turn", None)
        if isinstance(value, dict) and "message" in value and "final_response" not in value:
            value = value["message"]
        return original(value, **kwargs)

    pp._built = built


@variant("proxy_url_slash_kept", "envelope.echo")
def proxy_url_slash_kept() -> None:
    original = pp.validate_proxy_url
    pp.validate_proxy_url = lambda url, where: original(url, where) + ("/" if str(url).strip().endswith("/") else "")


@variant("task_input_not_nested", "envelope.echo")
def task_input_not_nested() -> None:
    original = pp.Envelope.from_dispatch.__func__

    def from_dispatch(cls: Any, body: Any, headers: Any = None) -> pp.Envelope:
        envelope = original(cls, body, headers)
        task = body.get("input") if isinstance(body, dict) else None
        return envelope.replace(task_input=task if isinstance(task, dict) else {})  # body.input, not body.input.input

    pp.Envelope.from_dispatch = classmethod(from_dispatch)


@variant("non_object_body_500", "http.non_object_body")
def non_object_body_500() -> None:
    original = pp.DispatchApp.handle

    def handle(self: Any, method: str, target: str, headers: Any, body: Optional[bytes]) -> Any:
        reply = original(self, method, target, headers, body)
        with contextlib.suppress(ValueError, TypeError):
            if reply.status == 400 and not isinstance(json.loads(body or b""), dict):
                return pp.json_reply(500, {"detail": "AttributeError: 'list' object has no attribute 'get'"})
        return reply

    pp.DispatchApp.handle = handle


@variant("tool_name_unencoded", "vectors.tool_names:secrets")
def tool_name_unencoded() -> None:
    """No local check of the tool name, and the name put in the path as it is (no percent-encoding)."""
    pp.validate_tool_name = lambda name: name
    pp.quote = lambda name, safe="": name


@variant("stale_token_header", "proxy.request_shape")
def stale_token_header() -> None:
    """A default header set once, from the first run: every later call carries two tokens that disagree."""
    first: Dict[str, str] = {}

    def add(headers: Dict[str, str], path: str) -> Dict[str, str]:
        token = headers.get("Authorization", "")[len("Bearer "):]
        return dict(headers, **{"X-Pipelines-Run-Token": first.setdefault("token", token)})

    wrap_sent_headers(add)


# -- legal variations, continued ----------------------------------------------------------------------------------


@variant("extra_top_level_keys", None)
def extra_top_level_keys() -> None:
    """Every response carries one more top-level key (§4 allows them)."""
    original = pp._built  # what DispatchApp builds its replies with
    pp._built = lambda value, **kwargs: dict(original(value, **kwargs), port="legal-variation")


@variant("other_error_wording", None)
def other_error_wording() -> None:
    """Refusals worded differently (upper case, other sentences), keeping the contract's nouns."""
    original = pp.error_reply

    def error_reply(exc: BaseException) -> Any:
        reply = original(exc)
        if reply.status == 500:
            return reply
        detail = json.loads(reply.body)["detail"]
        extra = [(k, v) for k, v in reply.headers if k.lower() not in ("content-type", "content-length")]
        return pp.json_reply(reply.status, {"detail": f"REQUEST REFUSED ({reply.status}): {detail.upper()}"}, extra)

    pp.error_reply = error_reply


@variant("sdk_style_error_detail", None)
def sdk_style_error_detail() -> None:
    """The 500 detail as the SDK words it: a prefix, then ``Type: message``."""
    original = pp.describe_error
    pp.describe_error = lambda exc, limit=pp.DETAIL_LIMIT, *secrets: (
        "unhandled exception in dispatch handler: " + original(exc, limit, *secrets))


@variant("lenient_request_heads", "http.no_smuggling")
def lenient_request_heads() -> None:
    """Heads read as http.server reads them instead of strictly: the request line split on whitespace, the fields
    by ``http.client.parse_headers`` (the email parser), so whitespace before a colon, obs-fold and the like pass
    and a request hidden in a body can be read as the next one."""
    import http.client
    import io

    def lenient(head: bytes) -> pp.RequestHead:
        line, _, fields = head.lstrip(b"\r\n").partition(b"\r\n")
        method, target, version = line.decode("latin-1").split()
        message = http.client.parse_headers(io.BytesIO(fields + b"\r\n\r\n"))
        return pp.RequestHead(method, target, version, list(message.items()))

    pp.parse_request_head = lenient  # the servers' reading of every head


@variant("other_jitter", None)
def other_jitter() -> None:
    """Another backoff: 0.3 s × 2ⁿ ±50 %, at most 3 attempts."""
    pp.RetryPolicy.base_delay_s = 0.3
    pp.RetryPolicy.jitter = 0.5
    pp.RetryPolicy.max_attempts = 3


@variant("more_attempts_wider_backoff", None)
def more_attempts_wider_backoff() -> None:
    """The guide says only "retry with backoff": 6 attempts, 0.2 s × 2ⁿ with full ±100 % jitter, each wait capped at 2 s."""
    pp.RetryPolicy.max_attempts = 6
    pp.RetryPolicy.base_delay_s = 0.2
    pp.RetryPolicy.jitter = 1.0
    pp.RetryPolicy.max_delay_s = 2.0


@variant("fastapi_error_bodies", None)
def fastapi_error_bodies() -> None:
    """Refusals as FastAPI writes them: a 400's detail as a validation list (``[{"loc", "msg", "type"}]``), and a
    500 for a raising agent as ``{"detail": "Internal Server Error: Type: message"}``."""
    original = pp.error_reply

    def error_reply(exc: BaseException) -> Any:
        reply = original(exc)
        if reply.status == 400:
            message = json.loads(reply.body)["detail"]
            return pp.json_reply(400, {"detail": [{"loc": ["body"], "msg": message, "type": "value_error"}]},
                                 [h for h in reply.headers if h[0].lower() not in ("content-type", "content-length")])
        if reply.status == 500:
            return pp.json_reply(500, {"detail": "Internal Server Error: " + json.loads(reply.body)["detail"]})
        return reply

    pp.error_reply = error_reply


@variant("no_keep_alive", None)
def no_keep_alive() -> None:
    """A new connection for every proxy request (``Connection: close``)."""
    wrap_sent_headers(lambda headers, path: dict(headers, Connection="close"))


@variant("lowercase_header_names", None)
def lowercase_header_names() -> None:
    """Proxy request header names in lower case, as HTTP/2-minded clients send them."""
    wrap_sent_headers(lambda headers, path: {k.lower(): v for k, v in headers.items()})


@variant("no_transport_retry", None)
def no_transport_retry() -> None:
    """A transport failure fails the call at once (what the SDK does)."""
    pp.RetryPolicy.transport_retries = 0


@variant("no_connectivity_check", None)
def no_connectivity_check() -> None:
    """No connectivity-check extension: such a body is an ordinary dispatch (its cases are skipped)."""
    original = pp.DispatchApp.handle

    def handle(self: Any, method: str, target: str, headers: Any, body: Optional[bytes]) -> Any:
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            payload = json.loads(body or b"")
            if payload.pop("connectivity_check", None) is True:
                body = json.dumps(payload).encode()
                headers = {k: v for k, v in dict(headers).items() if k.lower() != "content-length"}
                headers["Content-Length"] = str(len(body))
        return original(self, method, target, headers, body)

    pp.DispatchApp.handle = handle


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="broken_ports.py", description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=sorted(VARIANTS))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", help="the agent token (default: auth off)")
    args = parser.parse_args(argv)
    chosen = VARIANTS[args.variant]
    overrides = chosen.patch() or {}
    from conformance.checker.agent import agent

    if chosen.mode == "misconfigured":  # the token variable the endpoint reads is not set
        auth: Dict[str, Any] = {"token_env": "BROKEN_PORTS_UNSET_TOKEN_VARIABLE"}
    else:
        auth = {"token": args.token} if args.token else {"no_auth": True}
    auth.update(overrides)
    logging.basicConfig()
    logging.getLogger("pipelines_port").setLevel("ERROR")
    # The threaded server: its one entry per request is DispatchApp.handle, the seam several variants patch.
    return pp.serve(agent, host=args.host, port=args.port, grace_s=2.0, server="threads",
                    ready=lambda server: print(f"listening on {server.url}", flush=True), **auth)


if __name__ == "__main__":
    sys.exit(main())
