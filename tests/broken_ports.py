"""Deliberately broken ports: our server and conformance agent with one contract rule broken.

    python3 tests/broken_ports.py VARIANT [--port 0] [--token T]

prints ``listening on URL`` and serves until SIGTERM.  Each variant patches
pipelines_port in its own process only (so nothing leaks into the checker) and
names the case ``python3 -m conformance check`` must fail it on.  ``correct``
patches nothing.  A *legal variation* (``fails`` is None, ``control`` lists
cases) changes something the contract leaves open, where pipelines_port made
one choice: the check must pass it on every case listed.
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
    fails: Optional[str]  # the case id check must fail; None for a port that keeps the contract
    control: Optional[str]  # a neighbouring case it must still pass; for a legal variation, the cases (--only)
    patch: Callable[[], None]


VARIANTS: Dict[str, Variant] = {}


def variant(name: str, fails: Optional[str], control: Optional[str]) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def register(patch: Callable[[], None]) -> Callable[[], None]:
        VARIANTS[name] = Variant(fails, control, patch)
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


@variant("correct", None, None)
def correct() -> None:
    pass


@variant("auth_after_ping", "auth.ping_wrong_credential", "auth.dispatch_without_credential")
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


@variant("envelope_unwrapped", "proxy.unwrap", "proxy.non_json_reply")
def envelope_unwrapped() -> None:
    def whole_body(status: int, body: bytes, reply: Any) -> Any:
        if reply.kind == "value":
            with contextlib.suppress(ValueError):
                return reply._replace(value=json.loads(body))  # the trace envelope itself
        return reply

    wrap_replies(whole_body)


@variant("no_retry_429", "proxy.retry_429", "proxy.retry_503_lock_contention")
def no_retry_429() -> None:
    wrap_replies(lambda status, body, reply: pp.ProxyOutcome("error", error=reply.error)
                 if status == 429 and reply.kind == "retry" else reply)


@variant("new_key_per_retry", "proxy.idempotency_reused_on_retry", "proxy.idempotency_fresh")
def new_key_per_retry() -> None:
    wrap_sent_headers(lambda headers, path: dict(headers, **{"Idempotency-Key": str(uuid.uuid4())})
                      if "Idempotency-Key" in headers else headers)


@variant("string_decoded_twice", "proxy.string_not_decoded_twice", "proxy.unwrap")
def string_decoded_twice() -> None:
    def decode_again(status: int, body: bytes, reply: Any) -> Any:
        if reply.kind == "value" and isinstance(reply.value, str):
            with contextlib.suppress(ValueError):
                return reply._replace(value=json.loads(reply.value))
        return reply

    wrap_replies(decode_again)


@variant("token_in_error_detail", "secrets.agent_error_detail", "response.agent_error")
def token_in_error_detail() -> None:
    pp.DispatchApp.redact = lambda self, text, envelope: text  # type: ignore[method-assign]


@variant("empty_final_response", "response.empty_final_response", "response.echo_valid")
def empty_final_response() -> None:
    original = pp.build_response

    def build_response(value: Any, **kwargs: Any) -> Any:
        try:
            return original(value, **kwargs)
        except pp.ResponseError:
            return {"final_response": ""}

    pp.build_response = build_response


@variant("global_envelope", "concurrency.distinct_tokens", "envelope.echo")
def global_envelope() -> None:
    current: Dict[str, pp.Envelope] = {}

    @contextlib.contextmanager
    def bind_envelope(envelope: pp.Envelope) -> Iterator[pp.Envelope]:
        current["envelope"] = envelope  # one global for every concurrent dispatch
        yield envelope

    pp.bind_envelope = bind_envelope
    pp.current_envelope = lambda: current["envelope"]


@variant("loose_ping", "ping.strict", "ping.exact")
def loose_ping() -> None:
    pp.is_ping = lambda body: isinstance(body, dict) and bool(body.get("ping"))


@variant("stale_not_distinguished", "proxy.stale_run_token", "proxy.terminal_401")
def stale_not_distinguished() -> None:
    def plain(status: int, body: bytes, reply: Any) -> Any:
        error = reply.error
        if isinstance(error, pp.StaleRunTokenError):
            return reply._replace(error=pp.ProxyError(error.message, status_code=error.status_code,
                                                      error_class=error.error_class, tool_name=error.tool_name))
        return reply

    wrap_replies(plain)


@variant("actor_not_validated", "actor.malformed_refused", "actor.trimmed")
def actor_not_validated() -> None:
    pp.validate_actor_label = lambda label: (label.strip() or None) if isinstance(label, str) else label


@variant("retries_terminal_500", "proxy.terminal_500", "proxy.retry_429")
def retries_terminal_500() -> None:
    wrap_replies(lambda status, body, reply: reply._replace(kind="retry") if status == 500 else reply)


@variant("header_fallback_ignored", "envelope.header_fallback", "envelope.echo")
def header_fallback_ignored() -> None:
    original = pp.Envelope.from_dispatch.__func__

    def from_dispatch(cls: Any, body: Any, headers: Any = None) -> pp.Envelope:
        token = {str(k).lower(): v for k, v in dict(headers or {}).items()}.get("x-pipelines-run-token")
        return original(cls, body, {"X-Pipelines-Run-Token": token} if token is not None else {})

    pp.Envelope.from_dispatch = classmethod(from_dispatch)


@variant("no_occurred_at", "trace.event_shape", "trace.self_handoff_dropped")
def no_occurred_at() -> None:
    class Client(pp.ProxyClient):
        def exchange(self, base: Any, method: str, path: str, headers: Any, body: bytes, *rest: Any) -> Any:
            if "/traces/" in path:
                event = json.loads(body)
                event.pop("__occurred_at", None)
                body = json.dumps(event).encode()
            return super().exchange(base, method, path, headers, body, *rest)

    pp.set_default_client(Client())


@variant("both_token_headers", "proxy.request_shape", "proxy.idempotency_fresh")
def both_token_headers() -> None:
    def add(headers: Dict[str, str], path: str) -> Dict[str, str]:
        auth = headers.get("Authorization", "")
        if auth.startswith("Bearer ") and "Idempotency-Key" in headers:
            headers["X-Pipelines-Run-Token"] = auth[7:]
        return headers

    wrap_sent_headers(add)


@variant("no_key_on_tool_calls", "proxy.idempotency_fresh", "trace.event_shape")
def no_key_on_tool_calls() -> None:
    wrap_sent_headers(lambda headers, path: {k: v for k, v in headers.items() if k != "Idempotency-Key"})


@variant("no_backoff", "vectors.proxy_replies:429-without-retry-after-is-retried-with-backoff", "proxy.retry_429")
def no_backoff() -> None:
    original = pp.RetryPolicy.delay

    def delay(self: Any, retry_number: int, retry_after: Optional[float] = None) -> float:
        return original(self, retry_number, retry_after) if retry_after is not None else 0.0  # hammers the proxy

    pp.RetryPolicy.delay = delay


@variant("json_before_auth", "auth.invalid_json_without_credential", "http.invalid_json")
def json_before_auth() -> None:
    original = pp.DispatchApp.handle

    def handle(self: Any, method: str, target: str, headers: Any, body: bytes) -> Any:
        try:
            json.loads(body)
        except ValueError:  # a 400 before the credential is looked at
            return pp.error_reply(pp.RequestError("body is not valid JSON"))
        return original(self, method, target, headers, body)

    pp.DispatchApp.handle = handle


@variant("untyped_error_detail", "response.agent_error", "secrets.agent_error_detail")
def untyped_error_detail() -> None:
    pp.describe_error = lambda exc, limit=pp.DETAIL_LIMIT: str(exc)[:limit]  # the message without the exception type


# -- legal variations: what the contract leaves open ------------------------------------------

SHAPE_CASES = "proxy.request_shape,proxy.idempotency_fresh,trace.event_shape,trace.handoff,concurrency," \
              "vectors.proxy_requests,vectors.trace_events"


@variant("chunked_requests", None, "proxy,trace,actor,concurrency,vectors.proxy_requests,vectors.trace_events,"
                                   "vectors.proxy_replies")
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


@variant("run_token_header", None, SHAPE_CASES)
def run_token_header() -> None:
    """The run token as X-Pipelines-Run-Token instead of Authorization: Bearer (§3.1 allows either)."""
    def swap(headers: Dict[str, str], path: str) -> Dict[str, str]:
        if headers.get("Authorization", "").startswith("Bearer "):
            headers["X-Pipelines-Run-Token"] = headers.pop("Authorization")[len("Bearer "):]
        return headers

    wrap_sent_headers(swap)


@variant("lowercase_bearer", None, SHAPE_CASES)
def lowercase_bearer() -> None:
    """``authorization: bearer <t>``: the scheme is case-insensitive."""
    def lower(headers: Dict[str, str], path: str) -> Dict[str, str]:
        if headers.get("Authorization", "").startswith("Bearer "):
            headers["authorization"] = "bearer " + headers.pop("Authorization")[len("Bearer "):]
        return headers

    wrap_sent_headers(lower)


@variant("no_key_on_traces", None, "trace,vectors.trace_events")
def no_key_on_traces() -> None:
    """No Idempotency-Key on trace events: §3.1's key is for tool calls."""
    wrap_sent_headers(lambda headers, path: {k: v for k, v in headers.items() if k != "Idempotency-Key"}
                      if "/traces/" in path else headers)


