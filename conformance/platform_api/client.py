"""The platform's REST API: JSON requests on the runtime module's transport, its retries, its errors in one line.

Where: ``--api-url``, else ``PIPELINES_API_URL`` (else the SDK's ``PIPELINES_BASE_URL``), else
``https://api.pipelines.tech``.  The key: ``PIPELINES_API_KEY``, sent as ``Authorization: Bearer`` (as the
SDK sends it), over https or plain http to a loopback host only.  It is never printed, logged or written:
messages name the variable, never its value, and an echo of it in a reply is redacted.

Retries (``pipelines_port``'s transport and retry loop): 429 and 5xx (500, 502, 503, 504) with backoff,
``Retry-After`` honoured (seconds or an HTTP date), and timeouts and dropped connections.  Every POST
carries an ``Idempotency-Key``, so a retried create is one create where the platform honours the key.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple
from urllib.parse import quote, urlencode, urlsplit

import pipelines_port as pp

__all__ = ["DEFAULT_API_URL", "ENV_API_URL", "ENV_API_KEY", "RETRY", "SetupError", "PlatformError", "Client",
           "resolve_api_url", "resolve_api_key", "connect"]

DEFAULT_API_URL = "https://api.pipelines.tech"  # the SDK's default (0.1.15)
ENV_API_URL = "PIPELINES_API_URL"
ENV_SDK_URL = "PIPELINES_BASE_URL"  # what the SDK reads: honoured after ours, so one setting serves both
ENV_API_KEY = "PIPELINES_API_KEY"
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
RETRY = pp.RetryPolicy(max_attempts=6, base_delay_s=1.0, max_delay_s=30.0, max_retry_after_s=120.0,
                       transport_retries=3)
TIMEOUT_S = 60.0
MAX_REPLY_BYTES = 64 << 20
REASONS = {401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 409: "Conflict", 422: "Unprocessable Entity",
           429: "Too Many Requests"}
USER_AGENT = f"pipelines-port/{pp.__version__}"
_UNSAFE_KEY = re.compile(r"[\x00-\x20\x7f]")


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class SetupError(Exception):
    """The command cannot reach the platform as configured (no key, a bad URL): exit status 2."""


class PlatformError(pp.PipelinesError):
    """The platform refused a request (``status``) or could not be reached (``status`` None); ``str()`` is one line.

    ``detail`` is the reply's own explanation, ``fields`` the ``(field, why)`` pairs of a 422.
    """

    def __init__(self, message: str, *, status: Optional[int] = None, detail: str = "",
                 fields: Sequence[Tuple[str, str]] = (), body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail
        self.fields = list(fields)
        self.body = body

    @property
    def usage(self) -> bool:
        """True when the caller's setup or input is what the platform refused (a 4xx other than 429)."""
        return self.status is not None and 400 <= self.status < 500 and self.status != 429


def _field(loc: Any) -> str:
    """A 422 ``loc`` as a field path: ``["body", "rows", 3, "state"]`` -> ``rows[3].state``."""
    parts = list(loc) if isinstance(loc, (list, tuple)) else [loc]
    if len(parts) > 1 and parts[0] == "body":
        parts = parts[1:]
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def reply_detail(body: Any) -> Tuple[str, List[Tuple[str, str]]]:
    """The explanation in an error reply, and its ``(field, why)`` pairs: FastAPI's ``detail`` as a string,
    a validation list (``loc``, ``msg``) or an object (``message``, ``error_class``); else the text."""
    if isinstance(body, Mapping):
        detail = body.get("detail", body.get("message", body.get("error")))
        if isinstance(detail, str):
            return detail, []
        if isinstance(detail, list):
            fields = [(_field(item.get("loc")), str(item.get("msg", item))) if isinstance(item, Mapping)
                      else ("", str(item)) for item in detail]
            return "; ".join(f"{f}: {why}" if f else why for f, why in fields), fields
        if isinstance(detail, Mapping):
            message, error_class = detail.get("message"), detail.get("error_class")
            if isinstance(message, str) and message:
                return message + (f" ({error_class})" if isinstance(error_class, str) and error_class else ""), []
            return str(error_class or json.dumps(detail)[:300]), []
        return json.dumps(body)[:300], []
    if isinstance(body, str):
        return _short(" ".join(body.split()), 300), []
    return ("" if body is None else json.dumps(body)[:300]), []


