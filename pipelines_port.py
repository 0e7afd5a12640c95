"""pipelines_port: put any agent under test on the Pipelines platform, stdlib only.

One file, no dependencies, Python 3.9+.  Copy it into a sandbox upload, run it
as a dispatch server, or read it while porting to another language.  The wire
contract it speaks is CONTRACT.md; section numbers below (§2, §3.3, ...) point
into it, and each rule there says whether a port MUST, SHOULD or MAY keep it.

The file has three parts, each opening with what it may and may not do:

1. THE CONTRACT: constants, errors (each carries its HTTP status), envelope
   parsing, inbound decisions (``decide``), request encoding, reply
   interpretation, the retry decision, response building and validation.
   No sockets, threads, environment reads or logging.  A porter reads this part alone.
2. THE PYTHON RUNTIME: the speed paths (part 1's rules computed faster, each
   held to them by a test), context binding, the two transports (blocking and
   asyncio) and their retry loop, ``ProxyClient``, ``DispatchApp`` (runs the
   agent, probes the proxy), the servers (asyncio, http.server, WSGI, ASGI),
   code mode.
3. CONVENIENCES: agent-loop helpers, tools from code, framework bridges, the
   MCP shim; last, the command line (``serve``, ``mcp``).

Map: each part and section at the line it starts on (tests/test_repo.py keeps
the numbers true)::

      256  PART 1 - THE CONTRACT
      277    Constants: the contract's names and numbers
      350    Errors
      556    Frozen data: read-only JSON containers that still serialise as JSON
      623    Envelope (§2 dispatch, §5 code mode)
     1177    Inbound decisions (§2): auth, framing, JSON, ping, connectivity, envelope
     1631    Request encoding (§3.1, §3.4, §3.5): what goes on the wire to the proxy
     1790    Reply interpretation (§3.2, §3.3) and the retry decision
     2024    Response envelope (§4): building and validation
     2666    HTTP replies of a dispatch endpoint: JSON bodies, one error path
     2732  PART 2 - THE PYTHON RUNTIME
     2778    Speed paths: what part 1 computes, computed faster in Python
     2897    Context binding: the envelope of the dispatch running in this context
     2942    Transport, blocking: pacing, keep-alive connections, a whole-reply deadline
     3280    The deadline wheel: the asyncio driver's and server's timeouts
     3374    Transport, asyncio: replies read as they arrive, connections pooled per loop
     3841    The retry loop of both drivers (RetryState.step decides), and what they share
     3999    Proxy client (§3): tool calls, trace events, actors
     4564    Running agents: a fresh thread per run, an optional deadline
     4816    The dispatch app (§2): decide(), then probe the proxy or run the agent
     5199    Server adapters: the built-in servers' settings; WSGI and ASGI
     5313    The http.server server: a thread per connection, its classes built on first use
     5614    The asyncio server: one event loop, a protocol per connection
     6035    Starting a server: make_server, start_server, serve (signals and the drain)
     6137    Code mode (§5): one agent function, the sandbox's run() entrypoint
     6265  PART 3 - CONVENIENCES
     6278    Agent-loop helpers: tool formats (§3.6), concurrent tool calls
     6522    Tools from code: JSON Schema from a function's signature
     6852    Framework bridges (the porting guide's steps 1 and 2)
     7361    MCP shim (§3.6): a stdio MCP server whose tools go through the proxy
     7558    Command line: serve, mcp

Quick look::

    import pipelines_port as pp

    env = pp.Envelope.from_dispatch(body, headers)     # §2, raises EnvelopeError
    with pp.bind_envelope(env):
        order = pp.proxy_call("get_order", {"order_id": "4521"})   # §3, unwrapped
        pp.post_trace("assistant_message", {"text": "looking it up"}, best_effort=True)
    reply = pp.build_response("Refund issued.", messages=[...])      # §4

Importing this module does no I/O and starts nothing.
"""

from __future__ import annotations
import base64
import binascii
import contextlib
import contextvars
import enum
import functools
import hmac
import json
import logging
import math
import os
import random
import re
import select
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping  # isinstance against typing.Mapping costs a Python-level check per call
from typing import (
    TYPE_CHECKING,
    Any,
    Awaitable,
    Callable,
    Coroutine,
    Deque,
    Dict,
    FrozenSet,
    Generic,
    Iterable,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Set,
    Tuple,
    Type,
    TypeVar,
    Union,
    cast,
)
from urllib.parse import quote, urlsplit

if TYPE_CHECKING:  # imported lazily at run time: they cost import time
    import http.client
    import ssl

if __name__ == "__main__":
    # Run as a script or with -m: an agent file's `import pipelines_port` must get this very
    # module (one envelope binding, one proxy client), not a second copy.
    sys.modules.setdefault("pipelines_port", sys.modules[__name__])

__version__ = "0.1.0"

__all__ = [
    # -- part 1: the contract ------------------------------------------------
    # errors (each with its http_status)
    "PipelinesError",
    "RequestError",
    "EnvelopeError",
    "NotFoundError",
    "MethodNotAllowedError",
    "UnknownMethodError",
    "LengthRequiredError",
    "BodyTooLargeError",
    "UnsupportedTransferCodingError",
    "FramingError",
    "TargetTooLongError",
    "HeadersTooLargeError",
    "VersionNotSupportedError",
    "AuthError",
    "MisconfiguredError",
    "ShuttingDownError",
    "OverloadedError",
    "RequestTimeoutError",
    "RunTimeoutError",
    "AgentError",
    "ResponseError",
    "ProxyError",
    "ProxyRequestError",
    "ProxyTransportError",
    "StaleRunTokenError",
    # envelope
    "Envelope",
    "validate_proxy_url",
    "json_type",
    # inbound decisions
    "check_credential",
    "is_ping",
    "request_body_length",
    "RequestHead",
    "parse_request_head",
    "connectivity_proxy_url",
    "Endpoint",
    "Decision",
    "decide",
    # request encoding
    "validate_tool_name",
    "validate_actor_label",
    "encode_args",
    "ProxyRequest",
    "proxy_request",
    "tool_call_request",
    "trace_request",
    "handoff_event",
    # reply interpretation and the retry decision
    "ProxyOutcome",
    "parse_retry_after",
    "error_fields",
    "interpret_reply",
    "RETRY_TABLE",
    "retry_decision",
    "RetryPolicy",
    "RetryStep",
    "RetryState",
    "TRACE_EVENT_TYPES",
    # response envelope
    "response_envelope",
    "build_turn_reply",
    "validate_response",
    "MAX_JSON_DEPTH",
    "MAX_INT_DIGITS",
    "HttpReply",
    "json_reply",
    "error_reply",
    "describe_error",
    "redact",
    # -- part 2: the Python runtime -------------------------------------------
    "bind_envelope",
    "current_envelope",
    "ProxyClient",
    "set_default_client",
    "proxy_call",
    "aproxy_call",
    "Actor",
    "as_actor",
    "post_trace",
    "apost_trace",
    "post_handoff",
    "apost_handoff",
    "build_response",
    "DispatchApp",
    "probe_proxy",
    "aprobe_proxy",
    "wsgi_app",
    "asgi_app",
    "make_server",
    "SERVERS",
    "AsyncDispatchServer",
    "default_max_connections",
    "start_server",
    "serve",
    "code_mode",
    "check_run_timeout",
    "run_in_fresh_thread",
    "load_agent",
    "main",
    # -- part 3: conveniences ----------------------------------------------
    "TOOL_FORMATS",
    "convert_tools",
    "load_tools_schema",
    "tools_schema_beside",
    "bound_output",
    "call_tools",
    "post_json",
    "HTTPStatusError",
    "Tool",
    "tool",
    "export_tools",
    "schema_for_type",
    "validate_args",
    "McpShim",
    "tools_schema_from",
    "proxied_tools",
    "response_from",
    "Handoffs",
    "MCP_PROTOCOL_VERSIONS",
]

_log = logging.getLogger("pipelines_port")
_access_log = logging.getLogger("pipelines_port.access")  # a line per request; serve --no-access-log quiets it

# ###########################################################################
#
#   PART 1 - THE CONTRACT
#
#   What a port must agree on, as data and pure functions: the contract's
#   names and numbers, the errors and the HTTP status each one means, the
#   dispatch envelope, the inbound decision (``decide``), how a proxy request
#   is encoded and its reply interpreted, when to retry, and the response
#   envelope.  Rules this part keeps: no sockets, no threads, no environment
#   reads (a caller that omits an ``environ`` mapping gets ``os.environ``,
#   read there and nowhere else), no logging.  Everything here takes its
#   inputs as arguments and returns values or raises one of the errors below,
#   so a TypeScript, Go or Rust port can translate it function by function.
#   What only makes Python faster lives in part 2 ("Speed paths"); three of
#   its names are called here, each meaning what a port's own library gives:
#   ``_json_from_bytes`` (json.loads), ``_idempotency_key`` (a fresh version-4
#   UUID as text) and ``_int_limit`` (10 ** MAX_INT_DIGITS).
#
# ###########################################################################



# ---------------------------------------------------------------------------
# Constants: the contract's names and numbers
# ---------------------------------------------------------------------------

# §2 inbound headers (compared case-insensitively; stored lower-case).
HEADER_RUN_TOKEN = "x-pipelines-run-token"
HEADER_PROXY_URL = "x-pipelines-odyssey-proxy-url"
HEADER_PROXY_URL_LEGACY = "x-pipelines-pwsa-proxy-url"
HEADER_RUN_ID = "x-pipelines-run-id"
HEADER_TASK_ID = "x-pipelines-task-id"
HEADER_RUN_TOKEN_JTI = "x-pipelines-run-token-jti"
# §3.5 outbound multi-agent attribution.
HEADER_ACTOR_ID = "X-Pipelines-Actor-Id"
# §2 body fields.
BODY_PROXY_URL = "odyssey_proxy_url"
BODY_PROXY_URL_LEGACY = "pwsa_proxy_url"
# §5 code-mode environment.
ENV_PROXY_URL = "PIPELINES_ODYSSEY_PROXY_URL"
ENV_RUN_TOKEN = "PIPELINES_RUN_TOKEN"
ENV_RUN_TOKEN_JTI = "PIPELINES_RUN_TOKEN_JTI"
ENV_RUN_ID = "PIPELINES_RUN_ID"
ENV_TASK_ID = "PIPELINES_TASK_ID"
ENV_AGENT_ID = "PIPELINES_AGENT_ID"
ENV_API_URL = "PIPELINES_API_URL"
ENV_TASK_INPUT_JSON = "_PIPELINES_TASK_INPUT_JSON"
ENV_TASK_INPUT_B64 = "_PIPELINES_TASK_INPUT_B64"
# §3.6 inline tools schema.
ENV_TOOLS_SCHEMA_B64 = "PIPELINES_TOOLS_SCHEMA_B64"
ENV_TOOLS_SCHEMA_JSON = "PIPELINES_TOOLS_SCHEMA_JSON"
# §3.1 client knobs.
ENV_PROXY_TIMEOUT_S = "PIPELINES_PROXY_TIMEOUT_S"
ENV_PROXY_RATE_PER_MINUTE = "PIPELINES_PROXY_RATE_PER_MINUTE"
# §3.1 tool names, §3.5 actor labels.
TOOL_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,127}")
ACTOR_SEGMENT_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
ACTOR_MAX_SEGMENTS = 8
ACTOR_MAX_LENGTH = 256
# Control characters that break an HTTP header value (a tab is allowed).
_CONTROL_CHARACTER = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
# §3.1 caps and limits.
MAX_REQUEST_BYTES = 1 << 20
MAX_REPLY_BYTES = 1 << 20
DEFAULT_PROXY_TIMEOUT_S = 120.0
RATE_LIMIT_PER_MINUTE = 60
# §3.3 retry classification.
TRANSIENT_503_CLASSES = frozenset(
    {"lock_contention", "context_store_unavailable", "trace_sequence_contended"}
)
STALE_TOKEN_CLASSES = frozenset(
    {"run_token_expired", "run_token_invalid", "run_token_rejected"}
)
# §3.4 reserved trace event types.
TRACE_EVENT_TYPES = frozenset(
    {
        "assistant_message",
        "thinking",
        "system_prompt",
        "custom",
        "llm_payload",
        "handoff",
        "subagent_message",
        "subagent_final",
    }
)
# §4 response envelope.
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
FINAL_RESPONSE_SOFT_LIMIT = 50_000
_METADATA_INT_KEYS = ("total_input_tokens", "total_output_tokens")
_METADATA_STR_KEYS = ("model", "system_prompt_id")
_REDACTED = "[redacted]"
_USER_AGENT = "pipelines-port/" + __version__


# ---------------------------------------------------------------------------
# Errors.  Each class carries the HTTP status a dispatch endpoint answers when
# it is raised while handling a request (``http_status``, like h11's
# ``error_status_hint``), so the inbound statuses come from this one table:
#
#   RequestError 400 (EnvelopeError 400, NotFoundError 404,
#       MethodNotAllowedError 405, LengthRequiredError 411, BodyTooLargeError 413)
#   AuthError 401          MisconfiguredError 503     ShuttingDownError 503
#   AgentError 500         ResponseError 500          RunTimeoutError 504
#
# ``error_reply(exc)`` turns any of them into the JSON ``{"detail": ...}`` reply.
# ---------------------------------------------------------------------------


class PipelinesError(Exception):
    """Base class of every error this module raises on purpose.

    ``http_status`` is what a dispatch endpoint answers when the error ends a
    request; ``headers`` are extra reply headers (``Allow``, ``WWW-Authenticate``).
    """

    http_status: int = 500
    headers: Tuple[Tuple[str, str], ...] = ()


class RequestError(PipelinesError, ValueError):
    """The request cannot be handled as sent: not JSON, not an object, truncated (§2)."""

    http_status = 400


class EnvelopeError(RequestError):
    """A dispatch envelope is missing, malformed, or not bound (§2, §5)."""


class NotFoundError(RequestError):
    """No route for the request's path."""

    http_status = 404


class MethodNotAllowedError(RequestError):
    """The path exists, the method does not; ``headers`` carry ``Allow``."""

    http_status = 405

    def __init__(self, message: str, allowed: Sequence[str]) -> None:
        super().__init__(message)
        self.headers = (("Allow", ", ".join(allowed)),)


class UnknownMethodError(RequestError):
    """A request method HTTP does not define (RFC 9110 §9): 501, as an origin server answers one it does not know."""

    http_status = 501


class LengthRequiredError(RequestError):
    """A POST without a usable Content-Length (chunked, absent or not a decimal number)."""

    http_status = 411


class BodyTooLargeError(RequestError):
    """A request body over the endpoint's cap, refused before it is read."""

    http_status = 413


class UnsupportedTransferCodingError(RequestError):
    """A ``Transfer-Encoding`` other than chunked (which gets 411): not a coding this endpoint reads (RFC 9112 §6.1)."""

    http_status = 501


class FramingError(RequestError):
    """A request head that breaks RFC 9112's grammar (§7.1 kit-strict-request-head): where this request ends is
    uncertain, so the connection closes after the reply; nothing after it is read as another request."""


class TargetTooLongError(FramingError):
    """A request line over :data:`MAX_REQUEST_LINE_BYTES`."""

    http_status = 414


class HeadersTooLargeError(FramingError):
    """A request head over :data:`MAX_REQUEST_HEAD_BYTES` or with more than :data:`MAX_REQUEST_FIELDS` fields."""

    http_status = 431


class VersionNotSupportedError(FramingError):
    """A well-formed HTTP version other than 1.x (``HTTP/2.0`` on a cleartext HTTP/1 connection, ``HTTP/9.9``)."""

    http_status = 505


class RequestTimeoutError(RequestError):
    """A request's head and body did not arrive within the server's ``read_timeout_s`` of its first byte."""

    http_status = 408


class AuthError(PipelinesError):
    """Missing or wrong inbound credential (§2 step 1); the message never echoes what was sent."""

    http_status = 401

    def __init__(self, message: str, *, bearer: bool = True) -> None:
        super().__init__(message)
        self.headers = (("WWW-Authenticate", "Bearer"),) if bearer else ()


class MisconfiguredError(PipelinesError):
    """The endpoint cannot check credentials: its token variable is unset (§2 step 1)."""

    http_status = 503


class ShuttingDownError(PipelinesError):
    """The server is draining after SIGTERM and takes no new requests."""

    http_status = 503


class OverloadedError(PipelinesError):
    """The server is at its limit of open connections (``max_connections``): retry shortly or elsewhere."""

    http_status = 503


class RunTimeoutError(PipelinesError):
    """The agent did not finish within ``run_timeout_s`` (§2 step 7)."""

    http_status = 504


class AgentError(PipelinesError):
    """The agent function raised; the message is ``Type: message``, the original is ``__cause__``."""

    http_status = 500


class ResponseError(PipelinesError, ValueError):
    """A value cannot become a valid response envelope (§4).

    ``problems`` lists every problem found, one readable string each.
    """

    http_status = 500

    def __init__(self, problems: Union[str, Sequence[str]]) -> None:
        self.problems: List[str] = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class ProxyError(PipelinesError):
    """A proxy call or trace post failed (§3.3).

    ``status_code`` is the HTTP status (``None`` when no reply arrived or the
    call was refused before sending), ``error_class`` the platform's machine-
    readable class from any of the three error body shapes, ``body`` the parsed
    reply body (or its first 200 characters when it is not JSON), ``tool_name``
    the tool or trace path called.  Messages never contain the run token.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: Optional[int] = None,
        error_class: Optional[str] = None,
        body: Any = None,
        tool_name: Optional[str] = None,
        retry_after: Optional[float] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.error_class = error_class
        self.body = body
        self.tool_name = tool_name
        self.retry_after = retry_after

    def to_value(self) -> Dict[str, Any]:
        """The failure as an ``{"error": ...}`` tool result a model can read."""
        value: Dict[str, Any] = {"error": self.message}
        if self.error_class:
            value["error_class"] = self.error_class
        if self.status_code is not None:
            value["status_code"] = self.status_code
        return value


class ProxyRequestError(ProxyError, ValueError):
    """The call was refused locally before sending: bad tool name, args, size or actor label."""


class ProxyTransportError(ProxyError):
    """No usable reply arrived: timeout, refused or reset connection, TLS failure."""


class StaleRunTokenError(ProxyError):
    """The proxy rejected the run token as expired, invalid or revoked: the run is over (§3.3)."""

# ---------------------------------------------------------------------------
# Frozen data: read-only JSON containers that still serialise as JSON
# ---------------------------------------------------------------------------

def _read_only(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise TypeError(
        "envelope data is read-only; copy it first (dict(x), list(x) or copy.deepcopy(x))"
    )


class _FrozenDict(Dict[Any, Any]):
    """A dict that refuses mutation.  ``json.dumps`` and ``isinstance(x, dict)`` still work."""

    __slots__ = ()
    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __copy__(self) -> Dict[Any, Any]:
        return dict(self)

    def __deepcopy__(self, memo: Dict[int, Any]) -> Dict[Any, Any]:
        return cast(Dict[Any, Any], _thaw(self))

    def __reduce__(self) -> Any:
        return (dict, (dict(self),))


class _FrozenList(List[Any]):
    """A list that refuses mutation.  ``json.dumps`` and ``isinstance(x, list)`` still work."""

    __slots__ = ()
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only
    append = extend = insert = pop = remove = clear = sort = reverse = _read_only

    def __copy__(self) -> List[Any]:
        return list(self)

    def __deepcopy__(self, memo: Dict[int, Any]) -> List[Any]:
        return cast(List[Any], _thaw(self))

    def __reduce__(self) -> Any:
        return (list, (list(self),))


_LEAVES = frozenset({str, int, float, bool, type(None)})  # what _freeze keeps as it is without a call


def _freeze(value: Any) -> Any:
    """Deep copy of a JSON value with every dict and list made read-only (a frozen one is kept: it is already)."""
    kind = type(value)
    if kind in _LEAVES or kind is _FrozenDict or kind is _FrozenList:  # exactly ours: already deep read-only
        return value
    if isinstance(value, dict):
        return _FrozenDict({k: v if type(v) in _LEAVES else _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return _FrozenList([v if type(v) in _LEAVES else _freeze(v) for v in value])
    return value


def _thaw(value: Any) -> Any:
    """Deep copy of a JSON value with plain, mutable dicts and lists."""
    if isinstance(value, dict):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_thaw(v) for v in value]
    return value

# ---------------------------------------------------------------------------
# Envelope (§2 dispatch, §5 code mode)
# ---------------------------------------------------------------------------

Id = Union[int, str]
HeadersLike = Union[Mapping[str, str], Iterable[Tuple[Any, Any]], None]


class _LowerHeaders(Dict[str, str]):
    """Headers whose names are already lower-cased: :func:`_lower_headers` returns them as they are.

    ``repeats`` holds the further values of a name sent more than once (the
    first value is the mapping's): a repeated credential or a conflicting
    Content-Length is refused, never resolved by order.
    """

    __slots__ = ("repeats",)

    def __init__(self) -> None:
        super().__init__()
        self.repeats: Dict[str, List[str]] = {}


def _lower_headers(headers: HeadersLike) -> Dict[str, str]:
    """Header names lower-cased (§2: case-insensitive); the first value of a repeated name wins.

    Accepts a mapping, an ``email.message.Message`` or a list of pairs; bytes
    (ASGI) are decoded as latin-1.  Cheap to call again on its own result.
    """
    if isinstance(headers, _LowerHeaders):
        return headers
    out = _LowerHeaders()
    if headers is None:
        return out
    items = getattr(headers, "items", None)  # a mapping or an email.message.Message
    pairs = cast("Iterable[Tuple[Any, Any]]", items() if callable(items) else headers)
    for name, value in pairs:
        if isinstance(name, bytes):
            name = name.decode("latin-1")
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        key, text = str(name).lower(), str(value)
        if key in out:
            out.repeats.setdefault(key, []).append(text)
        else:
            out[key] = text
    return out


def _repeated(headers: Mapping[str, str], name: str, *, conflicting: bool = False) -> bool:
    """True when header ``name`` came more than once (with ``conflicting``: with a different value)."""
    extra = getattr(headers, "repeats", {}).get(name, ())
    if conflicting:
        first = (headers.get(name) or "").strip()
        return any(value.strip() != first for value in extra)
    return bool(extra)


def _header(headers: Mapping[str, str], name: str) -> Optional[str]:
    value = headers.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


_SPACE_OR_CONTROL = re.compile("[\x00-\x20\x7f]")


def validate_proxy_url(url: Any, where: str) -> str:
    """The proxy base URL without its trailing ``/``; http(s) with a host only."""
    if not isinstance(url, str) or not url.strip():
        raise EnvelopeError(f"proxy URL from {where} must be a non-empty string")
    text: str = url.strip().rstrip("/")
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise EnvelopeError(f"proxy URL {_short(text)!r} from {where} is not a valid URL: {exc}") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise EnvelopeError(
            f"proxy URL {_short(text)!r} from {where} must be an http:// or https:// URL with a host"
        )
    if parts.query or parts.fragment:
        raise EnvelopeError(f"proxy URL {_short(text)!r} from {where} must not carry a query or fragment")
    try:
        parts.hostname.encode("idna")
    except UnicodeError:
        raise EnvelopeError(f"proxy URL {_short(text)!r} from {where} has a host name that is not valid") from None
    if _SPACE_OR_CONTROL.search(text):
        raise EnvelopeError(f"proxy URL from {where} contains whitespace or control characters")
    return text


def _check_run_token(token: Any, where: str) -> str:
    if not isinstance(token, str) or not token.strip():
        raise EnvelopeError(f"run token from {where} must be a non-empty string")
    text: str = token.strip()
    if _CONTROL_CHARACTER.search(text) or "\t" in text:
        # Never echo it: it is a secret.
        raise EnvelopeError(f"run token from {where} contains control characters")
    return text


def _native_id(value: Any) -> Optional[Id]:
    """An id as the body carries it (int or str); anything else counts as absent."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip():
        return value.strip()
    return None


def _env_id(value: Optional[str]) -> Optional[Id]:
    """An id from a ``PIPELINES_*`` variable: decimal digits become an int, as the task JSON carries ids."""
    text = (value or "").strip()
    if text.isascii() and text.isdigit() and len(text) <= 18:
        return int(text)
    return text or None


def _first_id(*candidates: Any) -> Optional[Id]:
    for candidate in candidates:
        value = _native_id(candidate)
        if value is not None:
            return value
    return None


def _sub_agent_catalog(value: Any) -> Tuple[str, ...]:
    """§2 ``sub_agents``: strings or ``{"actor_id": ...}``; malformed entries skipped."""
    if not isinstance(value, list):
        return ()
    labels: List[str] = []
    for entry in value:
        label = entry.get("actor_id") if isinstance(entry, dict) else entry
        if not isinstance(label, str):
            continue
        try:
            label = validate_actor_label(label)
        except ProxyRequestError:
            continue
        if label and label not in labels:
            labels.append(label)
    return tuple(labels)


def _object_or(value: Any, default: Any) -> Any:
    return value if isinstance(value, dict) else default


class Envelope:
    """One run's dispatch context (§2), read-only.

    Build it with :meth:`from_dispatch` (HTTP mode), :meth:`from_run` (code-mode
    ``run()`` arguments) or :meth:`from_env` (code-mode environment).  Every
    container field is a read-only deep copy; ``raw`` is the whole dispatch
    body, unknown fields included.  ``repr`` and ``str`` never show the run token.
    """

    __slots__ = (
        "proxy_url",
        "run_token",
        "run_id",
        "task_id",
        "agent_id",
        "run_token_jti",
        "user_instruction",
        "task_input",
        "latest_user_prompt",
        "session_id",
        "turn_id",
        "messages",
        "scenario_state",
        "workspace",
        "tools_schema",
        "sub_agents",
        "raw",
    )

    proxy_url: str
    run_token: str
    run_id: Optional[Id]
    task_id: Optional[Id]
    agent_id: Optional[Id]
    run_token_jti: Optional[str]
    user_instruction: str
    task_input: Mapping[str, Any]
    latest_user_prompt: Optional[str]
    session_id: Optional[Id]
    turn_id: Optional[Any]
    messages: Optional[Sequence[Any]]
    scenario_state: Optional[Mapping[str, Any]]
    workspace: Optional[Mapping[str, Any]]
    tools_schema: Optional[Sequence[Any]]
    sub_agents: Tuple[str, ...]
    raw: Mapping[str, Any]

    def __init__(
        self,
        *,
        proxy_url: str,
        run_token: str,
        run_id: Optional[Id] = None,
        task_id: Optional[Id] = None,
        agent_id: Optional[Id] = None,
        run_token_jti: Optional[str] = None,
        user_instruction: str = "",
        task_input: Optional[Mapping[str, Any]] = None,
        latest_user_prompt: Optional[str] = None,
        session_id: Optional[Id] = None,
        turn_id: Optional[Any] = None,
        messages: Optional[Sequence[Any]] = None,
        scenario_state: Optional[Mapping[str, Any]] = None,
        workspace: Optional[Mapping[str, Any]] = None,
        tools_schema: Optional[Sequence[Any]] = None,
        sub_agents: Iterable[Any] = (),
        raw: Optional[Mapping[str, Any]] = None,
    ) -> None:
        self._fill(validate_proxy_url(proxy_url, "the proxy_url argument"),
                   _check_run_token(run_token, "the run_token argument"),
                   run_id, task_id, agent_id, run_token_jti, user_instruction, task_input, latest_user_prompt,
                   session_id, turn_id, messages, scenario_state, workspace, tools_schema, sub_agents, raw)

    def _fill(self, proxy_url: str, run_token: str, run_id: Optional[Id], task_id: Optional[Id],
              agent_id: Optional[Id], run_token_jti: Optional[str], user_instruction: Any,
              task_input: Optional[Mapping[str, Any]], latest_user_prompt: Optional[str], session_id: Optional[Id],
              turn_id: Any, messages: Any, scenario_state: Any, workspace: Any, tools_schema: Any,
              sub_agents: Iterable[Any], raw: Optional[Mapping[str, Any]]) -> None:
        """Set every field, containers frozen; ``proxy_url`` and ``run_token`` come checked."""
        setter = object.__setattr__
        setter(self, "proxy_url", proxy_url)
        setter(self, "run_token", run_token)
        setter(self, "run_id", run_id)
        setter(self, "task_id", task_id)
        setter(self, "agent_id", agent_id)
        setter(self, "run_token_jti", run_token_jti)
        setter(self, "user_instruction", user_instruction if isinstance(user_instruction, str) else "")
        setter(self, "task_input", _freeze(task_input if type(task_input) is _FrozenDict else dict(task_input or {})))
        setter(self, "latest_user_prompt", latest_user_prompt)
        setter(self, "session_id", session_id)
        setter(self, "turn_id", _freeze(turn_id))
        setter(self, "messages", _freeze(messages))
        setter(self, "scenario_state", _freeze(scenario_state))
        setter(self, "workspace", _freeze(workspace))
        setter(self, "tools_schema", _freeze(tools_schema))
        setter(self, "sub_agents", _sub_agent_catalog(list(sub_agents)))
        setter(self, "raw", _freeze(raw if type(raw) is _FrozenDict else dict(raw or {})))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Envelope is read-only; use Envelope.replace(...) for a changed copy")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Envelope is read-only; use Envelope.replace(...) for a changed copy")

    def __repr__(self) -> str:
        return (
            f"Envelope(run_id={self.run_id!r}, task_id={self.task_id!r}, agent_id={self.agent_id!r}, "
            f"run_token_jti={self.run_token_jti!r}, proxy_url={self.proxy_url!r}, run_token={_REDACTED!r})"
        )

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Envelope):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self.__slots__)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> Any:
        return (_rebuild_envelope, ({n: _thaw(getattr(self, n)) for n in self.__slots__},))

    def replace(self, **changes: Any) -> Envelope:
        """A copy with some fields changed (like ``dataclasses.replace``)."""
        fields = {n: _thaw(getattr(self, n)) for n in self.__slots__}
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"Envelope has no field(s) {sorted(unknown)}")
        fields.update(changes)
        return Envelope(**fields)

    # -- derived --------------------------------------------------------------

    @property
    def api_url(self) -> str:
        """Origin of the proxy URL (``PIPELINES_API_URL`` in code mode, §5)."""
        parts = urlsplit(self.proxy_url)
        return f"{parts.scheme}://{parts.netloc}"

    @property
    def is_multi_turn(self) -> bool:
        return self.session_id is not None or self.turn_id is not None

    def conversation(self) -> List[Dict[str, str]]:
        """This turn as chat messages, ``[{"role", "content"}, ...]``, for a model API.

        The earlier user and assistant text of a multi-turn run (``messages``),
        then the prompt: ``latest_user_prompt``, else ``user_instruction`` with
        a non-empty task input appended as JSON (§2), else a placeholder.  The
        prompt is not repeated when the history already ends with it.
        """
        turns = [
            {"role": m["role"], "content": m["content"]}
            for m in self.messages or ()
            if isinstance(m, Mapping) and m.get("role") in ("user", "assistant")
            and isinstance(m.get("content"), str) and m["content"].strip()
        ]
        prompt = self.latest_user_prompt or self.user_instruction or "(no instruction given)"
        if self.task_input and not self.latest_user_prompt:
            prompt += "\n\nTask input:\n" + json.dumps(self.task_input, indent=2)
        if not turns or turns[-1] != {"role": "user", "content": prompt}:
            turns.append({"role": "user", "content": prompt})
        return turns

    def child_env(self, base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """The ``PIPELINES_*`` environment for a child process of this run (§5).

        Returns a new dict (``base`` or ``os.environ`` plus this run's
        variables) for ``subprocess.Popen(env=...)``.  ``os.environ`` itself is
        never touched: concurrent dispatches share the process.
        """
        env = dict(os.environ if base is None else base)
        env[ENV_PROXY_URL] = self.proxy_url
        env[ENV_RUN_TOKEN] = self.run_token
        env[ENV_API_URL] = self.api_url
        for key, value in (
            (ENV_RUN_TOKEN_JTI, self.run_token_jti),
            (ENV_RUN_ID, self.run_id),
            (ENV_TASK_ID, self.task_id),
            (ENV_AGENT_ID, self.agent_id),
        ):
            if value is None:
                env.pop(key, None)
            else:
                env[key] = str(value)
        task = {"user_instruction": self.user_instruction, "input": _thaw(self.task_input)}
        if self.task_id is not None:
            task["task_id"] = self.task_id
        env[ENV_TASK_INPUT_JSON] = json.dumps(task, separators=(",", ":"))
        env.pop(ENV_TASK_INPUT_B64, None)
        if self.tools_schema is not None:
            encoded = json.dumps(self.tools_schema, separators=(",", ":")).encode()
            env[ENV_TOOLS_SCHEMA_B64] = base64.b64encode(encoded).decode("ascii")
        return env

    # -- constructors ---------------------------------------------------------

    @classmethod
    def from_dispatch(cls, body: Union[Mapping[str, Any], bytes, str], headers: HeadersLike = None) -> Envelope:
        """Parse an HTTP dispatch (§2): the JSON body plus the request headers.

        Body fields win; ids, the jti and the proxy URL fall back to the
        ``X-Pipelines-*`` headers (and the legacy ``pwsa`` names).  The run
        token comes from ``X-Pipelines-Run-Token``.  Raises :class:`EnvelopeError`
        naming what is missing and where it was looked for.
        """
        if isinstance(body, (bytes, bytearray, str)):
            try:
                body = json.loads(body)
            except (ValueError, UnicodeDecodeError) as exc:
                raise EnvelopeError(f"dispatch body is not valid JSON: {exc}") from None
        if not isinstance(body, Mapping):
            raise EnvelopeError(f"dispatch body must be a JSON object, got {json_type(body)}")
        h = _lower_headers(headers)

        missing: List[str] = []
        url_field, url = None, None
        for field in (BODY_PROXY_URL, BODY_PROXY_URL_LEGACY):
            if isinstance(body.get(field), str) and body[field].strip():
                url_field, url = f"body field {field!r}", body[field]
                break
        else:
            for name in (HEADER_PROXY_URL, HEADER_PROXY_URL_LEGACY):
                if _header(h, name):
                    url_field, url = f"header {_title(name)}", _header(h, name)
                    break
        if url is None:
            missing.append(
                f"proxy URL (looked for body field {BODY_PROXY_URL!r}, legacy {BODY_PROXY_URL_LEGACY!r}, "
                f"and headers {_title(HEADER_PROXY_URL)}, legacy {_title(HEADER_PROXY_URL_LEGACY)})"
            )
        token = _header(h, HEADER_RUN_TOKEN)
        if token is None:
            missing.append(f"run token (looked for header {_title(HEADER_RUN_TOKEN)})")
        if missing:
            raise EnvelopeError("dispatch is missing " + " and ".join(missing))
        proxy_url = validate_proxy_url(url, url_field or "")
        run_token = _check_run_token(token, f"header {_title(HEADER_RUN_TOKEN)}")

        # The body frozen once; the task's fields are parts of that copy (already frozen, so kept as they are).
        raw = _freeze(body if isinstance(body, dict) else dict(body))
        task = _object_or(raw.get("input"), {})
        jti = raw.get("run_token_jti")
        fields = _task_fields(task)
        envelope = cls.__new__(cls)
        envelope._fill(
            proxy_url, run_token,
            _first_id(raw.get("run_id"), _header(h, HEADER_RUN_ID)),
            _first_id(raw.get("task_id"), task.get("task_id"), _header(h, HEADER_TASK_ID)),
            _first_id(raw.get("agent_id")),
            jti.strip() if isinstance(jti, str) and jti.strip() else _header(h, HEADER_RUN_TOKEN_JTI),
            fields["user_instruction"], fields["task_input"], fields["latest_user_prompt"], fields["session_id"],
            fields["turn_id"], fields["messages"], fields["scenario_state"], fields["workspace"],
            raw.get("tools_schema") if isinstance(raw.get("tools_schema"), list) else None,
            raw["sub_agents"] if isinstance(raw.get("sub_agents"), list) else (),
            raw,
        )
        return envelope

    @classmethod
    def from_run(
        cls,
        task_input: Optional[Mapping[str, Any]],
        *,
        proxy_url: str,
        run_token: str,
        environ: Optional[Mapping[str, str]] = None,
    ) -> Envelope:
        """Build the envelope from code-mode ``run(task_input, *, proxy_url, run_token)`` (§5).

        The ids, jti and inline tools schema come from ``environ`` (default
        ``os.environ``) when the sandbox sets them.  ``raw`` is a synthesised
        dispatch body, so code-mode agents see the same shape as HTTP agents.
        """
        if task_input is None:
            task_input = {}
        if not isinstance(task_input, Mapping):
            raise EnvelopeError(f"task_input must be a mapping, got {json_type(task_input)}")
        env = os.environ if environ is None else environ
        proxy_url = validate_proxy_url(proxy_url, "the proxy_url argument")
        run_token = _check_run_token(run_token, "the run_token argument")
        task = dict(task_input)
        run_id = _env_id(env.get(ENV_RUN_ID))
        task_id = _first_id(task.get("task_id"), _env_id(env.get(ENV_TASK_ID)))
        agent_id = _env_id(env.get(ENV_AGENT_ID))
        jti = (env.get(ENV_RUN_TOKEN_JTI) or "").strip() or None
        tools_schema = _tools_schema_from_env(env)
        raw: Dict[str, Any] = {"input": task, BODY_PROXY_URL: proxy_url}
        for key, value in (("task_id", task_id), ("run_id", run_id), ("agent_id", agent_id), ("run_token_jti", jti)):
            if value is not None:
                raw[key] = value
        if tools_schema is not None:
            raw["tools_schema"] = tools_schema
        return cls(
            proxy_url=proxy_url,
            run_token=run_token,
            run_id=run_id,
            task_id=task_id,
            agent_id=agent_id,
            run_token_jti=jti,
            tools_schema=tools_schema,
            raw=raw,
            **_task_fields(task),
        )

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> Envelope:
        """Build the envelope from the code-mode ``PIPELINES_*`` environment (§5).

        The task comes from ``_PIPELINES_TASK_INPUT_JSON`` or ``_PIPELINES_TASK_INPUT_B64``.
        """
        env = os.environ if environ is None else environ
        missing = [name for name in (ENV_PROXY_URL, ENV_RUN_TOKEN) if not (env.get(name) or "").strip()]
        if missing:
            raise EnvelopeError("environment is missing " + " and ".join(missing))
        task: Any = {}
        if (env.get(ENV_TASK_INPUT_JSON) or "").strip():
            try:
                task = json.loads(env[ENV_TASK_INPUT_JSON])
            except ValueError as exc:
                raise EnvelopeError(f"{ENV_TASK_INPUT_JSON} is not valid JSON: {exc}") from None
        elif (env.get(ENV_TASK_INPUT_B64) or "").strip():
            try:
                task = json.loads(base64.b64decode(env[ENV_TASK_INPUT_B64], validate=True))
            except (ValueError, binascii.Error) as exc:
                raise EnvelopeError(f"{ENV_TASK_INPUT_B64} is not base64-encoded JSON: {exc}") from None
        if not isinstance(task, Mapping):
            raise EnvelopeError(f"the task input in the environment must be a JSON object, got {json_type(task)}")
        proxy_url = validate_proxy_url(env[ENV_PROXY_URL], f"environment variable {ENV_PROXY_URL}")
        run_token = _check_run_token(env[ENV_RUN_TOKEN], f"environment variable {ENV_RUN_TOKEN}")
        return cls.from_run(task, proxy_url=proxy_url, run_token=run_token, environ=env)


def _task_fields(task: Mapping[str, Any]) -> Dict[str, Any]:
    """The envelope fields read from the task payload (``body["input"]``, §2), wrong types dropped."""
    def typed(key: str, kind: type) -> Any:
        value = task.get(key)
        return value if isinstance(value, kind) else None

    return {
        "user_instruction": typed("user_instruction", str) or "",
        "task_input": typed("input", dict) or {},
        "latest_user_prompt": typed("latest_user_prompt", str),
        "session_id": _native_id(task.get("session_id")),
        "turn_id": task.get("turn_id"),
        "messages": typed("messages", list),
        "scenario_state": typed("scenario_state", dict),
        "workspace": typed("workspace", dict),
    }


def _rebuild_envelope(fields: Dict[str, Any]) -> Envelope:
    return Envelope(**fields)


def _title(lower_header: str) -> str:
    return "-".join(part.capitalize() for part in lower_header.split("-"))


def json_type(value: Any) -> str:
    """The JSON type of ``value`` as messages name it: ``"an object"``, ``"a string"``, ``"null"``, ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__


def _tools_schema_from_env(env: Mapping[str, str]) -> Optional[List[Any]]:
    """§3.6 inline tools schema: ``PIPELINES_TOOLS_SCHEMA_B64``, else legacy ``_JSON``."""
    for name, decode in (
        (ENV_TOOLS_SCHEMA_B64, lambda s: base64.b64decode(s, validate=True)),
        (ENV_TOOLS_SCHEMA_JSON, lambda s: s),
    ):
        text = (env.get(name) or "").strip()
        if not text:
            continue
        try:
            value = json.loads(decode(text))
        except (ValueError, binascii.Error) as exc:
            raise EnvelopeError(f"{name} is not a valid JSON tools list: {exc}") from None
        if isinstance(value, dict) and isinstance(value.get("tools"), list):
            value = value["tools"]
        if not isinstance(value, list):
            raise EnvelopeError(f"{name} must hold a JSON list of tools, got {json_type(value)}")
        return value
    return None


# ---------------------------------------------------------------------------
# Inbound decisions (§2): auth, framing, JSON, ping, connectivity, envelope.
# ``decide`` is the one function that decides what a dispatch request gets;
# the adapters (http.server, WSGI, ASGI) read the body ``request_body_length``
# allows, call it once, and carry out its decision.
# ---------------------------------------------------------------------------

DEFAULT_DISPATCH_PATH = "/dispatch"
DEFAULT_TOKEN_ENV = "AGENT_TOKEN"
DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_RUN_TIMEOUT_S = 300.0
MAX_RUN_TIMEOUT_S = 1800.0


def check_run_timeout(run_timeout_s: Any) -> float:
    """``run_timeout_s`` as a float in (0, 1800] (§7.3 kit-run-timeout-range); ``ValueError`` naming it otherwise."""
    if isinstance(run_timeout_s, bool) or not isinstance(run_timeout_s, (int, float)) or not (
            0 < run_timeout_s <= MAX_RUN_TIMEOUT_S):
        raise ValueError(f"run_timeout_s must be a number in (0, {MAX_RUN_TIMEOUT_S:g}], got {run_timeout_s!r}")
    return float(run_timeout_s)
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})
HEALTH_PATH = "/healthz"
TOOLS_SCHEMA_PATH = "/tools_schema"


def check_credential(headers: HeadersLike, expected: str, *, header_name: str = "Authorization") -> bool:
    """True when the request carries the expected credential, compared in constant time (§2 step 1).

    With ``header_name="Authorization"`` the header must read ``Bearer <expected>``
    (the scheme is case-insensitive); a custom header (e.g. ``X-API-Key``)
    carries the raw value.  An empty ``expected`` never matches.
    """
    expected = (expected or "").strip()
    if not expected:
        return False
    received = _lower_headers(headers).get(header_name.lower())
    if received is None:
        return False
    received = received.strip()
    if header_name.lower() == "authorization":
        scheme, _, received = received.partition(" ")
        if scheme.lower() != "bearer":
            # Still compare, so a wrong scheme costs the same time as a wrong token.
            hmac.compare_digest(b"", expected.encode("utf-8", "surrogateescape"))
            return False
        received = received.strip()
    try:  # http.server and ASGI hand over header bytes as latin-1 text: compare the bytes that arrived
        received_bytes = received.encode("latin-1")
    except UnicodeEncodeError:
        received_bytes = received.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(received_bytes, expected.encode("utf-8", "surrogateescape"))


def is_ping(body: Any) -> bool:
    """True only for a body that is exactly ``{"ping": true}``: one key, the boolean ``true`` (§2 step 3)."""
    return isinstance(body, Mapping) and len(body) == 1 and body.get("ping") is True


def _content_length(value: Optional[str]) -> Optional[int]:
    """A Content-Length value as an int: ASCII digits only, at most 18 of them; ``None`` otherwise."""
    value = (value or "").strip()
    return int(value) if value.isascii() and value.isdigit() and len(value) <= 18 else None


def request_body_length(headers: Mapping[str, str], max_body: int) -> Optional[int]:
    """How many body bytes an adapter reads before calling :func:`decide` (lower-cased ``headers``).

    The Content-Length when it is a decimal number within ``max_body``; 0 when
    the request has no body headers at all; ``None`` when the body must not be
    read: chunked or any Transfer-Encoding (its framing could disagree with
    Content-Length), Content-Length headers that disagree, an unreadable
    length, or one over the cap.  After a
    ``None`` the adapter closes the connection once it has answered, rather
    than parse the unread body as the next request.
    """
    if "transfer-encoding" in headers or _repeated(headers, "content-length", conflicting=True):
        return None
    if "content-length" not in headers:
        return 0
    length = _content_length(headers["content-length"])
    return length if length is not None and length <= max_body else None


MAX_REQUEST_LINE_BYTES = 8 << 10
MAX_REQUEST_HEAD_BYTES = 64 << 10
MAX_REQUEST_FIELDS = 100
# RFC 9112's pieces, as patterns re compiles on first use and keeps: only a head the servers' fast path declines
# is read with them, so most processes never compile them.
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_FIELD_VALUE_BAD = rb"[\x00-\x08\x0a-\x1f\x7f]"  # control characters but HTAB
_TARGET_BAD = rb"[\x00-\x20\x7f-\xff]"
_VERSION = rb"HTTP/([0-9])\.([0-9])"


class RequestHead(NamedTuple):
    """A request line and its header fields, as :func:`parse_request_head` read them."""

    method: str
    target: str
    version: str  # "HTTP/1.1" or "HTTP/1.0"
    headers: List[Tuple[str, str]]  # in order, names as sent

    def keep_alive(self) -> bool:
        """Whether the connection may carry another request after this one (RFC 9112 §9.3)."""
        tokens = {t.strip().lower() for v in _all_values(self.headers, "connection") for t in v.split(",")}
        return "close" not in tokens if self.version == "HTTP/1.1" else "keep-alive" in tokens


def _all_values(headers: Sequence[Tuple[str, str]], name: str) -> List[str]:
    return [v for k, v in headers if k.lower() == name]


def parse_request_head(head: bytes) -> RequestHead:
    """Read a request's head strictly (RFC 9112): the bytes before the empty line that ends it.

    A request a front end could frame differently is refused, never guessed at: every line ends in CRLF (a
    bare CR or LF is a 400), a field name is a token right before its colon (``Content-Length : 5`` is a
    400), no line folding, no control character in a value, one Host (HTTP/1.1), a Content-Length that is
    one decimal number, and not both Content-Length and Transfer-Encoding.  Empty lines before the request
    line are skipped (§2.2).  Raises :class:`FramingError` (400), :class:`TargetTooLongError` (414),
    :class:`HeadersTooLargeError` (431) or :class:`VersionNotSupportedError` (505), naming the problem.
    """
    lines = _head_lines(head)
    method, target, version = _request_line(lines[0])
    headers = [_header_field(line) for line in lines[1:]]
    _check_framing(version, headers)
    return RequestHead(method, target, version, headers)


def _head_lines(head: bytes) -> List[bytes]:
    """The head's lines, empty ones before the request line skipped: within the size limits, and each one
    ending in CRLF (no bare CR or LF inside a line)."""
    while head.startswith(b"\r\n"):
        head = head[2:]
    line_end = head.find(b"\r\n")
    if (line_end if line_end >= 0 else len(head)) > MAX_REQUEST_LINE_BYTES:
        raise TargetTooLongError(f"request line is over {MAX_REQUEST_LINE_BYTES} bytes")
    if len(head) > MAX_REQUEST_HEAD_BYTES:
        raise HeadersTooLargeError(f"request head is over {MAX_REQUEST_HEAD_BYTES} bytes")
    lines = head.split(b"\r\n")
    if len(lines) - 1 > MAX_REQUEST_FIELDS:
        raise HeadersTooLargeError(f"request has {len(lines) - 1} header fields, over {MAX_REQUEST_FIELDS}")
    for number, line in enumerate(lines):
        if b"\r" in line or b"\n" in line:
            where = "the request line" if number == 0 else f"header line {number}"
            raise FramingError(f"{where} has a bare CR or LF: every line must end in CRLF (RFC 9112 §2.2)")
    return lines


def _request_line(line: bytes) -> Tuple[str, str, str]:
    """``(method, target, version)``: a token, a target and ``HTTP/1.x``, single spaces between (RFC 9112 §3)."""
    parts = line.split(b" ")
    if len(parts) != 3 or not re.fullmatch(_TOKEN, parts[0]) or not parts[1] or re.search(_TARGET_BAD, parts[1]):
        raise FramingError(f"malformed request line {_short(repr(line), 100)}: expected "
                           "'METHOD /path HTTP/1.1' with single spaces (RFC 9112 §3)")
    version = re.fullmatch(_VERSION, parts[2])
    if version is None:
        raise FramingError(f"malformed HTTP version {_short(repr(parts[2]), 40)}: expected HTTP/1.1 (RFC 9112 §2.3)")
    if version.group(1) != b"1":
        raise VersionNotSupportedError(f"HTTP/{version.group(1).decode()}.{version.group(2).decode()} is not "
                                       "supported here: send HTTP/1.1")
    http_version = "HTTP/1.0" if version.group(2) == b"0" else "HTTP/1.1"  # HTTP/1.2 and up read as 1.1 (RFC 9110 §2.5)
    return parts[0].decode("ascii"), parts[1].decode("ascii"), http_version


def _header_field(line: bytes) -> Tuple[str, str]:
    """One header line as ``(name, value)``: a token right before the colon, no folding, no control character
    in the value (RFC 9112 §5, RFC 9110 §5.5); the value without the whitespace around it."""
    if line[:1] in (b" ", b"\t"):
        raise FramingError("a header line starts with whitespace (obsolete line folding, RFC 9112 §5.2)")
    name, colon, value = line.partition(b":")
    if not colon:
        raise FramingError(f"header line {_short(repr(line), 60)} has no colon (RFC 9112 §5)")
    if not re.fullmatch(_TOKEN, name):
        raise FramingError(f"header name {_short(repr(name), 60)} is not a token: no whitespace before the "
                           "colon (RFC 9112 §5.1)")
    value = value.strip(b" \t")
    if re.search(_FIELD_VALUE_BAD, value):
        raise FramingError(f"header {name.decode('ascii')} has a control character in its value (RFC 9110 §5.5)")
    return name.decode("ascii"), value.decode("latin-1")


def _check_framing(version: str, headers: Sequence[Tuple[str, str]]) -> None:
    """Where the request ends must be certain: one Host (HTTP/1.1), a Content-Length that is one decimal number,
    and Transfer-Encoding neither beside a Content-Length nor on HTTP/1.0 (RFC 9112 §3.2, §6)."""
    if version == "HTTP/1.1" and len(_all_values(headers, "host")) != 1:
        raise FramingError("an HTTP/1.1 request needs exactly one Host header (RFC 9112 §3.2)")
    lengths = [v.strip() for value in _all_values(headers, "content-length") for v in value.split(",")]
    if lengths and (len(set(lengths)) != 1 or not all(v.isascii() and v.isdigit() for v in lengths)):
        raise FramingError(f"Content-Length {_short(', '.join(lengths), 60)!r} is not one decimal number "
                           "(RFC 9112 §6.3)")
    codings = _all_values(headers, "transfer-encoding")
    if codings and (lengths or version == "HTTP/1.0"):
        raise FramingError("a request with Transfer-Encoding must not also have a Content-Length, nor be "
                           "HTTP/1.0 (RFC 9112 §6.1)")


class Endpoint(NamedTuple):
    """A dispatch endpoint's settings, as :func:`decide` sees them (:class:`DispatchApp` builds one)."""

    path: str = DEFAULT_DISPATCH_PATH
    auth_header: str = "Authorization"
    token_env: Optional[str] = DEFAULT_TOKEN_ENV  # named in the 503 when it is unset
    no_auth: bool = False
    max_body: int = DEFAULT_MAX_BODY_BYTES
    tools_schema: Optional[Sequence[Any]] = None  # served at GET /tools_schema when set
    proxy_hosts: Optional[Tuple[str, ...]] = None  # the proxy hosts dispatches may name; None: any

    def allowed_methods(self, path: str) -> Optional[Tuple[str, ...]]:
        """The methods routed at ``path``, or ``None`` for no route."""
        if path == self.path:
            return ("POST",)
        if path == HEALTH_PATH:
            return ("GET",)
        if path == TOOLS_SCHEMA_PATH and self.tools_schema is not None:
            return ("GET",)
        return None


class Decision(NamedTuple):
    """What to do with one request.

    ``action`` is ``"reply"`` (send ``reply``), ``"probe"`` (the connectivity
    check: probe ``proxy_url``, §3.7) or ``"run"`` (run the agent on
    ``envelope``).  ``what`` names the request for the log line.
    """

    action: str
    reply: Optional[HttpReply] = None
    proxy_url: Optional[str] = None
    envelope: Optional[Envelope] = None
    what: str = "rejected"


def decide(
    endpoint: Endpoint,
    method: str,
    target: str,
    headers: HeadersLike,
    body: Optional[bytes],
    *,
    expected_token: Optional[str],
) -> Decision:
    """Decide what one request gets, in §2's order: route, auth, framing, JSON, ping, connectivity, envelope.

    ``body`` is what :func:`request_body_length` allowed the adapter to read
    (``None`` when it read nothing).  ``expected_token`` is the configured
    agent token (``""`` when its variable is unset: 503; ignored with
    ``endpoint.no_auth``).  Pure: every refusal is an error class whose
    ``http_status`` :func:`error_reply` turns into the reply.
    """
    try:
        return _decide(endpoint, method.upper(), target, _lower_headers(headers), body, expected_token)
    except PipelinesError as exc:
        return Decision("reply", error_reply(exc))
    except RecursionError:  # a JSON body nested deeper than Python's parser (or our copy of it) goes
        return Decision("reply", error_reply(RequestError("body is nested too deeply to handle")))


def _decide(endpoint: Endpoint, method: str, target: str, headers: Mapping[str, str], body: Optional[bytes],
            expected_token: Optional[str]) -> Decision:
    path = _route(endpoint, method, target)
    if path == HEALTH_PATH:  # before auth: load balancers probe it without a credential
        return Decision("reply", json_reply(200, {"ok": True, "version": __version__}), what="health")
    if path == TOOLS_SCHEMA_PATH:  # before auth too: the platform's tooling reads it without one (kit-routes)
        return Decision("reply", json_reply(200, {"tools_schema": endpoint.tools_schema}), what="tools schema")
    if not endpoint.no_auth:
        _authenticate(endpoint, headers, expected_token)
    data = _framed_body(endpoint, headers, body)
    try:
        payload = _json_from_bytes(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"body is not valid JSON: {_short(str(exc), 200)}") from None
    if is_ping(payload):
        json.loads(data, object_pairs_hook=_unique_keys)  # {"ping": false, "ping": true} is no ping
        return Decision("reply", json_reply(200, {"ok": True}), what="ping")
    if not isinstance(payload, dict):
        raise RequestError(f"body must be a JSON object, got {json_type(payload)}")
    if payload.get("connectivity_check") is True:
        proxy_url = _allowed(connectivity_proxy_url(payload, headers), endpoint.proxy_hosts)
        return Decision("probe", proxy_url=proxy_url, what="connectivity check")
    envelope = Envelope.from_dispatch(payload, headers)
    _allowed(envelope.proxy_url, endpoint.proxy_hosts)
    return Decision("run", envelope=envelope, what="dispatch")


def _route(endpoint: Endpoint, method: str, target: str) -> str:
    """The request's path, once its method is known (501 otherwise) and routed there: 404 for no route, 405 for
    a method the path does not take."""
    if method not in HTTP_METHODS:
        raise UnknownMethodError(f"method {_short(method, 40)} is not implemented here: dispatches are POST")
    path = urlsplit(target).path.rstrip("/") or "/"
    allowed = endpoint.allowed_methods(path)
    if allowed is None:
        raise NotFoundError(f"no route for {_short(path, 100)}: dispatches go to POST {endpoint.path}")
    if method not in allowed:
        raise MethodNotAllowedError(f"{method} is not allowed on {path}: use {' or '.join(allowed)}", allowed)
    return path


def _authenticate(endpoint: Endpoint, headers: Mapping[str, str], expected_token: Optional[str]) -> None:
    """§2 step 1: 503 when the agent token's variable is unset; 401 when the credential is sent twice, missing or
    wrong."""
    if not (expected_token or "").strip():
        raise MisconfiguredError(f"this agent's wrapper is misconfigured: auth reads environment variable "
                                 f"{endpoint.token_env}, which is not set")
    if _repeated(headers, endpoint.auth_header.lower()):
        raise AuthError(f"the {endpoint.auth_header} header was sent more than once: send one credential",
                        bearer=endpoint.auth_header.lower() == "authorization")
    if not check_credential(headers, expected_token or "", header_name=endpoint.auth_header):
        raise AuthError(f"missing or invalid credential in the {endpoint.auth_header} header",
                        bearer=endpoint.auth_header.lower() == "authorization")


def _framed_body(endpoint: Endpoint, headers: Mapping[str, str], body: Optional[bytes]) -> bytes:
    """The body, framed by one Content-Length within the cap and read whole: 411 for a chunked body or none
    declared, 501 for another Transfer-Encoding, 413 over the cap, 400 for lengths that disagree, an unreadable
    one or a truncated body (kit-body-framing)."""
    coding = headers.get("transfer-encoding")
    if coding is not None:
        if coding.strip().lower() == "chunked":
            raise LengthRequiredError("chunked request bodies are not supported: send the JSON body with a "
                                      "Content-Length header")
        raise UnsupportedTransferCodingError(f"Transfer-Encoding {_short(coding, 60)!r} is not supported: send the "
                                             "JSON body as it is, with a Content-Length header")
    if _repeated(headers, "content-length", conflicting=True):
        raise RequestError("the request has Content-Length headers that disagree: send one (RFC 9112 §6.3)")
    declared = headers.get("content-length")
    if declared is None:
        raise LengthRequiredError("a Content-Length header is required: send the JSON body with its length")
    length = _content_length(declared)
    if length is None:
        if declared.strip().isascii() and declared.strip().isdigit():
            raise BodyTooLargeError(f"request body of {len(declared.strip())}-digit length is over this "
                                    f"endpoint's {endpoint.max_body}-byte cap")
        raise RequestError(f"Content-Length {_short(declared, 40)!r} is not a decimal number (RFC 9112 §6.3)")
    if length > endpoint.max_body or (body is not None and len(body) > endpoint.max_body):
        raise BodyTooLargeError(f"request body of {max(length, len(body or b''))} bytes is over this endpoint's "
                                f"{endpoint.max_body}-byte cap")
    if body is None or len(body) < length:
        raise RequestError(f"request body truncated: got {len(body or b'')} of {length} bytes")
    return body


def proxy_host_allowed(proxy_url: str, allowed: Optional[Sequence[str]]) -> bool:
    """Whether a proxy URL's host (and port) is on an allow-list (``None``: no list, any host).

    An entry (as :func:`parse_proxy_hosts` leaves it) is a host name or IP address matched exactly, or a
    suffix starting with ``.`` matching that domain and every name under it (``.pipelines.tech`` matches
    ``pipelines.tech`` and ``api.pipelines.tech``), either with ``:port`` (that port only; the URL's
    default port counts: 80 for http, 443 for https) or without (any port).  Case-insensitive; a
    trailing dot is ignored.
    """
    if allowed is None:
        return True
    parts = urlsplit(proxy_url)
    host = (parts.hostname or "").rstrip(".").lower()
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return False
    for entry in allowed:
        name, entry_port = _split_host_entry(entry)
        if entry_port is not None and entry_port != port:
            continue
        if name.startswith("."):
            if host == name[1:] or host.endswith(name):
                return True
        elif name and host == name:
            return True
    return False


_HOST_ENTRY = re.compile(r"(?P<name>\.?[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?|\[[0-9A-Fa-f:.]+\])"
                         r"(?::(?P<port>[0-9]{1,5}))?")


def _split_host_entry(entry: str) -> Tuple[str, Optional[int]]:
    """``"api.example.com:8443"`` as ``("api.example.com", 8443)``; ``"[::1]"`` as ``("::1", None)``."""
    entry = entry.strip().lower()
    if entry.count(":") > 1 and not entry.startswith("["):  # a bare IPv6 address: no port possible
        return entry, None
    match = _HOST_ENTRY.fullmatch(entry)
    if match is None:
        return entry, None
    port = match.group("port")
    return match.group("name").strip("[]").rstrip("."), int(port) if port else None


def parse_proxy_hosts(text: Optional[str]) -> Optional[Tuple[str, ...]]:
    """An allow-list from text (``"api.pipelines.tech, .example.com, 127.0.0.1:8080"``); ``None`` for none given.

    An entry is a host name, an IP address (IPv6 in brackets when it carries a port), or a ``.suffix``
    (``*.example.com`` is taken as ``.example.com``), each optionally with ``:port``.  Text with no entry
    at all (``""``, ``" , "``) is refused: an allow-list that is set but empty is a mistake, and neither
    guess (any host, no host) is safe to make silently.
    """
    if text is None:
        return None
    entries = tuple(e.strip() for e in text.split(",") if e.strip())
    if not entries:
        raise ValueError(f"the proxy host allow-list is set but empty ({text!r}): list the proxy hosts dispatches "
                         "may name (e.g. .pipelines.tech), or leave it unset to allow any host")
    return tuple(_normal_host_entry(entry) for entry in entries)


def _normal_host_entry(entry: str) -> str:
    shown = _short(entry, 100)
    if entry.startswith("*."):
        entry = entry[1:]
    if entry.count(":") > 1 and not entry.startswith("["):  # a bare IPv6 address
        import ipaddress

        try:
            return str(ipaddress.IPv6Address(entry))
        except ValueError:
            pass
    elif _HOST_ENTRY.fullmatch(entry):
        port = _split_host_entry(entry)[1]
        if port is None or 0 < port < 65536:
            return entry.lower()
    raise ValueError(f"proxy host {shown!r} must be a host name, an IP address or a .suffix (*.suffix too), "
                     "optionally with :port, without scheme, path or other wildcards")


def _allowed(proxy_url: str, allowed: Optional[Sequence[str]]) -> str:
    if not proxy_host_allowed(proxy_url, allowed):
        host = urlsplit(proxy_url).hostname
        raise EnvelopeError(f"proxy URL host {_short(str(host), 100)!r} is not on this endpoint's allow-list of "
                            f"proxy hosts ({', '.join(allowed or ())})")
    return proxy_url


def _unique_keys(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    """A JSON object's ``object_pairs_hook`` refusing a key that appears twice (which one would count is a guess)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: Set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise RequestError(f"body has the key {_short(key, 60)!r} twice: send each key once")
            seen.add(key)
    return obj


def connectivity_proxy_url(payload: Mapping[str, Any], headers: HeadersLike) -> str:
    """The proxy URL a connectivity check asks to probe (§2 step 4); :class:`EnvelopeError` when absent or bad."""
    h = _lower_headers(headers)
    url = payload.get(BODY_PROXY_URL) or payload.get(BODY_PROXY_URL_LEGACY) or _header(h, HEADER_PROXY_URL)
    if not url:
        raise EnvelopeError(f"connectivity_check needs a proxy URL: body field {BODY_PROXY_URL!r} "
                            f"or header {_title(HEADER_PROXY_URL)}")
    return validate_proxy_url(url, "the connectivity check")

# ---------------------------------------------------------------------------
# Request encoding (§3.1, §3.4, §3.5): what goes on the wire to the proxy
# ---------------------------------------------------------------------------

def validate_tool_name(name: Any) -> str:
    """Return ``name`` when it matches ``^[A-Za-z_][A-Za-z0-9_-]{0,127}$`` (§3.1)."""
    if not isinstance(name, str) or not TOOL_NAME_RE.fullmatch(name):
        shown = _short(repr(name), 80)
        raise ProxyRequestError(
            f"invalid tool name {shown}: must match ^[A-Za-z_][A-Za-z0-9_-]{{0,127}}$",
            tool_name=name if isinstance(name, str) else None,
        )
    return name


def validate_actor_label(label: Any) -> Optional[str]:
    """The normalised actor label (§3.5), or ``None`` for an empty one.

    Surrounding whitespace is trimmed; at most 8 ``/``-separated segments of
    1–64 characters from ``[A-Za-z0-9_.:-]``, at most 256 characters in all.
    Raises :class:`ProxyRequestError` (``error_class="actor_id_invalid"``).
    """
    if label is None:
        return None
    if not isinstance(label, str):
        raise ProxyRequestError(
            f"actor label must be a string, got {type(label).__name__}", error_class="actor_id_invalid"
        )
    label = str(label).strip()
    if not label:
        return None
    problem = None
    segments = label.split("/")
    if len(label) > ACTOR_MAX_LENGTH:
        problem = f"is {len(label)} characters long (at most {ACTOR_MAX_LENGTH})"
    elif len(segments) > ACTOR_MAX_SEGMENTS:
        problem = f"has {len(segments)} segments (at most {ACTOR_MAX_SEGMENTS})"
    else:
        for segment in segments:
            if not ACTOR_SEGMENT_RE.fullmatch(segment):
                problem = (
                    f"has segment {_short(repr(segment), 80)}: each segment is 1-64 characters "
                    "from [A-Za-z0-9_.:-]"
                )
                break
    if problem:
        raise ProxyRequestError(f"invalid actor label {_short(repr(label), 80)}: {problem}",
                                error_class="actor_id_invalid")
    return cast(str, label)


# The JSON this part writes: compact, non-ASCII characters as they are; the strict one (request bodies) refuses
# NaN and infinities.  Made once: json.dumps with options builds an encoder per call, and one keeps no state.
_COMPACT_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_STRICT_COMPACT_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def encode_args(name: str, args: Any, *, what: str = "tool arguments") -> bytes:
    """Compact JSON for the request body; must be a JSON object under the 1 MiB cap."""
    if args is None:
        args = {}
    if not isinstance(args, Mapping):
        raise ProxyRequestError(f"{what} for {name!r} must be a JSON object, got {json_type(args)}", tool_name=name)
    try:
        body = _STRICT_COMPACT_JSON.encode(args).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ProxyRequestError(f"{what} for {name!r} are not JSON-serialisable: {exc}", tool_name=name) from None
    if len(body) > MAX_REQUEST_BYTES:
        raise ProxyRequestError(
            f"{what} for {name!r} are {len(body)} bytes as JSON, over the {MAX_REQUEST_BYTES}-byte cap", tool_name=name
        )
    return body


def _header_problem(headers: Mapping[str, str]) -> Optional[str]:
    """A header whose value would break the request (a line break, a control character), named without its value."""
    for name, value in headers.items():
        if _CONTROL_CHARACTER.search(value):
            return (f"header {name} has a line break or control character in its value (not shown: it may be "
                    "a secret); check where it comes from, e.g. a trailing newline in an environment variable")
    return None


class ProxyRequest(NamedTuple):
    """One proxy request as it goes on the wire (§3.1, §3.4); every retry of the logical call sends it unchanged."""

    kind: str  # "tools" | "traces"
    name: str  # the tool, or the trace event type
    url: Any  # the split proxy URL (urllib.parse.SplitResult): scheme, host and port to connect to
    path: str
    headers: Dict[str, str]
    body: bytes


def proxy_request(proxy_url: str, run_token: str, kind: str, name: str, body: bytes, *,
                  actor: Optional[str] = None, idempotency_key: Optional[str] = None) -> ProxyRequest:
    """``POST {proxy_url}/{kind}/{name}`` with the run token as bearer and one Idempotency-Key (§3.1).

    ``name`` is percent-encoded, so no name can move the request to another path; ``actor`` (validated)
    goes in ``X-Pipelines-Actor-Id``.  A fresh key unless ``idempotency_key`` is given.
    """
    url = urlsplit(proxy_url)
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json",
        "Authorization": "Bearer " + run_token,
        "Idempotency-Key": idempotency_key or _idempotency_key(),
        "User-Agent": _USER_AGENT,
    }
    if actor:
        headers[HEADER_ACTOR_ID] = actor
    quoted = name if TOOL_NAME_RE.fullmatch(name) else quote(name, safe="")  # such a name has nothing to encode
    return ProxyRequest(kind, name, url, f"{url.path.rstrip('/')}/{kind}/{quoted}", headers, body)


def tool_call_request(proxy_url: str, run_token: str, name: str, args: Any, *, actor: Optional[str] = None,
                      idempotency_key: Optional[str] = None) -> ProxyRequest:
    """A tool call, checked before anything is sent: the name pattern, the actor label, a JSON object of
    arguments under the 1 MiB cap (§3.1, §3.5, §7.5); :class:`ProxyRequestError` naming the problem."""
    validate_tool_name(name)
    label = validate_actor_label(actor)
    return proxy_request(proxy_url, run_token, "tools", name, encode_args(name, args), actor=label,
                         idempotency_key=idempotency_key)


def trace_request(proxy_url: str, run_token: str, event_type: str, payload: Optional[Mapping[str, Any]], *,
                  occurred_at: str, actor: Optional[str] = None) -> ProxyRequest:
    """A live trace event (§3.4): a known event type, a JSON object payload, ``__occurred_at`` stamped once
    (kept when the payload has one, so every retry carries the same time)."""
    if event_type not in TRACE_EVENT_TYPES:
        raise ProxyRequestError(
            f"unknown trace event type {_short(repr(event_type), 60)}: expected one of "
            + ", ".join(sorted(TRACE_EVENT_TYPES)),
            tool_name=str(event_type),
        )
    label = validate_actor_label(actor)
    event = dict(payload or {}) if isinstance(payload, Mapping) or payload is None else payload
    if not isinstance(event, dict):
        raise ProxyRequestError(f"trace payload must be a JSON object, got {json_type(payload)}", tool_name=event_type)
    event.setdefault("__occurred_at", occurred_at)
    return proxy_request(proxy_url, run_token, "traces", event_type,
                         encode_args(event_type, event, what="trace payload"), actor=label)

def handoff_event(from_sub_agent: str, to_sub_agent: str, *, reason: Optional[str] = None,
                  payload_preview: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """The payload of a ``handoff`` trace event (§3.4): both labels validated as §3.5; ``None`` for a
    self-handoff (equal once trimmed), which is dropped rather than sent."""
    source, target = validate_actor_label(from_sub_agent), validate_actor_label(to_sub_agent)
    if not source or not target:
        raise ProxyRequestError("a handoff needs non-empty from and to labels", error_class="actor_id_invalid")
    if source == target:
        return None
    event: Dict[str, Any] = {"from_sub_agent": source, "to_sub_agent": target}
    if reason is not None:
        event["reason"] = reason
    if payload_preview is not None:
        event["payload_preview"] = payload_preview
    return event

# ---------------------------------------------------------------------------
# Reply interpretation (§3.2, §3.3) and the retry decision
# ---------------------------------------------------------------------------

class ProxyOutcome(NamedTuple):
    """What one attempt came to (§3.2, §3.3): ``kind`` is ``"value"``, ``"error"``, ``"retry"`` or ``"transport"``.

    ``"transport"``: no usable reply, and a failure worth retrying with the same Idempotency-Key (a timeout,
    a refused or dropped connection); ``stale`` marks a pooled keep-alive connection the server had closed,
    retried at once.  A transport failure not worth retrying (a certificate or DNS failure) is an ``"error"``.
    """

    kind: str  # "value" | "error" | "retry" | "transport"
    value: Any = None
    error: Optional[PipelinesError] = None  # ProxyError for proxy replies; post_json's HTTPStatusError
    retry_after: Optional[float] = None
    stale: bool = False


def _model_retry_after(headers: Any) -> Optional[float]:
    """The wait a model API asks for: ``retry-after-ms`` (OpenAI, milliseconds) first, else ``Retry-After``."""
    lowered = _lower_headers(headers)
    millis = (lowered.get("retry-after-ms") or "").strip()
    if millis:
        try:
            value = float(millis) / 1000
        except ValueError:
            value = float("nan")
        if value == value and value >= 0:  # not NaN
            return value
    return parse_retry_after(lowered.get("retry-after"))


def parse_retry_after(value: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """Seconds from a ``Retry-After`` header (delta-seconds or HTTP-date); ``None`` when absent or unreadable."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        from email.utils import parsedate_to_datetime

        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if math.isnan(seconds):
        return None
    return max(0.0, seconds)


def error_fields(body: Any) -> Tuple[Optional[str], Optional[str]]:
    """``(error_class, message)`` from the three error body shapes (§3.3)."""
    if not isinstance(body, dict):
        return None, None
    detail = body.get("detail")
    if isinstance(detail, dict):
        cls = detail.get("error_class")
        msg = detail.get("message") or detail.get("detail")
        return (cls if isinstance(cls, str) else None), (msg if isinstance(msg, str) else None)
    if isinstance(detail, str):
        cls = body.get("error_class")
        return (cls if isinstance(cls, str) else None), detail
    cls = body.get("error_class")
    msg = body.get("message") or body.get("error")
    if detail is not None and msg is None:
        msg = json.dumps(detail)[:200]
    return (cls if isinstance(cls, str) else None), (msg if isinstance(msg, str) else None)


def _decode_body(body: bytes, content_type: str) -> Tuple[Any, bool]:
    """``(value, is_json)``: parsed JSON, or the text when the body is not JSON."""
    if not body:
        return None, False
    try:
        return _json_from_bytes(body), True
    except ValueError:
        return body.decode("utf-8", "replace"), False

# §3.3 the retry decision as data: (status, error classes or None for any) -> what the client does.
# "retry": wait (Retry-After, else backoff) and try again; "stale": the run is over; anything else fails.
RETRY_TABLE: Tuple[Tuple[int, Optional[FrozenSet[str]], str], ...] = (
    (429, None, "retry"),
    (503, TRANSIENT_503_CLASSES, "retry"),
    (401, STALE_TOKEN_CLASSES, "stale"),
)


def retry_decision(status: int, error_class: Optional[str]) -> str:
    """``"retry"``, ``"stale"`` or ``"fail"`` for a non-2xx proxy reply, from :data:`RETRY_TABLE` (§3.3)."""
    for table_status, classes, outcome in RETRY_TABLE:
        if status == table_status and (classes is None or error_class in classes):
            return outcome
    return "fail"


def interpret_reply(
    status: int, headers: HeadersLike, body: bytes, *, tool_name: str, run_token: Optional[str] = None
) -> ProxyOutcome:
    """Decide what a proxy reply means, with no I/O (§3.2, §3.3).

    2xx: the unwrapped ``response`` (legacy bodies without it returned whole,
    non-JSON text as the string).  429 and the transient 503 classes: retry.
    401 with a stale-token class: :class:`StaleRunTokenError`.  Anything else:
    :class:`ProxyError`.  ``run_token`` is scrubbed from error bodies and messages.
    """
    h = _lower_headers(headers)
    value, is_json = _decode_body(body, h.get("content-type", ""))
    if 200 <= status < 300:
        if is_json and isinstance(value, dict) and "response" in value:
            return ProxyOutcome("value", value["response"])
        return ProxyOutcome("value", value)

    if run_token:  # an error body is kept and shown: scrub the token from it
        value = redact(value, run_token)
    error_class, message = error_fields(value) if is_json else (None, None)
    if message is None:
        message = _short(value if isinstance(value, str) else (json.dumps(value) if value is not None else ""), 200)
    body_kept = value if is_json else (_short(value, 200) if isinstance(value, str) else value)
    retry_after = parse_retry_after(h.get("retry-after"))
    text = f"proxy call {tool_name!r} failed: HTTP {status}"
    if error_class:
        text += f" {error_class}"
    if message:
        text += f": {message}"
    decision = retry_decision(status, error_class)
    error_type = StaleRunTokenError if decision == "stale" else ProxyError
    error = error_type(text + (" (the run is over)" if decision == "stale" else ""), status_code=status,
                       error_class=error_class, body=body_kept, tool_name=tool_name, retry_after=retry_after)
    return ProxyOutcome("retry" if decision == "retry" else "error", error=error, retry_after=retry_after)


class RetryPolicy(NamedTuple):
    """The one retry policy of proxy calls and trace posts (§3.3).

    ``max_attempts`` counts the first try (429 / transient 503).  Waits grow
    ``base_delay_s * 2**n`` with ±``jitter`` and are capped at ``max_delay_s``;
    a ``Retry-After`` header replaces the computed wait; one longer than
    ``max_retry_after_s`` is not waited: the call fails at once.  Transport failures (timeout, refused or reset
    connection) are retried ``transport_retries`` more times with the same
    Idempotency-Key.
    """

    max_attempts: int = 4
    base_delay_s: float = 0.5
    max_delay_s: float = 4.0
    jitter: float = 0.25
    max_retry_after_s: float = 60.0
    transport_retries: int = 2

    def delay(self, retry_number: int, retry_after: Optional[float] = None) -> float:
        """Seconds to wait before retry ``retry_number`` (1 for the first retry)."""
        if retry_after is not None:
            return min(retry_after, self.max_retry_after_s)
        wait = self.base_delay_s * (2 ** (retry_number - 1))
        wait *= random.uniform(1 - self.jitter, 1 + self.jitter)
        return float(max(0.0, min(wait, self.max_delay_s)))


class RetryStep(NamedTuple):
    """What a driver does after one attempt: ``"return"`` ``value``, ``"raise"`` ``error``, or ``"retry"``
    after waiting ``wait_s`` seconds (``None``: at once) with the same request, its Idempotency-Key included."""

    action: str  # "return" | "raise" | "retry"
    value: Any = None
    error: Optional[PipelinesError] = None
    wait_s: Optional[float] = None


class RetryState:
    """One logical call's way through the retry policy (§3.3): every driver loops over :meth:`step`.

    A driver (blocking or asyncio here; each port has its own) makes an attempt, turns what came back into
    a :class:`ProxyOutcome` (:func:`interpret_reply`, or ``"transport"`` when no reply arrived), and does
    what ``step`` answers::

        state = RetryState(policy)
        while True:
            (refuse if the dispatch is over; wait for a pacing slot)
            step = state.step(outcome of one attempt)
            "return" -> step.value;  "raise" -> step.error;  "retry" -> wait step.wait_s, loop

    ``attempts`` counts every attempt, transport failures included; ``max_attempts`` bounds the 429 and
    transient-503 retries, ``transport_retries`` the transport ones (a stale pooled connection is retried
    without a wait, but counts).
    """

    __slots__ = ("policy", "attempts", "transport_failures")

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.attempts = 0
        self.transport_failures = 0

    def step(self, outcome: ProxyOutcome) -> RetryStep:
        """The next step after an attempt that came to ``outcome``."""
        self.attempts += 1
        if outcome.kind == "value":
            return RetryStep("return", outcome.value)
        if outcome.kind == "transport":
            self.transport_failures += 1
            if self.transport_failures > self.policy.transport_retries:
                return RetryStep("raise", error=outcome.error)
            wait = None if outcome.stale else self.policy.delay(self.transport_failures)
            return RetryStep("retry", error=outcome.error, wait_s=wait)
        if outcome.kind == "retry" and _waits_too_long(outcome.retry_after, self.policy):
            return RetryStep("raise", error=_not_waited(outcome, self.policy))
        if outcome.kind == "retry" and self.attempts < self.policy.max_attempts:
            return RetryStep("retry", error=outcome.error, wait_s=self.policy.delay(self.attempts, outcome.retry_after))
        return RetryStep("raise", error=outcome.error)


def _waits_too_long(retry_after: Optional[float], policy: RetryPolicy) -> bool:
    return retry_after is not None and retry_after > policy.max_retry_after_s


def _not_waited(outcome: ProxyOutcome, policy: RetryPolicy) -> PipelinesError:
    """The error of a reply whose ``Retry-After`` is past the cap (§7.4 kit-retry-after-cap): retrying sooner
    than asked would hammer the proxy, sleeping that long would outlast the run, so the call fails now."""
    error = outcome.error
    note = (f" (the proxy asked to wait {outcome.retry_after:g} s before a retry, longer than the "
            f"{policy.max_retry_after_s:g} s this client waits: not retried)")
    if isinstance(error, ProxyError):
        return type(error)(error.message + note, status_code=error.status_code, error_class=error.error_class,
                           body=error.body, tool_name=error.tool_name, retry_after=error.retry_after)
    if error is not None:  # another driver's own error (post_json's): its words, then why it was not retried
        error.args = (f"{error}{note.replace('the proxy', 'the server')}",)
        return error
    return ProxyError(f"proxy call failed{note}", retry_after=outcome.retry_after)

# ---------------------------------------------------------------------------
# Response envelope (§4): building and validation
# ---------------------------------------------------------------------------

_FINAL_KEYS = ("final_response", "final_output", "output", "message")


def _final_text(value: Any, key: str, strict: bool = True, notes: Optional[List[str]] = None) -> Optional[str]:
    """The final response as a string; frameworks' non-string outputs become JSON or ``str()``.

    A non-string ``final_response`` is refused in strict mode; otherwise it
    becomes its JSON text (``42`` -> ``"42"``, an object -> ``'{"a": 1}'``).
    """
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if key == "final_response" and strict:
        raise ResponseError(f"final_response must be a string, got {json_type(value)}")
    if isinstance(value, (dict, list, int, float, bool)):
        return json.dumps(_jsonable(value, key, [] if notes is None else notes), ensure_ascii=False)
    dump = getattr(value, "model_dump_json", None)  # pydantic models, without importing pydantic
    if callable(dump):
        return _called_text(dump, value)
    return _safe_text(value)


def _unpack_result(value: Any, strict: bool = True,
                   notes: Optional[List[str]] = None) -> Tuple[Optional[str], Any, Any, Dict[str, Any]]:
    """``(final, messages, metadata, extra_keys)`` from a string, mapping or result object.

    Only an envelope-shaped value (one with ``final_response``) contributes its
    messages, metadata and extra top-level keys; a framework's result
    (``final_output`` / ``output`` / ``message``) contributes its text alone,
    since its other fields are rarely JSON.
    """
    if isinstance(value, str):
        return value, None, None, {}
    if isinstance(value, Mapping):
        if "final_response" in value:
            extra = {k: v for k, v in value.items() if k not in ("final_response", "messages", "metadata")}
            final = _final_text(value["final_response"], "final_response", strict, notes)
            return final, value.get("messages"), value.get("metadata"), extra
        for key in _FINAL_KEYS[1:]:
            if value.get(key) is not None:
                return _final_text(value[key], key, notes=notes), None, None, {}
        return None, None, None, {}
    if value is None:
        return None, None, None, {}
    for key in _FINAL_KEYS:
        attr = getattr(value, key, None)
        if attr is not None and not callable(attr):
            if key == "final_response":
                final = _final_text(attr, key, strict, notes)
                return final, getattr(value, "messages", None), getattr(value, "metadata", None), {}
            return _final_text(attr, key, notes=notes), None, None, {}
    raise ResponseError(
        f"cannot build a response from {type(value).__name__}: return a string, a mapping with "
        "'final_response', or an object with final_response / final_output / output / message"
    )


def _tool_call_name(call: Any) -> Optional[str]:
    """The resolvable name of a tool call (flat ``name`` or nested ``function.name``), else ``None``."""
    if not isinstance(call, Mapping):
        return None
    if isinstance(call.get("name"), str) and call["name"]:
        return str(call["name"])
    function = call.get("function")
    if isinstance(function, Mapping) and isinstance(function.get("name"), str) and function["name"]:
        return str(function["name"])
    return None


def _normalise_tool_call(call: Any) -> Any:
    """OpenAI nested ``{type: function, function: {name, arguments}}`` -> flat ``{id?, name, arguments?}``."""
    if isinstance(call, Mapping) and "name" not in call and isinstance(call.get("function"), Mapping):
        flat = {k: v for k, v in call.items() if k not in ("function", "type")}
        flat["name"] = call["function"].get("name")
        if "arguments" in call["function"]:
            flat["arguments"] = call["function"]["arguments"]
        return flat
    return dict(call) if isinstance(call, Mapping) else call


def _normalise_messages(messages: Any) -> Any:
    if not isinstance(messages, (list, tuple)):
        return messages
    out = []
    for message in messages:
        if isinstance(message, Mapping):
            message = dict(message)
            if isinstance(message.get("tool_calls"), (list, tuple)):
                message["tool_calls"] = [_normalise_tool_call(c) for c in message["tool_calls"]]
        out.append(message)
    return out


MAX_JSON_DEPTH = 100  # nesting the builder keeps; deeper is cut (§7.7 kit-json-safe-response)
MAX_INT_DIGITS = 4300  # CPython's default int_max_str_digits: the platform's JSON parser reads no longer integer
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def _jsonable(value: Any, path: str, notes: List[str], depth: int = 0,
              active: Optional[Set[int]] = None) -> Any:
    """A JSON-safe copy of ``value``: what JSON (or UTF-8) cannot carry is converted, each change noted with its
    path, nothing dropped silently (§7.7 kit-json-safe-response).

    NaN and infinities become ``null`` (as FastAPI sends them); lone surrogates U+FFFD (a pair split into two
    code points is joined); integers of more than :data:`MAX_INT_DIGITS` digits their decimal text; datetimes,
    dates and times their ISO text; sets and tuples lists; bytes their UTF-8 text; other objects their text
    (``repr``, then the type name, when ``str`` raises); non-string keys their text, renamed ``"1 (int)"`` when
    that text is taken; a value containing itself, or nested deeper than :data:`MAX_JSON_DEPTH`, is cut to a
    marker string.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if _SURROGATE_RE.search(value) is None:
            return value
        notes.append(f"{path}: lone surrogates (text cut mid-character?) are not valid UTF-8; sent as U+FFFD "
                     "(a pair split into two code points joined)")
        return _well_formed(value)
    if isinstance(value, int):
        if value.bit_length() < 14_000 or abs(value) < _int_limit():  # 10**4300 has 14,284 bits
            return int(value)
        notes.append(f"{path}: an integer of more than {MAX_INT_DIGITS} digits is more than JSON parsers read; "
                     "sent as its decimal text")
        return _int_text(int(value))
    if isinstance(value, float):
        if math.isfinite(value):
            return value if type(value) is float else float.__float__(value)  # a subclass's __repr__ may raise
        notes.append(f"{path}: {float.__repr__(value)} is not JSON; sent as null")
        return None
    if isinstance(value, (Mapping, list, tuple, set, frozenset)):
        return _jsonable_container(value, path, notes, depth, set() if active is None else active)
    return _jsonable_other(value, path, notes, depth, active)


def _jsonable_container(value: Any, path: str, notes: List[str], depth: int, active: Set[int]) -> Any:
    """:func:`_jsonable` of a mapping, list, tuple or set: a cycle or nesting past :data:`MAX_JSON_DEPTH` cut to a
    marker, a set sorted into a list, a container that raises when read cut."""
    if id(value) in active:
        notes.append(f"{_short(path, 200)}: contains itself (a cycle); cut there")
        return "[cycle]"
    if depth >= MAX_JSON_DEPTH:
        notes.append(f"{_short(path, 200)}: nested more than {MAX_JSON_DEPTH} levels; cut there")
        return "[nested too deeply]"
    active.add(id(value))
    try:
        if isinstance(value, Mapping):
            return _jsonable_object(value, path, notes, depth, active)
        if not isinstance(value, (list, tuple)):
            notes.append(f"{path}: {type(value).__name__} is not JSON; sent as an array")
            value = sorted(value, key=_safe_repr)
        return [_jsonable(item, f"{path}[{i}]", notes, depth + 1, active) for i, item in enumerate(value)]
    except Exception as exc:  # noqa: BLE001 - a container that raises when read (a broken Mapping) is cut
        notes.append(f"{_short(path, 200)}: reading its {type(value).__name__} raised {type(exc).__name__}; "
                     "cut there")
        return f"[unreadable {type(value).__name__}]"
    finally:
        active.discard(id(value))


def _jsonable_other(value: Any, path: str, notes: List[str], depth: int, active: Optional[Set[int]]) -> Any:
    """:func:`_jsonable` of what is no JSON type: a date or time its ISO text, bytes their UTF-8 text, anything
    else its text."""
    iso = getattr(value, "isoformat", None)
    if callable(iso):
        notes.append(f"{path}: {type(value).__name__} is not JSON; sent as its ISO text")
        return _jsonable(_called_text(iso, value), path, notes, depth, active)
    if isinstance(value, (bytes, bytearray, memoryview)):
        notes.append(f"{path}: bytes are not JSON; sent as UTF-8 text")
        return bytes(value).decode("utf-8", "replace")
    notes.append(f"{path}: {type(value).__name__} is not JSON; sent as its text")
    return _jsonable(_safe_text(value), path, notes, depth, active)


def _jsonable_object(value: Mapping[Any, Any], path: str, notes: List[str], depth: int,
                     active: Set[int]) -> Dict[str, Any]:
    """:func:`_jsonable` of a mapping: every key a string, none lost to a collision."""
    out: Dict[str, Any] = {}
    taken = {k for k in value if isinstance(k, str) and _SURROGATE_RE.search(k) is None}  # sent as they are
    for key, item in value.items():
        if isinstance(key, str) and _SURROGATE_RE.search(key) is None:
            name = str.__str__(key)  # a str subclass's own __str__ may raise
        elif isinstance(key, str):  # a lone surrogate: U+FFFD, and never onto another key's name
            name = _jsonable(str.__str__(key), f"{path}: key {_short(repr(_well_formed(key)), 40)}", notes)
            if name in taken or name in out:
                base, n = name, 2
                while name in taken or name in out:
                    name, n = f"{base} {n}", n + 1
                shown = _short(repr(_well_formed(key)), 40)
                notes.append(f"{path}: key {shown} would collide with another key once its lone surrogates are "
                             f"replaced; sent as {name!r}")
        else:
            name = _key_text(key)
            shown = _short(_safe_repr(key), 40)
            if name in taken or name in out:
                base, n = f"{name} ({type(key).__name__})", 2
                name = base
                while name in taken or name in out:
                    name, n = f"{base} {n}", n + 1
                notes.append(f"{path}: key {shown} is not a string and its text is taken; sent as {name!r}")
            else:
                notes.append(f"{path}: key {shown} is not a string; sent as its text")
        out[name] = _jsonable(item, f"{path}.{name}", notes, depth + 1, active)
    return out


def _copied(mapping: Mapping[Any, Any]) -> Any:
    """``dict(mapping)``; a mapping that raises when read is left for :func:`_jsonable` to cut (strict: named)."""
    try:
        return dict(mapping)
    except Exception:  # noqa: BLE001
        return mapping


def _well_formed(text: str) -> str:
    """``text`` as valid Unicode: surrogate pairs joined, lone surrogates replaced by U+FFFD."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _int_text(number: int) -> str:
    """The decimal text of any integer, without ``str()``'s digit limit (divide and conquer)."""
    if number < 0:
        return "-" + _int_text(-number)
    if number.bit_length() < 3000:  # well under any int_max_str_digits a process may set (640 at the least)
        return str(number)
    half = number.bit_length() * 30103 // 200000  # about half its decimal digits
    high, low = divmod(number, 10 ** half)
    return _int_text(high) + _int_text(low).zfill(half)


def _key_text(key: Any) -> str:
    """A non-string key's text, as ``json.dumps`` writes the ones it knows (``true``, ``null``, ``1``)."""
    if key is None or isinstance(key, bool):
        return json.dumps(key)
    if isinstance(key, int):
        return _int_text(int.__int__(key))  # any size: no quotes, no digit limit
    if isinstance(key, float):
        return json.dumps(_jsonable(key, "key", []))
    return _well_formed(_safe_text(key))


def _safe_text(value: Any) -> str:
    """``str(value)``, else ``repr``, else ``<TypeName>``: never raises."""
    try:
        return str(value)
    except Exception:  # noqa: BLE001 - an object whose __str__ raises still gets a text
        return _safe_repr(value)


def _called_text(method: Callable[[], Any], value: Any) -> str:
    """The text of ``method()`` (``isoformat``, ``model_dump_json``), else :func:`_safe_text` of ``value``."""
    try:
        return str(method())
    except Exception:  # noqa: BLE001
        return _safe_text(value)


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:  # noqa: BLE001
        return f"<{type(value).__name__}>"


def _as_the_platform_keeps(body: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """``body`` changed the way the platform treats what it cannot use (§4), and a note per change.

    Values JSON cannot carry are converted (:func:`_jsonable`); tool calls with
    no resolvable name are dropped; a ``messages`` or ``metadata`` value that
    still breaks the schema or the pairing rule is dropped whole, as the
    platform drops it to null.  ``final_response`` is never touched.
    """
    notes: List[str] = []
    body = _jsonable_object(body, "body", notes, 0, set())
    notes = [note[len("body."):] if note.startswith("body.") else note for note in notes]
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            if isinstance(calls, list):
                kept = [c for c in calls if _tool_call_name(c) is not None]
                for j in [j for j, c in enumerate(calls) if _tool_call_name(c) is None]:
                    notes.append(f"messages[{i}].tool_calls[{j}]: no resolvable tool name; dropped")
                message["tool_calls"] = [_normalise_tool_call(c) for c in kept]
    problems = _message_problems(messages)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        notes.append(f"{problems[0]}{more}; messages dropped, as the platform drops a malformed transcript")
        del body["messages"]
    problems = _metadata_problems(body.get("metadata"))
    if problems:
        notes.append(f"{problems[0]}; metadata dropped, as the platform drops it")
        del body["metadata"]
    return body, notes


def response_envelope(
    value: Any,
    *,
    messages: Optional[Sequence[Mapping[str, Any]]] = None,
    metadata: Optional[Mapping[str, Any]] = None,
    strict: bool = False,
    multi_turn: bool = False,
) -> Tuple[Dict[str, Any], List[str]]:
    """``(body, warnings)``: the v1 response envelope (§4) from what an agent returned.

    ``value`` is a string, a mapping (``final_response`` and friends, plus any
    extra top-level keys, kept), or a result object exposing ``final_response``
    / ``final_output`` / ``output`` / ``message``.  ``messages`` and
    ``metadata`` override those found in ``value``.  Nested OpenAI tool calls
    become the flat form.

    Lenient (the default): the body the platform would grade goes out.  A
    non-string ``final_response`` becomes its JSON text; what the platform
    would drop is dropped the same way (:func:`_as_the_platform_keeps`) and
    named in ``warnings``, with the soft problems (a truncated or blank final
    response, mistyped metadata).  Only a missing or empty ``final_response``
    raises :class:`ResponseError`: there is nothing to grade.

    ``strict=True`` refuses instead: :class:`ResponseError` lists every
    problem, the soft ones too, except the truncation warning.

    A turn reply (§4.2: a mapping with ``message`` and ``session_done`` and no
    ``final_response``, as :func:`build_turn_reply` builds it) is the body
    itself in a multi-turn dispatch (``multi_turn=True``: the envelope carries
    ``session_id`` or ``turn_id``), checked by :func:`_turn_reply_body`; in a
    single-turn one it becomes the response envelope, ``message`` as
    ``final_response``, ``session_done`` dropped with a warning
    (kit-turn-reply-detected, kit-turn-reply-single-turn).
    """
    unpacked: List[str] = []
    if _is_turn_reply(value):
        if multi_turn:
            return _turn_reply_body(value, strict)
        value = {("final_response" if k == "message" else k): v for k, v in value.items() if k != "session_done"}
        unpacked.append("session_done: a single-turn dispatch has no session to end; the turn reply is sent as the "
                        "response envelope, its message as final_response")
    final, found_messages, found_metadata, extra = _unpack_result(value, strict, unpacked)
    if messages is None:
        messages = found_messages
    if metadata is None:
        metadata = found_metadata
    body: Dict[str, Any] = dict(extra)
    body["final_response"] = final
    if messages is not None:
        body["messages"] = _normalise_messages(messages)
    if metadata is not None:
        body["metadata"] = _copied(metadata) if isinstance(metadata, Mapping) else metadata
    notes: List[str] = unpacked
    if not strict:
        body, kept = _as_the_platform_keeps(body)
        notes = notes + kept
    return body, notes + _soft_problems(validate_response(body), strict)


def _soft_problems(found: List[str], strict: bool) -> List[str]:
    """The soft problems of ``found`` (as :func:`validate_response` words them), without their ``warning:``;
    :class:`ResponseError` for the hard ones, and in strict mode for the soft ones too but the truncation warning."""
    errors = [p for p in found if not p.startswith("warning:")]
    soft = [p[len("warning: "):] for p in found if p.startswith("warning:")]
    if strict:
        errors += [w for w in soft if not w.startswith("final_response: ") or "truncates" not in w]
    if errors:
        raise ResponseError(errors)
    return soft


def _is_turn_reply(value: Any) -> bool:
    """A multi-turn per-turn reply (§4.2): a mapping with ``message`` and ``session_done``, no ``final_response``."""
    return isinstance(value, Mapping) and "message" in value and "session_done" in value and (
        "final_response" not in value)


def _turn_reply_body(reply: Mapping[str, Any], strict: bool) -> Tuple[Dict[str, Any], List[str]]:
    """``(body, warnings)``: a turn reply as it goes out, its keys and their order as built (kit-turn-reply-checked).

    Lenient, as :func:`response_envelope` treats an envelope: a ``message``
    that is not a string becomes its JSON text, a ``session_done`` that is not
    a boolean is sent as ``false`` (no hint), the rest as
    :func:`_as_the_platform_keeps` sends it, each change a warning; only a
    missing or empty ``message`` raises :class:`ResponseError`.  Strict:
    every problem raises, the soft ones too (a blank message, mistyped metadata).
    """
    body: Dict[str, Any] = dict(reply)
    notes: List[str] = []
    if not strict:
        if body["message"] is not None and not isinstance(body["message"], str):
            body["message"] = _final_text(body["message"], "message", notes=notes)
        if not isinstance(body["session_done"], bool):
            notes.append(f"session_done: must be a boolean, got {json_type(body['session_done'])}; sent as false "
                         "(no hint)")
            body["session_done"] = False
        body, kept = _as_the_platform_keeps(body)
        notes += kept
    return body, notes + _soft_problems(_turn_reply_problems(body), strict)


def _turn_reply_problems(body: Mapping[str, Any]) -> List[str]:
    """Every problem of a turn reply, worded as :func:`validate_response` words an envelope's: a non-empty string
    ``message`` (blank: a warning), a boolean ``session_done``, and what it shares with the envelope."""
    problems: List[str] = []
    warnings: List[str] = []
    message = body.get("message")
    if message is None or message == "":
        problems.append("message: required, a non-empty string (the user answers it)")
    elif not isinstance(message, str):
        problems.append(f"message: must be a string, got {json_type(message)}")
    elif not message.strip():
        warnings.append("warning: message: blank (only whitespace): the user has nothing to answer")
    if not isinstance(body.get("session_done"), bool):
        problems.append(f"session_done: must be a boolean, got {json_type(body.get('session_done'))}")
    problems.extend(_shared_problems(body, warnings))
    return problems + warnings


def build_turn_reply(
    message: Any, *, metadata: Optional[Mapping[str, Any]] = None, session_done: bool = False
) -> Dict[str, Any]:
    """A multi-turn per-turn reply ``{"message", "session_done", "metadata"?}`` (§4.2), checked as a strict server
    checks it: a ``message`` that is not a string becomes its JSON text; a blank one, a ``session_done`` that is not
    a boolean or metadata the platform cannot use raises :class:`ResponseError` (kit-turn-reply-checked)."""
    reply: Dict[str, Any] = {"message": message if isinstance(message, str) else _final_text(message, "message"),
                             "session_done": session_done}
    if metadata is not None:
        reply["metadata"] = _copied(metadata) if isinstance(metadata, Mapping) else metadata
    return _turn_reply_body(reply, strict=True)[0]


def _metadata_problems(metadata: Any) -> List[str]:
    """Schema problems of ``metadata``: it must be an object or null (any keys)."""
    if metadata is None or isinstance(metadata, Mapping):
        return []
    return [f"metadata: must be an object or null, got {json_type(metadata)} (the platform drops it)"]


def _metadata_warnings(metadata: Any) -> List[str]:
    """The first-class keys the platform renders, mistyped: the schema allows them, the renderer cannot use them."""
    if not isinstance(metadata, Mapping):
        return []
    try:
        return _first_class_warnings(metadata)
    except Exception:  # noqa: BLE001 - a mapping that raises when read: _unencodable names it
        return []


def _first_class_warnings(metadata: Mapping[Any, Any]) -> List[str]:
    warnings = []
    for key in _METADATA_STR_KEYS:
        if key in metadata and metadata[key] is not None and not isinstance(metadata[key], str):
            warnings.append(f"warning: metadata.{key}: should be a string, got {json_type(metadata[key])}")
    for key in _METADATA_INT_KEYS:
        v = metadata.get(key)
        if key in metadata and v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            shown = _short(_safe_repr(v), 40)
            warnings.append(f"warning: metadata.{key}: should be a non-negative integer, got {shown}")
    v = metadata.get("agent_runtime_ms")
    if "agent_runtime_ms" in metadata and v is not None and (
        isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
    ):
        shown = _short(_safe_repr(v), 40)
        warnings.append(f"warning: metadata.agent_runtime_ms: should be a non-negative number, got {shown}")
    return warnings


def _message_problems(messages: Any, warnings: Optional[List[str]] = None) -> List[str]:
    """Schema and pairing problems of ``messages``; soft ones are appended to ``warnings`` when given."""
    if messages is None:
        return []
    if not isinstance(messages, (list, tuple)):
        return [f"messages: must be an array or null, got {json_type(messages)} (the platform drops it)"]
    problems: List[str] = []
    soft: List[str] = [] if warnings is None else warnings
    seen_call_ids: Set[str] = set()
    for i, message in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(message, Mapping):
            problems.append(f"{at}: must be an object, got {json_type(message)}")
            continue
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            problems.append(f"{at}.role: must be one of {', '.join(MESSAGE_ROLES)}, got {_short(repr(role), 40)}")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list, tuple)):
            problems.append(f"{at}.content: must be a string, an array of parts or null, got {json_type(content)}")
        if "tool_calls" in message:
            tool_calls = message["tool_calls"]
            if not isinstance(tool_calls, (list, tuple)):
                problems.append(f"{at}.tool_calls: must be an array, got {json_type(tool_calls)}")
            else:
                if role != "assistant" and tool_calls:
                    soft.append(f"warning: {at}.tool_calls: only assistant messages carry tool calls, "
                                f"this one is {role!r}")
                for j, call in enumerate(tool_calls):
                    problems.extend(_tool_call_problems(call, f"{at}.tool_calls[{j}]", seen_call_ids, soft))
        if "thinking" in message:
            thinking = message["thinking"]
            if not isinstance(thinking, (list, tuple)):
                problems.append(f"{at}.thinking: must be an array of objects, got {json_type(thinking)}")
            else:
                for j, block in enumerate(thinking):
                    if not isinstance(block, Mapping):
                        problems.append(f"{at}.thinking[{j}]: must be an object, got {json_type(block)}")
        call_id = message.get("tool_call_id")
        if "tool_call_id" in message and not isinstance(call_id, str):
            problems.append(f"{at}.tool_call_id: must be a string, got {json_type(call_id)}")
        elif role == "tool":
            if not call_id:
                problems.append(f"{at}.tool_call_id: required on role 'tool'")
            elif call_id not in seen_call_ids:
                problems.append(
                    f"{at}.tool_call_id: {_short(repr(call_id), 60)} does not match the id of an earlier "
                    "assistant tool_calls entry"
                )
    return problems


def _tool_call_problems(call: Any, at: str, seen_call_ids: Set[str], warnings: List[str]) -> List[str]:
    """A tool call against the schema's ``oneOf``: exactly one of the flat and the nested shape."""
    if not isinstance(call, Mapping):
        return [f"{at}: must be an object, got {json_type(call)}"]
    function = call.get("function")
    flat = isinstance(call.get("name"), str)
    nested = isinstance(function, Mapping) and isinstance(function.get("name"), str) and (
        "type" not in call or call["type"] == "function")
    if flat and nested:
        return [f"{at}: has both 'name' and 'function': send one of the flat and the nested form"]
    if not flat and not nested:
        if "type" in call and call["type"] != "function" and isinstance(function, Mapping):
            return [f"{at}.type: must be \"function\" in the nested form, got {_short(repr(call['type']), 40)}"]
        return [f"{at}.name: no resolvable tool name (neither 'name' nor 'function.name'); the platform drops it"]
    problems = []
    call_id = call.get("id")
    if "id" in call:
        if not isinstance(call_id, str):
            problems.append(f"{at}.id: must be a string, got {json_type(call_id)}")
        else:
            seen_call_ids.add(call_id)
    arguments = call["arguments"] if flat and "arguments" in call else (
        function.get("arguments") if nested and isinstance(function, Mapping) else None)
    if arguments is not None and not isinstance(arguments, (Mapping, str)):
        warnings.append(f"warning: {at}.arguments: should be an object or a JSON-encoded string, "
                        f"got {json_type(arguments)}")
    return problems


def _unencodable(value: Any, path: str, depth: int = 0, active: Optional[Set[int]] = None) -> Optional[str]:
    """The first place in ``value`` that JSON (or the platform's parser, or UTF-8) cannot carry, with the fix,
    or ``None``: NaN, infinity, a non-JSON type, a non-string key, a lone surrogate, an integer of more than
    :data:`MAX_INT_DIGITS` digits, a value containing itself, nesting deeper than :data:`MAX_JSON_DEPTH`."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, str):
        surrogate = _SURROGATE_RE.search(value)
        if surrogate is None:
            return None
        return (f"{path}: a lone surrogate (U+{ord(surrogate.group()):04X}) at character {surrogate.start()} is "
                "not valid UTF-8 (text cut mid-character?): replace it, e.g. text.encode('utf-16', 'surrogatepass')"
                ".decode('utf-16', 'replace')")
    if isinstance(value, int):
        if value.bit_length() < 14_000 or abs(value) < _int_limit():
            return None
        return (f"{path}: an integer of more than {MAX_INT_DIGITS} digits is more than JSON parsers (the platform's "
                "included) read: send it as a string")
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{path}: {float.__repr__(value)} is not JSON: send null or a string"
    if not isinstance(value, (Mapping, list, tuple)):
        return f"{path}: {type(value).__name__} is not a JSON type: convert it (to a string, a list or an object)"
    active = set() if active is None else active
    if id(value) in active:
        return f"{path}: contains itself (a cycle), which JSON cannot carry: send a copy without the back-reference"
    if depth >= MAX_JSON_DEPTH:
        return f"{path}: nested more than {MAX_JSON_DEPTH} levels: flatten it or send that part as text"
    active.add(id(value))
    try:
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    return f"{path}: key {_short(_safe_repr(key), 40)} is not a string: use string keys"
                found_key = _unencodable(key, f"{path}: key {_short(repr(_well_formed(key)), 40)}", depth, active)
                found = found_key or _unencodable(item, f"{path}.{str.__str__(key)}", depth + 1, active)
                if found:
                    return found
            return None
        for i, item in enumerate(value):
            found = _unencodable(item, f"{path}[{i}]", depth + 1, active)
            if found:
                return found
        return None
    except Exception as exc:  # noqa: BLE001 - a container that raises when read (a broken Mapping)
        return (f"{_short(path, 200)}: reading its {type(value).__name__} raised {type(exc).__name__}: "
                "send plain dicts, lists, strings and numbers")
    finally:
        active.discard(id(value))


def validate_response(body: Any) -> List[str]:
    """Every problem of a response body against §4 and its JSON Schema, each starting with its JSON path.

    Hard problems (no prefix) are what the schema rejects, the contract's
    rules (a non-empty ``final_response``, ``tool_call_id`` pairing) and values
    JSON cannot carry: the platform refuses the body or drops the part.  Soft
    ones start with ``warning:``: a final response the platform truncates, a
    blank one, mistyped first-class metadata, odd tool arguments.  An empty
    list means the body is accepted as sent.
    """
    if not isinstance(body, Mapping):
        return [f"body: must be a JSON object, got {json_type(body)}"]
    problems: List[str] = []
    warnings: List[str] = []
    final = body.get("final_response")
    if "final_response" not in body or final is None:
        problems.append("final_response: required, a non-empty string (the judge grades it)")
    elif not isinstance(final, str):
        problems.append(f"final_response: must be a string, got {json_type(final)}")
    elif not final:
        problems.append("final_response: must not be empty (the judge has nothing to grade)")
    elif not final.strip():
        warnings.append("warning: final_response: blank (only whitespace): the judge has nothing to grade")
    elif len(final) > FINAL_RESPONSE_SOFT_LIMIT:
        warnings.append(
            f"warning: final_response: {len(final)} characters; the platform truncates it at "
            f"~{FINAL_RESPONSE_SOFT_LIMIT} with a soft warning"
        )
    problems.extend(_shared_problems(body, warnings))
    return problems + warnings


def _shared_problems(body: Mapping[str, Any], warnings: List[str]) -> List[str]:
    """The problems of what a turn reply shares with the envelope (``messages``, ``metadata``, values JSON cannot
    carry); soft ones are appended to ``warnings``."""
    problems = _message_problems(body.get("messages"), warnings) + _metadata_problems(body.get("metadata"))
    warnings.extend(_metadata_warnings(body.get("metadata")))
    unencodable = _unencodable(body, "body")
    if unencodable:
        problems.append(unencodable[len("body."):] if unencodable.startswith("body.") else unencodable)
    return problems


# ---------------------------------------------------------------------------
# HTTP replies of a dispatch endpoint: JSON bodies, one error path
# ---------------------------------------------------------------------------

DETAIL_LIMIT = 500  # characters of an error ``detail``: one readable line, never a traceback


class HttpReply(NamedTuple):
    """What a dispatch endpoint answers: a status, headers and a JSON body."""

    status: int
    headers: List[Tuple[str, str]]
    body: bytes


def json_reply(status: int, payload: Any, extra_headers: Sequence[Tuple[str, str]] = ()) -> HttpReply:
    """A reply with ``payload`` as compact JSON (valid UTF-8: a lone surrogate goes as U+FFFD) and its
    Content-Length."""
    try:
        body = _COMPACT_JSON.encode(payload).encode("utf-8")
    except UnicodeEncodeError:
        body = json.dumps(_jsonable(payload, "reply", []), ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    headers.extend(extra_headers)
    return HttpReply(status, headers, body)


def error_reply(exc: BaseException) -> HttpReply:
    """The one error path: ``exc.http_status`` (500 for anything not ours) with ``{"detail": message}``.

    Our errors' messages are written to be shown; anything else is described as
    ``Type: message`` (§2 step 8).  At most :data:`DETAIL_LIMIT` characters.
    """
    if isinstance(exc, PipelinesError):
        return json_reply(exc.http_status, {"detail": _short(str(exc), DETAIL_LIMIT - 1)}, exc.headers)
    return json_reply(500, {"detail": describe_error(exc)})


def describe_error(exc: BaseException, limit: int = DETAIL_LIMIT, *secrets: Optional[str]) -> str:
    """``"TypeName: message"`` of an exception, one line of at most ``limit`` characters: what the platform shows.

    Each of ``secrets`` is redacted from the whole text before it is shortened: a cut must never leave part
    of a token that redaction would no longer recognise (§7.6 kit-error-detail-shape)."""
    message = _safe_text(exc)
    text = _well_formed(f"{type(exc).__name__}: {message}" if message else type(exc).__name__)
    return _short(" ".join(cast(str, redact(text, *secrets)).split()), limit - 1)  # with its "…": ``limit``


def redact(value: Any, *secrets: Optional[str]) -> Any:
    """``value`` (a string or JSON value) with every occurrence of each non-empty secret replaced by ``[redacted]``."""
    for secret in secrets:
        if secret:
            value = _redact_one(value, secret)
    return value


def _redact_one(value: Any, secret: str) -> Any:
    if isinstance(value, str):
        return value.replace(secret, _REDACTED) if secret in value else value
    if isinstance(value, dict):
        return {_redact_one(k, secret): _redact_one(v, secret) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_one(v, secret) for v in value]
    return value

# ###########################################################################
#
#   PART 2 - THE PYTHON RUNTIME
#
#   Carries out part 1's decisions with Python's standard library: part 1's
#   speed paths, the envelope bound per dispatch (ContextVars), keep-alive
#   connections and the retry loop, the proxy client, the dispatch app that
#   runs the agent, the servers (asyncio, http.server, WSGI, ASGI) and code
#   mode.  This is where sockets, threads, the environment and the log live;
#   every protocol decision is delegated to part 1.  Global state is limited
#   to ContextVars and the lazily built, lock-guarded singletons below.
#
# ###########################################################################


_T = TypeVar("_T")


class _Once(Generic[_T]):
    """A value built on first use, exactly once, under a lock: the module's one lazy-singleton idiom.

    Import stays cheap (nothing is built until needed) and no two threads
    build it twice.  :meth:`replace` swaps it (tests, a custom default client).
    """

    __slots__ = ("_make", "_lock", "_value")

    def __init__(self, make: Callable[[], _T]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._value: Optional[_T] = None

    def __call__(self) -> _T:
        value = self._value
        if value is None:
            with self._lock:
                if self._value is None:
                    self._value = self._make()
                value = self._value
        return value

    def replace(self, value: _T) -> None:
        with self._lock:
            self._value = value



# ---------------------------------------------------------------------------
# Speed paths: what part 1 computes, computed faster in Python.  Each gives
# exactly what part 1's own reading gives, or hands over to it (a test holds
# the two to agreeing).  A port needs none of them.
# ---------------------------------------------------------------------------

def _json_from_bytes(data: bytes) -> Any:
    """``json.loads(data)``, skipping its encoding sniff for a body that opens ``{`` then a non-NUL byte: the
    sniff gives UTF-8 for exactly those, decoded with ``surrogatepass`` as ``json.loads`` decodes it."""
    if data[:1] == b"{" and data[1:2] != b"\x00":
        return json.loads(data.decode("utf-8", "surrogatepass"))
    return json.loads(data)


def _idempotency_key() -> str:
    """A fresh random (version 4) UUID as text, as ``str(uuid.uuid4())`` gives it, at under half its cost."""
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # the RFC 4122 variant
    text = raw.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


@functools.lru_cache(maxsize=1)
def _int_limit() -> int:
    """``10 ** MAX_INT_DIGITS``, made once: the least integer with more digits than JSON parsers read."""
    return int(10 ** MAX_INT_DIGITS)


# One pass per line for the common, well-formed head; any line it does not match goes to parse_request_head,
# which names the problem.  The value class excludes CR, LF and every control character but HTAB, so a
# match also means no bare CR or LF; a name that is a token right before the colon means no folding.
_FIELD_LINE_RE = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):([^\x00-\x08\x0a-\x1f\x7f]*)")
_REQUEST_LINE_RE = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+) ([^\x00-\x20\x7f-\xff]+) HTTP/1\.([0-9])")


def _well_formed_head(head: bytes) -> Optional[RequestHead]:
    """:func:`parse_request_head` of a head with nothing unusual in it, or ``None``: the servers then read it with
    ``parse_request_head`` itself, which names the problem (tests/test_request_head_fast_path.py holds the two
    to agreeing)."""
    if len(head) > MAX_REQUEST_LINE_BYTES or head.startswith(b"\r\n"):
        return None
    lines = head.split(b"\r\n")
    if len(lines) - 1 > MAX_REQUEST_FIELDS:
        return None
    request = _REQUEST_LINE_RE.fullmatch(lines[0])
    if request is None:
        return None
    headers: List[Tuple[str, str]] = []
    hosts = lengths = 0
    for line in lines[1:]:
        field = _FIELD_LINE_RE.fullmatch(line)
        if field is None:
            return None
        name, value = field.group(1).decode("ascii"), field.group(2).strip(b" \t").decode("latin-1")
        lowered = name.lower()
        if lowered == "host":
            hosts += 1
        elif lowered == "content-length":
            lengths += 1
            if not (value.isascii() and value.isdigit()):
                return None
        elif lowered == "transfer-encoding":
            return None
        headers.append((name, value))
    version = "HTTP/1.0" if request.group(3) == b"0" else "HTTP/1.1"
    if (version == "HTTP/1.1" and hosts != 1) or lengths > 1:  # framing the full reading decides
        return None
    return RequestHead(request.group(1).decode("ascii"), request.group(2).decode("ascii"), version, headers)


def _plain_text(text: str) -> bool:
    """No lone surrogate in ``text`` (ASCII checked first: it is the common case, and cheap)."""
    return text.isascii() or _SURROGATE_RE.search(text) is None


def _plain_envelope(value: Any) -> Optional[Dict[str, Any]]:
    """The body :func:`response_envelope` builds, with no note and no warning, for the commonest results: a string,
    or a dict of plain scalars (no ``messages``, no ``metadata``) whose ``final_response`` is a string; ``None``
    for anything ``response_envelope`` has to look at, which :func:`build_response` then calls
    (tests/test_response_fast_path.py holds the two to agreeing).

    Only exact types pass (``str``, ``int``, ``float``, ``bool``, ``None``; no subclass), every string free of lone
    surrogates, every number one JSON carries, the final response non-blank and within the soft limit: then
    neither leniency nor strictness changes anything, so either gives this body.
    """
    if type(value) is str:
        final, extra = value, None
    elif type(value) is dict and type(value.get("final_response")) is str and "messages" not in value and (
            "metadata" not in value):
        final, extra = value["final_response"], value
    else:
        return None
    if not final.strip() or len(final) > FINAL_RESPONSE_SOFT_LIMIT or not _plain_text(final):
        return None
    body: Dict[str, Any] = {}
    if extra is not None:
        for key, item in extra.items():
            if key == "final_response":
                continue
            if type(key) is not str or not _plain_text(key):
                return None
            kind = type(item)
            if kind is str:
                if not _plain_text(item):
                    return None
            elif kind is int:
                if item.bit_length() >= 14_000:  # maybe over MAX_INT_DIGITS digits: response_envelope decides
                    return None
            elif kind is float:
                if not math.isfinite(item):
                    return None
            elif item is not None and kind is not bool:
                return None
            body[key] = item
    body["final_response"] = final  # last, as response_envelope puts it
    return body


# ---------------------------------------------------------------------------
# Context binding: the envelope of the dispatch running in this context
# ---------------------------------------------------------------------------

_current: contextvars.ContextVar[Optional[Envelope]] = contextvars.ContextVar(
    "pipelines_port_envelope", default=None
)


@contextlib.contextmanager
def bind_envelope(envelope: Envelope) -> Iterator[Envelope]:
    """Bind ``envelope`` to the current context for the ``with`` block.

    Module-level tools can then call :func:`proxy_call` without being handed
    the envelope.  Each thread and each asyncio task has its own context, so
    concurrent dispatches never see each other's envelope.  A fresh thread does
    not inherit the binding: bind inside it (or use ``contextvars.copy_context``).
    """
    if not isinstance(envelope, Envelope):
        raise TypeError(f"bind_envelope() needs an Envelope, got {type(envelope).__name__}")
    token = _current.set(envelope)
    try:
        yield envelope
    finally:
        _current.reset(token)


def current_envelope() -> Envelope:
    """The envelope bound to this context; else the sandbox's run from its ``PIPELINES_*`` environment (§5).

    The environment counts only when it carries a run token (a sandbox, or a child process given its run's
    variables): a dispatch server's environment never does (§5 child-env-explicit).  :class:`EnvelopeError`
    when neither is there.
    """
    envelope = _current.get()
    if envelope is not None:
        return envelope
    if (os.environ.get(ENV_RUN_TOKEN) or "").strip():
        return Envelope.from_env()
    raise EnvelopeError(
        "no dispatch envelope is bound to this context and the environment has no run "
        f"({ENV_RUN_TOKEN} is not set): call inside a dispatch or run(), "
        "wrap the code in `with bind_envelope(envelope):`, or pass envelope=..."
    )

# ---------------------------------------------------------------------------
# Transport, blocking: pacing, keep-alive connections, a whole-reply deadline
# ---------------------------------------------------------------------------

def _env_float(name: str, default: float) -> float:
    text = (os.environ.get(name) or "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise PipelinesError(f"environment variable {name} must be a number, got {_short(text, 40)!r}") from None
    if not math.isfinite(value) or value < 0:
        raise PipelinesError(f"environment variable {name} must be a non-negative number, got {text!r}")
    return value


class _Pacer:
    """Client-side pacing: at most ``limit`` requests per token in any ``window_s`` (§3.1 rate limit).

    A sliding log per token; a caller over the limit is told how long to wait
    for its reserved slot, so a burst is spread out instead of collecting 429s.
    """

    def __init__(self, limit: int, window_s: float = 60.0, max_tokens: int = 4096) -> None:
        self.limit = limit
        self.window_s = window_s
        self._max_tokens = max_tokens
        self._log: OrderedDict[str, Deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def reserve(self, key: str, now: Optional[float] = None) -> float:
        """Reserve the next slot for ``key``; return the seconds to wait for it."""
        now = time.monotonic() if now is None else now
        with self._lock:
            log = self._log.get(key)
            if log is None:
                log = self._log[key] = deque(maxlen=self.limit)
                if len(self._log) > self._max_tokens:
                    self._log.popitem(last=False)
            else:
                self._log.move_to_end(key)
            slot = now if len(log) < self.limit else max(now, log[0] + self.window_s)
            log.append(slot)
            return slot - now


class _DispatchStats:
    """Proxy calls made by one dispatch (for the server's log line)."""

    __slots__ = ("proxy_calls", "cancelled", "_lock")

    def __init__(self) -> None:
        self.proxy_calls = 0
        self.cancelled = False  # set when the dispatch overran run_timeout_s
        self._lock = threading.Lock()

    def count(self) -> None:
        with self._lock:
            self.proxy_calls += 1


_dispatch_stats: contextvars.ContextVar[Optional[_DispatchStats]] = contextvars.ContextVar(
    "pipelines_port_dispatch_stats", default=None
)

def _runs_on(loop: Any) -> bool:
    """True on the thread running ``loop``: waiting there for the loop's own work would never end."""
    import asyncio

    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


# The event loop of the server that started this sync agent on a thread of its own: the blocking driver's
# exchanges run there (see ProxyClient.exchange), so a thousand agent threads wait on futures instead of each
# driving a socket under the GIL.
_server_loop: contextvars.ContextVar[Any] = contextvars.ContextVar("pipelines_port_server_loop", default=None)


class _Connections:
    """Idle keep-alive connections per (scheme, host, port), shared by every thread.

    ``http.client`` connections are not thread-safe, so one serves one exchange
    at a time: :meth:`get` takes it out of the pool and :meth:`put` returns it
    once the reply is read.  Connections thus move between threads (the server
    runs each agent on a fresh one) but are never used by two at once.  An idle
    connection the server has closed is detected and replaced.
    """

    MAX_IDLE_PER_HOST = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: Dict[Tuple[str, str, int], List[Any]] = {}

    def get(self, key: Tuple[str, str, int], timeout: float, make: Callable[[], Any]) -> Tuple[Any, bool]:
        """``(connection, reused)`` for ``key``: the most recently used idle one, or a new one."""
        while True:
            with self._lock:
                idle = self._idle.get(key)
                conn = idle.pop() if idle else None
            if conn is None:
                return make(), False
            if conn.sock is not None and not _peer_closed(conn.sock):
                conn.timeout = timeout
                conn.sock.settimeout(timeout)
                return conn, True
            conn.close()

    def put(self, key: Tuple[str, str, int], conn: Any) -> None:
        """Return ``conn`` to the pool (closed instead when the pool for ``key`` is full)."""
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) < self.MAX_IDLE_PER_HOST:
                idle.append(conn)
                return
        conn.close()

    def close_idle(self) -> None:
        """Close every idle connection (those in use finish their exchange first)."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()


def _peer_closed(sock: Any) -> bool:
    """True when an idle keep-alive socket is readable: the server closed it (or sent junk)."""
    try:
        if hasattr(select, "poll"):  # select() cannot watch descriptors >= 1024
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return bool(poller.poll(0))
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


class _Watchdog:
    """Shuts down sockets whose exchange overran its deadline: one lazily started daemon thread.

    A socket timeout bounds each ``recv``, not a whole reply: a peer sending a
    byte now and then would hold a call forever.  :meth:`watch` a socket for
    an exchange, :meth:`done` when it ends; ``done`` says whether it fired.
    """

    def __init__(self) -> None:
        self._wake = threading.Condition(threading.Lock())
        self._heap: List[List[Any]] = []  # [deadline, sequence, socket, state]: 0 watched, 1 done, 2 fired
        self._watched = 0
        self._sequence = 0
        self._thread: Optional[threading.Thread] = None

    def watch(self, sock: Any, seconds: float) -> List[Any]:
        import heapq

        with self._wake:
            self._sequence += 1
            entry = [time.monotonic() + seconds, self._sequence, sock, 0]
            heapq.heappush(self._heap, entry)
            self._watched += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pipelines-watchdog", daemon=True)
                self._thread.start()
            if self._heap[0] is entry:  # the thread sleeps until the earliest deadline: wake it only for an earlier one
                self._wake.notify()
            return entry

    def done(self, entry: List[Any]) -> bool:
        import heapq

        with self._wake:
            fired = bool(entry[3] == 2)
            if entry[3] == 0:
                self._watched -= 1
            entry[3], entry[2] = 1, None
            if len(self._heap) > 64 and len(self._heap) > 4 * self._watched:  # drop finished entries now and then
                self._heap = [e for e in self._heap if e[3] == 0]
                heapq.heapify(self._heap)
            return fired

    def _run(self) -> None:
        import heapq
        import socket

        while True:
            with self._wake:
                while not self._heap or (self._heap[0][3] == 0 and self._heap[0][0] > time.monotonic()):
                    self._wake.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                entry = heapq.heappop(self._heap)
                if entry[3] != 0:
                    continue
                entry[3] = 2
                self._watched -= 1
                sock = entry[2]
            try:
                sock.shutdown(socket.SHUT_RDWR)  # the blocked read returns at once
            except OSError:
                pass


_watchdog = _Once(_Watchdog)


def _loggable_path(path: str) -> str:
    """A request path for a log line: a query string may carry a key, so it is cut."""
    return path.split("?", 1)[0] + ("?…" if "?" in path else "")


def _make_tls_context() -> ssl.SSLContext:
    """One verifying TLS context per process, created on first use (loading CAs is slow)."""
    import ssl

    return ssl.create_default_context()


_default_tls_context = _Once(_make_tls_context)


class _TransportFailure(Exception):
    """No usable reply arrived; the socket or protocol error is ``__cause__``.

    ``stale`` marks a reused keep-alive connection the server had closed: worth
    an immediate retry, without the backoff wait.
    """

    def __init__(self, stale: bool = False) -> None:
        super().__init__()
        self.stale = stale


class _ReplyTooLarge(Exception):
    """A reply body over the caller's cap; refused without reading it all."""

    def __init__(self, status: int, cap: int, length: Optional[int]) -> None:
        self.status = status
        super().__init__(
            f"is {length} bytes, over the {cap}-byte cap" if length is not None else f"exceeds the {cap}-byte cap"
        )


class _Transport:
    """HTTP(S) exchanges over keep-alive connections: the one I/O layer of every outbound call."""

    def __init__(self, ssl_context: Optional[ssl.SSLContext] = None) -> None:
        self._ssl_context = ssl_context
        self._connections = _Connections()

    def close(self) -> None:
        self._connections.close_idle()

    def exchange(
        self, base: Any, method: str, path: str, headers: Mapping[str, str], body: bytes, timeout: float, max_reply: int
    ) -> Tuple[int, List[Tuple[str, str]], bytes]:
        """``(status, headers, body)`` of one request; raises :class:`_TransportFailure` or :class:`_ReplyTooLarge`.

        An idle pooled connection the server closed is replaced before use; if
        the server closes it while we send, the request is re-sent at once on a
        fresh connection (it cannot have been read).  A reused connection that
        drops while we await the reply is ambiguous (the request may have been
        processed) and raises a ``stale`` :class:`_TransportFailure`.
        """
        import http.client

        # UnicodeError: a host name that cannot be IDNA-encoded fails like an unreachable one.
        transport_errors = (OSError, http.client.HTTPException, UnicodeError)
        problem = _header_problem(headers)
        if problem:
            raise ValueError(problem)
        scheme, host = base.scheme.lower(), base.hostname
        port = base.port or (443 if scheme == "https" else 80)
        key = (scheme, host, port)
        debug = _log.isEnabledFor(logging.DEBUG)
        where = f"{host}:{port}{_loggable_path(path)}"  # never userinfo or a query: they may hold keys
        for fresh_retry in (False, True):
            conn, reused = self._connections.get(key, timeout, lambda: self._connect(scheme, host, port, timeout))
            started = time.monotonic()
            if debug:
                _log.debug("-> %s %s (%d bytes%s)", method, where, len(body), _debug_headers(headers))
            try:
                conn.request(method, path, body, dict(headers))
            except transport_errors as exc:
                conn.close()
                if reused and not fresh_retry and _is_stale_connection_error(exc):
                    continue  # closed before it read our request: re-send once on a fresh connection
                raise _TransportFailure() from exc
            status, reply_headers, reply = self._reply(conn, key, reused, timeout, started, max_reply, transport_errors)
            if debug:
                _log.debug("<- %s %s HTTP %d (%d bytes) in %.1f ms", method, where, status, len(reply),
                           (time.monotonic() - started) * 1000)
            return status, reply_headers, reply
        raise AssertionError("unreachable")

    def _connect(self, scheme: str, host: str, port: int, timeout: float) -> http.client.HTTPConnection:
        """A new connection (not yet connected: ``http.client`` connects on the first request)."""
        if scheme == "https":
            context = self._ssl_context or _default_tls_context()
            return cast("http.client.HTTPConnection", _http_classes()[1](host, port, timeout=timeout, context=context))
        return cast("http.client.HTTPConnection", _http_classes()[0](host, port, timeout=timeout))

    def _reply(self, conn: http.client.HTTPConnection, key: Tuple[str, str, int], reused: bool, timeout: float,
               started: float, max_reply: int,
               transport_errors: Tuple[Type[BaseException], ...]) -> Tuple[int, List[Tuple[str, str]], bytes]:
        """The reply to the request sent on ``conn`` at ``started``, whole within ``timeout`` of it however slowly a
        peer drips it (the watchdog shuts the socket then); ``conn`` goes back to the pool if the reply leaves it
        reusable."""
        watch = _watchdog().watch(conn.sock, max(timeout - (time.monotonic() - started), 0.001))
        try:
            response = conn.getresponse()
            status = response.status
            reply_headers = response.getheaders()
            length = _content_length(response.getheader("Content-Length"))
            if length is not None and length > max_reply:
                conn.close()
                raise _ReplyTooLarge(status, max_reply, length)
            reply = response.read(max_reply + 1)
            if len(reply) > max_reply:
                conn.close()
                raise _ReplyTooLarge(status, max_reply, None)
        except transport_errors as exc:
            conn.close()
            if _watchdog().done(watch):
                raise _TransportFailure() from TimeoutError(f"timed out: no complete reply within {timeout:g} s")
            raise _TransportFailure(stale=reused and _is_stale_connection_error(exc)) from exc
        if _watchdog().done(watch):  # fired just as the reply completed: the socket is shut
            conn.close()
        elif response.isclosed() and not response.will_close:
            self._connections.put(key, conn)
        else:
            conn.close()
        return status, reply_headers, reply


# ---------------------------------------------------------------------------
# The deadline wheel: the asyncio driver's and server's timeouts, one timer per
# 0.25 s tick for the far ones
# ---------------------------------------------------------------------------

class _Deadline:
    """One timeout of :class:`_Deadlines`: ``cancel()`` and ``when()``, as an asyncio ``TimerHandle`` has."""

    __slots__ = ("_when", "_callback", "_args", "_tick")

    def __init__(self, when: float, callback: Callable[..., Any], args: Tuple[Any, ...], tick: Set[Any]) -> None:
        self._when = when
        self._callback: Optional[Callable[..., Any]] = callback
        self._args = args
        self._tick: Optional[Set[Any]] = tick

    def when(self) -> float:
        return self._when

    def cancel(self) -> None:
        if self._tick is not None:
            self._tick.discard(self)
        self._tick, self._callback, self._args = None, None, ()

    def _run(self) -> None:
        callback, args = self._callback, self._args
        self._tick, self._callback, self._args = None, None, ()
        if callback is not None:  # not cancelled between its tick and now
            callback(*args)


class _Deadlines:
    """The long timeouts of one event loop, for the price of a few asyncio timers.

    The server and the asyncio driver set a timeout per connection, per run and per proxy exchange, and almost
    none of them fire: at thousands of dispatches at once, a ``TimerHandle`` each (its heap, compared in
    Python) is a real share of the loop's work.  A timeout at least ``COARSE_AFTER_S`` away joins the tick of
    ``GRAIN_S`` it falls in: one asyncio timer per tick, cancelling is a set removal, and it fires at most
    ``GRAIN_S`` late (under 2.5 %).  Nearer ones are plain ``loop.call_at``, exact.  Used on the loop's thread only.
    """

    GRAIN_S = 0.25
    COARSE_AFTER_S = 10.0
    _of_loop: Any = None  # loop -> its _Deadlines (a WeakKeyDictionary, made on first use under _lock)
    _lock = threading.Lock()

    def __init__(self, loop: Any) -> None:
        import weakref

        self._loop = weakref.proxy(loop)  # the value of a weak-keyed entry must not keep its key (the loop) alive
        self._ticks: Dict[int, Set[_Deadline]] = {}

    @classmethod
    def call_at(cls, loop: Any, when: float, callback: Callable[..., Any], *args: Any) -> Any:
        """``loop.call_at(when, callback, *args)`` for a timeout: its handle has ``cancel()`` and ``when()``."""
        if when - loop.time() < cls.COARSE_AFTER_S:
            return loop.call_at(when, callback, *args)
        return cls._for(loop)._at(when, callback, args)

    def at(self, when: float, callback: Callable[..., Any], *args: Any) -> Any:
        """:meth:`call_at` on this loop, for a caller that keeps its loop's :class:`_Deadlines` (no lookup)."""
        loop = self._loop
        if when - loop.time() < self.COARSE_AFTER_S:
            return loop.call_at(when, callback, *args)
        return self._at(when, callback, args)

    @classmethod
    def _for(cls, loop: Any) -> _Deadlines:
        of_loop = cls._of_loop
        deadlines = of_loop.get(loop) if of_loop is not None else None
        if deadlines is None:
            with cls._lock:
                if cls._of_loop is None:
                    import weakref

                    cls._of_loop = weakref.WeakKeyDictionary()
                deadlines = cls._of_loop.setdefault(loop, cls(loop))
        return cast(_Deadlines, deadlines)

    def _at(self, when: float, callback: Callable[..., Any], args: Tuple[Any, ...]) -> _Deadline:
        tick = math.ceil(when / self.GRAIN_S)
        entries = self._ticks.get(tick)
        if entries is None:
            entries = self._ticks[tick] = set()
            self._loop.call_at(tick * self.GRAIN_S, self._fire, tick)
        deadline = _Deadline(when, callback, args, entries)
        entries.add(deadline)
        return deadline

    def _fire(self, tick: int) -> None:
        for deadline in self._ticks.pop(tick, ()):
            self._loop.call_soon(deadline._run)  # each its own handle: one that raises stops none of the others


# ---------------------------------------------------------------------------
# Transport, asyncio: replies read as they arrive, connections pooled per loop
# ---------------------------------------------------------------------------

class _ReplyReader:
    """One HTTP/1.1 reply, read from bytes as they arrive (sans-IO): the asyncio driver's parser.

    The status line and headers (1xx interim replies skipped), then the body framed by Content-Length,
    by chunked coding, or by the end of the connection; at most ``max_reply`` body bytes
    (:class:`_ReplyTooLarge`, from Content-Length before any is read).  A malformed reply raises
    ``ConnectionError``.  ``done`` once the reply is whole; ``keep_alive`` when the connection may
    carry the next request.
    """

    MAX_HEAD = 64 << 10

    __slots__ = ("max_reply", "status", "headers", "keep_alive", "done", "_buffer", "_body", "_mode", "_left")

    def __init__(self, max_reply: int) -> None:
        self.max_reply = max_reply
        self.status = 0
        self.headers: List[Tuple[str, str]] = []
        self.keep_alive = False
        self.done = False
        self._buffer = bytearray()
        self._body = bytearray()
        self._mode = "head"  # head | length | chunk-size | chunk-data | chunk-end | trailers | eof
        self._left = 0

    @property
    def body(self) -> bytes:
        return bytes(self._body)

    def feed(self, data: bytes) -> None:
        """Take the next bytes of the connection."""
        buffer = self._buffer
        buffer += data
        while buffer and not self.done:
            mode = self._mode
            if mode == "head":
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(buffer) > self.MAX_HEAD:
                        raise ConnectionError(f"malformed HTTP reply: no end of headers within {self.MAX_HEAD} bytes")
                    return
                head = bytes(buffer[:end])
                del buffer[:end + 4]
                self._start(head)
            elif mode == "length" or mode == "chunk-data":
                take = min(self._left, len(buffer))
                self._body += buffer[:take]
                del buffer[:take]
                self._left -= take
                if self._left == 0:
                    self._mode = "chunk-end" if mode == "chunk-data" else "done"
                    self.done = mode == "length"
            elif mode == "eof":
                self._take_body(len(buffer))
                self._body += buffer
                buffer.clear()
            else:  # chunk-size, chunk-end, trailers: one line each
                end = buffer.find(b"\r\n")
                if end < 0:
                    if len(buffer) > 4096:
                        raise ConnectionError("malformed HTTP reply: a chunk line over 4096 bytes")
                    return
                line = bytes(buffer[:end])
                del buffer[:end + 2]
                self._chunk_line(mode, line)
        if self.done and buffer:  # bytes past the end of the reply: nothing asked for them
            self.keep_alive = False

    def feed_eof(self) -> None:
        """The peer closed the connection: the end of a body framed by it, or a reply cut short."""
        if self._mode == "eof":
            self.done = True
        elif not self.done:
            raise ConnectionError("the proxy closed the connection before the reply was complete")

    def _take_body(self, size: int) -> None:
        if len(self._body) + size > self.max_reply:
            raise _ReplyTooLarge(self.status, self.max_reply, None)

    def _start(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        code = rest[:3]
        if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise ConnectionError(f"malformed HTTP reply: status line {_short(repr(lines[0]), 80)}")
        status = int(code)
        headers: List[Tuple[str, str]] = []
        for line in lines[1:]:
            if line[:1] in (b" ", b"\t") and headers:  # obs-fold: a continuation of the header before
                headers[-1] = (headers[-1][0], headers[-1][1] + " " + line.strip().decode("latin-1"))
                continue
            name, colon, value = line.partition(b":")
            if not colon or not name.strip():
                raise ConnectionError(f"malformed HTTP reply: header line {_short(repr(line), 80)}")
            headers.append((name.strip().decode("latin-1"), value.strip().decode("latin-1")))
        if 100 <= status < 200 and status != 101:
            return  # an interim reply (100 Continue, 103 Early Hints): the real one follows
        if status == 101:
            raise ConnectionError("malformed HTTP reply: 101 Switching Protocols, which no request asked for")
        self.status, self.headers = status, headers
        lowered = _lower_headers(headers)
        connection = {t.strip().lower() for t in lowered.get("connection", "").split(",")}
        self.keep_alive = ("close" not in connection if version == b"HTTP/1.1" else "keep-alive" in connection)
        coding = lowered.get("transfer-encoding")
        if status in (204, 304):
            self._mode, self.done = "done", True
        elif coding is not None:
            if coding.split(",")[-1].strip().lower() != "chunked":  # RFC 9112 §6.3: the body ends with the connection
                self._mode, self.keep_alive = "eof", False
            else:
                self._mode = "chunk-size"
        elif "content-length" in lowered:
            length = _content_length(lowered["content-length"])
            if length is None or _repeated(lowered, "content-length", conflicting=True):
                raise ConnectionError(f"malformed HTTP reply: Content-Length {_short(lowered['content-length'], 40)!r}")
            if length > self.max_reply:
                raise _ReplyTooLarge(status, self.max_reply, length)
            self._mode, self._left = "length", length
            self.done = length == 0
        else:
            self._mode, self.keep_alive = "eof", False

    def _chunk_line(self, mode: str, line: bytes) -> None:
        if mode == "chunk-end":
            if line:
                raise ConnectionError("malformed HTTP reply: chunk data longer than its size")
            self._mode = "chunk-size"
        elif mode == "trailers":
            if not line:
                self._mode, self.done = "done", True
        else:
            size_text = line.split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16) if size_text and size_text.isalnum() else -1
            except ValueError:
                size = -1
            if size < 0:
                raise ConnectionError(f"malformed HTTP reply: chunk size {_short(repr(line), 40)}")
            self._take_body(size)
            self._mode, self._left = ("trailers", 0) if size == 0 else ("chunk-data", size)


class _ClientConnection:
    """One keep-alive connection to a proxy origin, as an asyncio protocol: one exchange at a time.

    :meth:`exchange` writes a request and waits for :class:`_ReplyReader` to have the whole reply, the
    deadline to pass (``TimeoutError``) or the connection to drop.  A cancelled exchange leaves the
    connection unusable: the caller aborts it.
    """

    __slots__ = ("loop", "transport", "closed", "received", "idle_since", "_reader", "_waiter", "_deadlines")

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self._deadlines = _Deadlines._for(loop)
        self.transport: Any = None
        self.closed = False
        self.received = False  # a byte of the current reply arrived (so a drop is no stale connection)
        self.idle_since = 0.0
        self._reader: Optional[_ReplyReader] = None
        self._waiter: Any = None

    async def exchange(self, request: bytes, max_reply: int, deadline: float, timeout: float) -> _ReplyReader:
        reader = self._reader = _ReplyReader(max_reply)
        self.received = False
        waiter = self._waiter = self.loop.create_future()
        timer = self._deadlines.at(deadline, self._timed_out, timeout)
        try:
            self.transport.write(request)
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        return reader

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _timed_out(self, timeout: float) -> None:
        self._settle(TimeoutError(f"timed out: no complete reply within {timeout:g} s"))

    def abort(self) -> None:
        """Drop the connection at once (mid-exchange: nothing more of it can be trusted)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _settle(self, error: Optional[BaseException]) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(error)

    # -- the asyncio protocol ------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        if reader is None or reader.done or self._waiter is None:  # bytes no request asked for
            self.abort()
            return
        self.received = True
        try:
            reader.feed(data)
        except (ConnectionError, _ReplyTooLarge) as exc:
            self._settle(exc)
            return
        if reader.done:
            self._settle(None)

    def eof_received(self) -> bool:
        self.closed = True
        reader = self._reader
        if reader is not None and self._waiter is not None and not reader.done:
            try:
                reader.feed_eof()
            except ConnectionError as exc:
                self._settle(exc if self.received else ConnectionResetError("the proxy closed the connection "
                                                                            "before replying"))
                return False
            self._settle(None)
        return False

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self.closed = True
        self._settle(exc or ConnectionResetError("the connection to the proxy closed before a complete reply"))

    def pause_writing(self) -> None:  # requests are at most 1 MiB: the transport buffers them whole
        pass

    def resume_writing(self) -> None:
        pass


class _AsyncPool:
    """The idle keep-alive connections of one event loop, per (scheme, host, port).

    At most ``max_idle`` per origin; one idle over ``idle_s`` seconds is closed, by a housekeeping task that
    lives while the pool holds any and closes them all when its loop shuts down (``asyncio.run`` cancels it).
    """

    def __init__(self, loop: Any, max_idle: int, idle_s: float) -> None:
        import weakref

        self._loop = weakref.proxy(loop)  # held in a weak-keyed map by its loop: no strong reference back
        self._max_idle = max_idle
        self._idle_s = idle_s
        self._idle: Dict[Tuple[str, str, int], List[_ClientConnection]] = {}
        self._reaper: Any = None

    def take(self, key: Tuple[str, str, int]) -> Optional[_ClientConnection]:
        """The most recently used live idle connection for ``key``, or ``None``."""
        idle = self._idle.get(key)
        now = self._loop.time()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self._idle_s:
                return conn
            conn.close()
        return None

    def give(self, key: Tuple[str, str, int], conn: _ClientConnection) -> None:
        idle = self._idle.setdefault(key, [])
        if conn.closed or len(idle) >= self._max_idle:
            conn.close()
            return
        conn.idle_since = self._loop.time()
        idle.append(conn)
        if self._reaper is None:  # in a context of its own: it must not keep a dispatch's envelope alive
            self._reaper = contextvars.Context().run(self._loop.create_task, self._reap())

    def close(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
        if self._reaper is not None:
            self._reaper.cancel()

    async def _reap(self) -> None:
        import asyncio

        try:
            # Sleeps first: a pool emptied by the next take right after a give keeps its reaper (one task per
            # exchange otherwise); it ends after a sleep that left nothing idle.
            while True:
                await asyncio.sleep(self._idle_s / 2)
                if not any(self._idle.values()):
                    break
                cutoff = self._loop.time() - self._idle_s
                for conns in self._idle.values():
                    if any(c.closed or c.idle_since <= cutoff for c in conns):
                        kept = [c for c in conns if not c.closed and c.idle_since > cutoff]
                        for conn in conns:
                            if conn.closed or conn.idle_since <= cutoff:
                                conn.close()
                        conns[:] = kept  # in place, once: not a list.remove per connection
        except asyncio.CancelledError:
            self.close()  # the loop is shutting down (or the client closing): leave no socket open
            raise
        finally:
            self._reaper = None


class _AsyncTransport:
    """HTTP(S) exchanges on asyncio: the twin of :class:`_Transport`, same arguments, results and failures.

    Keep-alive connections are pooled per event loop and origin (:class:`_AsyncPool`); the ``timeout``
    bounds the whole attempt, connecting included; a cancelled exchange closes the connection it used.
    """

    MAX_IDLE_PER_ORIGIN: Optional[int] = None  # None: half of default_max_connections(), from 64 to 4096
    # Across an agent's model turns and between waves of dispatches, at or below the idle timeout of the usual
    # front ends (AWS ALB 60 s, nginx 75 s; Go's client keeps 90 s, the blocking driver here until the server
    # closes).  A server that closes an idle connection sooner (uvicorn after 5 s) is seen by its EOF and the
    # connection not reused; a close that crosses our request is the stale case, re-sent at once.
    IDLE_TIMEOUT_S = 60.0

    def __init__(self, ssl_context: Optional[ssl.SSLContext] = None) -> None:
        import weakref

        self._ssl_context = ssl_context
        self._pools: weakref.WeakKeyDictionary[Any, _AsyncPool] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def _pool(self, loop: Any) -> _AsyncPool:
        pool = self._pools.get(loop)
        if pool is None:
            with self._lock:
                pool = self._pools.get(loop)
                if pool is None:
                    # A fan-out of N runs holds N connections to the one proxy: a small cap would close most of
                    # them after each call only to reconnect for the run's next one (bench/bench_fanout.py).
                    max_idle = self.MAX_IDLE_PER_ORIGIN or max(64, min(4096, default_max_connections() // 2))
                    pool = self._pools[loop] = _AsyncPool(loop, max_idle, self.IDLE_TIMEOUT_S)
        return pool

    def close(self) -> None:
        """Close the idle connections of the running loop's pool (other loops' are closed on their shutdown)."""
        import asyncio

        with contextlib.suppress(RuntimeError):
            pool = self._pools.pop(asyncio.get_running_loop(), None)
            if pool is not None:
                pool.close()

    async def exchange(
        self, base: Any, method: str, path: str, headers: Mapping[str, str], body: bytes, timeout: float, max_reply: int
    ) -> Tuple[int, List[Tuple[str, str]], bytes]:
        """``(status, headers, body)`` of one request; raises :class:`_TransportFailure` or :class:`_ReplyTooLarge`.

        A reused connection that drops before any byte of the reply is a ``stale`` failure (the retry
        policy re-sends at once, with the same Idempotency-Key).
        """
        import asyncio

        problem = _header_problem(headers)
        if problem:
            raise ValueError(problem)
        loop = asyncio.get_running_loop()
        scheme, host = base.scheme.lower(), base.hostname
        port = base.port or (443 if scheme == "https" else 80)
        key = (scheme, host, port)
        started = loop.time()
        deadline = started + timeout
        pool = self._pool(loop)
        debug = _log.isEnabledFor(logging.DEBUG)
        where = f"{host}:{port}{_loggable_path(path)}" if debug else ""
        if debug:
            _log.debug("-> %s %s (%d bytes%s)", method, where, len(body), _debug_headers(headers))
        try:
            request = _request_bytes(method, path, host, port, scheme, headers, body)
        except UnicodeError as exc:
            raise _TransportFailure() from exc
        conn = pool.take(key)
        reused = conn is not None
        if conn is None:
            conn = await self._connect(loop, scheme, host, port, deadline, timeout)
        try:
            reader = await conn.exchange(request, max_reply, deadline, timeout)
        except _ReplyTooLarge:
            conn.abort()
            raise
        except OSError as exc:  # TimeoutError and ConnectionError included
            conn.abort()
            raise _TransportFailure(stale=reused and not conn.received and not isinstance(exc, TimeoutError)) from exc
        except BaseException:  # cancelled mid-exchange: what is left of the reply must not meet the next request
            conn.abort()
            raise
        if reader.keep_alive and not conn.closed:
            pool.give(key, conn)
        else:
            conn.close()
        if debug:
            _log.debug("<- %s %s HTTP %d (%d bytes) in %.1f ms", method, where, reader.status, len(reader._body),
                       (loop.time() - started) * 1000)
        return reader.status, reader.headers, reader.body

    async def _connect(self, loop: Any, scheme: str, host: str, port: int, deadline: float,
                       timeout: float) -> _ClientConnection:
        """A new connection, TLS included, by ``deadline``, as ``asyncio.timeout`` bounds an await (3.11+).

        The deadline cancels this task where it waits, inside ``create_connection``, which closes what it
        opened; that cancellation becomes the timeout, and any other is passed on.  Not ``asyncio.wait_for``:
        before Python 3.12 it adds a task, a future and a timer on the loop's heap per connect, and a fan-out
        connects thousands at once (bench/bench_fanout.py).
        """
        import asyncio

        context = (self._ssl_context or _default_tls_context()) if scheme == "https" else None
        task = asyncio.current_task()
        if task is None:  # not run by a task (no loop does that, but then there is nothing to cancel)
            raise RuntimeError("the asyncio driver runs in a task of an event loop")
        expired: List[bool] = []

        def expire() -> None:
            expired.append(True)
            task.cancel()

        timer = _Deadlines.call_at(loop, deadline, expire)
        try:
            _, conn = await loop.create_connection(lambda: _ClientConnection(loop), host, port, ssl=context,
                                                   server_hostname=host if context is not None else None)
        except asyncio.CancelledError:
            if expired and _uncancel(task) == 0:  # the deadline's own cancellation, and no other: a timeout
                raise _TransportFailure() from TimeoutError(f"timed out: no connection within {timeout:g} s")
            raise
        except (OSError, UnicodeError) as exc:
            raise _TransportFailure() from exc
        finally:
            timer.cancel()
        return cast(_ClientConnection, conn)


def _uncancel(task: Any) -> int:
    """``task.uncancel()``: the cancellations still pending once one is withdrawn (Python 3.11+).  Before 3.11
    there is no count (0): a cancellation in the very loop turn the deadline fires is taken for the timeout, as
    ``asyncio.wait_for`` there takes it; a run cut that way has its further proxy calls refused all the same."""
    uncancel: Optional[Callable[[], int]] = getattr(task, "uncancel", None)
    return uncancel() if uncancel is not None else 0


def _request_bytes(method: str, path: str, host: str, port: int, scheme: str, headers: Mapping[str, str],
                   body: bytes) -> bytes:
    """An HTTP/1.1 request as bytes, with Host and Content-Length (``UnicodeError`` for what cannot be sent)."""
    try:
        host.encode("ascii")
    except UnicodeEncodeError:
        host = host.encode("idna").decode("ascii")
    shown = f"[{host}]" if ":" in host else host
    if port != (443 if scheme == "https" else 80):
        shown = f"{shown}:{port}"
    head = f"{method} {path} HTTP/1.1\r\nHost: {shown}\r\n".encode("ascii")
    fields = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return head + fields.encode("latin-1") + b"Content-Length: %d\r\n\r\n" % len(body) + body


# ---------------------------------------------------------------------------
# The retry loop of both drivers (RetryState.step decides), and what they share
# ---------------------------------------------------------------------------

_SECRET_HEADERS = frozenset({"authorization", "x-pipelines-run-token", "x-api-key", "api-key", "proxy-authorization"})


def _debug_headers(headers: Mapping[str, str]) -> str:
    """Headers worth a debug line, secrets redacted."""
    shown = [
        f"{k}: {_REDACTED if k.lower() in _SECRET_HEADERS else v}"
        for k, v in headers.items()
        if k.lower() in _SECRET_HEADERS or k.lower() in ("idempotency-key", HEADER_ACTOR_ID.lower())
    ]
    return (", " + ", ".join(shown)) if shown else ""


_Reply = Tuple[int, List[Tuple[str, str]], bytes]


def _retry_loop(
    send: Callable[[], _Reply],
    interpret: Callable[[int, List[Tuple[str, str]], bytes], ProxyOutcome],
    *,
    policy: RetryPolicy,
    sleep: Callable[[float], Any],
    transport_error: Callable[[BaseException], PipelinesError],
    before_attempt: Optional[Callable[[], float]] = None,
) -> Any:
    """The blocking driver of :class:`RetryState` (§3.3); :func:`_aretry_loop` is its asyncio twin, line for line.

    ``before_attempt`` runs before every attempt, retries included (it may refuse the call) and returns the
    seconds to wait for a pacing slot.  ``send`` makes one exchange, ``interpret`` says what its reply means,
    and ``transport_error`` builds the error for an exchange that got no usable reply.
    """
    state = RetryState(policy)
    while True:
        wait = before_attempt() if before_attempt is not None else 0.0
        if wait > 0:
            sleep(wait)
        try:
            outcome = interpret(*send())
        except _TransportFailure as failure:
            outcome = _transport_outcome(failure, transport_error)
        step = state.step(outcome)
        if step.action == "return":
            return step.value
        if step.action == "raise":
            raise cast(PipelinesError, step.error)
        _log_retry(step, outcome, state)
        if step.wait_s is not None:
            sleep(step.wait_s)


async def _aretry_loop(
    send: Callable[[], Awaitable[_Reply]],
    interpret: Callable[[int, List[Tuple[str, str]], bytes], ProxyOutcome],
    *,
    policy: RetryPolicy,
    sleep: Callable[[float], Awaitable[Any]],
    transport_error: Callable[[BaseException], PipelinesError],
    before_attempt: Optional[Callable[[], float]] = None,
) -> Any:
    """The asyncio driver of :class:`RetryState` (§3.3): :func:`_retry_loop` with ``await`` at each wait and send."""
    state = RetryState(policy)
    while True:
        wait = before_attempt() if before_attempt is not None else 0.0
        if wait > 0:
            await sleep(wait)
        try:
            outcome = interpret(*(await send()))
        except _TransportFailure as failure:
            outcome = _transport_outcome(failure, transport_error)
        step = state.step(outcome)
        if step.action == "return":
            return step.value
        if step.action == "raise":
            raise cast(PipelinesError, step.error)
        _log_retry(step, outcome, state)
        if step.wait_s is not None:
            await sleep(step.wait_s)


def _transport_outcome(failure: _TransportFailure, transport_error: Callable[[BaseException], PipelinesError]
                       ) -> ProxyOutcome:
    """What an exchange without a usable reply comes to: ``"transport"`` (retry with the same key) or ``"error"``."""
    cause = failure.__cause__ or failure
    error = transport_error(cause)
    error.__cause__, error.__suppress_context__ = cause, True
    if not _is_retryable_transport(cause):
        return ProxyOutcome("error", error=error)
    return ProxyOutcome("transport", error=error, stale=failure.stale)


def _log_retry(step: RetryStep, outcome: ProxyOutcome, state: RetryState) -> None:
    if outcome.kind != "transport":
        _log.warning("%s; retry %d in %.2f s", step.error, state.attempts, step.wait_s or 0.0)
    elif outcome.stale:
        _log.info("%s (a stale keep-alive connection); retrying at once", step.error)
    else:
        _log.warning("%s; retrying in %.2f s", step.error, step.wait_s or 0.0)


def _make_http_classes() -> Tuple[type, type]:
    """``http.client`` connections with TCP_NODELAY, built on first use so import stays cheap.

    Without TCP_NODELAY a keep-alive request can stall ~40 ms on delayed ACKs.
    """
    import http.client
    import socket

    class HTTPConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            super().connect()
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    class HTTPSConnection(http.client.HTTPSConnection):
        def connect(self) -> None:
            super().connect()
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    return HTTPConnection, HTTPSConnection


_http_classes = _Once(_make_http_classes)


def _is_stale_connection_error(exc: BaseException) -> bool:
    import http.client

    return isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError,
                            http.client.RemoteDisconnected, http.client.BadStatusLine))


def _failed_before_reply(what: str, cause: BaseException) -> str:
    reason = str(cause) or type(cause).__name__
    return f"{what} failed before a reply arrived: {type(cause).__name__}: {_short(reason, 200)}"


def _is_retryable_transport(cause: BaseException) -> bool:
    """Timeouts and refused, reset or dropped connections; not certificate or DNS failures."""
    import socket

    ssl = sys.modules.get("ssl")  # a certificate error implies ssl is loaded
    if ssl is not None and isinstance(cause, ssl.SSLCertVerificationError):
        return False
    return not isinstance(cause, socket.gaierror)


def _utc_now_iso() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


_shared_transport = _Once(lambda: _Transport())  # probes and model-API calls; each ProxyClient has its own
_shared_atransport = _Once(lambda: _AsyncTransport())


# ---------------------------------------------------------------------------
# Proxy client (§3): tool calls, trace events, actors
# ---------------------------------------------------------------------------

class ProxyClient:
    """Calls the per-run proxy (§3): validation, keep-alive, pacing, retries; blocking and asyncio alike.

    :meth:`call` and :meth:`trace` block (``http.client``); :meth:`acall` and :meth:`atrace` are their
    asyncio twins (``asyncio`` streams on the running loop: no thread per call), with the same arguments,
    results, errors and redaction.  Both run part 1's one policy (:class:`RetryState`).  One instance is safe
    to share between threads, event loops and tasks; the module functions use a shared default.  Knobs:

    - ``timeout``: seconds per attempt (default ``PIPELINES_PROXY_TIMEOUT_S`` or 120).
    - ``retry``: a :class:`RetryPolicy`.
    - ``rate_per_minute``: client-side pacing per run token (default
      ``PIPELINES_PROXY_RATE_PER_MINUTE`` or 60; 0 turns pacing off).
    - ``ssl_context``: for https proxies (default: the system CAs).
    - ``sleep``: how to wait between attempts (tests pass a fake; the asyncio forms await what it returns).
    """

    def __init__(
        self,
        *,
        timeout: Optional[float] = None,
        retry: RetryPolicy = RetryPolicy(),
        rate_per_minute: Optional[float] = None,
        ssl_context: Optional[ssl.SSLContext] = None,
        sleep: Optional[Callable[[float], Any]] = None,
    ) -> None:
        self.timeout = _env_float(ENV_PROXY_TIMEOUT_S, DEFAULT_PROXY_TIMEOUT_S) if timeout is None else float(timeout)
        if not self.timeout > 0:  # 0 would make every socket non-blocking and every call fail
            where = f"environment variable {ENV_PROXY_TIMEOUT_S}" if timeout is None else "timeout"
            raise PipelinesError(f"{where} must be a positive number of seconds, got {self.timeout:g}")
        self.retry = retry
        rate = (_env_float(ENV_PROXY_RATE_PER_MINUTE, RATE_LIMIT_PER_MINUTE) if rate_per_minute is None
                else rate_per_minute)
        self._pacer = _Pacer(int(rate)) if rate and rate >= 1 else None
        self._sleep = sleep
        self._transport = _Transport(ssl_context)
        self._atransport = _AsyncTransport(ssl_context)

    # -- public ---------------------------------------------------------------

    def call(
        self,
        envelope: Envelope,
        name: str,
        args: Optional[Mapping[str, Any]] = None,
        *,
        actor: Optional[str] = None,
        timeout: Optional[float] = None,
        idempotency_key: Optional[str] = None,
        errors: str = "raise",
    ) -> Any:
        """POST ``args`` to ``{proxy_url}/tools/{name}`` and return the unwrapped ``response``.

        ``errors="return"`` turns a failed call into an ``{"error": ...}``
        value for the model to read instead of an exception; a stale run token
        still raises, because the run is over.
        """
        _check_errors_mode(errors)
        try:
            request = self._tool_call(envelope, name, args, actor, idempotency_key)
            return _retry_loop(self._send(request, timeout), sleep=self._sleep or time.sleep,
                               **self._policy(envelope, request))
        except ProxyError as exc:
            if errors == "raise" or isinstance(exc, StaleRunTokenError):
                raise
            return _error_value(exc, name)

    async def acall(
        self,
        envelope: Envelope,
        name: str,
        args: Optional[Mapping[str, Any]] = None,
        *,
        actor: Optional[str] = None,
        timeout: Optional[float] = None,
        idempotency_key: Optional[str] = None,
        errors: str = "raise",
    ) -> Any:
        """The asyncio form of :meth:`call`: the same request, policy, result and errors, awaited on this loop."""
        _check_errors_mode(errors)
        try:
            request = self._tool_call(envelope, name, args, actor, idempotency_key)
            return await _aretry_loop(self._asend(request, timeout), sleep=self._asleep,
                                      **self._policy(envelope, request))
        except ProxyError as exc:
            if errors == "raise" or isinstance(exc, StaleRunTokenError):
                raise
            return _error_value(exc, name)

    def trace(
        self,
        envelope: Envelope,
        event_type: str,
        payload: Optional[Mapping[str, Any]] = None,
        *,
        actor: Optional[str] = None,
        timeout: Optional[float] = None,
        best_effort: bool = False,
    ) -> Optional[Dict[str, Any]]:
        """POST a live trace event to ``{proxy_url}/traces/{event_type}`` (§3.4).

        Returns the proxy's ``{"accepted": true, "sequence": N}`` (``None`` when
        an older platform answers with an empty body).  ``__occurred_at`` is
        stamped once, before the first attempt.  With ``best_effort=True`` a
        failure is logged as a warning and ``None`` returned.
        """
        try:
            request = self._trace(envelope, event_type, payload, actor)
            result = _retry_loop(self._send(request, timeout), sleep=self._sleep or time.sleep,
                                 **self._policy(envelope, request))
            return result if isinstance(result, dict) else None
        except ProxyError as exc:
            if not best_effort:
                raise
            _log.warning("trace event %r not recorded: %s", event_type, exc)
            return None

    async def atrace(
        self,
        envelope: Envelope,
        event_type: str,
        payload: Optional[Mapping[str, Any]] = None,
        *,
        actor: Optional[str] = None,
        timeout: Optional[float] = None,
        best_effort: bool = False,
    ) -> Optional[Dict[str, Any]]:
        """The asyncio form of :meth:`trace`."""
        try:
            request = self._trace(envelope, event_type, payload, actor)
            result = await _aretry_loop(self._asend(request, timeout), sleep=self._asleep,
                                        **self._policy(envelope, request))
            return result if isinstance(result, dict) else None
        except ProxyError as exc:
            if not best_effort:
                raise
            _log.warning("trace event %r not recorded: %s", event_type, exc)
            return None

    def close(self) -> None:
        """Close the idle keep-alive connections (of the blocking driver, and of the running loop if any)."""
        self._transport.close()
        self._atransport.close()

    async def aclose(self) -> None:
        """Close the idle keep-alive connections of both drivers, the running loop's included."""
        self.close()

    # -- seams: override in a subclass to observe or change the wire (tests, broken ports) ----

    def exchange(self, base: Any, method: str, path: str, headers: Mapping[str, str], body: bytes, timeout: float,
                 max_reply: int) -> Tuple[int, List[Tuple[str, str]], bytes]:
        """One HTTP exchange with the proxy: ``(status, headers, body)`` (``base`` is the split proxy URL).

        On a sync agent's thread started by a server's event loop, the exchange runs on that loop (the asyncio
        transport, same results and failures) while this thread waits; elsewhere on the blocking transport.
        """
        loop = _server_loop.get()
        if loop is not None and loop.is_running() and not _runs_on(loop):
            return self._on_loop(loop, base, method, path, headers, body, timeout, max_reply)
        return self._transport.exchange(base, method, path, headers, body, timeout, max_reply)

    async def aexchange(self, base: Any, method: str, path: str, headers: Mapping[str, str], body: bytes,
                        timeout: float, max_reply: int) -> Tuple[int, List[Tuple[str, str]], bytes]:
        """The asyncio form of :meth:`exchange`."""
        return await self._atransport.exchange(base, method, path, headers, body, timeout, max_reply)

    def _on_loop(self, loop: Any, base: Any, method: str, path: str, headers: Mapping[str, str], body: bytes,
                 timeout: float, max_reply: int) -> Tuple[int, List[Tuple[str, str]], bytes]:
        """:meth:`exchange` run on ``loop`` from another thread; a loop that closes meanwhile is a transport
        failure (the asyncio transport bounds the exchange by ``timeout``; the wait has a margin over it)."""
        import asyncio
        import concurrent.futures

        exchange = self._atransport.exchange(base, method, path, headers, body, timeout, max_reply)
        try:
            future = asyncio.run_coroutine_threadsafe(exchange, loop)
        except RuntimeError:  # the loop closed after the check: this thread can still reach the proxy itself
            exchange.close()
            return self._transport.exchange(base, method, path, headers, body, timeout, max_reply)
        try:
            return future.result(timeout + 5.0)
        except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError) as exc:
            future.cancel()
            raise _TransportFailure() from exc

    def interpret(self, status: int, headers: HeadersLike, body: bytes, *, tool_name: str,
                  run_token: Optional[str] = None) -> ProxyOutcome:
        """What one proxy reply means: :func:`interpret_reply` (both drivers)."""
        return interpret_reply(status, headers, body, tool_name=tool_name, run_token=run_token)

    # -- internals: what both drivers share ----------------------------------

    def _tool_call(self, envelope: Envelope, name: str, args: Any, actor: Optional[str],
                   idempotency_key: Optional[str]) -> ProxyRequest:
        _check_envelope(envelope)
        request = tool_call_request(envelope.proxy_url, envelope.run_token, name, args, actor=actor,
                                    idempotency_key=idempotency_key)
        label = request.headers.get(HEADER_ACTOR_ID)
        if label:
            _warn_if_undeclared(envelope, label)
        return request

    def _trace(self, envelope: Envelope, event_type: str, payload: Optional[Mapping[str, Any]],
               actor: Optional[str]) -> ProxyRequest:
        _check_envelope(envelope)
        return trace_request(envelope.proxy_url, envelope.run_token, event_type, payload,
                             occurred_at=_utc_now_iso(), actor=actor)

    def _policy(self, envelope: Envelope, request: ProxyRequest) -> Dict[str, Any]:
        """The arguments both retry loops take but ``send`` and ``sleep``: interpretation, errors, pacing."""
        name = request.name
        stats = _dispatch_stats.get()
        if stats is not None:
            stats.count()

        def before_attempt() -> float:
            if stats is not None and stats.cancelled:  # checked before every attempt: no retry runs a tool late
                raise ProxyError(f"proxy call {name!r} refused: this dispatch overran its run_timeout_s and was "
                                 "answered already", tool_name=name)
            if self._pacer is None:
                return 0.0
            wait = self._pacer.reserve(envelope.run_token)
            if wait > 0:
                _log.info("pacing proxy calls under %d/min: waiting %.2f s", self._pacer.limit, wait)
            return wait

        return {
            "interpret": lambda status, reply_headers, reply: self.interpret(
                status, reply_headers, reply, tool_name=name, run_token=envelope.run_token),
            "policy": self.retry,
            "transport_error": lambda cause: ProxyTransportError(
                _failed_before_reply(f"proxy call {name!r}", cause), tool_name=name),
            "before_attempt": before_attempt,
        }

    def _send(self, request: ProxyRequest, timeout: Optional[float]) -> Callable[[], _Reply]:
        seconds = self.timeout if timeout is None else float(timeout)

        def send() -> _Reply:
            try:
                return self.exchange(request.url, "POST", request.path, request.headers, request.body, seconds,
                                     MAX_REPLY_BYTES)
            except _ReplyTooLarge as big:
                raise _reply_too_large(big, request.name) from None

        return send

    def _asend(self, request: ProxyRequest, timeout: Optional[float]) -> Callable[[], Awaitable[_Reply]]:
        seconds = self.timeout if timeout is None else float(timeout)

        async def send() -> _Reply:
            try:
                return await self.aexchange(request.url, "POST", request.path, request.headers, request.body,
                                            seconds, MAX_REPLY_BYTES)
            except _ReplyTooLarge as big:
                raise _reply_too_large(big, request.name) from None

        return send

    async def _asleep(self, seconds: float) -> None:
        if self._sleep is None:
            import asyncio

            await asyncio.sleep(seconds)
            return
        result = self._sleep(seconds)
        if result is not None and hasattr(result, "__await__"):
            await result


def _check_envelope(envelope: Any) -> None:
    if not isinstance(envelope, Envelope):
        raise TypeError(f"envelope must be an Envelope, got {type(envelope).__name__}")


def _check_errors_mode(errors: str) -> None:
    if errors not in ("raise", "return"):
        raise ValueError("errors must be 'raise' or 'return'")


def _error_value(exc: ProxyError, name: str) -> Dict[str, Any]:
    """A failed tool call as the ``{"error": ...}`` value the model reads (``errors="return"``)."""
    _log.info("tool %r failed, returning the error to the agent: %s", name, exc)
    return exc.to_value()


def _reply_too_large(big: _ReplyTooLarge, name: str) -> ProxyError:
    return ProxyError(f"proxy reply to {name!r} {big}", status_code=big.status, tool_name=name)


_undeclared_lock = threading.Lock()
_undeclared_seen: OrderedDict[Tuple[Any, ...], None] = OrderedDict()


def _warn_if_undeclared(envelope: Envelope, label: str) -> None:
    """§3.5: a label off the declared catalog is accepted; warn once per run and label."""
    catalog = envelope.sub_agents
    if not catalog or label in catalog or label.rsplit("/", 1)[-1] in catalog:
        return
    key = (envelope.run_id, envelope.run_token_jti, envelope.proxy_url, label)
    with _undeclared_lock:
        if key in _undeclared_seen:
            return
        _undeclared_seen[key] = None
        if len(_undeclared_seen) > 4096:
            _undeclared_seen.popitem(last=False)
    _log.warning("actor label %r is not in this run's declared sub_agents %s; the platform will show it as undeclared",
                 label, list(catalog))


_default_client = _Once(lambda: ProxyClient())


def set_default_client(client: ProxyClient) -> ProxyClient:
    """Make ``client`` the one :func:`proxy_call`, :func:`post_trace` and tools use when none is passed.

    The supported way to change how every call of the process goes out (a
    subclass overriding :meth:`ProxyClient.exchange` or :meth:`ProxyClient.interpret`,
    other timeouts or pacing).  Returns the client it replaces, so a caller can put it back.
    """
    if not isinstance(client, ProxyClient):
        raise TypeError(f"set_default_client() needs a ProxyClient, got {type(client).__name__}")
    previous = _default_client()
    _default_client.replace(client)
    return previous


def proxy_call(
    name: str,
    args: Optional[Mapping[str, Any]] = None,
    *,
    envelope: Optional[Envelope] = None,
    actor: Optional[str] = None,
    timeout: Optional[float] = None,
    idempotency_key: Optional[str] = None,
    errors: str = "raise",
    client: Optional[ProxyClient] = None,
) -> Any:
    """Call tool ``name`` through the per-run proxy; return the unwrapped ``response`` (§3).

    Uses ``envelope`` or the one bound to this context.  Retries 429 and the
    transient 503 classes; raises :class:`ProxyError` (or
    :class:`StaleRunTokenError`) otherwise, or returns ``{"error": ...}`` with
    ``errors="return"``.
    """
    return (client or _default_client()).call(
        envelope or current_envelope(), name, args,
        actor=actor, timeout=timeout, idempotency_key=idempotency_key, errors=errors,
    )


async def aproxy_call(
    name: str,
    args: Optional[Mapping[str, Any]] = None,
    *,
    envelope: Optional[Envelope] = None,
    actor: Optional[str] = None,
    timeout: Optional[float] = None,
    idempotency_key: Optional[str] = None,
    errors: str = "raise",
    client: Optional[ProxyClient] = None,
) -> Any:
    """The asyncio form of :func:`proxy_call`: same arguments, result and errors, awaited on the running loop."""
    return await (client or _default_client()).acall(
        envelope or current_envelope(), name, args,
        actor=actor, timeout=timeout, idempotency_key=idempotency_key, errors=errors,
    )


class Actor:
    """Proxy calls and trace events attributed to one sub-agent (§3.5).

    Every request carries ``X-Pipelines-Actor-Id: <label>``.  Build with
    :func:`as_actor`.
    """

    __slots__ = ("label", "_envelope", "_client")

    def __init__(self, label: str, *, envelope: Optional[Envelope] = None,
                 client: Optional[ProxyClient] = None) -> None:
        normalised = validate_actor_label(label)
        if not normalised:
            raise ProxyRequestError("actor label must not be empty", error_class="actor_id_invalid")
        self.label = normalised
        self._envelope = envelope
        self._client = client
        if envelope is not None:
            _warn_if_undeclared(envelope, normalised)

    def __repr__(self) -> str:
        return f"Actor({self.label!r})"

    def call(self, name: str, args: Optional[Mapping[str, Any]] = None, **options: Any) -> Any:
        """:func:`proxy_call` as this actor."""
        return proxy_call(name, args, envelope=self._envelope, actor=self.label, client=self._client, **options)

    async def acall(self, name: str, args: Optional[Mapping[str, Any]] = None, **options: Any) -> Any:
        """:func:`aproxy_call` as this actor."""
        return await aproxy_call(name, args, envelope=self._envelope, actor=self.label, client=self._client,
                                 **options)

    def trace(self, event_type: str, payload: Optional[Mapping[str, Any]] = None,
              **options: Any) -> Optional[Dict[str, Any]]:
        """:func:`post_trace` as this actor."""
        return post_trace(event_type, payload, envelope=self._envelope, actor=self.label, client=self._client,
                          **options)

    async def atrace(self, event_type: str, payload: Optional[Mapping[str, Any]] = None,
                     **options: Any) -> Optional[Dict[str, Any]]:
        """:func:`apost_trace` as this actor."""
        return await apost_trace(event_type, payload, envelope=self._envelope, actor=self.label,
                                 client=self._client, **options)

    def handoff_to(self, to_sub_agent: str, **options: Any) -> Optional[Dict[str, Any]]:
        """:func:`post_handoff` from this actor to ``to_sub_agent``."""
        return post_handoff(self.label, to_sub_agent, envelope=self._envelope, client=self._client, **options)

    async def ahandoff_to(self, to_sub_agent: str, **options: Any) -> Optional[Dict[str, Any]]:
        """:func:`apost_handoff` from this actor to ``to_sub_agent``."""
        return await apost_handoff(self.label, to_sub_agent, envelope=self._envelope, client=self._client,
                                   **options)

    def actor(self, child: str) -> Actor:
        """A sub-actor one level down the call path (``parent/child``)."""
        return Actor(f"{self.label}/{child}", envelope=self._envelope, client=self._client)


def as_actor(label: str, *, envelope: Optional[Envelope] = None, client: Optional[ProxyClient] = None) -> Actor:
    """A handle whose calls carry ``X-Pipelines-Actor-Id: label``; validated now (§3.5)."""
    return Actor(label, envelope=envelope, client=client)


def post_trace(
    event_type: str,
    payload: Optional[Mapping[str, Any]] = None,
    *,
    envelope: Optional[Envelope] = None,
    actor: Optional[str] = None,
    timeout: Optional[float] = None,
    best_effort: bool = False,
    client: Optional[ProxyClient] = None,
) -> Optional[Dict[str, Any]]:
    """Post a live trace event for the bound run (§3.4); see :meth:`ProxyClient.trace`."""
    envelope = _trace_envelope(envelope, event_type, best_effort)
    if envelope is None:
        return None
    return (client or _default_client()).trace(envelope, event_type, payload, actor=actor, timeout=timeout,
                                               best_effort=best_effort)


async def apost_trace(
    event_type: str,
    payload: Optional[Mapping[str, Any]] = None,
    *,
    envelope: Optional[Envelope] = None,
    actor: Optional[str] = None,
    timeout: Optional[float] = None,
    best_effort: bool = False,
    client: Optional[ProxyClient] = None,
) -> Optional[Dict[str, Any]]:
    """The asyncio form of :func:`post_trace`."""
    envelope = _trace_envelope(envelope, event_type, best_effort)
    if envelope is None:
        return None
    return await (client or _default_client()).atrace(envelope, event_type, payload, actor=actor, timeout=timeout,
                                                      best_effort=best_effort)


def _trace_envelope(envelope: Optional[Envelope], event_type: str, best_effort: bool) -> Optional[Envelope]:
    """The envelope a trace event goes to; ``None`` (logged) for a best-effort event with none bound."""
    if envelope is not None:
        return envelope
    if not best_effort:
        return current_envelope()
    try:
        return current_envelope()
    except EnvelopeError as exc:
        _log.warning("trace event %r not recorded: %s", event_type, exc)
        return None


def post_handoff(
    from_sub_agent: str,
    to_sub_agent: str,
    *,
    reason: Optional[str] = None,
    payload_preview: Optional[str] = None,
    **options: Any,
) -> Optional[Dict[str, Any]]:
    """Record a control transfer between sub-agents as a ``handoff`` event (§3.4).

    Both labels are validated as §3.5; a self-handoff is dropped (logged, not sent).  ``options`` as for
    :func:`post_trace`.
    """
    event = _handoff(from_sub_agent, to_sub_agent, reason, payload_preview)
    return None if event is None else post_trace("handoff", event, **options)


async def apost_handoff(
    from_sub_agent: str,
    to_sub_agent: str,
    *,
    reason: Optional[str] = None,
    payload_preview: Optional[str] = None,
    **options: Any,
) -> Optional[Dict[str, Any]]:
    """The asyncio form of :func:`post_handoff`."""
    event = _handoff(from_sub_agent, to_sub_agent, reason, payload_preview)
    return None if event is None else await apost_trace("handoff", event, **options)


def _handoff(source: str, target: str, reason: Optional[str], payload_preview: Optional[str]
             ) -> Optional[Dict[str, Any]]:
    event = handoff_event(source, target, reason=reason, payload_preview=payload_preview)
    if event is None:
        _log.info("dropping self-handoff %r -> %r", source, target)
    return event


ENV_STRICT = "PIPELINES_PORT_STRICT"  # "1": refuse responses the platform would only soften (see build_response)


def _strict(strict: Optional[bool]) -> bool:
    return _truthy(os.environ.get(ENV_STRICT)) if strict is None else strict


def build_response(
    value: Any,
    *,
    messages: Optional[Sequence[Mapping[str, Any]]] = None,
    metadata: Optional[Mapping[str, Any]] = None,
    strict: Optional[bool] = None,
) -> Dict[str, Any]:
    """The v1 response envelope (§4) from what an agent returned: :func:`response_envelope`, each warning logged.

    Lenient by default: what the platform would drop is dropped the same way
    and logged once as a warning naming its JSON path.  ``strict=True`` (or
    ``PIPELINES_PORT_STRICT=1`` when ``strict`` is not given) raises
    :class:`ResponseError` listing every problem instead.
    """
    return _built(value, messages=messages, metadata=metadata, strict=strict)


def _built(value: Any, *, messages: Optional[Sequence[Mapping[str, Any]]] = None,
           metadata: Optional[Mapping[str, Any]] = None, strict: Optional[bool] = None,
           secrets: Sequence[Optional[str]] = (), multi_turn: bool = False) -> Dict[str, Any]:
    """:func:`build_response`, each warning logged without ``secrets`` or the bound run's token (a warning names
    paths, and a key may hold the token): what every server and ``run()`` send, a turn reply as built in a
    ``multi_turn`` dispatch."""
    plain = _plain_envelope(value) if messages is None and metadata is None else None
    if plain is not None:  # nothing to warn about, strict or not (and no environment variable to read)
        return plain
    body, warnings = response_envelope(value, messages=messages, metadata=metadata, strict=_strict(strict),
                                       multi_turn=multi_turn)
    bound = _current.get()
    hidden = (*secrets, bound.run_token if bound is not None else None)
    for warning in warnings:
        _log.warning("response: %s", redact(warning, *hidden))
    return body


# ---------------------------------------------------------------------------
# Running agents: a fresh thread per run, an optional deadline
# ---------------------------------------------------------------------------

ENV_DEBUG = "PIPELINES_AGENT_SDK_DEBUG"
ENV_PROXY_ALLOWED_HOSTS = "PIPELINES_PROXY_ALLOWED_HOSTS"  # the dispatch server's proxy host allow-list
_PROBE_TOOL = "__reachability_probe__"


class _Overran(RunTimeoutError):
    """Raised by :func:`_on_fresh_thread` when its deadline passes (the agent itself never raises this)."""


class _AgentRaised(Exception):
    """Carries what the agent raised on its thread (``error``) to the waiting one, apart from what hits the waiter."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error


def _on_fresh_thread(fn: Callable[[], Any], timeout_s: Optional[float] = None, *, wrap: bool = False) -> Any:
    """Run ``fn()`` in a copy of this context on a new daemon thread; its result, or its exception re-raised.

    The one way this module runs agent code off the caller's thread: the
    sandbox kernel's thread already runs an event loop (§5), and the server
    must be able to stop waiting.  With ``timeout_s``, :class:`RunTimeoutError`
    after that long; a Python thread cannot be killed, so the agent runs on in
    the background (the caller refuses its further proxy calls).  With
    ``wrap``, what ``fn`` raised comes as :class:`_AgentRaised`, so an
    exception raised in the waiting thread itself (a server's worker abort,
    a signal) is never taken for the agent's.
    """
    context = contextvars.copy_context()
    outcome: Dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = context.run(fn)
        except BaseException as exc:  # noqa: BLE001 - handed back to the waiting thread
            outcome["error"] = exc

    worker = threading.Thread(target=target, name="pipelines-agent", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise _Overran(f"agent did not finish within run_timeout_s={timeout_s:g} s")
    if "error" in outcome:
        raise _AgentRaised(outcome["error"]) if wrap else outcome["error"]
    return outcome.get("result")


class _RedactedError(Exception):
    """Stands in an exception chain for an exception whose text showed a secret and could not be cleaned."""


def _scrub(value: Any, secrets: Sequence[str]) -> Any:
    """``value`` with each secret replaced by ``[redacted]``: strings and bytes, inside lists, tuples and dicts."""
    if isinstance(value, str):
        return redact(value, *secrets)
    if isinstance(value, (bytes, bytearray)):
        for secret in secrets:
            value = value.replace(secret.encode("utf-8"), _REDACTED.encode("ascii"))
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_scrub(v, secrets) for v in value) if not hasattr(value, "_fields") else value
    if isinstance(value, dict):
        return {_scrub(k, secrets): _scrub(v, secrets) for k, v in value.items()}
    return value


def _redact_exception_chain(exc: Optional[BaseException], *secrets: Optional[str]) -> Optional[BaseException]:
    """``exc`` and its whole chain (``__cause__``, ``__context__``, group members) with no secret left in them.

    Cleaned in place: ``args``, ``__notes__`` and string attributes (``OSError.filename`` too).  An exception
    whose text still shows a secret (its class builds the text some other way) is replaced in the chain by a
    ``_RedactedError`` naming its type, with its traceback.  Returns what stands for ``exc`` now.  IPython
    prints the whole chain of what ``run()`` raises, and a log line formats it: no link may show the token.
    """
    wanted = [s for s in secrets if s]
    seen: Dict[int, Optional[BaseException]] = {}

    def text_of(error: BaseException) -> str:
        try:
            return f"{error}\n{error!r}\n" + "\n".join(map(str, getattr(error, "__notes__", None) or ()))
        except Exception:  # noqa: BLE001 - a __str__ that fails shows nothing
            return ""

    def clean(error: Optional[BaseException]) -> Optional[BaseException]:
        if error is None or not wanted:
            return error
        if id(error) in seen:
            return seen[id(error)]
        seen[id(error)] = error
        with contextlib.suppress(Exception):
            error.args = _scrub(error.args, wanted)
        notes = getattr(error, "__notes__", None)
        if isinstance(notes, list):
            notes[:] = [_scrub(n, wanted) for n in notes]
        for name, value in list(getattr(error, "__dict__", {}).items()):
            if isinstance(value, (str, bytes, list, tuple, dict)) and name != "__notes__":
                with contextlib.suppress(Exception):
                    setattr(error, name, _scrub(value, wanted))
        if isinstance(error, OSError):
            for name in ("strerror", "filename", "filename2"):
                with contextlib.suppress(Exception):
                    setattr(error, name, _scrub(getattr(error, name), wanted))
        for member in getattr(error, "exceptions", None) or ():  # an ExceptionGroup's members
            if isinstance(member, BaseException):
                clean(member)
        error.__cause__ = clean(error.__cause__)
        error.__context__ = clean(error.__context__)
        if not any(secret in text_of(error) for secret in wanted):
            return error
        try:
            message = redact(str(error), *wanted)
        except Exception:  # noqa: BLE001
            message = ""
        stand_in = _RedactedError(f"{type(error).__name__}: {message}" if message
                                  else f"{type(error).__name__} (its text showed a secret)")
        stand_in.__cause__, stand_in.__context__ = error.__cause__, error.__context__
        stand_in.__suppress_context__ = error.__suppress_context__
        seen[id(error)] = stand_in.with_traceback(error.__traceback__)
        return seen[id(error)]

    return clean(exc)


def _settle(result: Any) -> Any:
    """``result``, awaited with ``asyncio.run`` when it is awaitable (this thread must run no event loop)."""
    import inspect

    if inspect.isawaitable(result):
        import asyncio

        async def _await() -> Any:
            return await result

        result = asyncio.run(_await())
    return result


def _call_agent(agent: Callable[..., Any], envelope: Envelope) -> Any:
    """Call a sync or ``async def`` agent with the envelope bound."""
    with bind_envelope(envelope):
        return _settle(agent(envelope))


async def _acall_agent(agent: Callable[..., Any], envelope: Envelope) -> Any:
    """Call an agent with the envelope bound, on the running loop; every task it starts sees the envelope too."""
    import inspect

    token = _current.set(envelope)  # bind_envelope, without a generator-based context manager per dispatch
    try:
        result = agent(envelope)
        if inspect.isawaitable(result):
            result = await result
        return result
    finally:
        _current.reset(token)


def _is_async_callable(fn: Any) -> bool:
    """``async def`` functions, partials of them and objects whose ``__call__`` is one."""
    import inspect

    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or (callable(fn) and inspect.iscoroutinefunction(fn.__call__))


async def _await_task(start: Callable[[], Coroutine[Any, Any, Any]], timeout_s: float) -> Any:
    """:func:`_on_fresh_thread` for a coroutine: run ``start()`` as a task of this loop (in a copy of this context),
    wait up to ``timeout_s``; its result, :class:`_AgentRaised` with what it raised, or :class:`_Overran` (the
    task cancelled).  Cancelling the waiter cancels the task too."""
    import asyncio

    loop = asyncio.get_running_loop()
    task: asyncio.Task[Any] = loop.create_task(start())
    waiter = loop.create_future()

    def wake(_: Any = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    task.add_done_callback(wake)
    timer = _Deadlines.call_at(loop, loop.time() + timeout_s, wake)
    try:
        await waiter
    except BaseException:
        task.cancel()
        raise
    finally:
        timer.cancel()
    if not task.done():
        task.cancel()
        raise _Overran(f"agent did not finish within run_timeout_s={timeout_s:g} s")
    if task.cancelled():
        raise _AgentRaised(asyncio.CancelledError())
    error = task.exception()
    if error is not None:
        raise _AgentRaised(error)
    return task.result()


async def _await_thread(fn: Callable[[], Any], timeout_s: Optional[float] = None) -> Any:
    """:func:`_on_fresh_thread` awaited: ``fn()`` on a new daemon thread in a copy of this context; its result,
    :class:`_AgentRaised` with what it raised, or :class:`_Overran` after ``timeout_s`` (it runs on)."""
    import asyncio

    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    context = contextvars.copy_context()
    context.run(_server_loop.set, loop)

    def settle(result: Any, error: Optional[BaseException]) -> None:
        if waiter.done():  # timed out, or the awaiting task was cancelled
            return
        if error is None:
            waiter.set_result(result)
        else:
            waiter.set_exception(error)

    def target() -> None:
        try:
            outcome: Tuple[Any, Optional[BaseException]] = (context.run(fn), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            outcome = (None, _AgentRaised(exc))
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=target, name="pipelines-agent", daemon=True).start()
    timer = None
    if timeout_s is not None:
        timer = _Deadlines.call_at(loop, loop.time() + timeout_s, settle, None,
                                   _Overran(f"agent did not finish within run_timeout_s={timeout_s:g} s"))
    try:
        return await waiter
    finally:
        if timer is not None:
            timer.cancel()


def _without_run_token(body: Dict[str, Any], envelope: Envelope, encoded: Optional[bytes] = None) -> Dict[str, Any]:
    """The response body with the run token redacted, should the agent have echoed it (logged once)."""
    encoded = json.dumps(body, ensure_ascii=False).encode("utf-8") if encoded is None else encoded
    if envelope.run_token.encode("utf-8") not in encoded:
        return body
    _log.warning("the agent's response contained the run token; it was redacted")
    return cast(Dict[str, Any], redact(body, envelope.run_token))


# ---------------------------------------------------------------------------
# The dispatch app (§2): decide(), then probe the proxy or run the agent
# ---------------------------------------------------------------------------


class DispatchApp:
    """An agent function and its endpoint settings; :meth:`handle` answers every request (§2).

    An instance is an ASGI3 application; :attr:`wsgi` is its WSGI application.

    ``agent(envelope)`` may be sync or ``async def`` and may return anything
    :func:`build_response` accepts.  Auth (step 1) uses ``token`` or, by
    default, the environment variable ``token_env`` read at each request; it is
    off only with ``no_auth=True``.  ``auth_header`` is ``Authorization``
    (``Bearer <token>``) or a custom header carrying the raw value.
    ``strict`` as for :func:`build_response`; ``proxy_hosts`` (default
    ``PIPELINES_PROXY_ALLOWED_HOSTS``) is the allow-list of proxy hosts a
    dispatch may name (:func:`proxy_host_allowed`).

    Serve it with :func:`serve` / :func:`start_server`, under a WSGI server
    (:attr:`wsgi`) or an ASGI server (:attr:`asgi`): all three call :meth:`handle`.
    """

    def __init__(
        self,
        agent: Callable[[Envelope], Any],
        *,
        path: str = DEFAULT_DISPATCH_PATH,
        token: Optional[str] = None,
        token_env: Optional[str] = DEFAULT_TOKEN_ENV,
        auth_header: str = "Authorization",
        no_auth: bool = False,
        max_body: int = DEFAULT_MAX_BODY_BYTES,
        run_timeout_s: float = DEFAULT_RUN_TIMEOUT_S,
        tools_schema: Union[Sequence[Any], str, os.PathLike[str], None] = None,
        proxy_hosts: Union[Sequence[str], str, None] = None,
        strict: Optional[bool] = None,
    ) -> None:
        if not callable(agent):
            raise TypeError(f"agent must be callable, got {type(agent).__name__}")
        if not path.startswith("/"):
            raise ValueError(f"path must start with '/', got {path!r}")
        if no_auth and token:
            raise ValueError("no_auth=True and a token contradict each other: choose one")
        if not no_auth and not token and not token_env:
            raise ValueError("auth needs a token or a token_env; pass no_auth=True to disable it explicitly")
        check_run_timeout(run_timeout_s)
        if max_body < 1:
            raise ValueError(f"max_body must be a positive number of bytes, got {max_body!r}")
        if not re.fullmatch(r"[A-Za-z0-9-]+", auth_header):
            raise ValueError(f"auth_header must be an HTTP header name, got {auth_header!r}")
        self.agent = agent
        self._agent_kind: Tuple[Any, bool] = (None, False)  # (agent, is async): agent_is_async's cache
        self.token = token
        self.token_env = None if token else token_env
        self.run_timeout_s = float(run_timeout_s)
        self.strict = strict  # None: PIPELINES_PORT_STRICT decides at each response
        # Validated here, served as given: the platform's tooling compares the entries field by field.
        if tools_schema is None or isinstance(tools_schema, (list, tuple)):
            tools = _thaw(list(tools_schema)) if tools_schema is not None else None
        else:
            tools = _read_tools_file(cast("Union[str, os.PathLike[str]]", tools_schema))
        if tools is not None:
            convert_tools(tools, "platform")  # raises ValueError naming the first bad entry
        try:
            if proxy_hosts is None or isinstance(proxy_hosts, str):
                hosts = parse_proxy_hosts(os.environ.get(ENV_PROXY_ALLOWED_HOSTS) if proxy_hosts is None
                                          else proxy_hosts)
            else:
                hosts = parse_proxy_hosts(",".join(proxy_hosts))
        except ValueError as exc:
            source = f"environment variable {ENV_PROXY_ALLOWED_HOSTS}" if proxy_hosts is None else "proxy_hosts"
            raise ValueError(f"{source}: {exc}") from None
        self.endpoint = Endpoint(path=path.rstrip("/") or "/", auth_header=auth_header, token_env=self.token_env,
                                 no_auth=no_auth, max_body=int(max_body), tools_schema=tools, proxy_hosts=hosts)

    @property
    def path(self) -> str:
        return self.endpoint.path

    @property
    def auth_header(self) -> str:
        return self.endpoint.auth_header

    @property
    def no_auth(self) -> bool:
        return self.endpoint.no_auth

    @property
    def max_body(self) -> int:
        return self.endpoint.max_body

    @property
    def tools_schema(self) -> Optional[List[Dict[str, Any]]]:
        return cast(Optional[List[Dict[str, Any]]], self.endpoint.tools_schema)

    def __repr__(self) -> str:
        name = getattr(self.agent, "__name__", self.agent)
        return f"DispatchApp({name!r}, path={self.path!r}, auth={self.describe_auth()!r})"

    def describe_auth(self) -> str:
        """How auth is configured, for a start-up line (never the token)."""
        if self.no_auth:
            return "DISABLED (no_auth): anyone who can reach this endpoint can dispatch"
        value = "Bearer <token>" if self.auth_header.lower() == "authorization" else "<token>"
        source = "the configured token" if self.token else f"${self.token_env}"
        line = f"{self.auth_header}: {value} (token from {source})"
        if self.token_env and not os.environ.get(self.token_env):
            line += f"; {self.token_env} is NOT set: every request gets 503 until it is"
        return line

    def describe_proxy_hosts(self) -> str:
        """Which proxy hosts dispatches may name, for a start-up line."""
        hosts = self.endpoint.proxy_hosts
        if hosts is None:
            return (f"any (no allow-list: set {ENV_PROXY_ALLOWED_HOSTS} or --proxy-hosts in production, or anyone "
                    "holding the agent token can make this server call any address)")
        return ", ".join(hosts) or "none"

    def expected_token(self) -> Optional[str]:
        """The agent token requests must carry, read now (``""`` when its variable is unset; ``None``: no auth)."""
        if self.no_auth:
            return None
        return (self.token or os.environ.get(self.token_env or "") or "").strip()

    # -- the core ---------------------------------------------------------------

    def handle(self, method: str, target: str, headers: HeadersLike, body: Optional[bytes]) -> HttpReply:
        """The reply to one request: :func:`decide`, then the probe or the agent run it asks for.

        ``body`` is what :func:`request_body_length` allowed the adapter to read
        (``None``: nothing).  Writes one log line per request (ids, status,
        duration, proxy calls; never a token); health probes and pings at DEBUG.
        The agent runs on a thread of its own (an ``async def`` one on a loop of its own there).
        """
        started = time.monotonic()
        headers = _lower_headers(headers)
        return self.carry_out(self.decide(method, target, headers, body), method, target, headers, started)

    async def ahandle(self, method: str, target: str, headers: HeadersLike, body: Optional[bytes]) -> HttpReply:
        """The asyncio form of :meth:`handle`: an ``async def`` agent runs on the running loop, a sync one on a
        thread of its own; the probe uses the asyncio driver."""
        started = time.monotonic()
        headers = _lower_headers(headers)
        return await self.acarry_out(self.decide(method, target, headers, body), method, target, headers, started)

    def decide(self, method: str, target: str, headers: HeadersLike, body: Optional[bytes]) -> Decision:
        """:func:`decide` with this app's endpoint and its token as configured now."""
        return decide(self.endpoint, method, target, headers, body, expected_token=self.expected_token())

    def carry_out(self, decision: Decision, method: str, target: str, headers: Mapping[str, str],
                  started: float) -> HttpReply:
        """Do what ``decision`` asks (reply, probe, run the agent) and log the request."""
        stats = _DispatchStats()
        if decision.action == "run":
            assert decision.envelope is not None
            reply = self.run_agent(decision.envelope, stats)
        elif decision.action == "probe":
            assert decision.proxy_url is not None
            reply = self.connectivity_check(decision.proxy_url)
        else:
            assert decision.reply is not None
            reply = decision.reply
        self._log_request(decision, reply, method, target, headers, started, stats)
        return reply

    async def acarry_out(self, decision: Decision, method: str, target: str, headers: Mapping[str, str],
                         started: float) -> HttpReply:
        """The asyncio form of :meth:`carry_out`."""
        stats = _DispatchStats()
        if decision.action == "run":
            assert decision.envelope is not None
            reply = await self.arun_agent(decision.envelope, stats)
        elif decision.action == "probe":
            assert decision.proxy_url is not None
            reply = await self.aconnectivity_check(decision.proxy_url)
        else:
            assert decision.reply is not None
            reply = decision.reply
        self._log_request(decision, reply, method, target, headers, started, stats)
        return reply

    def _log_request(self, decision: Decision, reply: HttpReply, method: str, target: str,
                     headers: Mapping[str, str], started: float, stats: _DispatchStats) -> None:
        what = decision.what
        # Health probes and accepted pings come often and mean little: DEBUG, so they neither
        # flood the log nor queue every handler thread on the log's lock.
        level = logging.DEBUG if what in ("health", "ping") and reply.status < 400 else logging.INFO
        if not _access_log.isEnabledFor(level):
            return
        envelope = decision.envelope
        if envelope is not None:
            ids: Tuple[Any, ...] = (envelope.run_id, envelope.task_id, envelope.run_token_jti)
        else:
            ids = (_header(headers, HEADER_RUN_ID), _header(headers, HEADER_TASK_ID),
                   _header(headers, HEADER_RUN_TOKEN_JTI))
        if what != "dispatch" and reply.status >= 400:
            what = "rejected: " + str(json.loads(reply.body).get("detail", ""))[:200]
        _access_log.log(level, "%s %s status=%d run_id=%s task_id=%s jti=%s duration_ms=%.1f proxy_calls=%d%s",
                 method, urlsplit(target).path, reply.status, *ids, (time.monotonic() - started) * 1000,
                 stats.proxy_calls, "" if what == "dispatch" else f" ({what})")

    def connectivity_check(self, proxy_url: str) -> HttpReply:
        """§2 step 4: probe the proxy with a fake bearer (§3.7); never runs user code.

        Without a proxy-host allow-list the answer says only whether a proxy answered (§7.1
        kit-proxy-host-allow-list): what else a probe met (a refused port, another service's status) would
        let a token holder map the server's network."""
        return json_reply(200, {"ok": True, "outbound": self._outbound(probe_proxy(proxy_url))})

    async def aconnectivity_check(self, proxy_url: str) -> HttpReply:
        """The asyncio form of :meth:`connectivity_check`."""
        return json_reply(200, {"ok": True, "outbound": self._outbound(await aprobe_proxy(proxy_url))})

    def _outbound(self, probe: Dict[str, Any]) -> Dict[str, Any]:
        if self.endpoint.proxy_hosts is not None or probe["reachable"]:
            return probe
        return {"reachable": False, "status_code": None, "latency_ms": None,
                "error": "no proxy answered at this URL (details are given only with a proxy-host allow-list)"}

    @property
    def agent_is_async(self) -> bool:
        """Whether the agent is an ``async def`` function (or a callable whose ``__call__`` is one)."""
        agent, known = self._agent_kind
        if agent is not self.agent:  # first asked, or the agent was replaced since: inspect it (once per agent)
            agent, known = self._agent_kind = (self.agent, _is_async_callable(self.agent))
        return known

    def run_agent(self, envelope: Envelope, stats: Optional[_DispatchStats] = None) -> HttpReply:
        """Run the agent on ``envelope`` within ``run_timeout_s`` on a thread of its own; the response envelope
        or the error reply.  An ``async def`` agent gets an event loop of its own on that thread."""
        stats = _DispatchStats() if stats is None else stats
        bound = _dispatch_stats.set(stats)
        try:
            result = _on_fresh_thread(functools.partial(_call_agent, self.agent, envelope), self.run_timeout_s,
                                      wrap=True)
        except (_Overran, _AgentRaised, ResponseError) as failed:
            return self._failed(failed, envelope, stats)
        finally:
            _dispatch_stats.reset(bound)
        return self._respond(result, envelope)

    async def arun_agent(self, envelope: Envelope, stats: Optional[_DispatchStats] = None) -> HttpReply:
        """The asyncio form of :meth:`run_agent`: an ``async def`` agent runs as a task on this loop (every dispatch
        on the one loop, so clients a framework shares across runs work), a sync one on a thread of its own, whose
        proxy exchanges run on this loop while the thread waits (:meth:`ProxyClient.exchange`).

        Cancelled (a server shutting down), the run is cut: the agent's task is cancelled with it, its further
        proxy calls refused, and the cut logged.
        """
        stats = _DispatchStats() if stats is None else stats
        bound = _dispatch_stats.set(stats)
        try:
            if self.agent_is_async:
                result = await _await_task(functools.partial(_acall_agent, self.agent, envelope), self.run_timeout_s)
            else:
                result = await _await_thread(functools.partial(_call_agent, self.agent, envelope), self.run_timeout_s)
        except (_Overran, _AgentRaised) as failed:
            return self._failed(failed, envelope, stats)
        except BaseException:  # this dispatch itself was cancelled: the run is cut short
            stats.cancelled = True
            _log.warning("run %s (jti %s) was cut before it finished: the server is shutting down; its further "
                         "proxy calls are refused", envelope.run_id, envelope.run_token_jti)
            raise
        finally:
            _dispatch_stats.reset(bound)
        return self._respond(result, envelope)

    def _respond(self, result: Any, envelope: Envelope) -> HttpReply:
        """The 200 reply for what the agent returned, its run token redacted; 500 when it cannot become one."""
        try:
            body = _built(result, strict=self.strict, secrets=self.secrets(envelope), multi_turn=envelope.is_multi_turn)
            reply = json_reply(200, body)
            clean = _without_run_token(body, envelope, reply.body)
            return reply if clean is body else json_reply(200, clean)
        except Exception as exc:  # noqa: BLE001 - a result that cannot become a response is a 500, never a crash
            return self._failed(exc, envelope, None)

    def _failed(self, failed: BaseException, envelope: Envelope, stats: Optional[_DispatchStats]) -> HttpReply:
        """The one error path of a run: 504 for an overrun, 500 for an unbuildable result or a raising agent."""
        if isinstance(failed, _Overran):
            if stats is not None:
                stats.cancelled = True  # its further proxy calls are refused before each attempt
            _log.error("run %s: the agent did not finish within run_timeout_s=%g s; answering 504 and refusing its "
                       "further proxy calls", envelope.run_id, self.run_timeout_s)
            return error_reply(failed)
        if isinstance(failed, ResponseError):
            return error_reply(ResponseError(self.redact(
                f"agent returned a value that cannot become a response: {failed}", envelope)))
        import traceback

        error = failed.error if isinstance(failed, _AgentRaised) else failed
        trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        _log.error("run %s: the agent raised:\n%s", envelope.run_id, self.redact(trace, envelope))
        return error_reply(AgentError(describe_error(error, DETAIL_LIMIT, *self.secrets(envelope))))

    def secrets(self, envelope: Optional[Envelope]) -> Tuple[Optional[str], Optional[str]]:
        """The run token and the agent token: what no reply or log line may show."""
        return (envelope.run_token if envelope is not None else None,
                self.token or os.environ.get(self.token_env or ""))

    def redact(self, text: str, envelope: Optional[Envelope]) -> str:
        """``text`` without the run token or the agent token (an agent's error may quote either)."""
        return cast(str, redact(text, *self.secrets(envelope)))

    # -- adapters (below: the server adapters section) ------------------------------

    def wsgi(self, environ: Dict[str, Any], start_response: Callable[..., Any]) -> List[bytes]:
        """The WSGI application (PEP 3333): ``application = DispatchApp(agent).wsgi`` for gunicorn & co."""
        return _wsgi(self, environ, start_response)

    async def __call__(self, scope: Dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        """The app is itself an ASGI3 application (HTTP and lifespan): ``app = DispatchApp(agent)`` for uvicorn & co."""
        await _asgi(self, scope, receive, send)

    @property
    def asgi(self) -> Callable[..., Any]:
        """The ASGI3 application as a plain ``async def`` function (servers' interface detection takes it as ASGI3)."""
        app = self

        async def asgi(scope: Dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
            await _asgi(app, scope, receive, send)

        return asgi


def probe_proxy(proxy_url: str, *, timeout: float = 10.0) -> Dict[str, Any]:
    """§3.7 reachability probe: ``{reachable, status_code, latency_ms, error}``.

    POSTs ``{}`` to ``{proxy_url}/tools/__reachability_probe__`` with a fake
    bearer: 401/403 (or 2xx) means reachable; a connection or DNS error means
    egress is blocked.  Never raises.
    """
    started = time.monotonic()
    try:
        request = _probe_request(proxy_url)
        status, _, _ = _shared_transport().exchange(request.url, "POST", request.path, request.headers, request.body,
                                                    timeout, 64 << 10)
    except (_TransportFailure, EnvelopeError, _ReplyTooLarge) as failure:
        return _probe_failed(failure, started)
    return _probe_result(status, started)


async def aprobe_proxy(proxy_url: str, *, timeout: float = 10.0) -> Dict[str, Any]:
    """The asyncio form of :func:`probe_proxy`."""
    started = time.monotonic()
    try:
        request = _probe_request(proxy_url)
        status, _, _ = await _shared_atransport().exchange(request.url, "POST", request.path, request.headers,
                                                           request.body, timeout, 64 << 10)
    except (_TransportFailure, EnvelopeError, _ReplyTooLarge) as failure:
        return _probe_failed(failure, started)
    return _probe_result(status, started)


def _probe_request(proxy_url: str) -> ProxyRequest:
    request = proxy_request(validate_proxy_url(proxy_url, "the probe"), "fake-token", "tools", _PROBE_TOOL, b"{}")
    del request.headers["Idempotency-Key"], request.headers["Accept"]
    return request


def _probe_result(status: int, started: float) -> Dict[str, Any]:
    reachable = status in (401, 403) or 200 <= status < 300
    return {"reachable": reachable, "status_code": status, "latency_ms": round((time.monotonic() - started) * 1000, 1),
            "error": None if reachable else f"unexpected HTTP {status} from the proxy"}


def _probe_failed(failure: BaseException, started: float) -> Dict[str, Any]:
    cause = (failure.__cause__ or failure) if isinstance(failure, _TransportFailure) else failure
    return {"reachable": False, "status_code": getattr(failure, "status", None),
            "latency_ms": round((time.monotonic() - started) * 1000, 1), "error": describe_error(cause, 200)}


def wsgi_app(agent: Callable[[Envelope], Any], **options: Any) -> Callable[..., List[bytes]]:
    """A WSGI application for ``agent``; ``options`` as for :class:`DispatchApp`."""
    return DispatchApp(agent, **options).wsgi


def asgi_app(agent: Callable[[Envelope], Any], **options: Any) -> Callable[..., Any]:
    """An ASGI application for ``agent``; ``options`` as for :class:`DispatchApp`."""
    return DispatchApp(agent, **options).asgi


# ---------------------------------------------------------------------------
# Server adapters: the built-in servers' settings; WSGI and ASGI, each a thin
# layer over DispatchApp (read the body request_body_length allows, decide, answer)
# ---------------------------------------------------------------------------

DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_GRACE_S = 30.0
DEFAULT_KEEPALIVE_S = 75.0  # nginx's: above the pool expiry of common clients, so a reused connection is still open
# serve()'s first-generation GC threshold (CPython's is 700).  A fan-out keeps thousands of dispatches alive for
# seconds; at 700 the collector rescans them hundreds of times (2,000 at once: a quarter of the server's CPU).
SERVE_GC_THRESHOLD = 50_000


def _read_exactly(read: Callable[[int], bytes], length: int) -> bytes:
    """Up to ``length`` bytes from a stream that may return short reads; fewer only at EOF."""
    chunks, remaining = [], length
    while remaining > 0:
        chunk = read(min(remaining, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _server_url(address: Tuple[Any, ...], path: str) -> str:
    """The URL of a listening server's dispatch path, an IPv6 host in brackets."""
    host, port = str(address[0]), address[1]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{path}"


@functools.lru_cache(maxsize=64)
def _reason(status: int) -> str:
    """The reason phrase for ``status`` (``Unknown`` for codes outside the registry)."""
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _wsgi(app: DispatchApp, environ: Dict[str, Any], start_response: Callable[..., Any]) -> List[bytes]:
    pairs = [(k[5:].replace("_", "-"), v) for k, v in environ.items() if k.startswith("HTTP_")]
    for key, name in (("CONTENT_TYPE", "Content-Type"), ("CONTENT_LENGTH", "Content-Length")):
        if environ.get(key):
            pairs.append((name, environ[key]))
    headers = _lower_headers(pairs)
    length = request_body_length(headers, app.max_body)
    body = _read_exactly(environ["wsgi.input"].read, length) if length else (b"" if length == 0 else None)
    started, method, target = time.monotonic(), environ.get("REQUEST_METHOD", "GET"), environ.get("PATH_INFO") or "/"
    try:
        reply = app.carry_out(app.decide(method, target, headers, body), method, target, headers, started)
    except Exception as exc:  # noqa: BLE001 - the last line of defence: a JSON reply, never the host's text page
        _log.exception("building the reply failed")
        reply = _fallback_reply(exc)
    # No Connection header here: PEP 3333 forbids hop-by-hop headers from a WSGI app (wsgiref refuses them);
    # the WSGI host frames and drains the body itself (gunicorn refuses obs-fold on its own).
    start_response(f"{reply.status} {_reason(reply.status)}", reply.headers)
    return [reply.body]


def _host_reply_headers(reply: HttpReply, decision: Decision, length: Optional[int]) -> List[Tuple[str, str]]:
    """``reply``'s headers for an ASGI host, with ``Connection: close`` when the body was not read or the request
    was refused before any agent ran: the host's framing may differ from what a front end meant (uvicorn and
    hypercorn unfold obs-fold, losing a folded Content-Length), so what it would read next on that connection
    is not trusted to be a request (kit-strict-request-head)."""
    if length is None or (decision.action == "reply" and reply.status >= 400):
        return [*reply.headers, ("Connection", "close")]
    return list(reply.headers)


async def _asgi(app: DispatchApp, scope: Dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
    """HTTP and lifespan scopes, on the host's own loop: an ``async def`` agent runs there as a task (no thread,
    no loop of its own), a sync one on a thread of its own, so a slow agent never blocks the loop."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        raise ValueError(f"DispatchApp.asgi serves http and lifespan scopes, not {scope['type']!r}")
    headers = _lower_headers(scope.get("headers", []))
    length = request_body_length(headers, app.max_body)
    body: Optional[bytes] = None
    if length is not None:
        chunks: List[bytes] = []
        received, more = 0, True
        while more and received < length:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            more = message.get("more_body", False)
        body = b"".join(chunks)
    started, method, target = time.monotonic(), scope["method"], scope.get("path", "/")
    try:
        decision = app.decide(method, target, headers, body)
        reply = await app.acarry_out(decision, method, target, headers, started)
        reply_headers = _host_reply_headers(reply, decision, length)
    except Exception as exc:  # noqa: BLE001 - the last line of defence: a JSON reply, never the host's text page
        _log.exception("building the reply failed")
        reply = _fallback_reply(exc)
        reply_headers = [*reply.headers, ("Connection", "close")]
    await send({"type": "http.response.start", "status": reply.status,
                "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply_headers]})
    await send({"type": "http.response.body", "body": reply.body})


# ---------------------------------------------------------------------------
# The http.server server: a thread per connection, its classes built on first use
# ---------------------------------------------------------------------------

if TYPE_CHECKING:
    from http.server import BaseHTTPRequestHandler as _HandlerBase
    from http.server import ThreadingHTTPServer as _ServerBase
else:  # http.server's classes join these parts on first use (_make_server_classes): importing it costs time
    _HandlerBase = _ServerBase = object


class _DrainingServer(_ServerBase):
    """What the ``http.server`` dispatch server adds to ``ThreadingHTTPServer``: one :class:`DispatchApp`, the
    requests in flight, and a graceful drain that answers 503 to those its grace period cuts."""

    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    request_queue_size = 4096  # socketserver's 5 resets connections in a burst (the kernel caps it at somaxconn)
    handler_class: type  # the request handler, joined with it in _make_server_classes

    def __init__(self, address: Tuple[str, int], app: DispatchApp, read_timeout_s: float) -> None:
        self.app = app
        self.read_timeout_s = read_timeout_s
        self.draining = threading.Event()
        self._in_flight = 0
        self._handlers: Set[Any] = set()  # the handlers of the requests being handled now
        self._idle = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        super().__init__(address, self.handler_class)

    @property
    def url(self) -> str:
        return _server_url(self.server_address, self.app.path)

    @property
    def in_flight(self) -> int:
        """Requests being handled now."""
        return self._in_flight

    def enter(self, handler: Any) -> bool:
        with self._idle:
            if self.draining.is_set():
                return False
            self._in_flight += 1
            self._handlers.add(handler)
            return True

    def leave(self, handler: Any) -> None:
        with self._idle:
            self._in_flight -= 1
            self._handlers.discard(handler)
            self._idle.notify_all()

    def drain(self, grace_s: float) -> bool:
        """Refuse new dispatches, wait up to ``grace_s`` for in-flight ones; True if all finished.  Those
        still running then are answered 503 (retryable) and their connections closed."""
        self.draining.set()
        deadline = time.monotonic() + grace_s
        with self._idle:
            while self._in_flight > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._idle.wait(left)
            cut = list(self._handlers)
        if not cut:
            return True
        _log.warning("grace period of %g s over with %d dispatches still running: answering each 503",
                     grace_s, len(cut))
        for handler in cut:
            _log.warning("%s was cut before it finished: the server is shutting down",
                         _run_label(*handler.request_info))
            handler.cut()
        return False

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        if self.socket.fileno() < 0:  # closed before it served: nothing to serve
            return
        super().serve_forever(poll_interval)

    def close(self, grace_s: float = 5.0) -> bool:
        """Stop accepting, let in-flight dispatches finish within ``grace_s``, close the socket."""
        self.draining.set()
        if self._thread is not None:
            self.shutdown()
        self.server_close()  # new connections are refused at once, not queued until the grace period ends
        return self.drain(grace_s)

    def handle_error(self, request: Any, client_address: Any) -> None:
        _log.debug("connection from %s ended with an error", client_address[0], exc_info=True)


class _DispatchRequests(_HandlerBase):
    """What the ``http.server`` request handler adds to ``BaseHTTPRequestHandler``: heads read strictly
    (:meth:`parse_request`), every method served by :meth:`_serve` through the server's :class:`DispatchApp`,
    replies written by one writer at a time so a drain's 503 and the agent's late reply never mix."""

    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.1"  # a refusal before the version is read still gets a status line
    server_version = "pipelines-port/" + __version__
    sys_version = ""
    server: _DrainingServer  # pyright: ignore[reportIncompatibleVariableOverride]
    run_label = ""  # "run 17" once a dispatch's body is read, for the log when a drain cuts it
    _cut = False  # answered 503 by a drain whose grace ran out: the agent's late reply is dropped
    wbufsize = -1  # buffered: a reply's headers and body leave in one send, not two

    # -- the request head -----------------------------------------------------

    def parse_request(self) -> bool:
        """The head read strictly by :func:`parse_request_head` (kit-strict-request-head), not http.server's
        lenient parser: a refusal is a JSON reply with ``Connection: close``."""
        import email.message

        self.command, self.request_version = "", self.default_request_version
        line: bytes = getattr(self, "raw_requestline", b"")  # set by handle_one_request
        self.requestline = line.decode("latin-1").rstrip("\r\n")  # what send_response logs
        try:
            raw = self._head_after(line)
            if raw is None:  # the client went away mid-head
                self.close_connection = True
                return False
            head = _well_formed_head(raw) or parse_request_head(raw)
        except PipelinesError as exc:
            self._send(error_reply(exc), close=True)
            return False
        self.command, self.path, self.request_version = head.method, head.target, head.version
        self.requestline = f"{head.method} {head.target} {head.version}"
        self.headers = email.message.Message()
        for name, value in head.headers:
            self.headers[name] = value
        self.close_connection = not head.keep_alive()
        if self.headers.get("Expect", "").lower() == "100-continue":
            return self.handle_expect_100()
        return True

    def _head_after(self, line: bytes) -> Optional[bytes]:
        """The whole head, from its first ``line`` (already read) up to the empty line after the request line, without
        the final CRLF CRLF; ``None`` when the client goes away first.  Over :data:`MAX_REQUEST_HEAD_BYTES`, or
        ending in a bare LF, it is refused."""
        lines, size = [line], len(line)
        started = bool(line.strip(b"\r\n"))
        while not started or line.strip(b"\r\n"):
            line = self.rfile.readline(MAX_REQUEST_HEAD_BYTES + 1)
            size += len(line)
            if not line:
                return None
            if size > MAX_REQUEST_HEAD_BYTES:
                raise HeadersTooLargeError(f"request head is over {MAX_REQUEST_HEAD_BYTES} bytes")
            started = started or bool(line.strip(b"\r\n"))
            lines.append(line)
        if line != b"\r\n":
            raise FramingError("the request head ends in a bare LF: every line must end in CRLF (RFC 9112 §2.2)")
        return b"".join(lines)[:-4]

    def handle_expect_100(self) -> bool:
        super().handle_expect_100()
        self.wfile.flush()  # the interim 100 Continue must leave now: the client waits for it to send the body
        return True

    # -- the connection ---------------------------------------------------------

    def setup(self) -> None:
        import socket

        self.reply_lock = threading.Lock()
        self.request_info: Tuple[Dict[str, str], Optional[bytes]] = ({}, None)
        super().setup()
        self.connection.settimeout(self.server.read_timeout_s)  # slow or truncated clients cannot hold a worker
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("%s %s", self.address_string(), format % args)

    # -- every method: one path through the DispatchApp -----------------------------------

    def do_GET(self) -> None:
        self._serve()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_TRACE = do_CONNECT = do_GET

    def _serve(self) -> None:
        app = self.server.app
        if not self.server.enter(self):
            self._send(error_reply(ShuttingDownError("server is shutting down: retry on another instance")),
                       close=True)
            return
        try:
            headers = _lower_headers(self.headers.items())
            length = request_body_length(headers, app.max_body)
            # A body that cannot be read (chunked, unreadable or oversized length) is not read: the
            # connection closes after the reply rather than parse that body as the next request.
            close = self.server.draining.is_set() or length is None
            body: Optional[bytes] = None
            if length is not None:
                body = self._body(length)
                if body is None:  # a client too slow or gone
                    return
                close = close or len(body) < length
            self.request_info = (headers, body)
            try:
                reply = app.handle(self.command, self.path, headers, body)
            except Exception as exc:  # noqa: BLE001 - the last line of defence: a JSON reply, never a dropped socket
                _log.exception("building the reply failed")
                reply, close = _fallback_reply(exc), True
            self._send(reply, close=close)
        finally:
            self.server.leave(self)

    def _body(self, length: int) -> Optional[bytes]:
        """Up to ``length`` body bytes, all within the read timeout however slowly they come (the watchdog shuts
        the socket after it); ``None`` when the client is too slow or gone: the connection then closes."""
        watch = _watchdog().watch(self.connection, self.server.read_timeout_s)
        try:
            return _read_exactly(self.rfile.read, length)
        except (OSError, ValueError):  # the watchdog may have shut the socket
            self.close_connection = True
            return None
        finally:
            if _watchdog().done(watch):
                self.close_connection = True

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        """http.server's own refusals (a bad request line, 414, 431, an unknown method) as JSON, like ours."""
        from http import HTTPStatus

        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "Error"
        detail = f"{phrase}: {message}" if message and message != phrase else phrase
        self._send(json_reply(code, {"detail": detail}), close=True)

    # -- replies: one writer at a time ----------------------------------------------------

    def _send(self, reply: HttpReply, *, close: bool = False) -> None:
        with self.reply_lock:
            if not self._cut:
                self._write(reply, close)

    def cut(self) -> None:
        """From the draining thread: answer 503 now (if nothing was sent yet), close, drop any later reply."""
        import socket

        with self.reply_lock:
            if self._cut:
                return
            self._cut = True
            self._write(error_reply(ShuttingDownError("the server shut down before this dispatch finished: "
                                                      "retry it")), True)
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

    def _write(self, reply: HttpReply, close: bool) -> None:
        self.send_response(reply.status)
        for name, value in reply.headers:
            self.send_header(name, value)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        try:
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(reply.body)
            self.wfile.flush()
        except OSError:
            self.close_connection = True


def _make_server_classes() -> Tuple[type, type]:
    """The ``http.server`` dispatch server and its request handler: the parts above joined with ``http.server``'s
    own classes on first use, so importing this module does not import ``http.server``."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class DispatchHandler(_DispatchRequests, BaseHTTPRequestHandler):  # pyright: ignore[reportIncompatibleVariableOverride]
        """One client connection of the ``http.server`` dispatch server."""

    class DispatchServer(_DrainingServer, ThreadingHTTPServer):
        """A threading HTTP/1.1 server over one :class:`DispatchApp`, with graceful shutdown."""

        handler_class = DispatchHandler

    return DispatchServer, DispatchHandler


_server_classes = _Once(_make_server_classes)


def _run_label(headers: Mapping[str, str], body: Optional[bytes]) -> str:
    """``run 17`` for the log, from a dispatch's body or its ``X-Pipelines-Run-Id``; ``a request`` otherwise."""
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        payload = None
    run_id = payload.get("run_id") if isinstance(payload, dict) else None
    if run_id is None:
        run_id = headers.get(HEADER_RUN_ID)
    return f"run {_short(str(run_id), 40)}" if run_id is not None else "a request"


# ---------------------------------------------------------------------------
# The asyncio server: one event loop, a protocol per connection
# ---------------------------------------------------------------------------

def default_max_connections() -> int:
    """Open connections the built-in server takes at most: 10,000, or half the process's file limit if lower
    (every dispatch needs its inbound connection and its proxy connections)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # no resource module (Windows)
        return 1000
    if soft == resource.RLIM_INFINITY:
        return 10_000
    return max(16, min(10_000, (soft - 32) // 2))


def _raise_file_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit (at most 65536), as servers do."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ImportError, OSError, ValueError):
        pass


def _tune_gc(threshold: int) -> None:
    """Freeze what is loaded (the agent, its imports: never garbage, never rescanned) and collect the first
    generation only every ``threshold`` allocations, unless the collector is off or already rarer."""
    import gc

    if threshold <= 0 or not gc.isenabled():
        return
    gc.freeze()
    first, *rest = gc.get_threshold()
    if 0 < first < threshold:
        gc.set_threshold(threshold, *rest)


_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


@functools.lru_cache(maxsize=4)
def _http_date_at(second: int) -> str:
    """The ``Date`` header value (RFC 9110 §5.6.7) for one second since the epoch."""
    t = time.gmtime(second)
    return (f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year} "
            f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT")


def _reply_bytes(reply: HttpReply, *, close: bool, keep_alive: bool = False, head_only: bool = False) -> bytes:
    """``reply`` as HTTP/1.1 bytes: status line, ``Server``, ``Date``, its headers, ``Connection`` when it matters."""
    reason = _reason(reply.status)
    lines = [f"HTTP/1.1 {reply.status} {reason}\r\nServer: pipelines-port/{__version__}\r\n",
             f"Date: {_http_date_at(int(time.time()))}\r\n"]
    lines.extend(f"{name}: {value}\r\n" for name, value in reply.headers)
    if close:
        lines.append("Connection: close\r\n")
    elif keep_alive:
        lines.append("Connection: keep-alive\r\n")
    lines.append("\r\n")
    head = "".join(lines).encode("latin-1")
    return head if head_only else head + reply.body


def _fallback_reply(exc: BaseException) -> HttpReply:
    """The last line of defence: a JSON 500 naming only the exception's type, when building a reply failed."""
    name = type(exc).__name__.encode("ascii", "replace")
    body = b'{"detail":"internal error while building the reply: ' + name + b'"}'
    return HttpReply(500, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))], body)


class _ServerConnection:
    """One client connection of :class:`AsyncDispatchServer`, as an asyncio protocol.

    One request at a time: its head (:func:`parse_request_head`), then the body :func:`request_body_length`
    allows, all within ``read_timeout_s`` of its first byte.  A decided refusal is answered at once; a dispatch
    or probe runs as a task while reading goes on (a client that leaves is seen), pausing only once more than
    ``MAX_REQUEST_HEAD_BYTES`` of pipelined bytes wait: no pause and resume per dispatch.  The connection
    closes after a framing refusal, on ``Connection: close``, after ``keepalive_s`` idle, and when the server
    drains.
    """

    __slots__ = ("server", "transport", "buffer", "head", "headers", "length", "task", "timer", "closing", "eof")

    def __init__(self, server: AsyncDispatchServer) -> None:
        self.server = server
        self.transport: Any = None
        self.buffer = bytearray()
        self.head: Optional[RequestHead] = None
        self.headers: Dict[str, str] = {}
        self.length: Optional[int] = 0
        self.task: Any = None
        self.timer: Any = None
        self.closing = False
        self.eof = False

    # -- the asyncio protocol ------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        server = self.server
        server.connections.add(self)
        if len(server.connections) > server.max_connections:
            self._send(error_reply(OverloadedError(f"this server is at its limit of {server.max_connections} open "
                                                   "connections: retry shortly")), close=True)
            return
        self._arm(server.read_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.buffer += data
        if self.task is None:
            self._advance()
        elif len(self.buffer) > MAX_REQUEST_HEAD_BYTES:  # pipelined bytes while a dispatch runs: enough for now
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        # The client sent all it will send: a running dispatch still gets its reply, a body cut short gets its
        # 400 (decide names the truncation), then the connection closes.
        self.eof = True
        if self.task is None and self.head is not None and not self.closing:
            head, self.head = self.head, None
            body = None if self.length is None else bytes(self.buffer[:self.length])
            self.buffer.clear()
            self._start(head, body)
        if self.task is not None:
            return True
        self.closing = True
        return False

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self.closing = True
        self.server.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        # A running dispatch finishes (a thread cannot be stopped, and the run's tool calls are real); its reply
        # has nowhere to go.

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        pass

    # -- reading requests ------------------------------------------------------

    def _advance(self) -> None:
        """Read as far as the buffer goes; start at most one request."""
        buffer = self.buffer
        while self.task is None and not self.closing:
            if self.head is None:
                while buffer[:2] == b"\r\n":  # empty lines before a request line (RFC 9112 §2.2)
                    del buffer[:2]
                if not buffer:
                    return
                if self.timer is None or self.timer.when() > self.server.loop.time() + self.server.read_timeout_s:
                    self._arm(self.server.read_timeout_s)  # from its first byte, the whole request has read_timeout_s
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    if b"\n\n" in buffer:  # lines ended by a bare LF: refused now, not left to the read timeout
                        self._refuse(FramingError("a line of the request head ends in a bare LF: every line must "
                                                  "end in CRLF (RFC 9112 §2.2)"))
                    elif (len(buffer) > MAX_REQUEST_LINE_BYTES
                          and buffer.find(b"\r\n", 0, MAX_REQUEST_LINE_BYTES + 2) < 0):
                        self._refuse(TargetTooLongError(f"request line is over {MAX_REQUEST_LINE_BYTES} bytes"))
                    elif len(buffer) > MAX_REQUEST_HEAD_BYTES:
                        self._refuse(HeadersTooLargeError(f"request head is over {MAX_REQUEST_HEAD_BYTES} bytes"))
                    return
                raw = bytes(buffer[:end])
                del buffer[:end + 4]
                try:
                    self.head = head = _well_formed_head(raw) or parse_request_head(raw)
                except PipelinesError as exc:
                    self._refuse(exc)
                    return
                self.headers = _lower_headers(head.headers)
                self.length = request_body_length(self.headers, self.server.app.max_body)
                if (self.length and len(buffer) < self.length
                        and self.headers.get("expect", "").lower() == "100-continue"):
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            need = self.length or 0
            if len(buffer) < need:
                return
            body = None if self.length is None else bytes(buffer[:need])
            del buffer[:need]
            head, self.head = self.head, None
            self._start(head, body)

    def _start(self, head: RequestHead, body: Optional[bytes]) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        server = self.server
        close = self.length is None or not head.keep_alive() or self.eof  # an unread body is no next request
        if server.draining:
            self._send(error_reply(ShuttingDownError("server is shutting down: retry on another instance")),
                       close=True)
            return
        self.task = server.loop.create_task(self._run(head, body, close))
        server.tasks.add(self.task)

    async def _run(self, head: RequestHead, body: Optional[bytes], close: bool) -> None:
        import asyncio

        try:
            reply = await self.server.app.ahandle(head.method, head.target, self.headers, body)
        except asyncio.CancelledError:
            if not self.server.cutting:
                raise
            reply, close = error_reply(ShuttingDownError("the server shut down before this dispatch finished: "
                                                         "retry it")), True
        except Exception as exc:  # noqa: BLE001 - the last line of defence: a JSON reply, never a dropped socket
            _log.exception("building the reply failed")
            reply = _fallback_reply(exc)
        finally:
            self.server.tasks.discard(asyncio.current_task())
            self.task = None
        self._send(reply, close=close or self.server.draining or self.eof, head=head)
        if not self.closing:
            self.transport.resume_reading()  # paused if pipelined bytes piled up meanwhile
            self._advance()

    # -- replying ---------------------------------------------------------------

    def _refuse(self, exc: PipelinesError) -> None:
        """A framing refusal: the reply, then the connection closes (what follows cannot be framed)."""
        _log.info("refused a request from %s: %s", self._peer(), exc)
        self._send(error_reply(exc), close=True)

    def _send(self, reply: HttpReply, *, close: bool, head: Optional[RequestHead] = None) -> None:
        if self.closing or self.transport.is_closing():
            self.closing = True
            return
        keep_alive = head is not None and head.version == "HTTP/1.0" and not close
        try:
            data = _reply_bytes(reply, close=close, keep_alive=keep_alive,
                                head_only=head is not None and head.method == "HEAD")
        except Exception as exc:  # noqa: BLE001 - a header that cannot be sent: still a JSON reply
            data, close = _reply_bytes(_fallback_reply(exc), close=True), True
        self.transport.write(data)
        if close:
            self.closing = True
            self.transport.close()  # after what was written has gone out
        elif not self.buffer:
            self._arm(self.server.keepalive_s)

    def _arm(self, seconds: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        server = self.server
        self.timer = server.deadlines.at(server.loop.time() + seconds, self._timed_out)

    def _timed_out(self) -> None:
        self.timer = None
        if self.task is not None or self.closing:
            return
        if self.buffer or self.head is not None:  # a request begun and not finished within read_timeout_s
            self._send(error_reply(RequestTimeoutError(
                f"the request did not arrive whole within {self.server.read_timeout_s:g} s")), close=True)
        else:  # idle: the keep-alive period is over
            self.closing = True
            self.transport.close()

    def cut(self) -> None:
        """Close now if idle or mid-read (draining); a running dispatch is left to the server's grace period."""
        if self.task is None and not self.closing:
            self.closing = True
            self.transport.close()

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return str(peer[0]) if isinstance(peer, tuple) else "a client"


class AsyncDispatchServer:
    """The built-in dispatch server: HTTP/1.1 on one asyncio event loop, standard library only.

    Every connection is a :class:`_ServerConnection`.  An ``async def`` agent runs as a task on the server's
    loop, so every dispatch shares one loop (and what a framework shares across runs); a sync agent runs on a
    thread of its own per dispatch.  Bound when made; :meth:`serve_forever` serves on the calling thread until
    :meth:`close`, which drains: no new requests, running dispatches get ``grace_s``, and those still running
    then are answered 503 (retryable) before their connections close.

    Limits (§7.1 kit-server-timeouts): a request's head and body must arrive within ``read_timeout_s`` of its
    first byte (408 after); an idle keep-alive connection closes after ``keepalive_s``; past
    ``max_connections`` open connections a new one is answered 503 and closed.
    """

    def __init__(self, app: DispatchApp, host: str = "127.0.0.1", port: int = 8080, *,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, keepalive_s: float = DEFAULT_KEEPALIVE_S,
                 max_connections: Optional[int] = None, backlog: int = 4096) -> None:
        import socket

        for name, value in (("read_timeout_s", read_timeout_s), ("keepalive_s", keepalive_s)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.app = app
        self.read_timeout_s = float(read_timeout_s)
        self.keepalive_s = float(keepalive_s)
        self.max_connections = max_connections or default_max_connections()
        self.connections: Set[_ServerConnection] = set()
        self.tasks: Set[Any] = set()
        self.draining = False
        self.cutting = False
        self.loop: Any = None
        self.deadlines: Any = None  # the loop's _Deadlines, once it runs
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=backlog)
        self.server_address: Tuple[Any, ...] = self.socket.getsockname()
        self._backlog = backlog
        self._listener: Any = None
        self._stopped: Any = None
        self._serving = threading.Event()
        self._finished = threading.Event()
        self._closing = False  # close() was called: a serve_forever starting after it returns at once
        self._started = False  # serve_forever began: it closes the socket when it ends
        self._state_lock = threading.Lock()
        self._result: Optional[bool] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return _server_url(self.server_address, self.app.path)

    @property
    def in_flight(self) -> int:
        """Dispatches and probes running now."""
        return len(self.tasks)

    def serve_forever(self, poll_interval: Optional[float] = None) -> None:
        """Serve on this thread (on an event loop of its own) until :meth:`close`."""
        import asyncio

        with self._state_lock:
            if self._closing:
                return
            self._started = True
        try:
            asyncio.run(self._serve())
        finally:
            self.socket.close()
            self._finished.set()

    async def _serve(self) -> None:
        import asyncio

        self.loop = asyncio.get_running_loop()
        self.deadlines = _Deadlines._for(self.loop)
        self._stopped = asyncio.Event()
        self._listener = await self.loop.create_server(lambda: _ServerConnection(self), sock=self.socket,
                                                       backlog=self._backlog)
        with self._state_lock:
            if self._closing:  # close() came while the loop was starting: it found nothing to drain
                self._listener.close()
                return
            self._serving.set()
        await self._stopped.wait()

    def close(self, grace_s: float = 5.0) -> bool:
        """Drain and stop (from any thread but the server's own): True when every running dispatch finished
        within ``grace_s``; those that did not were answered 503 and are logged."""
        import asyncio

        with self._state_lock:  # against _serve: either it is serving and is drained, or it will not serve
            self._closing = True
            serving = self._serving.is_set() and not self._finished.is_set()
            started = self._started
        if self._result is None:
            if serving:
                future = asyncio.run_coroutine_threadsafe(self.aclose(grace_s), self.loop)
                self._result = future.result()
                self._finished.wait(10)
            else:
                self._result = True
                if not started:
                    self.socket.close()
        if self._thread is not None:
            self._thread.join(10)
        return self._result

    def shutdown(self) -> None:
        """Stop serving at once (socketserver's name for it): :meth:`close` with no grace period."""
        self.close(0)

    def server_close(self) -> None:
        self.close(0)

    async def aclose(self, grace_s: float = 5.0) -> bool:
        """:meth:`close` from the server's own loop."""
        import asyncio

        self.draining = True
        self._listener.close()  # new connections are refused at once, not queued for the grace period
        for conn in list(self.connections):
            conn.cut()
        finished = True
        if self.tasks:
            _done, pending = await asyncio.wait(set(self.tasks), timeout=grace_s)
            if pending:
                finished = False
                self.cutting = True
                _log.warning("grace period of %g s over with %d dispatches still running: answering each 503",
                             grace_s, len(pending))
                for task in pending:
                    task.cancel()
                await asyncio.wait(pending, timeout=5)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        self._stopped.set()
        return finished


# ---------------------------------------------------------------------------
# Starting a server: make_server, start_server, serve (signals and the drain)
# ---------------------------------------------------------------------------

def _as_app(agent: Union[DispatchApp, Callable[[Envelope], Any]], options: Dict[str, Any]) -> DispatchApp:
    if isinstance(agent, DispatchApp):
        if options:
            raise TypeError(f"options {sorted(options)} apply when building the app; got an existing DispatchApp")
        return agent
    return DispatchApp(agent, **options)


SERVERS = ("asyncio", "threads")


def make_server(
    agent: Union[DispatchApp, Callable[[Envelope], Any]],
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    server: str = "asyncio",
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    keepalive_s: float = DEFAULT_KEEPALIVE_S,
    max_connections: Optional[int] = None,
    **options: Any,
) -> Any:
    """A bound, not yet serving dispatch server; ``options`` as for :class:`DispatchApp`.

    ``server="asyncio"`` (the default): :class:`AsyncDispatchServer`, every dispatch on one event loop.
    ``server="threads"``: ``http.server``'s ``ThreadingHTTPServer``, a thread per connection.  Both have
    ``.url``, ``.server_address``, ``.serve_forever()`` and ``.close(grace_s)``.
    """
    app = _as_app(agent, options)
    if app.no_auth:
        _log.warning("auth is DISABLED: anyone who can reach this endpoint can dispatch")
    if server == "asyncio":
        return AsyncDispatchServer(app, host, port, read_timeout_s=read_timeout_s, keepalive_s=keepalive_s,
                                   max_connections=max_connections)
    if server == "threads":
        server_class, _ = _server_classes()
        return server_class((host, port), app, read_timeout_s)
    raise ValueError(f"server must be one of {', '.join(SERVERS)}, got {server!r}")


def start_server(agent: Union[DispatchApp, Callable[[Envelope], Any]], *, host: str = "127.0.0.1", port: int = 0,
                 **options: Any) -> Any:
    """Serve on a background thread (tests, notebooks); returns the server: ``.url``, ``.close(grace_s)``.

    ``options`` as for :func:`make_server`."""
    server = make_server(agent, host=host, port=port, **options)
    server._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                      name="pipelines-server", daemon=True)
    server._thread.start()
    return server


def serve(
    agent: Union[DispatchApp, Callable[[Envelope], Any]],
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    grace_s: float = DEFAULT_GRACE_S,
    ready: Optional[Callable[[Any], None]] = None,
    gc_threshold: int = SERVE_GC_THRESHOLD,
    **options: Any,
) -> int:
    """Serve until SIGTERM or SIGINT, then drain: refuse new dispatches, let in-flight ones finish.

    In-flight dispatches get up to ``grace_s`` seconds.  ``ready(server)`` is
    called once listening.  Returns 0 when every dispatch finished, 1 otherwise.
    Like a server's file limit, the process's garbage collector is tuned for serving (see
    :data:`SERVE_GC_THRESHOLD`); ``gc_threshold=0`` leaves it as it is.
    """
    import signal

    _raise_file_limit()  # a thousand dispatches at once need more than the usual 1024 open files
    server = make_server(agent, host=host, port=port, **options)
    _tune_gc(gc_threshold)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    server._thread = thread
    thread.start()
    try:
        if ready is not None:
            ready(server)
        while not stop.wait(0.5):
            pass
        _log.info("shutting down: refusing new dispatches, waiting up to %g s for in-flight ones", grace_s)
        finished = server.close(grace_s)
        if not finished:
            _log.warning("grace period over with dispatches still running; exiting anyway")
        return 0 if finished else 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# ---------------------------------------------------------------------------
# Code mode (§5): one agent function, the sandbox's run() entrypoint
# ---------------------------------------------------------------------------


def run_in_fresh_thread(fn: Callable[..., Any], *args: Any, envelope: Optional[Envelope] = None, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on a new thread and hand back its result or exception.

    For the sandbox, whose Jupyter kernel already runs an event loop on the
    calling thread (``asyncio.run`` raises there).  ``fn`` may be ``async def``:
    it gets ``asyncio.run`` on the new thread.  ``envelope`` (default: the one
    bound here, if any) is bound inside the new thread.  An exception is
    re-raised with its traceback, the envelope's run token redacted from its
    whole chain.
    """
    envelope = envelope if envelope is not None else _current.get()

    def call() -> Any:
        with contextlib.ExitStack() as stack:
            if envelope is not None:
                stack.enter_context(bind_envelope(envelope))
            return _settle(fn(*args, **kwargs))

    try:
        return _on_fresh_thread(call, wrap=True)
    except _AgentRaised as raised:
        error = raised.error
    raise cast(BaseException, _redact_exception_chain(error, envelope.run_token if envelope else None))


def _code_mode_envelope(task_input: Any, proxy_url: Optional[str], run_token: Optional[str]) -> Envelope:
    """The envelope of one ``run()`` call: its arguments, else the sandbox's environment (§5 code-mode-env)."""
    if proxy_url is None and run_token is None and task_input is None:
        return Envelope.from_env()  # the whole run from the environment: PIPELINES_* and the task variable
    env = os.environ
    if proxy_url is None:
        proxy_url = env.get(ENV_PROXY_URL)
        if not (proxy_url or "").strip():
            raise EnvelopeError(f"run() got no proxy_url argument, and environment variable {ENV_PROXY_URL} is not set")
    if run_token is None:
        run_token = env.get(ENV_RUN_TOKEN)
        if not (run_token or "").strip():
            raise EnvelopeError(f"run() got no run_token argument, and environment variable {ENV_RUN_TOKEN} is not set")
    return Envelope.from_run(task_input, proxy_url=cast(str, proxy_url), run_token=cast(str, run_token))


def _code_mode_result(agent: Callable[[Envelope], Any], envelope: Envelope, limit: float) -> Any:
    """What ``agent`` returned for ``envelope``, run on a fresh thread within ``limit`` seconds; else the failure
    :func:`code_mode` names: :class:`RunTimeoutError`, :class:`AgentError`, or the kit's own error as it is, each
    without the run token.  From an overrun or an interrupt on, the agent's further proxy calls are refused."""
    stats = _DispatchStats()
    bound = _dispatch_stats.set(stats)  # copied into the agent's thread: its proxy calls check `cancelled`
    failure: Optional[BaseException] = None
    try:
        return _on_fresh_thread(functools.partial(_call_agent, agent, envelope), limit, wrap=True)
    except _Overran:
        stats.cancelled = True
        failure = RunTimeoutError(f"agent did not finish within run_timeout_s={limit:g} s; its further proxy "
                                  "calls are refused (a thread cannot be stopped: it may still be running)")
    except _AgentRaised as raised:
        error = raised.error
        cleaned = cast(BaseException, _redact_exception_chain(error, envelope.run_token))
        if isinstance(error, PipelinesError) or not isinstance(error, Exception):
            failure = cleaned  # the kit's own errors (a stale run token) and interpreter exits, as they are
        else:
            failure = AgentError(f"agent raised {describe_error(error, DETAIL_LIMIT, envelope.run_token)}")
            failure.__cause__ = cleaned
    except BaseException:  # a kernel interrupt while waiting: the agent runs on, refused from now on
        stats.cancelled = True
        raise
    finally:
        _dispatch_stats.reset(bound)
    raise failure  # outside the except clauses: no implicit context to show the original


def _code_mode_body(result: Any, envelope: Envelope, strict: Optional[bool]) -> Dict[str, Any]:
    """The response body ``run()`` returns for ``result``: built, without the run token, and sure to serialise as
    the JSON and UTF-8 the sandbox sends; else a :class:`ResponseError` without the run token, never a half-built
    dict."""
    try:
        body = _without_run_token(_built(result, strict=strict, secrets=(envelope.run_token,),
                                         multi_turn=envelope.is_multi_turn), envelope)
        json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except ResponseError as exc:
        raise ResponseError([cast(str, redact(p, envelope.run_token)) for p in exc.problems]) from None
    except Exception as exc:  # noqa: BLE001 - the last line of defence: a clear error, never a half-built dict
        raise ResponseError("the response cannot be sent as JSON: "
                            f"{describe_error(exc, DETAIL_LIMIT, envelope.run_token)}") from None
    return body


def code_mode(agent: Callable[[Envelope], Any], *, strict: Optional[bool] = None,
              run_timeout_s: float = DEFAULT_RUN_TIMEOUT_S) -> Callable[..., Dict[str, Any]]:
    """The sandbox entrypoint ``run(task_input, *, proxy_url, run_token) -> dict`` for ``agent`` (§5).

    The same ``agent(envelope)`` function (sync or ``async def``) serves HTTP
    mode.  It runs on a fresh thread with the envelope bound, so it works under
    the kernel's running loop.  The result goes through :func:`build_response`;
    a raising agent gives :class:`AgentError` (original exception chained), a
    :class:`PipelinesError` it raises (a stale run token, say) propagates as it
    is, and a result that cannot become a response gives :class:`ResponseError`,
    never a half-built dict (``strict`` as for :func:`build_response`).  The run
    token is redacted from the returned body, from error messages and from the
    whole chain of a raised exception, as the server does.

    An agent that overruns ``run_timeout_s`` (300 s by default, at most 1800 s,
    as in HTTP mode) gives :class:`RunTimeoutError` naming the limit; so does a
    kernel interrupt, by its own exception.  Either way the abandoned agent's
    further proxy calls are refused, so it cannot act on a run that is over.
    Missing ``proxy_url`` / ``run_token`` arguments are read from the sandbox's
    ``PIPELINES_ODYSSEY_PROXY_URL`` / ``PIPELINES_RUN_TOKEN``; ``run()`` with no
    argument at all reads the whole run from the environment (§7.8 kit-code-mode-env).
    """
    limit = check_run_timeout(run_timeout_s)

    def run(task_input: Optional[Mapping[str, Any]] = None, *, proxy_url: Optional[str] = None,
            run_token: Optional[str] = None) -> Dict[str, Any]:
        envelope = _code_mode_envelope(task_input, proxy_url, run_token)
        return _code_mode_body(_code_mode_result(agent, envelope, limit), envelope, strict)

    run.__name__ = "run"
    run.__qualname__ = "run"
    name = getattr(agent, "__name__", "the agent")
    run.__doc__ = f"Code-mode entrypoint for {name} (built by pipelines_port.code_mode)."
    run.agent = agent  # type: ignore[attr-defined]
    return run

# ###########################################################################
#
#   PART 3 - CONVENIENCES
#
#   Helpers for writing the agent itself, built on parts 1 and 2 and needed
#   by neither: agent-loop helpers (tool formats, concurrent tool calls,
#   bounded output, a retrying JSON client for model APIs), tools from code
#   (JSON Schema from type hints), framework bridges and the MCP shim; last,
#   the command line (``serve``, ``mcp``), which uses all three parts.  The
#   dispatch app uses only ``convert_tools`` / ``load_tools_schema`` from here.
#
# ###########################################################################


# ---------------------------------------------------------------------------
# Agent-loop helpers: tool formats (§3.6), concurrent tool calls, bounded
# output, and a retrying JSON client for model APIs
# ---------------------------------------------------------------------------

TOOL_FORMATS = ("platform", "openai_chat", "openai_responses", "anthropic")


def _tool_parts(entry: Any, index: int) -> Tuple[str, str, Dict[str, Any]]:
    """``(name, description, input_schema)`` of one tool in any accepted shape (§3.6).

    Platform ``{name, description?, input_schema}``, the Import-JSON shapes
    ``{name, description, parameters}`` (OpenAI) and ``{name, description,
    input_schema}`` (Anthropic), and Chat Completions' ``{type: function, function: {...}}``.
    """
    if isinstance(entry, Mapping) and isinstance(entry.get("function"), Mapping):
        entry = entry["function"]
    if not isinstance(entry, Mapping):
        raise ValueError(f"tools[{index}]: must be an object, got {json_type(entry)}")
    name = entry.get("name")
    if not isinstance(name, str) or not TOOL_NAME_RE.fullmatch(name):
        raise ValueError(f"tools[{index}].name: {_short(repr(name), 60)} must match ^[A-Za-z_][A-Za-z0-9_-]{{0,127}}$")
    schema = entry.get("input_schema", entry.get("parameters"))
    if schema is None:
        schema = {"type": "object", "properties": {}}
    if not isinstance(schema, Mapping):
        raise ValueError(f"tools[{index}] ({name}): input_schema must be a JSON Schema object")
    description = entry.get("description") or ""
    return name, str(description), _thaw(schema)


def convert_tools(tools: Iterable[Any], to: str) -> List[Dict[str, Any]]:
    """A tool list in another API's format: ``platform``, ``openai_chat``, ``openai_responses`` or ``anthropic``.

    Accepts any shape :func:`load_tools_schema` accepts; raises ``ValueError``
    naming the first bad entry or a duplicate name.
    """
    if to not in TOOL_FORMATS:
        raise ValueError(f"unknown tool format {to!r}: expected one of {', '.join(TOOL_FORMATS)}")
    out: List[Dict[str, Any]] = []
    seen: Set[str] = set()
    for i, entry in enumerate(tools):
        name, description, schema = _tool_parts(entry, i)
        if name in seen:
            raise ValueError(f"tools[{i}].name: {name!r} is declared twice; tool names are unique per agent")
        if to != "platform" and len(name) > 64:
            raise ValueError(f"tools[{i}].name: {name!r} is {len(name)} characters; the platform allows 128, but "
                             "OpenAI and Anthropic tool names are at most 64: shorten it")
        seen.add(name)
        if to == "platform":
            tool: Dict[str, Any] = {"name": name, "description": description, "input_schema": schema}
            for key in ("output_schema", "default_execution_mode", "passthrough_binding"):
                if isinstance(entry, Mapping) and key in entry:
                    tool[key] = _thaw(entry[key])
        elif to == "openai_chat":
            tool = {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}
        elif to == "openai_responses":
            # strict false said out loud: the Responses API defaults function tools to strict mode, which
            # rewrites the schema so every property is required (the model could no longer omit one).
            tool = {"type": "function", "name": name, "description": description, "parameters": schema,
                    "strict": False}
        else:
            tool = {"name": name, "description": description, "input_schema": schema}
        out.append(tool)
    return out


def load_tools_schema(source: Union[str, os.PathLike[str], None] = None) -> List[Dict[str, Any]]:
    """The tool list in the platform's shape, from a JSON file or the environment (§3.6).

    ``source`` is a path to a JSON list (or ``{"tools": [...]}`` / ``{"tools_schema": [...]}``);
    with no source, ``PIPELINES_TOOLS_SCHEMA_B64`` or ``PIPELINES_TOOLS_SCHEMA_JSON``.
    Raises ``ValueError`` naming the file and the problem.
    """
    if source is None:
        tools = _tools_schema_from_env(os.environ)
        where = "the environment"
        if tools is None:
            raise ValueError(f"no tools schema: set {ENV_TOOLS_SCHEMA_B64} or {ENV_TOOLS_SCHEMA_JSON}, or pass a file")
    else:
        where = os.fspath(source)
        tools = _read_tools_file(source)
    try:
        return convert_tools(tools, "platform")
    except ValueError as exc:
        raise ValueError(f"tools schema {where}: {exc}") from None


def _read_tools_file(source: Union[str, os.PathLike[str]]) -> List[Any]:
    """The tool entries of a JSON file, as written; ``ValueError`` naming the file when it has none."""
    where = os.fspath(source)
    try:
        with open(source, encoding="utf-8") as f:
            tools = json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read tools schema {where}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"tools schema {where} is not valid JSON: {exc}") from None
    if isinstance(tools, dict):
        tools = tools.get("tools_schema", tools.get("tools", tools))
    if not isinstance(tools, list):
        raise ValueError(f"tools schema {where} must be a JSON list of tools, got {json_type(tools)}")
    return tools


def tools_schema_beside(agent_spec: str) -> Optional[str]:
    """The ``tools_schema.json`` beside an agent file named as ``PATH.py:NAME``, if there is one (§3.6).

    ``serve`` serves it at ``GET /tools_schema`` and the kit's ``doctor`` checks it.
    """
    where = agent_spec.rpartition(":")[0]
    if not where.endswith(".py"):
        return None
    beside = os.path.join(os.path.dirname(os.path.abspath(where)), "tools_schema.json")
    return beside if os.path.isfile(beside) else None


def bound_output(text: Any, limit: int = 8000) -> str:
    """``text`` (JSON-encoded when not a string) cut to about ``limit`` characters, head and tail kept.

    The middle is replaced by a marker saying how many characters were cut, so
    a model sees both how a long tool result starts and how it ends.
    """
    shown: str = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False, default=str)
    if len(shown) <= limit:
        return shown
    keep = max(limit - 40, 2)
    head, tail = keep - keep // 2, keep // 2
    cut = len(shown) - head - tail
    return f"{shown[:head]}\n...[{cut} characters truncated]...\n{shown[len(shown) - tail:]}"


def call_tools(
    calls: Iterable[Tuple[str, Union[Mapping[str, Any], str, None]]],
    *,
    max_concurrency: int = 8,
    errors: str = "return",
    **options: Any,
) -> List[Any]:
    """Run one model turn's tool calls through the proxy concurrently; results in call order.

    Arguments may be objects or the JSON text models produce (decoded here;
    text that is not a JSON object is refused before sending).  At most
    ``max_concurrency`` run at once; the client's pacing keeps them under the
    platform's rate limit.  Each call sees this context's bound envelope.  With
    ``errors="return"`` (the default here) a failed or refused call gives its
    ``{"error": ...}`` value, so the model can react; a stale run token still
    raises.  ``options`` go to :func:`proxy_call`.
    """
    calls = [(name, args) for name, args in calls]
    if not calls:
        return []

    def one(name: str, args: Any) -> Any:
        if isinstance(args, (str, bytes)):
            try:
                args = json.loads(args or "{}")
            except ValueError as exc:
                error = ProxyRequestError(f"arguments for {name!r} must be a JSON object, got invalid JSON: {exc}",
                                          tool_name=name)
                if errors == "return":
                    return error.to_value()
                raise error from None
        return proxy_call(name, args, errors=errors, **options)

    if len(calls) == 1 or max_concurrency <= 1:
        return [one(name, args) for name, args in calls]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(max_concurrency, len(calls)), thread_name_prefix="pipelines-tool") as pool:
        futures = [pool.submit(contextvars.copy_context().run, one, name, args) for name, args in calls]
        return [f.result() for f in futures]


class HTTPStatusError(PipelinesError):
    """A JSON API (e.g. a model API) answered with an error status after retries, or with no JSON."""

    def __init__(self, message: str, *, status_code: Optional[int] = None, body: Any = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body


_MODEL_RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 529})
_MODEL_RETRY = RetryPolicy(max_attempts=5, base_delay_s=1.0, max_delay_s=20.0, transport_retries=2)


def post_json(
    url: str,
    payload: Mapping[str, Any],
    *,
    headers: Optional[Mapping[str, str]] = None,
    timeout: float = 300.0,
    retry: RetryPolicy = _MODEL_RETRY,
    max_reply_bytes: int = 64 << 20,
    sleep: Callable[[float], None] = time.sleep,
) -> Any:
    """POST JSON to an HTTP API (a model API) and return the decoded JSON reply.

    Keep-alive connections are shared with the proxy client.  429, 408, 409,
    425, 5xx and 529 (overloaded) are retried with backoff, ``Retry-After``
    honoured, as are timeouts and dropped connections.  Other errors raise
    :class:`HTTPStatusError` with the status and the first 500 characters of
    the body.  Header values (API keys) never appear in messages or logs.
    """
    try:
        base = urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"invalid URL {_short(url)!r}: {exc}") from None
    if base.scheme.lower() not in ("http", "https") or not base.hostname:
        raise ValueError(f"URL {_short(url)!r} must be http:// or https:// with a host")
    path = (base.path or "/") + (f"?{base.query}" if base.query else "")
    body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    sent = {"Content-Type": "application/json", "Accept": "application/json", "User-Agent": _USER_AGENT}
    sent.update(headers or {})
    transport = _shared_transport()
    shown_port = f":{base.port}" if base.port else ""
    where = f"POST {base.scheme}://{base.hostname}{shown_port}{base.path}"  # no userinfo or query: they may hold keys

    def send() -> Tuple[int, List[Tuple[str, str]], bytes]:
        try:
            return transport.exchange(base, "POST", path, sent, body, timeout, max_reply_bytes)
        except _ReplyTooLarge as big:
            raise HTTPStatusError(f"{where}: reply {big}", status_code=big.status) from None

    def interpret(status: int, reply_headers: List[Tuple[str, str]], reply: bytes) -> ProxyOutcome:
        value, is_json = _decode_body(reply, "")
        if 200 <= status < 300:
            if not is_json:
                return ProxyOutcome("error", error=HTTPStatusError(
                    f"{where}: HTTP {status} but the reply is not JSON: {_short(str(value or ''), 200)!r}",
                    status_code=status, body=value))
            return ProxyOutcome("value", value)
        text = json.dumps(value)[:500] if is_json else _short(str(value or ""), 500)
        error = HTTPStatusError(f"{where}: HTTP {status}: {text}", status_code=status, body=value)
        if status in _MODEL_RETRY_STATUSES:
            return ProxyOutcome("retry", error=error, retry_after=_model_retry_after(reply_headers))
        return ProxyOutcome("error", error=error)

    return _retry_loop(
        send, interpret, policy=retry, sleep=sleep,
        transport_error=lambda cause: HTTPStatusError(_failed_before_reply(where, cause)),
    )

# ---------------------------------------------------------------------------
# Tools from code: JSON Schema from a function's signature, local argument
# validation, proxied inside a dispatch and local outside one (§3.6)
# ---------------------------------------------------------------------------

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def _is_json_type(value: Any, kind: str) -> bool:
    if kind == "null":
        return value is None
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "array":
        return isinstance(value, (list, tuple))
    if kind == "object":
        return isinstance(value, Mapping)
    return True  # an unknown type name constrains nothing


def validate_args(schema: Mapping[str, Any], value: Any, path: str = "args") -> List[str]:
    """Every way ``value`` breaks ``schema``, one readable string each (empty: valid).

    The JSON Schema subset tools use: ``type`` (one or a list), ``properties``,
    ``required``, ``additionalProperties``, ``enum``, ``const``, ``items``,
    ``minimum`` / ``maximum`` (and exclusive), ``minLength`` / ``maxLength``,
    ``minItems`` / ``maxItems``, ``anyOf`` / ``oneOf``.  Other keywords are ignored.
    """
    if not isinstance(schema, Mapping):
        return []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        if not any(_is_json_type(value, k) for k in kinds):
            return [f"{path}: expected {' or '.join(kinds)}, got {json_type(value)}"]
    problems = _value_problems(schema, value, path)
    if isinstance(value, (list, tuple)):
        problems += _array_problems(schema, value, path)
    if isinstance(value, Mapping):
        problems += _object_problems(schema, value, path)
    return problems + _alternative_problems(schema, value, path)


# validate_args's numeric bounds: (keyword, holds(value, bound), the words for a value it refuses).
_NUMBER_BOUNDS: Tuple[Tuple[str, Callable[[float, float], bool], str], ...] = (
    ("minimum", lambda v, b: v >= b, "at least"), ("maximum", lambda v, b: v <= b, "at most"),
    ("exclusiveMinimum", lambda v, b: v > b, "more than"), ("exclusiveMaximum", lambda v, b: v < b, "less than"))


def _value_problems(schema: Mapping[str, Any], value: Any, path: str) -> List[str]:
    """:func:`validate_args` for any value: ``enum`` and ``const``, a number's bounds, a string's length."""
    problems: List[str] = []
    if "enum" in schema and value not in schema["enum"]:
        shown = ", ".join(json.dumps(v) for v in schema["enum"])
        problems.append(f"{path}: {_short(json.dumps(value, default=str), 60)} is not one of {shown}")
    if "const" in schema and value != schema["const"]:
        problems.append(f"{path}: must be {json.dumps(schema['const'])}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for key, holds, word in _NUMBER_BOUNDS:
            bound = schema.get(key)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and not holds(value, bound):
                problems.append(f"{path}: {value} is not {word} {bound}")
    if isinstance(value, str):
        if isinstance(schema.get("minLength"), int) and len(value) < schema["minLength"]:
            problems.append(f"{path}: {len(value)} characters, fewer than minLength {schema['minLength']}")
        if isinstance(schema.get("maxLength"), int) and len(value) > schema["maxLength"]:
            problems.append(f"{path}: {len(value)} characters, more than maxLength {schema['maxLength']}")
    return problems


def _array_problems(schema: Mapping[str, Any], value: Sequence[Any], path: str) -> List[str]:
    """:func:`validate_args` for an array: ``minItems`` / ``maxItems``, then each item against ``items``."""
    problems: List[str] = []
    if isinstance(schema.get("minItems"), int) and len(value) < schema["minItems"]:
        problems.append(f"{path}: {len(value)} items, fewer than minItems {schema['minItems']}")
    if isinstance(schema.get("maxItems"), int) and len(value) > schema["maxItems"]:
        problems.append(f"{path}: {len(value)} items, more than maxItems {schema['maxItems']}")
    if isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            problems.extend(validate_args(schema["items"], item, f"{path}[{i}]"))
    return problems


def _object_problems(schema: Mapping[str, Any], value: Mapping[str, Any], path: str) -> List[str]:
    """:func:`validate_args` for an object: ``required``, then each member against its property's schema, or
    ``additionalProperties`` for a member with none."""
    problems: List[str] = []
    properties: Mapping[str, Any] = schema["properties"] if isinstance(schema.get("properties"), Mapping) else {}
    for name in schema.get("required") or ():
        if name not in value:
            problems.append(f"{path}.{name}: required")
    extra = schema.get("additionalProperties", True)
    for name, item in value.items():
        if name in properties:
            problems.extend(validate_args(properties[name], item, f"{path}.{name}"))
        elif extra is False:
            problems.append(f"{path}.{name}: not allowed (additionalProperties is false)")
        elif isinstance(extra, Mapping):
            problems.extend(validate_args(extra, item, f"{path}.{name}"))
    return problems


def _alternative_problems(schema: Mapping[str, Any], value: Any, path: str) -> List[str]:
    """:func:`validate_args` for ``anyOf`` (at least one alternative matches) and ``oneOf`` (exactly one)."""
    problems: List[str] = []
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            matches = sum(1 for option in options if not validate_args(option, value, path))
            if matches == 0 or (key == "oneOf" and matches > 1):
                problems.append(f"{path}: matches {matches} of the {key} alternatives")
    return problems


def schema_for_type(annotation: Any) -> Dict[str, Any]:
    """The JSON Schema for a Python type hint: str, int, float, bool, None, Optional/Union,
    list/tuple/set[X], dict[str, X], Literal, Enum, Any.  Raises ``TypeError`` for anything else."""
    import typing

    if annotation is Any:
        return {}
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if annotation is None:
        return {"type": "null"}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _enum_schema([m.value for m in annotation])
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return _enum_schema(list(args))
    if origin is Union or type(annotation).__name__ == "UnionType":
        return _union_schema(args)
    if annotation in (list, tuple, set, frozenset) or origin in (list, tuple, set, frozenset):
        return _array_schema(args)
    if annotation is dict or origin is dict:
        schema: Dict[str, Any] = {"type": "object"}
        if len(args) == 2 and args[1] is not Any:
            schema["additionalProperties"] = schema_for_type(args[1])
        return schema
    raise TypeError(f"no JSON Schema for type {annotation!r}: use str, int, float, bool, None, Optional, "
                    "list/dict of those, Literal or an Enum")


def _enum_schema(values: List[Any]) -> Dict[str, Any]:
    """An Enum's or a Literal's schema: its values, and their JSON type when they share one."""
    schema: Dict[str, Any] = {"enum": values}
    kinds = {_JSON_TYPES.get(type(v)) for v in values}
    if len(kinds) == 1 and None not in kinds:
        schema["type"] = kinds.pop()
    return schema


def _union_schema(args: Tuple[Any, ...]) -> Dict[str, Any]:
    """A Union's (``Optional``'s, ``X | Y``'s) schema: ``anyOf`` its members, or a type list for a plain
    ``Optional[X]``."""
    members = [a for a in args if a is not type(None)]
    nullable = len(members) < len(args)
    parts = [schema_for_type(a) for a in members]
    if len(parts) == 1:
        only = parts[0]
        if nullable and isinstance(only.get("type"), str) and set(only) == {"type"}:
            return {"type": [only["type"], "null"]}
        return {"anyOf": [only, {"type": "null"}]} if nullable else only
    return {"anyOf": parts + ([{"type": "null"}] if nullable else [])}


def _array_schema(args: Tuple[Any, ...]) -> Dict[str, Any]:
    """A list's, tuple's or set's schema: an array whose ``items`` are its one member type, or any of a
    fixed-shape tuple's."""
    schema: Dict[str, Any] = {"type": "array"}
    members = [a for a in args if a is not Ellipsis]
    if len(set(members)) == 1:
        schema["items"] = schema_for_type(members[0])
    elif members:  # a fixed-shape tuple: each item is one of its types
        schema["items"] = {"anyOf": [schema_for_type(a) for a in dict.fromkeys(members)]}
    return schema


def _docstring_parts(doc: Optional[str]) -> Tuple[str, Dict[str, str]]:
    """``(description, {param: description})`` from a Google-style (``Args:``) or Sphinx (``:param x:``) docstring."""
    import inspect

    text = inspect.cleandoc(doc or "")
    params: Dict[str, str] = {}
    summary: List[str] = []
    section = None
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        sphinx = re.match(r":param\s+(?:[\w\[\], ]+\s+)?(\w+):\s*(.*)", stripped)
        if sphinx:
            current = sphinx.group(1)
            params[current] = sphinx.group(2)
            section = "sphinx"
            continue
        if re.fullmatch(r"(Args|Arguments|Parameters):", stripped):
            section, current = "args", None
            continue
        if re.fullmatch(r"(Returns|Raises|Yields|Examples?|Notes?):", stripped) or stripped.startswith(":"):
            section, current = "other", None
            continue
        if section == "args":
            m = re.match(r"(\w+)\s*(\([^)]*\))?:\s*(.*)", stripped)
            if m and line.startswith(("    ", "\t")) and not line.startswith(("        ", "\t\t")):
                current = m.group(1)
                params[current] = m.group(3)
            elif current and stripped:
                params[current] = (params[current] + " " + stripped).strip()
            continue
        if section == "sphinx" and current and stripped and line.startswith((" ", "\t")):
            params[current] = (params[current] + " " + stripped).strip()
            continue
        if section is None:
            summary.append(line)
    description = "\n".join(summary).strip()
    return re.sub(r"\s*\n\s*\n\s*", "\n\n", description), params


class Tool:
    """A tool declared from a plain function with :func:`tool`.

    Inside a dispatch (an envelope is bound) a call validates its arguments
    against the derived input schema, then goes through the proxy and returns
    the unwrapped result; outside one it runs the function locally.  An ``async
    def`` function gives an awaitable either way.
    """

    def __init__(self, fn: Callable[..., Any], *, name: Optional[str] = None, description: Optional[str] = None,
                 default_execution_mode: Optional[str] = None) -> None:
        import inspect
        import typing

        self.fn = fn
        self.name = validate_tool_name(name or fn.__name__)
        summary, param_docs = _docstring_parts(fn.__doc__)
        self.description = description if description is not None else summary
        self.is_async = inspect.iscoroutinefunction(fn)
        self.signature = inspect.signature(fn)
        try:
            hints = typing.get_type_hints(fn)
        except Exception as exc:  # noqa: BLE001 - unresolvable annotations
            raise TypeError(f"tool {self.name!r}: cannot resolve its type hints: {exc}") from None
        properties: Dict[str, Any] = {}
        required: List[str] = []
        for param in self.signature.parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool {self.name!r}: *{param.name} cannot be described as named arguments")
            try:
                prop = schema_for_type(hints[param.name]) if param.name in hints else {}
            except TypeError as exc:
                raise TypeError(f"tool {self.name!r}, argument {param.name!r}: {exc}") from None
            if param_docs.get(param.name):
                prop["description"] = param_docs[param.name]
            if param.default is param.empty:
                required.append(param.name)
            else:
                default = param.default.value if isinstance(param.default, enum.Enum) else param.default
                try:
                    prop["default"] = json.loads(json.dumps(default))  # as the JSON a model would send
                except (TypeError, ValueError):
                    pass
            properties[param.name] = prop
        self.input_schema: Dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
        if required:
            self.input_schema["required"] = required
        if default_execution_mode not in (None, "sandbox", "passthrough"):
            raise ValueError("default_execution_mode must be 'sandbox' or 'passthrough'")
        self.default_execution_mode = default_execution_mode
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"

    @property
    def schema(self) -> Dict[str, Any]:
        """This tool in the platform's tools_schema shape."""
        entry: Dict[str, Any] = {"name": self.name, "description": self.description,
                                 "input_schema": _thaw(self.input_schema)}
        if self.default_execution_mode:
            entry["default_execution_mode"] = self.default_execution_mode
        return entry

    def validate(self, arguments: Mapping[str, Any]) -> List[str]:
        """Every way ``arguments`` break this tool's input schema."""
        return validate_args(self.input_schema, arguments)

    def arguments(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """The JSON arguments object a call sends (enum members become their values)."""
        bound = self.signature.bind(*args, **kwargs)
        return {k: v.value if isinstance(v, enum.Enum) else v for k, v in bound.arguments.items()}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _current.get() is None:
            return self.fn(*args, **kwargs)
        arguments = self.arguments(*args, **kwargs)
        problems = self.validate(arguments)
        if problems:
            raise ProxyRequestError(f"arguments for tool {self.name!r} do not match its input schema: "
                                    + "; ".join(problems), tool_name=self.name)
        if self.is_async:
            return aproxy_call(self.name, arguments)
        return proxy_call(self.name, arguments)


def tool(fn: Optional[Callable[..., Any]] = None, *, name: Optional[str] = None, description: Optional[str] = None,
         default_execution_mode: Optional[str] = None) -> Any:
    """Declare a tool from a plain function: ``@tool`` or ``@tool(name=..., description=...)``.

    The input schema comes from the signature and type hints, the description
    from the docstring (its ``Args:`` / ``:param:`` lines describe the arguments).
    Inside a dispatch a call goes through the proxy; outside, the function runs.
    """
    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(f, name=name, description=description, default_execution_mode=default_execution_mode)

    return wrap(fn) if fn is not None else wrap


def export_tools(tools: Iterable[Any], to: str = "platform") -> List[Dict[str, Any]]:
    """The tool list for registration or a model API: ``Tool`` objects and/or tools_schema entries
    in ``platform``, ``openai_chat``, ``openai_responses`` or ``anthropic`` shape."""
    return convert_tools([t.schema if isinstance(t, Tool) else t for t in tools], to)

# ---------------------------------------------------------------------------
# Framework bridges (the porting guide's steps 1 and 2): the tools_schema of a
# framework's tools, the same tools with their bodies going through the proxy,
# and a framework's run result as the response envelope.  Duck-typed on each
# framework's public objects: nothing is imported here unless the caller's
# objects come from that framework (the caller has it installed).
# ---------------------------------------------------------------------------


def _framework_tool_parts(tool: Any) -> Optional[Tuple[str, str, Dict[str, Any]]]:
    """``(name, description, JSON Schema)`` of one framework tool object, or ``None`` for a mapping."""
    if isinstance(tool, Mapping):
        return None
    name = getattr(tool, "name", None)
    if isinstance(getattr(tool, "params_json_schema", None), Mapping):  # OpenAI Agents SDK FunctionTool
        return str(name), str(getattr(tool, "description", "") or ""), dict(tool.params_json_schema)
    spec = getattr(tool, "tool_spec", None)
    if isinstance(spec, Mapping):  # Strands: {"name", "description", "inputSchema": {"json": schema}}
        schema = spec.get("inputSchema") or {}
        schema = schema.get("json", schema) if isinstance(schema, Mapping) else {}
        return str(spec.get("name")), str(spec.get("description") or ""), dict(schema)
    for attribute in ("inputSchema", "input_schema"):  # an MCP Tool (input_schema in the newer SDKs)
        schema = getattr(tool, attribute, None)
        if isinstance(schema, Mapping):
            return str(name), str(getattr(tool, "description", "") or ""), dict(schema)
    if hasattr(tool, "args_schema") or hasattr(tool, "get_input_schema"):  # LangChain BaseTool
        args_schema = getattr(tool, "args_schema", None)
        if isinstance(args_schema, Mapping):
            schema = dict(args_schema)
        else:
            model = getattr(tool, "tool_call_schema", None) or tool.get_input_schema()
            schema = model.model_json_schema() if hasattr(model, "model_json_schema") else model.schema()
        schema.pop("title", None)
        schema.pop("description", None)
        return str(name), str(getattr(tool, "description", "") or ""), schema
    raise TypeError(f"not a tool this module knows: {type(tool).__name__} (an OpenAI Agents FunctionTool, a "
                    "LangChain tool, a Strands tool, an MCP Tool or a tools_schema mapping)")


def _tools_of(source: Any) -> List[Any]:
    """The tools of an agent object (``.tools``), or the items of a list of tools."""
    if isinstance(source, (list, tuple)):
        return list(source)
    tools = getattr(source, "tools", None)
    if isinstance(tools, (list, tuple)):
        return list(tools)
    raise TypeError(f"give a list of tools or an agent with .tools, got {type(source).__name__}")


def tools_schema_from(source: Any) -> List[Dict[str, Any]]:
    """The platform ``tools_schema`` (§3.6) of a framework's tools or of an agent holding them (``.tools``).

    Reads OpenAI Agents SDK ``FunctionTool`` (``params_json_schema``), LangChain and LangGraph tools
    (``args_schema``), Strands tools (``tool_spec``), MCP ``Tool`` objects (``inputSchema``) and tools_schema
    mappings in any shape :func:`convert_tools` reads.  Entries get ``default_execution_mode: sandbox``.
    """
    entries: List[Any] = []
    for tool in _tools_of(source):
        parts = _framework_tool_parts(tool)
        if parts is None:
            entries.append(tool)
        else:
            name, description, schema = parts
            entries.append({"name": name, "description": description, "input_schema": schema,
                            "default_execution_mode": "sandbox"})
    return convert_tools(entries, "platform")


def _as_tool_output(value: Any) -> str:
    """A tool result as the text a framework hands its model: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def proxied_tools(source: Any, *, actor: Optional[str] = None) -> List[Any]:
    """The same tools, of the same framework types, whose bodies call the per-run proxy (the guide's step 2).

    Names, descriptions and argument schemas stay as they were, so the framework and its planner behave as
    before; only the body changes: ``proxy_call(name, args, actor=actor, errors="return")`` with the envelope
    bound where the framework calls the tool (a dispatch, ``run()``, or ``bind_envelope``).  A failed call
    reaches the model as ``{"error": ...}``.  Supported: OpenAI Agents SDK ``FunctionTool`` (async body),
    LangChain/LangGraph tools (``StructuredTool`` with a sync and an async body) and Strands tools
    (``PythonAgentTool``).  The envelope bound where ``proxied_tools`` is called (in a dispatch or ``run()``)
    goes with the tools, so a framework running tools on threads of its own still reaches this run.
    """
    # The envelope bound here (proxied inside a dispatch or run()) goes with the tools: a framework that runs
    # tools on threads of its own, without copying the context, still reaches this run.  Else: at call time.
    envelope = _current.get()
    out: List[Any] = []
    for tool in _tools_of(source):
        parts = _framework_tool_parts(tool)
        if parts is None:
            raise TypeError(f"cannot proxy a {type(tool).__name__}: give OpenAI Agents FunctionTools, LangChain "
                            "tools or Strands tools (for a tools_schema entry, call proxy_call in the tool's body)")
        bridge = _BridgeCall(parts[0], actor, envelope)
        if isinstance(getattr(tool, "params_json_schema", None), Mapping) and hasattr(tool, "on_invoke_tool"):
            out.append(_proxied_function_tool(tool, bridge))
        elif hasattr(tool, "args_schema") and hasattr(tool, "invoke"):
            out.append(_proxied_langchain_tool(tool, bridge))
        elif isinstance(getattr(tool, "tool_spec", None), Mapping) and hasattr(tool, "stream"):
            out.append(_proxied_strands_tool(tool, bridge))
        else:
            raise TypeError(f"cannot proxy a {type(tool).__name__}: give OpenAI Agents FunctionTools, LangChain "
                            "tools or Strands tools (for others, call proxy_call in the tool's body)")
    return out


class _BridgeCall(NamedTuple):
    """One proxied tool's body, blocking (:meth:`call`) and awaitable (:meth:`acall`): the tool's name, the JSON
    arguments; a failure comes back as ``{"error": ...}``."""

    tool_name: str
    actor: Optional[str]
    envelope: Optional[Envelope]

    def call(self, args: Mapping[str, Any]) -> Any:
        return proxy_call(self.tool_name, dict(args), actor=self.actor, errors="return", envelope=self.envelope)

    async def acall(self, args: Mapping[str, Any]) -> Any:
        return await aproxy_call(self.tool_name, dict(args), actor=self.actor, errors="return",
                                 envelope=self.envelope)


def _proxied_function_tool(tool: Any, bridge: _BridgeCall) -> Any:
    import dataclasses

    async def on_invoke_tool(context: Any, arguments: str) -> str:
        args = json.loads(arguments) if arguments and arguments.strip() else {}
        return _as_tool_output(await bridge.acall(args))

    return dataclasses.replace(tool, on_invoke_tool=on_invoke_tool)


def _proxied_langchain_tool(tool: Any, bridge: _BridgeCall) -> Any:
    name = tool.name
    # The caller's LangChain is loaded already (the tool is one of its objects): take its class from there.
    structured_tool = getattr(sys.modules.get("langchain_core.tools"), "StructuredTool", None)
    if structured_tool is None:
        raise TypeError(f"cannot proxy {name!r}: langchain_core.tools is not loaded")

    def sync_body(**kwargs: Any) -> str:
        return _as_tool_output(bridge.call(_jsonable_args(kwargs)))

    async def acall(**kwargs: Any) -> str:
        return _as_tool_output(await bridge.acall(_jsonable_args(kwargs)))

    args_schema = tool.args_schema if tool.args_schema is not None else tool.get_input_schema()
    return structured_tool.from_function(func=sync_body, coroutine=acall, name=name, description=tool.description,
                                         args_schema=args_schema, return_direct=getattr(tool, "return_direct", False))


def _proxied_strands_tool(tool: Any, bridge: _BridgeCall) -> Any:
    # The caller's Strands is loaded already (the tool is one of its objects): take its class from there.
    python_agent_tool = getattr(sys.modules.get("strands.tools.tools"), "PythonAgentTool", None)
    if python_agent_tool is None:
        raise TypeError(f"cannot proxy {tool.tool_name!r}: strands.tools.tools is not loaded")

    async def tool_func(tool_use: Mapping[str, Any], **invocation_state: Any) -> Dict[str, Any]:
        result = await bridge.acall(tool_use.get("input") or {})
        failed = isinstance(result, Mapping) and "error" in result
        return {"toolUseId": tool_use.get("toolUseId"), "status": "error" if failed else "success",
                "content": [{"text": _as_tool_output(result)}]}

    return python_agent_tool(tool.tool_name, dict(tool.tool_spec), tool_func)


class Handoffs:
    """``handoff`` trace events (§3.4) from a framework's own control flow, each transfer once.

    ``enter(label)`` marks the sub-agent now acting: when it differs from the one before, a handoff from that
    one is posted (best-effort: tracing never ends a run).  ``node(label, fn)`` wraps a LangGraph node (sync
    or async) so entering it is such a transfer; ``agents_hooks()`` gives OpenAI Agents SDK ``RunHooks`` that
    post the SDK's own handoffs.  The envelope bound where the object is made goes with it.  One per run.
    """

    def __init__(self, first: Optional[str] = None, *, envelope: Optional[Envelope] = None) -> None:
        self.current = validate_actor_label(first) if first else None
        self._envelope = envelope if envelope is not None else _current.get()
        self._lock = threading.Lock()

    def enter(self, label: str, reason: Optional[str] = None) -> None:
        """``label`` acts from now on; a handoff from the sub-agent before it is posted."""
        moved = self._move_to(label)
        if moved:
            post_handoff(*moved, reason=reason, envelope=self._envelope, best_effort=True)

    async def aenter(self, label: str, reason: Optional[str] = None) -> None:
        """The asyncio form of :meth:`enter`."""
        moved = self._move_to(label)
        if moved:
            await apost_handoff(*moved, reason=reason, envelope=self._envelope, best_effort=True)

    def _move_to(self, label: str) -> Optional[Tuple[str, str]]:
        """Make ``label`` current; ``(from, to)`` when control moved, else ``None``."""
        label = cast(str, validate_actor_label(label))
        with self._lock:
            previous, self.current = self.current, label
        return (previous, label) if previous and previous != label else None

    def node(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a graph node), entering ``label`` before each call."""
        import inspect

        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def async_node(*args: Any, **kwargs: Any) -> Any:
                await self.aenter(label)
                return await fn(*args, **kwargs)
            return async_node

        @functools.wraps(fn)
        def sync_node(*args: Any, **kwargs: Any) -> Any:
            self.enter(label)
            return fn(*args, **kwargs)
        return sync_node

    def agents_hooks(self) -> Any:
        """OpenAI Agents SDK ``RunHooks`` posting each handoff between agents (by their names)."""
        run_hooks = getattr(sys.modules.get("agents"), "RunHooks", None)
        if run_hooks is None:
            raise TypeError("agents_hooks() needs the OpenAI Agents SDK (the `agents` package) imported")
        handoffs = self

        class _Hooks(run_hooks):  # type: ignore[misc, valid-type]
            async def on_agent_start(self, context: Any, agent: Any) -> None:
                await handoffs.aenter(agent.name)

        return _Hooks()


def _jsonable_args(kwargs: Mapping[str, Any]) -> Dict[str, Any]:
    """Tool arguments as JSON values (a framework may hand over pydantic models)."""
    def plain(value: Any) -> Any:
        if hasattr(value, "model_dump"):
            return value.model_dump(mode="json")
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value
    return {str(k): plain(v) for k, v in kwargs.items()}


def response_from(result: Any, **fields: Any) -> Dict[str, Any]:
    """A framework's run result as the v1 response envelope (§4): the answer, a transcript, model and tokens.

    Reads an OpenAI Agents SDK ``RunResult`` (``final_output``, ``new_items``, ``raw_responses``), a Strands
    ``Agent`` after its run (its ``messages``, Bedrock Converse blocks), a LangChain
    or LangGraph message list (or a LangGraph state with ``messages``), and an Anthropic Messages conversation
    (dicts or the SDK's ``Message`` objects, with ``tool_use`` / ``tool_result`` / ``thinking`` blocks);
    anything else goes to :func:`build_response` as it is.  ``fields`` (``messages``, ``metadata``,
    ``strict``) are passed to :func:`build_response` and win over what was read.
    """
    if hasattr(result, "new_items") and hasattr(result, "final_output"):
        final, messages, metadata = _from_agents_run(result)
    elif _is_strands_agent(result):
        final, messages, metadata = _from_strands(result)
    else:
        messages_in = result.get("messages") if isinstance(result, Mapping) and "messages" in result else result
        if isinstance(messages_in, (list, tuple)) and messages_in and all(
                hasattr(m, "type") and hasattr(m, "content") and not isinstance(m, Mapping) for m in messages_in):
            final, messages, metadata = _from_langchain(list(messages_in))
        elif isinstance(messages_in, (list, tuple)) and messages_in and all(
                _anthropic_message(m) is not None for m in messages_in):
            final, messages, metadata = _from_anthropic([cast(Dict[str, Any], _anthropic_message(m))
                                                         for m in messages_in])
        else:
            return build_response(result, **fields)
    strict = fields.pop("strict", None)
    return build_response(final, **{"messages": messages, "metadata": metadata, **fields}, strict=strict)


def _from_agents_run(result: Any) -> Tuple[Any, List[Dict[str, Any]], Dict[str, Any]]:
    """An OpenAI Agents SDK ``RunResult``: its items as the v1 transcript, the usage of its raw responses."""
    messages = _agents_run_messages(result)
    metadata = _agents_run_metadata(result)
    return result.final_output, messages, metadata


def _agents_run_messages(result: Any) -> List[Dict[str, Any]]:
    """The run's input, then its items: reasoning (as the thinking of the next assistant message), tool and
    handoff calls, their outputs, and message outputs."""
    messages: List[Dict[str, Any]] = []
    first = result.input
    if isinstance(first, str):
        messages.append({"role": "user", "content": first})
    thinking: List[Dict[str, Any]] = []
    for item in result.new_items:
        kind, raw = getattr(item, "type", ""), getattr(item, "raw_item", None)

        def get(key: str, raw: Any = raw) -> Any:
            return raw.get(key) if isinstance(raw, Mapping) else getattr(raw, key, None)

        if kind == "reasoning_item":
            thinking += [{"type": "text", "text": getattr(s, "text", "")} for s in get("summary") or ()]
        elif kind in ("tool_call_item", "handoff_call_item"):  # a handoff is the model calling transfer_to_X
            message: Dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [
                {"id": get("call_id") or get("id"), "name": get("name"), "arguments": get("arguments") or "{}"}]}
            if thinking:
                message["thinking"], thinking = thinking, []
            messages.append(message)
        elif kind in ("tool_call_output_item", "handoff_output_item"):
            output = getattr(item, "output", None) if kind == "tool_call_output_item" else get("output")
            messages.append({"role": "tool", "tool_call_id": get("call_id"), "content": _as_tool_output(output)})
        elif kind == "message_output_item":
            text = "".join(getattr(part, "text", "") or "" for part in get("content") or ())
            message = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"], thinking = thinking, []
            messages.append(message)
    return messages


def _agents_run_metadata(result: Any) -> Dict[str, Any]:
    """The tokens of the run's raw responses, and the model of its last agent when it names one."""
    usage = [getattr(r, "usage", None) for r in getattr(result, "raw_responses", ()) or ()]
    metadata: Dict[str, Any] = {
        "total_input_tokens": sum(getattr(u, "input_tokens", 0) or 0 for u in usage if u is not None),
        "total_output_tokens": sum(getattr(u, "output_tokens", 0) or 0 for u in usage if u is not None),
    }
    agent = getattr(result, "last_agent", None)
    model = getattr(agent, "model", None)
    if isinstance(model, str):
        metadata["model"] = model
    elif model is not None and isinstance(getattr(model, "model", None), str):
        metadata["model"] = model.model
    return metadata


def _assistant_message(text: str, tool_calls: List[Dict[str, Any]], thinking: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A transcript's assistant message: its text (``None`` when empty), then its tool calls and its thinking, each
    only when there is some."""
    message: Dict[str, Any] = {"role": "assistant", "content": text or None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if thinking:
        message["thinking"] = thinking
    return message


def _is_strands_agent(value: Any) -> bool:
    """A Strands ``Agent`` after a run: its conversation in ``messages`` (Bedrock Converse blocks)."""
    messages = getattr(value, "messages", None)
    return hasattr(value, "tool_registry") and isinstance(messages, list)


def _from_strands(agent: Any) -> Tuple[Any, List[Dict[str, Any]], Dict[str, Any]]:
    """A Strands ``Agent`` after its run: its Bedrock Converse messages, the tokens its event loop counted and the
    model its configuration names."""
    final, messages, metadata = _from_bedrock(list(agent.messages))
    usage = getattr(getattr(agent, "event_loop_metrics", None), "accumulated_usage", None)
    if isinstance(usage, Mapping):
        metadata = {"total_input_tokens": int(usage.get("inputTokens") or 0),
                    "total_output_tokens": int(usage.get("outputTokens") or 0), **metadata}
    model_id = (getattr(getattr(agent, "model", None), "config", None) or {}).get("model_id")
    if isinstance(model_id, str):
        metadata["model"] = model_id
    return final, messages, metadata


def _from_bedrock(items: List[Any]) -> Tuple[Any, List[Dict[str, Any]], Dict[str, Any]]:
    """Bedrock Converse messages (Strands): ``text``, ``toolUse``, ``toolResult``, ``reasoningContent`` blocks."""
    messages: List[Dict[str, Any]] = []
    final: Any = ""
    for item in items:
        blocks = [b for b in item.get("content") or () if isinstance(b, Mapping)]
        text = "".join(str(b["text"]) for b in blocks if isinstance(b.get("text"), str))
        if item.get("role") != "assistant":
            messages += _bedrock_user_turn(blocks, text)
            continue
        message = _bedrock_assistant(blocks, text)
        messages.append(message)
        if text and "tool_calls" not in message:
            final = text
    return final, messages, {}


def _bedrock_assistant(blocks: Sequence[Mapping[str, Any]], text: str) -> Dict[str, Any]:
    """An assistant turn of Bedrock Converse blocks: its text, ``toolUse`` blocks and ``reasoningContent``."""
    uses = [b["toolUse"] for b in blocks if isinstance(b.get("toolUse"), Mapping)]
    thoughts = [((b["reasoningContent"].get("reasoningText") or {}).get("text"))
                for b in blocks if isinstance(b.get("reasoningContent"), Mapping)]
    return _assistant_message(
        text, [{"id": u.get("toolUseId"), "name": u.get("name"), "arguments": u.get("input") or {}} for u in uses],
        [{"type": "text", "text": x} for x in thoughts if x])


def _bedrock_user_turn(blocks: Sequence[Mapping[str, Any]], text: str) -> List[Dict[str, Any]]:
    """A user turn of Bedrock Converse blocks: each ``toolResult`` a tool message, then the user's text (kept,
    empty, when there is nothing else)."""
    messages: List[Dict[str, Any]] = []
    results = [b["toolResult"] for b in blocks if isinstance(b.get("toolResult"), Mapping)]
    for result in results:
        parts = [p.get("text") if "text" in p else _as_tool_output(p.get("json"))
                 for p in result.get("content") or () if isinstance(p, Mapping)]
        messages.append({"role": "tool", "tool_call_id": result.get("toolUseId"),
                         "content": "".join(str(p) for p in parts)})
    if text or not results:
        messages.append({"role": "user", "content": text})
    return messages


def _anthropic_message(item: Any) -> Optional[Dict[str, Any]]:
    """An Anthropic Messages API message (a dict, or the SDK's ``Message`` object) as a dict; else ``None``."""
    if hasattr(item, "model_dump") and hasattr(item, "role") and hasattr(item, "content"):
        item = item.model_dump()
    if isinstance(item, Mapping) and item.get("role") in ("user", "assistant") and isinstance(
            item.get("content"), (str, list)):
        return dict(item)
    return None


def _from_anthropic(items: List[Dict[str, Any]]) -> Tuple[Any, List[Dict[str, Any]], Dict[str, Any]]:
    """Anthropic messages (text, tool_use, tool_result and thinking blocks) as the v1 transcript."""
    messages: List[Dict[str, Any]] = []
    final: Any = ""
    inputs = outputs = 0
    model = None
    for item in items:
        content = item["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else [
            b for b in content if isinstance(b, Mapping)]
        text = "".join(str(b.get("text") or "") for b in blocks if b.get("type") == "text")
        if item["role"] != "assistant":
            messages += _anthropic_user_turn(blocks, text)
            continue
        message = _anthropic_assistant(blocks, text)
        messages.append(message)
        if text and "tool_calls" not in message:
            final = text
        usage: Mapping[str, Any] = item["usage"] if isinstance(item.get("usage"), Mapping) else {}
        inputs += int(usage.get("input_tokens") or 0)
        outputs += int(usage.get("output_tokens") or 0)
        model = item.get("model") or model
    metadata: Dict[str, Any] = {"total_input_tokens": inputs, "total_output_tokens": outputs}
    if isinstance(model, str):
        metadata["model"] = model
    return final, messages, metadata


def _anthropic_assistant(blocks: Sequence[Mapping[str, Any]], text: str) -> Dict[str, Any]:
    """An assistant turn of Anthropic blocks: its text, ``tool_use`` and ``thinking`` blocks."""
    uses = [b for b in blocks if b.get("type") == "tool_use"]
    thoughts = [b.get("thinking") for b in blocks if b.get("type") == "thinking" and b.get("thinking")]
    return _assistant_message(
        text, [{"id": b.get("id"), "name": b.get("name"), "arguments": b.get("input") or {}} for b in uses],
        [{"type": "thinking", "text": t} for t in thoughts])


def _anthropic_user_turn(blocks: Sequence[Mapping[str, Any]], text: str) -> List[Dict[str, Any]]:
    """A user turn of Anthropic blocks: each ``tool_result`` a tool message, then the user's text (kept, empty,
    when there is nothing else)."""
    messages: List[Dict[str, Any]] = []
    results = [b for b in blocks if b.get("type") == "tool_result"]
    for block in results:
        output = block.get("content")
        if isinstance(output, list):
            output = "".join(str(part.get("text") or "") for part in output if isinstance(part, Mapping))
        messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": _as_tool_output(output)})
    if text or not results:
        messages.append({"role": "user", "content": text})
    return messages


_LANGCHAIN_ROLES = {"human": "user", "ai": "assistant", "tool": "tool", "system": "system"}


def _from_langchain(items: List[Any]) -> Tuple[Any, List[Dict[str, Any]], Dict[str, Any]]:
    """LangChain or LangGraph messages (``type`` human, ai, tool or system) as the v1 transcript."""
    messages: List[Dict[str, Any]] = []
    inputs = outputs = 0
    model = None
    final: Any = ""
    for item in items:
        role = _LANGCHAIN_ROLES.get(getattr(item, "type", ""), "assistant")
        content = item.content
        text = content if isinstance(content, str) else "".join(
            b.get("text", "") for b in content if isinstance(b, Mapping) and b.get("type") == "text")
        if role != "assistant":
            message: Dict[str, Any] = {"role": role, "content": text}
            if role == "tool":
                message["tool_call_id"] = getattr(item, "tool_call_id", None)
            messages.append(message)
            continue
        message = _langchain_assistant(item, content, text)
        messages.append(message)
        usage = getattr(item, "usage_metadata", None) or {}
        inputs += int(usage.get("input_tokens") or 0)
        outputs += int(usage.get("output_tokens") or 0)
        model = (getattr(item, "response_metadata", None) or {}).get("model_name") or model
        if text and "tool_calls" not in message:
            final = text
    metadata: Dict[str, Any] = {"total_input_tokens": inputs, "total_output_tokens": outputs}
    if model:
        metadata["model"] = model
    return final, messages, metadata


def _langchain_assistant(item: Any, content: Any, text: str) -> Dict[str, Any]:
    """An AI message: its text, ``tool_calls``, and the thinking or reasoning blocks of a list content."""
    calls = getattr(item, "tool_calls", None) or []
    thoughts = [b.get("thinking") or b.get("text") for b in content if isinstance(b, Mapping)
                and b.get("type") in ("thinking", "reasoning")] if isinstance(content, list) else []
    message = _assistant_message(
        text, [{"id": c.get("id"), "name": c.get("name"), "arguments": c.get("args") or {}} for c in calls], [])
    if thoughts:  # reasoning blocks, even empty ones only: then an empty list
        message["thinking"] = [{"type": "text", "text": t} for t in thoughts if t]
    return message


# ---------------------------------------------------------------------------
# MCP shim (§3.6): a stdio MCP server whose tools go through the proxy
# ---------------------------------------------------------------------------

MCP_PROTOCOL_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
_RPC_PARSE_ERROR, _RPC_INVALID_REQUEST, _RPC_METHOD_NOT_FOUND = -32700, -32600, -32601
_RPC_INVALID_PARAMS, _RPC_INTERNAL_ERROR = -32602, -32603


class McpShim:
    """A Model Context Protocol server over stdio (JSON-RPC 2.0, one message per line).

    For agent frameworks that speak MCP: ``tools/list`` comes from §3.6's
    sources (``PIPELINES_TOOLS_SCHEMA_B64`` / ``_JSON``, else the platform's
    ``GET {api_url}/api/agents/{agent_id}/tools-schema``), ``tools/call`` goes
    through the proxy client (one Idempotency-Key per call, reused on its
    retries; failures become ``isError`` results).  Notifications are never
    answered; malformed lines get JSON-RPC errors; nothing crashes it.
    """

    def __init__(self, *, environ: Optional[Mapping[str, str]] = None, client: Optional[ProxyClient] = None) -> None:
        self.environ = dict(os.environ if environ is None else environ)
        self.client = client
        self._tools: Optional[List[Dict[str, Any]]] = None
        self._envelope: Optional[Envelope] = None
        self._lock = threading.Lock()

    # -- protocol -----------------------------------------------------------------

    def handle_line(self, line: str) -> Optional[str]:
        """The reply line to one input line, or ``None`` (notifications, responses, blank lines)."""
        if not line.strip():
            return None
        try:
            message = json.loads(line)
        except ValueError as exc:
            return _rpc_error(None, _RPC_PARSE_ERROR, f"parse error: {_short(str(exc), 120)}")
        if isinstance(message, list):
            return _rpc_error(None, _RPC_INVALID_REQUEST, "batches are not supported: send one message per line")
        if not isinstance(message, dict):
            return _rpc_error(None, _RPC_INVALID_REQUEST, f"a message must be a JSON object, got {json_type(message)}")
        has_id = "id" in message
        request_id = message.get("id")
        valid_id = request_id is None or (isinstance(request_id, (str, int)) and not isinstance(request_id, bool))
        if has_id and not valid_id:
            return _rpc_error(None, _RPC_INVALID_REQUEST, "id must be a string or a number")
        method = message.get("method")
        if method is None and ("result" in message or "error" in message):
            return None  # a response to something we never send: ignore
        if message.get("jsonrpc") != "2.0" or not isinstance(method, str):
            expected = 'expected {"jsonrpc": "2.0", "method": ...}'
            return _rpc_error(request_id, _RPC_INVALID_REQUEST, expected) if has_id else None
        if not has_id:
            return None  # a notification (notifications/initialized, cancelled, ...): never answered
        params = message.get("params", {})
        if not isinstance(params, dict):
            return _rpc_error(request_id, _RPC_INVALID_PARAMS, "params must be an object")
        try:
            result = self._dispatch(method, params)
        except _RpcError as exc:
            return _rpc_error(request_id, exc.code, exc.message)
        except Exception as exc:  # noqa: BLE001 - never crash the shim
            token = self._envelope.run_token if self._envelope else None
            _log.error("mcp: %s failed", method, exc_info=_redact_exception_chain(exc, token))
            return _rpc_error(request_id, _RPC_INTERNAL_ERROR, describe_error(exc, DETAIL_LIMIT, token))
        return json.dumps({"jsonrpc": "2.0", "id": request_id, "result": result}, ensure_ascii=False)

    def _dispatch(self, method: str, params: Dict[str, Any]) -> Dict[str, Any]:
        if method == "initialize":
            asked = params.get("protocolVersion")
            version = asked if asked in MCP_PROTOCOL_VERSIONS else MCP_PROTOCOL_VERSIONS[0]
            return {"protocolVersion": version, "capabilities": {"tools": {"listChanged": False}},
                    "serverInfo": {"name": "pipelines_port", "version": __version__},
                    "instructions": "Every tool call goes through the Pipelines per-run proxy."}
        if method == "ping":
            return {}
        if method == "tools/list":
            return {"tools": [{"name": t["name"], "description": t.get("description") or "",
                               "inputSchema": t["input_schema"]} for t in self.tools()]}
        if method == "tools/call":
            name, arguments = params.get("name"), params.get("arguments", {})
            if not isinstance(name, str):
                raise _RpcError(_RPC_INVALID_PARAMS, "tools/call needs params.name, a string")
            if arguments is None:
                arguments = {}
            if not isinstance(arguments, dict):
                raise _RpcError(_RPC_INVALID_PARAMS, "tools/call params.arguments must be an object")
            return self.call_tool(name, arguments)
        raise _RpcError(_RPC_METHOD_NOT_FOUND, f"method not found: {_short(method, 80)}")

    # -- tools --------------------------------------------------------------------

    def envelope(self) -> Envelope:
        with self._lock:
            if self._envelope is None:
                try:
                    self._envelope = Envelope.from_env(self.environ)
                except EnvelopeError as exc:
                    raise _RpcError(_RPC_INTERNAL_ERROR, f"the shim has no run: {exc}") from None
            return self._envelope

    def tools(self) -> List[Dict[str, Any]]:
        """The tool list (platform shape), read once: inline env first, else the platform's endpoint."""
        with self._lock:
            cached = self._tools
        if cached is not None:
            return cached
        try:
            inline = _tools_schema_from_env(self.environ)
        except EnvelopeError as exc:
            raise _RpcError(_RPC_INTERNAL_ERROR, str(exc)) from None
        tools = inline if inline is not None else self._fetch_tools()
        try:
            tools = convert_tools(tools, "platform")
        except ValueError as exc:
            raise _RpcError(_RPC_INTERNAL_ERROR, f"the tools schema is invalid: {exc}") from None
        with self._lock:
            self._tools = tools
        return tools

    def _fetch_tools(self) -> List[Any]:
        """``GET {api_url}/api/agents/{agent_id}/tools-schema`` with the run token (§3.6)."""
        agent_id = (self.environ.get(ENV_AGENT_ID) or "").strip()
        if not agent_id:
            raise _RpcError(_RPC_INTERNAL_ERROR, f"no tools schema: set {ENV_TOOLS_SCHEMA_B64} (or "
                                                 f"{ENV_TOOLS_SCHEMA_JSON}), or {ENV_AGENT_ID} to fetch it")
        envelope = self.envelope()
        api_url = (self.environ.get(ENV_API_URL) or "").strip().rstrip("/") or envelope.api_url
        try:
            base = urlsplit(validate_proxy_url(api_url, ENV_API_URL))
        except EnvelopeError as exc:
            raise _RpcError(_RPC_INTERNAL_ERROR, str(exc)) from None
        path = f"{base.path.rstrip('/')}/api/agents/{quote(agent_id, safe='')}/tools-schema"
        headers = {"Accept": "application/json", "Authorization": "Bearer " + envelope.run_token,
                   "User-Agent": _USER_AGENT}
        try:
            status, _, body = _shared_transport().exchange(base, "GET", path, headers, b"", 30.0, MAX_REPLY_BYTES)
        except (_TransportFailure, _ReplyTooLarge) as exc:
            raise _RpcError(_RPC_INTERNAL_ERROR, f"cannot fetch the tools schema: "
                                                 f"{describe_error(exc.__cause__ or exc, 200)}") from None
        value, is_json = _decode_body(body, "")
        tools = value.get("tools") if is_json and isinstance(value, dict) else None
        if status != 200 or not isinstance(tools, list):
            raise _RpcError(_RPC_INTERNAL_ERROR, f"cannot fetch the tools schema: HTTP {status} from "
                                                 f"{base.netloc}{path}")
        return tools

    def call_tool(self, name: str, arguments: Dict[str, Any]) -> Dict[str, Any]:
        """One ``tools/call`` through the proxy, as an MCP result (``isError`` on failure)."""
        envelope = self.envelope()
        try:
            value = proxy_call(name, arguments, envelope=envelope, client=self.client)
        except ProxyError as exc:
            return {"content": [{"type": "text", "text": str(exc)}], "isError": True}
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        result: Dict[str, Any] = {"content": [{"type": "text", "text": text}], "isError": False}
        if isinstance(value, dict):
            result["structuredContent"] = value
        return result

    # -- transport -----------------------------------------------------------------

    def serve(self, stdin: Any = None, stdout: Any = None, *, max_concurrency: int = 8) -> int:
        """Read lines until EOF; ``tools/call`` runs concurrently, replies are written whole, one per line."""
        from concurrent.futures import ThreadPoolExecutor

        stdin = sys.stdin if stdin is None else stdin
        stdout = sys.stdout if stdout is None else stdout
        write_lock = threading.Lock()

        def answer(line: str) -> None:
            reply = self.handle_line(line)
            if reply is not None:
                with write_lock:
                    stdout.write(reply + "\n")
                    stdout.flush()

        with ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="pipelines-mcp") as pool:
            for line in stdin:
                # Only tool calls are slow (the proxy may take minutes); a false positive of this
                # cheap test merely runs a line on the pool, where replies may come out of order.
                if '"tools/call"' in line:
                    pool.submit(answer, line)
                else:
                    answer(line)
        return 0


class _RpcError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _rpc_error(request_id: Any, code: int, message: str) -> str:
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}})

# ---------------------------------------------------------------------------
# Command line: serve, mcp
# ---------------------------------------------------------------------------

class _UsageError(Exception):
    """A command-line problem: printed as one line, exit status 2."""


def load_agent(spec: str) -> Callable[..., Any]:
    """The callable named by ``PATH.py:NAME`` or ``package.module:NAME`` (``NAME`` may be dotted).

    A file's directory goes first on ``sys.path`` so its sibling imports work.
    Raises ``ValueError`` with one readable line.
    """
    import importlib
    import importlib.util

    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"expected PATH_OR_MODULE:FUNCTION (e.g. agent.py:agent or mypkg.agent:agent), got {spec!r}")
    is_file = where.endswith(".py") or os.sep in where or "/" in where
    try:
        if is_file:
            path = os.path.abspath(where)
            if not os.path.isfile(path):
                raise ValueError(f"no such file: {where}")
            directory, name = os.path.split(path)
            name = name[:-3] if name.endswith(".py") else name
            loaded = sys.modules.get(name)
            if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") != path:
                name = f"_pipelines_agent_{name}"
            if directory not in sys.path:
                sys.path.insert(0, directory)
            spec_ = importlib.util.spec_from_file_location(name, path)
            if spec_ is None or spec_.loader is None:
                raise ValueError(f"cannot load {where} as a Python module")
            module = importlib.util.module_from_spec(spec_)
            sys.modules[name] = module
            try:
                loader: Any = spec_.loader  # Loader.exec_module is missing from Python 3.9's stubs
                loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name, None)
                raise
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
    except ValueError:
        raise
    except SyntaxError as exc:
        raise ValueError(f"{where} has a syntax error: {exc.msg} (line {exc.lineno})") from None
    except (Exception, SystemExit) as exc:
        raise ValueError(f"cannot import {where}: it raised {describe_error(exc, 300)}{_where_raised(exc)}") from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
            hint = (" (it has `agent`: add `run = pp.code_mode(agent)`)" if attr == "run" and "agent" in names
                    else f" (callables defined there: {', '.join(names)[:200] or 'none'})")
            raise ValueError(f"{where} has no function {attr!r}{hint}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{where}:{attr} is a {type(target).__name__}, not a function")
    return cast(Callable[..., Any], target)


def _where_raised(exc: BaseException) -> str:
    """`` (file.py, line N)`` of the innermost frame, to find an import error fast."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return ""
    return f" ({os.path.basename(tb.tb_frame.f_code.co_filename)}, line {tb.tb_lineno})"


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _configure_logging(debug: bool, access_log: bool = True) -> None:
    logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _log.setLevel(logging.DEBUG if debug else logging.INFO)
    if not access_log:
        _access_log.setLevel(logging.WARNING)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _argparse().ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise _argparse().ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _port(text: str) -> int:
    if not text.strip().isdigit() or int(text) > 65535:
        raise _argparse().ArgumentTypeError(f"expected a port number from 0 to 65535, got {text!r}")
    return int(text)


def _non_negative_int(text: str) -> int:
    if not text.strip().isdigit():
        raise _argparse().ArgumentTypeError(f"expected a whole number, 0 or more, got {text!r}")
    return int(text)


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise _argparse().ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def _argparse() -> Any:
    import argparse

    return argparse


def _cmd_serve(args: Any) -> int:
    _configure_logging(args.debug or _truthy(os.environ.get(ENV_DEBUG)), access_log=not args.no_access_log)
    try:
        agent = load_agent(args.agent)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None
    tools_schema = args.tools_schema if args.tools_schema is not None else tools_schema_beside(args.agent)
    if isinstance(agent, DispatchApp):
        app = agent
    else:
        try:
            app = DispatchApp(
                agent, path=args.path, token_env=args.token_env, auth_header=args.auth_header, no_auth=args.no_auth,
                max_body=args.max_body, run_timeout_s=args.timeout, tools_schema=tools_schema,
                proxy_hosts=args.proxy_hosts, strict=True if args.strict else None,
            )
        except ValueError as exc:
            raise _UsageError(str(exc)) from None

    def ready(server: Any) -> None:
        print(f"pipelines_port serve: listening on {server.url}", flush=True)
        print(f"pipelines_port serve: auth: {app.describe_auth()}", flush=True)
        if app.tools_schema is not None:
            print(f"pipelines_port serve: {len(app.tools_schema)} tools declared, served at GET /tools_schema",
                  flush=True)
        print(f"pipelines_port serve: proxy hosts: {app.describe_proxy_hosts()}", flush=True)
        if (os.environ.get(ENV_RUN_TOKEN) or "").strip():  # §5 child-env-explicit: a server's environment has no run
            print(f"pipelines_port serve: WARNING: {ENV_RUN_TOKEN} is set in this server's environment: a proxy call "
                  "made outside a dispatch would use that run; unset it", flush=True)

    try:
        status = serve(app, host=args.host, port=args.port, grace_s=args.grace, ready=ready, server=args.server,
                       read_timeout_s=args.read_timeout, keepalive_s=args.keepalive,
                       max_connections=args.max_connections, gc_threshold=args.gc_threshold)
    except OSError as exc:
        raise _UsageError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    if status != 0:  # dispatches still running after the grace period: leave without waiting for their threads
        logging.shutdown()
        sys.stdout.flush()
        os._exit(status)
    return status


def _cmd_mcp(args: Any) -> int:
    logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _log.setLevel(logging.DEBUG if args.debug or _truthy(os.environ.get(ENV_DEBUG)) else logging.WARNING)
    return McpShim().serve()


_KIT_COMMANDS = ("init", "doctor", "check", "dataset", "simulate", "demo")


def _prog_name() -> str:
    """How the user ran us: ``python3 -m pipelines_port`` or ``pipelines_port.py``."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main_spec is not None and getattr(main_spec, "name", "") == "pipelines_port":
        return "python3 -m pipelines_port"
    if os.path.basename(sys.argv[0] or "") == "pipelines_port.py":
        return "pipelines_port.py"
    return "python3 -m pipelines_port"


def _parser(prog: Optional[str] = None) -> Any:
    """The command line's parser: ``serve`` and ``mcp``."""
    argparse = _argparse()
    # allow_abbrev=False: a prefix must not stand for an option (`--token SECRET` read as `--token-env SECRET`
    # would print the secret as a variable name).
    parser = argparse.ArgumentParser(
        prog=prog or _prog_name(),
        description="Put an agent under test on the Pipelines platform, standard library only.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"pipelines_port {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve_command(commands, argparse)
    _add_mcp_command(commands)
    return parser


def _add_serve_command(commands: Any, argparse: Any) -> None:
    serve_ = commands.add_parser(
        "serve", help="serve an agent as a dispatch endpoint (CONTRACT §2)", allow_abbrev=False,
        description="Serve agent(envelope) as a Pipelines dispatch endpoint: auth, ping, envelope, response.",
    )
    serve_.add_argument("agent", metavar="PATH_OR_MODULE:FUNCTION", help="e.g. agent.py:agent or mypkg.agent:agent")
    _add_endpoint_options(serve_, argparse)
    _add_server_options(serve_)
    _add_reply_options(serve_)
    serve_.set_defaults(run=_cmd_serve)


def _add_endpoint_options(serve_: Any, argparse: Any) -> None:
    """Where ``serve`` listens and how it checks the credential (§2 step 1)."""
    serve_.add_argument("--host", default="127.0.0.1",
                        help="interface to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    serve_.add_argument("--port", type=_port, default=8080, help="port (default 8080; 0 picks a free one)")
    serve_.add_argument("--path", default=DEFAULT_DISPATCH_PATH, help="dispatch path (default /dispatch)")
    serve_.add_argument("--token-env", default=DEFAULT_TOKEN_ENV, metavar="NAME",
                        help="environment variable holding the agent token (default AGENT_TOKEN)")
    serve_.add_argument("--token", action=_refuse_token_flag(argparse), help=argparse.SUPPRESS)
    serve_.add_argument("--auth-header", default="Authorization", metavar="NAME",
                        help="header carrying it: Authorization (Bearer <token>) or a custom name with the raw value")
    serve_.add_argument("--no-auth", action="store_true", help="disable inbound auth (anyone can dispatch)")


def _refuse_token_flag(argparse: Any) -> type:
    """The action of ``--token VALUE``: refused without echoing VALUE, which would be the agent token itself."""

    class RefuseTokenFlag(argparse.Action):  # type: ignore[misc]
        def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
            parser.error("--token is not accepted: the agent token is read from an environment variable, so it never "
                         "shows in a process list or a log: set AGENT_TOKEN, or name another with --token-env NAME")

    return RefuseTokenFlag


def _add_server_options(serve_: Any) -> None:
    """The limits ``serve`` holds requests to, and the server that holds them."""
    serve_.add_argument("--max-body", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                        help=f"largest request body accepted (default {DEFAULT_MAX_BODY_BYTES})")
    serve_.add_argument("--timeout", type=_positive_float, default=DEFAULT_RUN_TIMEOUT_S, metavar="SECONDS",
                        help="run_timeout_s: answer 504 when the agent takes longer (default 300, max 1800)")
    serve_.add_argument("--grace", type=_positive_float, default=DEFAULT_GRACE_S, metavar="SECONDS",
                        help="on SIGTERM/SIGINT, how long in-flight dispatches may finish (default 30)")
    serve_.add_argument("--server", choices=SERVERS, default="asyncio",
                        help="asyncio (default): one event loop, async agents on it, sync ones on a thread each; "
                             "threads: http.server, a thread per connection")
    serve_.add_argument("--read-timeout", type=_positive_float, default=DEFAULT_READ_TIMEOUT_S, metavar="SECONDS",
                        help=f"a request's head and body must arrive within this (default {DEFAULT_READ_TIMEOUT_S:g}; "
                             "408 after)")
    serve_.add_argument("--keepalive", type=_positive_float, default=DEFAULT_KEEPALIVE_S, metavar="SECONDS",
                        help=f"close an idle keep-alive connection after this (default {DEFAULT_KEEPALIVE_S:g}; "
                             "asyncio server)")
    serve_.add_argument("--max-connections", type=_positive_int, default=None, metavar="N",
                        help="open connections beyond this get 503 (default: from the open-file limit; asyncio "
                             "server)")


def _add_reply_options(serve_: Any) -> None:
    """What ``serve`` answers and allows (strictness, proxy hosts, the tools schema), what it logs, and how often
    it collects garbage."""
    serve_.add_argument("--strict", action="store_true",
                        help="refuse (500) a response the platform would only soften or drop parts of, instead of "
                             f"sending what it grades (also: {ENV_STRICT}=1)")
    serve_.add_argument("--proxy-hosts", metavar="HOSTS",
                        help="comma-separated allow-list of proxy hosts dispatches may name: host names, IP addresses "
                             "or .suffixes (*.suffix too), each optionally with :port (default: "
                             f"{ENV_PROXY_ALLOWED_HOSTS}, else any host; set but empty is an error)")
    serve_.add_argument("--tools-schema", metavar="FILE",
                        help="tools list served at GET /tools_schema "
                             "(default: tools_schema.json beside the agent file)")
    serve_.add_argument("--debug", action="store_true",
                        help=f"log every proxy request and reply, secrets redacted (also: {ENV_DEBUG}=1)")
    serve_.add_argument("--no-access-log", action="store_true",
                        help="no log line per request (logger pipelines_port.access); agents' errors still show")
    serve_.add_argument("--gc-threshold", type=_non_negative_int, default=SERVE_GC_THRESHOLD, metavar="N",
                        help=f"collect garbage every N allocations, not 700, after freezing what is loaded "
                             f"(default {SERVE_GC_THRESHOLD}; 0 leaves Python's collector as it is)")


def _add_mcp_command(commands: Any) -> None:
    mcp_ = commands.add_parser(
        "mcp", help="a stdio MCP server whose tools go through the per-run proxy", allow_abbrev=False,
        description="Serve MCP (JSON-RPC 2.0, one message per line) on stdin/stdout: tools/list from "
                    f"{ENV_TOOLS_SCHEMA_B64} or the platform, tools/call through the proxy of the run in "
                    f"{ENV_PROXY_URL} / {ENV_RUN_TOKEN}. Logs go to stderr.",
    )
    mcp_.add_argument("--debug", action="store_true", help="log every proxy request and reply, secrets redacted")
    mcp_.set_defaults(run=_cmd_mcp)


def main(argv: Optional[Sequence[str]] = None, *, prog: Optional[str] = None) -> int:
    """The command line (``serve``, ``mcp``); returns the exit status.  ``prog`` names the command in messages."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _KIT_COMMANDS:
        print(f"pipelines_port {argv[0]}: a kit command, not part of this module: run `pipelines-port {argv[0]}` "
              f"(pip install the kit) or `python3 -m conformance {argv[0]}` from a checkout", file=sys.stderr)
        return 2
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except _UsageError as exc:
        print(f"{parser.prog} {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
