"""Local fakes of three model APIs on 127.0.0.1, for testing agent loops with no network.

- :class:`FakeResponsesAPI`: OpenAI Responses, ``POST {base_url}/responses``:
  ``reasoning`` items (with a summary when the request asks for one),
  ``function_call`` items, ``message`` items.
- :class:`FakeChatAPI`: OpenAI Chat Completions, ``POST {base_url}/chat/completions``:
  ``tool_calls`` on the assistant message; the model's reasoning as
  ``reasoning_content``, the way OpenAI-compatible servers (DeepSeek, vLLM) send it.
- :class:`FakeAnthropicAPI`: Anthropic Messages, ``POST {base_url}/v1/messages``:
  a signed ``thinking`` block first when the request enables thinking (its
  text the turn's reasoning, possibly empty), then ``text`` and ``tool_use`` blocks.

Each fake answers from a script of turns in its API's wire shape, rejects what
the real API rejects (a wrong key, a tool call without its result, a result
without its call, an unknown reasoning item or thinking signature, an Anthropic
text block without non-whitespace text) with that API's error body, and records
every request::

    with FakeChatAPI() as api:
        api.script([RATE_LIMITED, Turn(tool_calls=[("get_order", {"order_id": "4521"})]), Turn(text="Done.")])
        monkeypatch.setenv("OPENAI_BASE_URL", api.base_url)
        ...
        api.requests[2].json   # the third request body

The script is consumed in order and its last entry repeats.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

__all__ = ["Turn", "RateLimited", "RATE_LIMITED", "Recorded", "FakeResponsesAPI", "FakeChatAPI", "FakeAnthropicAPI"]


class Turn(NamedTuple):
    """One model reply: optional reasoning, optional text, tool calls as ``(name, arguments)``.

    Arguments are an object; the OpenAI fakes send a string as is (to script broken JSON).
    """

    text: str = ""
    tool_calls: Sequence[Tuple[str, Union[str, Mapping[str, Any]]]] = ()
    reasoning: str = ""
    input_tokens: int = 100
    output_tokens: int = 20
    stop: str = ""  # "" (a normal end), "max_tokens" (cut off by the output limit) or "pause_turn" (Anthropic)


class RateLimited(NamedTuple):
    """A 429 reply in the API's error shape, with ``Retry-After``."""

    retry_after: str = "0"


RATE_LIMITED = RateLimited()
Step = Union[Turn, RateLimited]


class Recorded:
    """One request the fake received, and the status it answered."""

    def __init__(self, path: str, headers: Dict[str, str], body: Any) -> None:
        self.path = path
        self.headers = headers  # lower-case names
        self.json = body
        self.status: Optional[int] = None
        self.reply: Any = None  # what the fake answered

    def __repr__(self) -> str:
        return f"Recorded(POST {self.path} -> {self.status})"