@variant("refusals_left_to_the_proxy", None, "vectors.tool_names,vectors.proxy_requests")
def refusals_left_to_the_proxy() -> None:
    """Tool names and argument sizes not checked locally: the proxy's 4xx reports them."""
    original = pp.ProxyClient.call

    def call(self: Any, envelope: Any, name: Any, args: Any, **kwargs: Any) -> Any:
        return original(self, envelope, name if isinstance(name, str) else json.dumps(name), args, **kwargs)

    pp.ProxyClient.call = call
    pp.validate_tool_name = lambda name: name
    pp.MAX_REQUEST_BYTES = 1 << 30


@variant("terse_missing_proxy_url", None, "envelope.missing_proxy_url,vectors.envelope")
def terse_missing_proxy_url() -> None:
    """A 400 that names the missing proxy URL and not every place looked for it."""
    original = pp.Envelope.from_dispatch.__func__

    def from_dispatch(cls: Any, body: Any, headers: Any = None) -> pp.Envelope:
        try:
            return original(cls, body, headers)
        except pp.EnvelopeError as exc:
            raise pp.EnvelopeError(re.sub(r"proxy URL \(looked for [^)]*\)", "proxy URL", str(exc))) from None

    pp.Envelope.from_dispatch = classmethod(from_dispatch)


@variant("blank_final_response_sent", None, "response.empty_final_response,vectors.build_response")
def blank_final_response_sent() -> None:
    """A blank final_response answered as is: §4 asks only for a non-empty string."""
    original = pp.build_response

    def build_response(value: Any, **kwargs: Any) -> Any:
        final = value.get("final_response") if isinstance(value, dict) else value
        if isinstance(final, str) and final and not final.strip():
            return {"final_response": final}
        return original(value, **kwargs)

    pp.build_response = build_response


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="broken_ports.py", description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=sorted(VARIANTS))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", help="the agent token (default: auth off)")
    args = parser.parse_args(argv)
    VARIANTS[args.variant].patch()
    from conformance.agent import agent

    auth: Dict[str, Any] = {"token": args.token} if args.token else {"no_auth": True}
    logging.basicConfig()
    logging.getLogger("pipelines_port").setLevel("ERROR")
    return pp.serve(agent, host=args.host, port=args.port, grace_s=2.0,
                    ready=lambda server: print(f"listening on {server.url}", flush=True), **auth)


if __name__ == "__main__":
    sys.exit(main())
