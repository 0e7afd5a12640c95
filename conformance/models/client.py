"""One client for OpenAI-compatible Chat Completions: every model-backed role of the kit asks through it.

The judge, the simulated tools and the simulated user each name an :class:`Endpoint` (base URL, model, the
environment variable holding the key) and ask :meth:`ChatClient.ask_json` for one JSON object of a schema.
Any server that speaks ``POST {base}/chat/completions`` will do: OpenAI, the vendors' compatible endpoints,
LiteLLM, Ollama, llama.cpp's server, vLLM, LM Studio, and the kit's scripted stand-in (``scripted.py``).

How an answer is got:

1. **The form.**  Servers differ in how they take a schema, so the client tries, per endpoint, in order:
   ``response_format`` ``json_schema`` (OpenAI's structured outputs); ``json_object`` with a ``schema`` beside
   it (llama.cpp's server, which refuses the first with an HTTP 500 and constrains sampling to the second);
   ``json_object`` alone; no ``response_format``.  A form the server refuses (an HTTP 400, 422 or 500 whose
   body names ``response_format`` or the schema; a 500 only after the retries, as a 500 may be passing)
   moves to the next one, for this request and every later one.  The schema is in the system message as
   well, so every form can be followed.  A parameter the model refuses by name (a newer OpenAI model's
   ``max_tokens``, which it wants as ``max_completion_tokens``, or its ``temperature``) is renamed or dropped
   the same way.
2. **Transport.**  :func:`pipelines_port.post_json`, the runtime's one retry policy: 429, 408 and 5xx retried
   with backoff, ``Retry-After`` (or ``retry-after-ms``) honoured up to a bound, timeouts and dropped
   connections retried; a per-request timeout; at most ``concurrency`` requests at once per base URL.
3. **The answer**, parsed strictly: the message content is one JSON object (a Markdown code fence around it is
   taken off), valid against the schema, and passing the role's own ``check``.  Anything else (not JSON, the
   wrong shape, an answer cut at ``max_tokens``, a refusal) is asked again **once**, the problem named; a
   second bad answer raises :class:`ModelError`.
4. **The cache** (``cache.py``), when given: keyed by everything sent (the messages, the schema, the model's
   name), so an unchanged request is answered from disk and asks nothing.

The key is read from the environment and sent only as ``Authorization: Bearer``; it is in no message, log
line, report or cache file (errors are scrubbed of it, in case a server echoes it).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple
from urllib.parse import urlsplit

import pipelines_port as pp

from .cache import AnswerCache

__all__ = ["DEFAULT_BASE_URL", "Endpoint", "Answer", "Usage", "ModelError", "ChatClient", "endpoint_from_options",
           "MODEL_RETRY", "add_usage"]

DEFAULT_BASE_URL = "https://api.openai.com/v1"
# Bounded: a role waits at most ~1 + 2 + 4 s between tries, or what Retry-After asks up to 60 s; then the row is
# reported as not judged (or the tool call as an error), never left hanging.
MODEL_RETRY = pp.RetryPolicy(max_attempts=4, base_delay_s=1.0, max_delay_s=20.0, max_retry_after_s=60.0,
                             transport_retries=2)
FORMS = ("json_schema", "json_object+schema", "json_object", "none")
_REFUSED_FORM = re.compile(r"response_format|json_schema|json_object|schema|structured", re.I)
_FENCE = re.compile(r"^```(?:json|JSON)?\s*\n?(.*?)\n?```$", re.S)


class ModelError(Exception):
    """A role's request could not be answered: one line naming why (never the key); ``usage``: what it cost."""

    def __init__(self, message: str, usage: Optional[Mapping[str, int]] = None) -> None:
        super().__init__(message)
        self.usage: Dict[str, int] = dict(usage or {})


class Endpoint(NamedTuple):
    """Where a role asks: ``{base_url}/chat/completions`` with ``model``, the key in ``$key_env`` (if any)."""

    base_url: str
    model: str
    key_env: Optional[str] = "OPENAI_API_KEY"
    timeout_s: float = 120.0
    concurrency: int = 16
    max_tokens: int = 2048

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"

    def describe(self) -> str:
        """``model at https://host/v1``: no credentials, no query (they may hold keys)."""
        return f"{self.model} at {_safe(self.base_url).rstrip('/')}"