class _Reject(Exception):
    """The request is one the real API refuses: ``status`` and the API's error ``kind``."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # hundreds of concurrent conversations connect at once


class FakeModelAPI:
    """The shared server: scripting, recording, routing.  Subclasses speak one API."""

    endpoint = ""  # path of the one endpoint, under the server root
    base_suffix = ""  # what base_url ends with (``/v1`` for OpenAI, nothing for Anthropic)

    def __init__(self, api_key: str = "sk-test-key-0123") -> None:
        self.api_key = api_key
        self.requests: List[Recorded] = []
        self.model_turns = 0  # successful replies so far
        self._script: List[Step] = [Turn(text="(unscripted)")]
        self._policy: Optional[Callable[[Dict[str, Any]], Step]] = None
        self._lock = threading.Lock()
        self._server: Optional[ThreadingHTTPServer] = None

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> "FakeModelAPI":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 30

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                status, extra_headers, payload = fake._handle(self.path, headers, raw)
                events = payload.pop("__sse__", None) if isinstance(payload, dict) else None
                if events is not None:  # a streamed reply: server-sent events, then [DONE]
                    data = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"
                else:
                    data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/event-stream" if events is not None else "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in extra_headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

        server = _Server(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "FakeModelAPI":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        assert self._server is not None, "start() the fake first"
        return f"http://127.0.0.1:{self._server.server_address[1]}{self.base_suffix}"

    # -- scripting -----------------------------------------------------------------

    def script(self, steps: Sequence[Step]) -> None:
        """The replies to give, in order; the last one repeats."""
        with self._lock:
            self._script = list(steps)

    def answer_by(self, policy: Callable[[Dict[str, Any]], Step]) -> None:
        """Answer each request with ``policy(request body)`` instead of the script: for concurrent
        conversations, where a shared script's order would mix them up."""
        with self._lock:
            self._policy = policy

    def answered(self) -> List[Recorded]:
        """The requests that got a model reply (not a 429 or a rejection)."""
        return [r for r in self.requests if r.status == 200]

    # -- handling --------------------------------------------------------------------

    def _handle(self, path: str, headers: Dict[str, str], raw: bytes) -> Tuple[int, Dict[str, str], Any]:
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        recorded = Recorded(path, headers, body)
        with self._lock:
            self.requests.append(recorded)
        try:
            if path != self.base_suffix + self.endpoint:
                raise _Reject(404, "not_found_error", f"no endpoint {path}")
            self._check_auth(headers)
            if not isinstance(body, dict):
                raise _Reject(400, "invalid_request_error", "the body must be a JSON object")
            self._check_request(body)
            with self._lock:
                policy = self._policy
                if policy is None:
                    step = self._script.pop(0) if len(self._script) > 1 else self._script[0]
            if policy is not None:
                step = policy(body)
            with self._lock:
                if isinstance(step, Turn):
                    self.model_turns += 1
                    number = self.model_turns
            if isinstance(step, RateLimited):
                recorded.status = 429
                return 429, {"Retry-After": step.retry_after}, self._error("rate_limit_error", "rate limit reached")
            reply = self._reply(step, number, body)
        except _Reject as reject:
            recorded.status = reject.status
            return reject.status, {}, self._error(reject.kind, str(reject))
        recorded.status = 200
        recorded.reply = reply
        return 200, {}, reply

    # What each API defines.

    def _check_auth(self, headers: Dict[str, str]) -> None:
        if headers.get("authorization") != f"Bearer {self.api_key}":
            raise _Reject(401, "invalid_request_error", "Incorrect API key provided")

    def _check_request(self, body: Dict[str, Any]) -> None:
        raise NotImplementedError

    def _reply(self, turn: Turn, number: int, body: Dict[str, Any]) -> Dict[str, Any]:
        raise NotImplementedError

    def _error(self, kind: str, message: str) -> Dict[str, Any]:
        return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _arguments(args: Union[str, Mapping[str, Any]]) -> str:
    """Tool-call arguments as OpenAI sends them: a JSON string (a scripted string goes as is, even broken JSON)."""
    return args if isinstance(args, str) else json.dumps(args)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise _Reject(400, "invalid_request_error", message)