def _line(status: int, method: str, path: str, detail: str, fields: Sequence[Tuple[str, str]], subject: str,
          attempts: int) -> str:
    """The one line an error status becomes (the commands say more for 404 and 409 where they know more)."""
    head = f"{status} {REASONS[status]}" if status in REASONS else f"HTTP {status}"
    tries = f"{attempts} attempt{'' if attempts == 1 else 's'}"
    said = f": {detail}" if detail else ""
    where = f"{method} {path}"
    if status == 401:
        return (f"{head}: the platform refused the API key in {ENV_API_KEY} (wrong, expired or revoked; the key "
                "is not shown): set a valid key")
    if status == 403:
        return f"{head}: the API key in {ENV_API_KEY} may not do this ({where}){said}"
    if status == 404:
        return f"{head}: {subject or where} does not exist, or this API key cannot see it{said}"
    if status == 422 and fields:
        return f"{head}: the platform rejected {subject or 'the request'}: " + "; ".join(
            f"{field}: {why}" if field else why for field, why in fields)
    if status == 429:
        return f"{head}: still rate limited after {tries} ({where}){said}"
    if status >= 500:
        return f"{head} from the platform after {tries} ({where}){said}"
    return f"{head} ({where}){said}"


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_api_url(flag: Optional[str], environ: Optional[Mapping[str, str]] = None) -> str:
    """The API's base URL (see the module docstring), without a trailing ``/``; raises :class:`SetupError`."""
    environ = os.environ if environ is None else environ
    url = (flag or environ.get(ENV_API_URL) or environ.get(ENV_SDK_URL) or DEFAULT_API_URL).strip()
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        raise SetupError(f"the API URL {_short(url, 80)!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not host:
        raise SetupError(f"the API URL {_short(url, 80)!r} must be http(s)://HOST[:PORT][/PATH] "
                         f"(--api-url or {ENV_API_URL})")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise SetupError(f"the API URL must not carry credentials, a query or a fragment (--api-url or {ENV_API_URL});"
                         f" the API key goes in {ENV_API_KEY}")
    if parts.scheme == "http" and not _is_loopback(host):
        raise SetupError(f"refusing to send the API key over plain http to {host}: use https:// (plain http is for "
                         "a loopback host only)")
    return url.rstrip("/")


def resolve_api_key(environ: Optional[Mapping[str, str]] = None) -> str:
    """The API key from ``PIPELINES_API_KEY``; raises :class:`SetupError` naming the variable (never the value)."""
    environ = os.environ if environ is None else environ
    key = (environ.get(ENV_API_KEY) or "").strip()
    if not key:
        raise SetupError(f"set {ENV_API_KEY} to an API key from the platform (Settings, API Keys); the kit reads it "
                         "from the environment only")
    if _UNSAFE_KEY.search(key):
        raise SetupError(f"{ENV_API_KEY} holds a space or control character inside it (not shown); copy the key "
                         "again")
    return key


class Client:
    """The platform's REST API for one base URL and key.  ``sleep`` and ``policy`` are seams for tests."""

    def __init__(self, base_url: str, api_key: str, *, policy: Optional[pp.RetryPolicy] = None,
                 sleep: Callable[[float], Any] = time.sleep, timeout: float = TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self._base = urlsplit(self.base_url)
        self.origin = f"{self._base.scheme}://{self._base.netloc}"
        self._key = api_key
        self._policy = policy or RETRY
        self._sleep = sleep
        self._timeout = timeout
        self._transport = pp._Transport()

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, body: Any = None, *, query: Optional[Mapping[str, Any]] = None,
                subject: str = "") -> Any:
        """Send one request (retried, see the module docstring); the decoded JSON reply, ``None`` when empty.

        Raises :class:`PlatformError`; ``subject`` ("agent 42") names what a 404 or 422 is about.
        """
        target = self._base.path.rstrip("/") + path + (f"?{urlencode(query)}" if query else "")
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT, "Authorization": f"Bearer {self._key}"}
        data = b""
        if body is not None:
            data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if method == "POST":
            headers["Idempotency-Key"] = secrets.token_hex(16)
        attempts = 0

        def send() -> Tuple[int, List[Tuple[str, str]], bytes]:
            nonlocal attempts
            attempts += 1
            try:
                return self._transport.exchange(self._base, method, target, headers, data, self._timeout,
                                                MAX_REPLY_BYTES)
            except pp._ReplyTooLarge as big:
                raise PlatformError(f"the platform's reply to {method} {path} {big}", status=big.status) from None

        def interpret(status: int, reply_headers: List[Tuple[str, str]], reply: bytes) -> pp.ProxyOutcome:
            try:
                value, is_json = (json.loads(reply), True) if reply.strip() else (None, True)
            except ValueError:
                value, is_json = reply.decode("utf-8", "replace"), False
            value = pp.redact(value, self._key)
            if 200 <= status < 300:
                if not is_json:
                    return pp.ProxyOutcome("error", error=PlatformError(
                        f"HTTP {status} from {method} {path}, but the reply is not JSON: "
                        f"{_short(' '.join(str(value).split()), 120)!r} (is --api-url the API's address?)",
                        status=status))
                return pp.ProxyOutcome("value", value)
            detail, fields = reply_detail(value)
            error = PlatformError(_line(status, method, path, detail, fields, subject, attempts), status=status,
                                  detail=detail, fields=fields, body=value)
            if status not in RETRY_STATUSES:
                return pp.ProxyOutcome("error", error=error)
            retry_after = pp.parse_retry_after(next((v for k, v in reply_headers if k.lower() == "retry-after"), None))
            if retry_after is not None and retry_after > self._policy.max_retry_after_s:
                return pp.ProxyOutcome("error", error=PlatformError(
                    f"{error} (the platform asked to wait {retry_after:g} s before a retry, longer than the "
                    f"{self._policy.max_retry_after_s:g} s this command waits)", status=status, detail=detail))
            return pp.ProxyOutcome("retry", error=error, retry_after=retry_after)

        def transport_error(cause: BaseException) -> PlatformError:
            reason = _short(" ".join(str(cause).split()) or type(cause).__name__, 200)
            return PlatformError(f"could not reach the platform at {self.origin} ({method} {path}): "
                                 f"{type(cause).__name__}: {reason}; check --api-url or {ENV_API_URL}")

        return pp._retry_loop(send, interpret, policy=self._policy, sleep=self._sleep, transport_error=transport_error)

    # -- the endpoints the kit uses (the SDK's paths, 0.1.15) ----------------------------------------

    def agents_named(self, name: str) -> List[Dict[str, Any]]:
        """The agents called exactly ``name`` (the list's ``search`` matches substrings)."""
        reply = self.request("GET", "/api/agents", query={"search": name})
        items = reply.get("items") if isinstance(reply, Mapping) else reply
        return [item for item in items or [] if isinstance(item, dict) and item.get("name") == name]

    def create_agent(self, body: Mapping[str, Any]) -> Dict[str, Any]:
        reply = self.request("POST", "/api/agents", body, subject=f"agent {body.get('name')!r}")
        return _object(reply, "POST /api/agents")

    def update_agent(self, agent_id: Any, body: Mapping[str, Any]) -> Dict[str, Any]:
        path = f"/api/agents/{quote(str(agent_id), safe='')}"
        return _object(self.request("PUT", path, body, subject=f"agent {agent_id}"), "PUT " + path)

    def create_test_run(self, agent_id: Any, body: Mapping[str, Any]) -> Dict[str, Any]:
        path = f"/api/agents/{quote(str(agent_id), safe='')}/test-runs"
        return _object(self.request("POST", path, body, subject=f"agent {agent_id}"), "POST " + path)

    def get_test_run(self, run_id: Any, page: Optional[int] = None) -> Dict[str, Any]:
        path = f"/api/test-runs/{quote(str(run_id), safe='')}"
        reply = self.request("GET", path, query={"page": page} if page else None, subject=f"test run {run_id}")
        return _object(reply, "GET " + path)


def _object(reply: Any, where: str) -> Dict[str, Any]:
    if not isinstance(reply, dict):
        raise PlatformError(f"{where}: expected a JSON object from the platform, got {pp.json_type(reply)}")
    return reply


def connect(api_url: Optional[str], environ: Optional[Mapping[str, str]] = None, **options: Any) -> Client:
    """A :class:`Client` for ``--api-url`` (or the environment) and the key; raises :class:`SetupError`."""
    return Client(resolve_api_url(api_url, environ), resolve_api_key(environ), **options)