class Usage:
    """Requests and tokens spent (``cached``: answers taken from the cache instead)."""

    __slots__ = ("requests", "prompt_tokens", "completion_tokens", "cached", "retries")

    def __init__(self) -> None:
        self.requests = self.prompt_tokens = self.completion_tokens = self.cached = self.retries = 0

    def add(self, other: Mapping[str, int]) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + int(other.get(name) or 0))

    def to_json(self) -> Dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


def add_usage(total: Dict[str, int], spent: Mapping[str, int]) -> None:
    """``spent`` summed into ``total`` (a row's usage of a role), key by key."""
    for key, value in spent.items():
        total[key] = total.get(key, 0) + value


class Answer(NamedTuple):
    """One role's answer: the JSON ``value``, what it cost, and whether the cache gave it."""

    value: Dict[str, Any]
    usage: Dict[str, int]
    cached: bool = False


def _is_loopback(base_url: str) -> bool:
    host = (urlsplit(base_url).hostname or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def endpoint_from_options(model: str, url: Optional[str], key_env: Optional[str], *, what: str,
                          timeout_s: float = 120.0, concurrency: int = 16) -> Endpoint:
    """An :class:`Endpoint` from a role's command-line options; ``ValueError`` names a bad one.

    ``url`` defaults to ``$OPENAI_BASE_URL``, else OpenAI's; ``key_env`` to ``OPENAI_API_KEY`` (``""``: none).
    A key variable that is not set is an error unless the server is on this machine (local servers need none).
    """
    base = (url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL).strip()
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what}-url must be an http:// or https:// base URL such as {DEFAULT_BASE_URL}, "
                         f"got {_safe(base)!r}")
    if parts.username or parts.password or parts.query:
        raise ValueError(f"{what}-url must not carry credentials or a query: put the key in an environment "
                         f"variable and name it with {what}-key-env")
    if not model.strip():
        raise ValueError(f"{what}: give a model name (or `scripted`, the kit's offline stand-in)")
    name = key_env if key_env is not None else "OPENAI_API_KEY"
    if name and not os.environ.get(name, "").strip() and not _is_loopback(base):
        raise ValueError(f"{what}: the environment variable {name} holding the API key for {_safe(base)} is not set "
                         f"(a server on this machine needs none; {what}-key-env names another variable)")
    return Endpoint(base.rstrip("/"), model.strip(), name or None, timeout_s, concurrency)


def _safe(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}"


_LIMITS: Dict[str, threading.BoundedSemaphore] = {}
_LIMITS_LOCK = threading.Lock()


def _limit(endpoint: Endpoint) -> threading.BoundedSemaphore:
    """The one semaphore of a base URL: every role asking there shares its concurrency."""
    with _LIMITS_LOCK:
        key = f"{endpoint.base_url}#{endpoint.concurrency}"
        if key not in _LIMITS:
            _LIMITS[key] = threading.BoundedSemaphore(max(1, endpoint.concurrency))
        return _LIMITS[key]