class FakeResponsesAPI(FakeModelAPI):
    """OpenAI Responses API.  Reasoning items are "stored": the input may only refer to issued ones."""

    endpoint = "/responses"
    base_suffix = "/v1"

    def __init__(self, api_key: str = "sk-test-key-0123") -> None:
        super().__init__(api_key)
        self.reasoning_ids: set = set()
        self.encrypted: set = set()

    def _check_request(self, body: Dict[str, Any]) -> None:
        _require(isinstance(body.get("model"), str), "model: required")
        items = body.get("input")
        _require(isinstance(items, (list, str)), "input: must be a string or a list of items")
        for tool in body.get("tools") or ():
            _require(tool.get("type") == "function" and isinstance(tool.get("name"), str)
                     and isinstance(tool.get("parameters"), dict), f"tools: bad function tool {tool!r}")
        if isinstance(items, str):
            return
        calls, outputs = [], []
        for item in items:
            kind = item.get("type")
            if kind == "function_call":
                _require(isinstance(item.get("arguments"), str), "function_call.arguments must be a string")
                calls.append(item["call_id"])
            elif kind == "function_call_output":
                _require(item.get("call_id") in calls,
                         f"No tool call found for function call output with call_id {item.get('call_id')}.")
                _require(isinstance(item.get("output"), str), "function_call_output.output must be a string")
                outputs.append(item["call_id"])
            elif kind == "reasoning":
                if body.get("store") is False:  # nothing is stored: the item must carry its encrypted content
                    _require(item.get("encrypted_content") in self.encrypted,
                             "Reasoning items must include encrypted_content when store is false.")
                elif item.get("id") not in self.reasoning_ids:
                    raise _Reject(404, "invalid_request_error", f"Item with id '{item.get('id')}' not found.")
            elif kind in (None, "message"):
                _require(item.get("role") in ("user", "assistant", "system", "developer"), f"bad input item {item!r}")
        missing = [c for c in calls if c not in outputs]
        _require(not missing, f"No tool output found for function call {', '.join(missing)}.")

    def _reply(self, turn: Turn, number: int, body: Dict[str, Any]) -> Dict[str, Any]:
        output: List[Dict[str, Any]] = []
        if turn.reasoning:
            summary_asked = bool((body.get("reasoning") or {}).get("summary"))
            summary = [{"type": "summary_text", "text": turn.reasoning}] if summary_asked else []
            item = {"type": "reasoning", "id": f"rs_{number}", "summary": summary}
            if "reasoning.encrypted_content" in (body.get("include") or ()):
                item["encrypted_content"] = f"gAAAA-encrypted-{number}"
            output.append(item)
            with self._lock:
                self.reasoning_ids.add(f"rs_{number}")
                self.encrypted.add(f"gAAAA-encrypted-{number}")
        for i, (name, args) in enumerate(turn.tool_calls, 1):
            output.append({"type": "function_call", "id": f"fc_{number}_{i}", "call_id": f"call_{number}_{i}",
                           "name": name, "arguments": _arguments(args), "status": "completed"})
        if turn.text:
            output.append({"type": "message", "id": f"msg_{number}", "status": "completed", "role": "assistant",
                           "content": [{"type": "output_text", "text": turn.text, "annotations": []}]})
        cut = turn.stop == "max_tokens"
        return {
            "id": f"resp_{number}", "object": "response", "created_at": 1700000000 + number,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "model": body["model"], "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "store": body.get("store", True), "error": None,
            "usage": {"input_tokens": turn.input_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens": turn.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": turn.input_tokens + turn.output_tokens},
        }