class ChatClient:
    """Asks one :class:`Endpoint` for JSON answers (see the module docstring); safe to share between threads."""

    def __init__(self, endpoint: Endpoint, *, cache: Optional[AnswerCache] = None,
                 retry: Optional[pp.RetryPolicy] = None, sleep: Callable[[float], None] = time.sleep) -> None:
        self.endpoint = endpoint
        self.cache = cache
        self.retry = retry or MODEL_RETRY
        self._sleep = sleep
        self._key = os.environ.get(endpoint.key_env, "").strip() if endpoint.key_env else ""
        self._form = 0  # index into FORMS: the first this endpoint has not refused
        self._token_limit = "max_tokens"  # newer OpenAI models take only max_completion_tokens
        self._temperature = True  # ... and only their default temperature
        self._form_lock = threading.Lock()
        self.usage = Usage()  # everything this client spent, all calls together
        self._usage_lock = threading.Lock()

    def __repr__(self) -> str:  # the key is a secret
        return f"ChatClient({self.endpoint.describe()!r})"

    # -- the one public call ------------------------------------------------------------------------------------

    def ask_json(self, messages: Sequence[Mapping[str, Any]], schema: Mapping[str, Any], *, name: str,
                 strict: bool = True, check: Optional[Callable[[Dict[str, Any]], Optional[str]]] = None) -> Answer:
        """One JSON object of ``schema`` for ``messages``; ``check(value)`` names a problem or returns ``None``.

        Raises :class:`ModelError` when no usable answer came (transport, an error status after the retries,
        two answers that were not usable).
        """
        conversation = [dict(m) for m in messages]
        conversation[0] = dict(conversation[0], content=str(conversation[0].get("content", "")) + _schema_note(schema))
        key = None
        if self.cache is not None:
            key = self.cache.key({"model": self.endpoint.model, "name": name, "schema": schema,
                                  "messages": conversation})
            hit = self.cache.get(key)
            value = hit.get("value") if hit is not None else None
            if isinstance(value, dict) and (check is None or check(value) is None):
                self._count({"cached": 1})
                return Answer(value, {"cached": 1}, cached=True)
        spent: Dict[str, int] = {}
        try:
            return self._ask(conversation, schema, name, strict, check, key, spent)
        except ModelError as exc:
            self._count(spent)
            exc.usage = dict(spent)
            raise

    def _ask(self, conversation: List[Dict[str, Any]], schema: Mapping[str, Any], name: str, strict: bool,
             check: Optional[Callable[[Dict[str, Any]], Optional[str]]], key: Optional[str],
             spent: Dict[str, int]) -> Answer:
        """An answer, asked once more when the first is unusable; raises :class:`ModelError`."""
        problem = ""
        for attempt in (1, 2):
            content, finish = self._complete(conversation, schema, name, strict, spent)
            value, problem = _parse(content, finish, schema)
            if value is not None and check is not None:
                problem = check(value) or ""
            if not problem and value is not None:
                self._count(spent)
                if self.cache is not None and key is not None:
                    self.cache.put(key, {"value": value, "model": self.endpoint.model})
                return Answer(value, spent)
            if attempt == 1:  # one re-ask, the problem named
                conversation = [
                    *conversation, {"role": "assistant", "content": content[:4000]},
                    {"role": "user", "content": f"That answer cannot be used: {problem}. Answer again with only "
                                                "one JSON object that follows the schema."}]
        raise ModelError(f"the model's answer was not usable after one re-ask: {problem}")

    # -- the parts -----------------------------------------------------------------------------------------------

    def _count(self, spent: Mapping[str, int]) -> None:
        with self._usage_lock:
            self.usage.add(spent)

    def _complete(self, conversation: List[Dict[str, Any]], schema: Mapping[str, Any], name: str, strict: bool,
                  spent: Dict[str, int]) -> Tuple[str, str]:
        """One completion's content and finish reason, trying the forms the endpoint has not refused."""
        while True:
            form = self._form
            try:
                reply = self._post(self._payload(conversation, schema, name, strict, FORMS[form]), spent)
            except pp.HTTPStatusError as exc:
                if self._adjust(exc):
                    continue
                if _refuses_form(exc) and form < len(FORMS) - 1:
                    with self._form_lock:
                        self._form = max(self._form, form + 1)
                    continue
                raise ModelError(self._scrub(_status_message(exc, self.endpoint))) from None
            return _content(reply, spent)

    def _adjust(self, exc: pp.HTTPStatusError) -> bool:
        """Drop or rename a parameter the model refused (a 400 naming it), for this request and every later one.

        OpenAI's newer models refuse ``max_tokens`` ("Use 'max_completion_tokens' instead") and any ``temperature``
        but their default; older servers (llama.cpp's) ignore ``max_completion_tokens``, so it is sent only when
        asked for.
        """
        if exc.status_code != 400:
            return False
        error = exc.body.get("error") if isinstance(exc.body, dict) else None
        param = error.get("param") if isinstance(error, dict) else None
        text = _body_text(exc.body)
        with self._form_lock:
            if self._token_limit == "max_tokens" and "max_completion_tokens" in text and (
                    param == "max_tokens" or "'max_tokens'" in text):
                self._token_limit = "max_completion_tokens"
                return True
            if self._temperature and (param == "temperature" or "'temperature'" in text):
                self._temperature = False
                return True
        return False

    def _payload(self, conversation: List[Dict[str, Any]], schema: Mapping[str, Any], name: str, strict: bool,
                 form: str) -> Dict[str, Any]:
        payload: Dict[str, Any] = {"model": self.endpoint.model, "messages": conversation,
                                   self._token_limit: self.endpoint.max_tokens}
        if self._temperature:
            payload["temperature"] = 0
        if form == "json_schema":
            payload["response_format"] = {"type": "json_schema",
                                          "json_schema": {"name": name, "schema": schema, "strict": strict}}
        elif form == "json_object+schema":
            payload["response_format"] = {"type": "json_object", "schema": schema}
        elif form == "json_object":
            payload["response_format"] = {"type": "json_object"}
        return payload

    def _post(self, payload: Mapping[str, Any], spent: Dict[str, int]) -> Any:
        """One request through the runtime's retry policy, within the endpoint's concurrency limit."""
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}

        def sleep(seconds: float) -> None:
            spent["retries"] = spent.get("retries", 0) + 1
            self._sleep(seconds)

        spent["requests"] = spent.get("requests", 0) + 1
        try:
            with _limit(self.endpoint):
                return pp.post_json(self.endpoint.url, payload, headers=headers, timeout=self.endpoint.timeout_s,
                                    retry=self.retry, sleep=sleep)
        except pp.HTTPStatusError:
            raise
        except (pp.PipelinesError, OSError, ValueError) as exc:  # e.g. a Retry-After longer than the policy waits
            raise ModelError(self._scrub(f"{self.endpoint.describe()}: {exc}")) from None

    def _scrub(self, text: str) -> str:
        return text.replace(self._key, "[redacted]") if self._key else text