class FakeChatAPI(FakeModelAPI):
    """OpenAI Chat Completions (and compatible servers that add ``reasoning_content``)."""

    endpoint = "/chat/completions"
    base_suffix = "/v1"

    def _check_request(self, body: Dict[str, Any]) -> None:
        _require(isinstance(body.get("model"), str), "model: required")
        messages = body.get("messages")
        _require(isinstance(messages, list) and bool(messages), "messages: required, a non-empty array")
        for tool in body.get("tools") or ():
            function = tool.get("function") or {}
            _require(tool.get("type") == "function" and isinstance(function.get("name"), str)
                     and isinstance(function.get("parameters"), dict), f"tools: bad function tool {tool!r}")
        pending: List[str] = []  # tool_call_ids still to be answered
        for i, message in enumerate(messages):
            role = message.get("role")
            _require(role in ("system", "developer", "user", "assistant", "tool"), f"messages[{i}].role: {role!r}")
            _require("reasoning_content" not in message, f"messages[{i}]: reasoning_content must not be sent back")
            if role == "tool":
                _require(message.get("tool_call_id") in pending,
                         "Invalid parameter: messages with role 'tool' must be a response to a preceding "
                         "message with 'tool_calls'.")
                _require(isinstance(message.get("content"), (str, list)), f"messages[{i}].content: must be a string")
                pending.remove(message["tool_call_id"])
                continue
            _require(not pending, "An assistant message with 'tool_calls' must be followed by tool messages "
                                  f"responding to each 'tool_call_id'. Missing: {', '.join(pending)}")
            for call in message.get("tool_calls") or ():
                _require(call.get("type") == "function" and isinstance(call.get("function", {}).get("arguments"), str),
                         f"messages[{i}].tool_calls: bad call {call!r}")
                pending.append(call["id"])
        _require(not pending, f"tool_call_ids without response messages: {', '.join(pending)}")

    def _reply(self, turn: Turn, number: int, body: Dict[str, Any]) -> Dict[str, Any]:
        message: Dict[str, Any] = {"role": "assistant", "content": turn.text or None, "refusal": None}
        if turn.reasoning:
            message["reasoning_content"] = turn.reasoning
        if turn.tool_calls:
            message["tool_calls"] = [
                {"id": f"call_{number}_{i}", "type": "function",
                 "function": {"name": name, "arguments": _arguments(args)}}
                for i, (name, args) in enumerate(turn.tool_calls, 1)
            ]
        if body.get("stream"):  # what a streaming client (Strands, say) asks for: the same turn as chunks
            return {"__sse__": _chat_chunks(turn, number, body)}
        return {
            "id": f"chatcmpl-{number}", "object": "chat.completion", "created": 1700000000 + number,
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": "length" if turn.stop == "max_tokens"
                         else "tool_calls" if turn.tool_calls else "stop"}],
            "usage": {"prompt_tokens": turn.input_tokens, "completion_tokens": turn.output_tokens,
                      "total_tokens": turn.input_tokens + turn.output_tokens},
        }