def _schema_note(schema: Mapping[str, Any]) -> str:
    return ("\n\nAnswer with exactly one JSON object, and nothing else, that follows this JSON Schema:\n"
            + json.dumps(schema, ensure_ascii=False))


def _refuses_form(exc: pp.HTTPStatusError) -> bool:
    """The server refused the request's ``response_format`` (not the request as a whole)."""
    return exc.status_code in (400, 422, 500, 501) and bool(_REFUSED_FORM.search(_body_text(exc.body)))


def _body_text(body: Any) -> str:
    return body if isinstance(body, str) else json.dumps(body, ensure_ascii=False, default=str)


def _status_message(exc: pp.HTTPStatusError, endpoint: Endpoint) -> str:
    """One line for an error status: what the server said, and the likely fix for the common ones."""
    status = exc.status_code
    hint = {401: f"the API key was refused (is ${endpoint.key_env} the key for this server?)",
            403: "the key may not use this model or endpoint",
            404: f"no such endpoint or model (is {endpoint.describe()} right? many servers want the base URL to "
                 "end in /v1)"}.get(status or 0, "")
    text = " ".join(str(exc).split())
    return f"{text[:400]}" + (f": {hint}" if hint else "")


def _content(reply: Any, spent: Dict[str, int]) -> Tuple[str, str]:
    """The message content and finish reason of a Chat Completions reply; tokens counted into ``spent``."""
    if not isinstance(reply, dict):
        raise ModelError(f"the server's reply is not a Chat Completions object: {json.dumps(reply)[:200]}")
    usage = reply.get("usage") if isinstance(reply.get("usage"), dict) else {}
    for ours, theirs in (("prompt_tokens", "prompt_tokens"), ("completion_tokens", "completion_tokens")):
        value = usage.get(theirs)
        if isinstance(value, int) and not isinstance(value, bool):
            spent[ours] = spent.get(ours, 0) + value
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        error = reply.get("error")
        raise ModelError("the server's reply has no choices" + (f": {json.dumps(error)[:300]}" if error else ""))
    message = choices[0].get("message") if isinstance(choices[0].get("message"), dict) else {}
    if isinstance(message.get("refusal"), str) and message["refusal"].strip():
        return "", "refusal:" + message["refusal"].strip()[:300]
    content = message.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return (content if isinstance(content, str) else ""), str(choices[0].get("finish_reason") or "")


def _parse(content: str, finish: str, schema: Mapping[str, Any]) -> Tuple[Optional[Dict[str, Any]], str]:
    """The answer as a JSON object valid against ``schema``, or ``None`` and the problem in a few words."""
    if finish.startswith("refusal:"):
        return None, f"the model refused ({finish[len('refusal:'):]})"
    text = content.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    if finish == "length":
        return None, "the answer was cut at the token limit: answer shorter"
    if not text:
        return None, "the answer was empty"
    try:
        value = json.loads(text)
    except ValueError as exc:
        return None, f"the answer is not JSON ({exc.msg} at character {exc.pos}): {text[:120]!r}"
    if not isinstance(value, dict):
        return None, f"the answer is JSON but not an object: {text[:120]!r}"
    problems = pp.validate_args(schema, value, path="answer")
    if problems:
        return None, "the answer does not follow the schema: " + "; ".join(problems[:5])
    return value, ""