def _chat_chunks(turn: Turn, number: int, body: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One Chat Completions turn as ``chat.completion.chunk`` events (role, text, tool calls, finish, usage)."""
    head = {"id": f"chatcmpl-{number}", "object": "chat.completion.chunk", "created": 1700000000 + number,
            "model": body["model"]}

    def chunk(delta: Dict[str, Any], finish: Optional[str] = None) -> Dict[str, Any]:
        return dict(head, choices=[{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}])

    events = [chunk({"role": "assistant", "content": ""})]
    if turn.text:
        events.append(chunk({"content": turn.text}))
    for i, (name, args) in enumerate(turn.tool_calls):
        events.append(chunk({"tool_calls": [{"index": i, "id": f"call_{number}_{i + 1}", "type": "function",
                                             "function": {"name": name, "arguments": _arguments(args)}}]}))
    finish = "length" if turn.stop == "max_tokens" else "tool_calls" if turn.tool_calls else "stop"
    events.append(chunk({}, finish))
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append(dict(head, choices=[], usage={"prompt_tokens": turn.input_tokens,
                                                    "completion_tokens": turn.output_tokens,
                                                    "total_tokens": turn.input_tokens + turn.output_tokens}))
    return events


class FakeAnthropicAPI(FakeModelAPI):
    """Anthropic Messages API.  Thinking blocks carry signatures the request must send back intact."""

    endpoint = "/v1/messages"
    base_suffix = ""

    def __init__(self, api_key: str = "sk-ant-test-key-0123") -> None:
        super().__init__(api_key)
        self.signatures: set = set()

    def _check_auth(self, headers: Dict[str, str]) -> None:
        # The API takes the key as x-api-key or (newer SDKs) as a bearer token, and needs a version header.
        if self.api_key not in (headers.get("x-api-key"), (headers.get("authorization") or "")[len("Bearer "):]):
            raise _Reject(401, "authentication_error", "invalid x-api-key")
        _require(bool(headers.get("anthropic-version")), "anthropic-version: header required")

    def _error(self, kind: str, message: str) -> Dict[str, Any]:
        return {"type": "error", "error": {"type": kind, "message": message}}

    def _check_request(self, body: Dict[str, Any]) -> None:
        _require(isinstance(body.get("model"), str), "model: Field required")
        max_tokens = body.get("max_tokens")
        _require(isinstance(max_tokens, int) and max_tokens >= 1, "max_tokens: Field required")
        thinking = body.get("thinking")
        if thinking is not None:
            budget = thinking.get("budget_tokens")
            _require(thinking.get("type") == "enabled" and isinstance(budget, int) and 1024 <= budget < max_tokens,
                     "thinking.budget_tokens: must be >= 1024 and less than max_tokens")
        for tool in body.get("tools") or ():
            _require(isinstance(tool.get("name"), str) and isinstance(tool.get("input_schema"), dict),
                     f"tools: bad tool {tool!r}")
        messages = body.get("messages")
        _require(isinstance(messages, list) and bool(messages), "messages: Field required")
        _require(messages[0].get("role") == "user", "messages: first message must use the user role")
        previous_uses: List[str] = []
        for i, message in enumerate(messages):
            _require(message.get("role") in ("user", "assistant"), f"messages.{i}.role: must be user or assistant")
            content = message.get("content")
            blocks = content if isinstance(content, list) else []
            _require(isinstance(content, (str, list)) and content != "", f"messages.{i}.content: must be non-empty")
            results = [b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"]
            for block in blocks:
                if block.get("type") == "tool_result":
                    _require(isinstance(block.get("content"), (str, list)), f"messages.{i}: tool_result content")
                if block.get("type") == "text":
                    _require(isinstance(block.get("text"), str) and bool(block["text"].strip()),
                             f"messages.{i}: text content blocks must contain non-whitespace text")
                if block.get("type") == "thinking":
                    _require(block.get("signature") in self.signatures,
                             f"messages.{i}: Invalid `signature` in `thinking` block")
            unexpected = [r for r in results if r not in previous_uses]
            _require(not unexpected,
                     f"messages.{i}: unexpected `tool_use_id` found in `tool_result` blocks: {unexpected}")
            missing = [u for u in previous_uses if u not in results]
            _require(not missing, f"messages.{i}: `tool_use` ids were found without `tool_result` blocks "
                                  f"immediately after: {', '.join(missing)}")
            is_assistant = message["role"] == "assistant"
            previous_uses = [b["id"] for b in blocks if b.get("type") == "tool_use"] if is_assistant else []
            if thinking is not None and previous_uses and i == len(messages) - 2:
                _require(blocks[0].get("type") in ("thinking", "redacted_thinking"),
                         f"messages.{i}.content.0.type: Expected `thinking` or `redacted_thinking`, but found "
                         f"`{blocks[0].get('type')}`. When `thinking` is enabled, an assistant message with tool use "
                         "must start with a thinking block.")
        _require(not previous_uses, "the last assistant message's tool_use blocks have no tool_result")

    def _reply(self, turn: Turn, number: int, body: Dict[str, Any]) -> Dict[str, Any]:
        content: List[Dict[str, Any]] = []
        if body.get("thinking"):  # with thinking on, every turn starts with a (signed) thinking block
            signature = f"sig-{number}-" + "x" * 16
            with self._lock:
                self.signatures.add(signature)
            content.append({"type": "thinking", "thinking": turn.reasoning, "signature": signature})
        if turn.text:
            content.append({"type": "text", "text": turn.text})
        for i, (name, args) in enumerate(turn.tool_calls, 1):
            content.append({"type": "tool_use", "id": f"toolu_{number}_{i}", "name": name, "input": dict(args)})
        return {
            "id": f"msg_{number}", "type": "message", "role": "assistant", "model": body["model"], "content": content,
            "stop_reason": turn.stop or ("tool_use" if turn.tool_calls else "end_turn"), "stop_sequence": None,
            "usage": {"input_tokens": turn.input_tokens, "output_tokens": turn.output_tokens},
        }
