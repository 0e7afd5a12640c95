"""``pipelines-port model``: a scripted stand-in for the OpenAI and Anthropic APIs, so agents run offline.

    python3 -m conformance model [--port 8090]        # prints the base URLs to export, serves until Ctrl-C

It answers the three endpoints the model-API templates call, in their wire shapes:
``POST /v1/responses`` (OpenAI Responses), ``POST /v1/chat/completions`` (OpenAI
Chat) and ``POST /v1/messages`` (Anthropic Messages).  Any API key is accepted.
It is no model: it *plans* from what each request carries, deterministically,
so an agent loop runs its real code path (tool calls, their results, a final
answer) against the simulator's proxy, failure rules and ledger:

1. The instruction is the first user message.  Ids are the numbers in it
   (``#4521`` gives ``4521``); words are its lower-case words.
2. First turn: every *read* tool (``get_``, ``list_``, ``search``, ``find``,
   ``lookup``, ``check`` ...) whose other name words appear in the instruction
   (``get_order`` for "order 4521"); if none does, a search-like tool with the
   instruction as its query.
3. Next turn: every *acting* tool (any other name) whose verb appears in the
   instruction (``refund_order`` for "refund"), once.
4. Then the answer: one sentence per tool result, saying what failed
   (``{"error": ...}`` results) and what came back.

Arguments are filled from each tool's JSON Schema: ``*_id``/``id`` properties
get the first id, ``query``/``question``/``text``-like ones the instruction,
numbers the first number, enums their first value, booleans ``true``.  Since it
acts whenever the instruction names the action, a refusal row shows whether
the agent (its tools, the platform's rules) stops a forbidden action: the
simulator's report flags one it carried out.

``simulate`` starts one itself (``--model scripted``, or ``auto`` when the
agent's ``REQUIRED_ENV`` keys are not set) and points the agent at it.

The kit's own model-backed roles (the judge, simulated tools, the simulated user) ask it too when run
``scripted``: a Chat Completions request whose ``response_format`` names a role (``roles.py``) gets that
role's scripted answer (``scripted_roles.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from ..kit import prog
from .client import Endpoint
from .scripted_roles import answer_role

__all__ = ["Plan", "plan", "ScriptedModel", "scripted_endpoint", "main", "READ_VERBS", "is_read_tool"]

READ_VERBS = ("get", "list", "search", "find", "lookup", "look", "check", "read", "fetch", "query", "describe",
              "show", "view", "retrieve")
TEXT_ARGUMENTS = ("query", "q", "question", "text", "message", "prompt", "search", "input", "content", "body")
MAX_TOOL_TURNS = 3
MODEL_NAME = "pipelines-port-scripted-model"


class Call(NamedTuple):
    name: str
    arguments: Dict[str, Any]


class Plan(NamedTuple):
    """One model turn: tool calls, or the final text."""

    calls: Tuple[Call, ...] = ()
    text: str = ""


def _words(text: str) -> List[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _stem(word: str) -> str:
    for suffix in ("ing", "ed", "es", "s"):
        if len(word) > len(suffix) + 2 and word.endswith(suffix):
            return word[: -len(suffix)]
    return word


def _ids(instruction: str) -> List[str]:
    return re.findall(r"\d+", instruction)


def _fill(schema: Any, instruction: str) -> Dict[str, Any]:
    """Arguments for a tool from its JSON Schema and the instruction (see the module docstring)."""
    if not isinstance(schema, dict):
        return {}
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = [p for p in schema.get("required") or [] if p in properties] or list(properties)
    ids, numbers = _ids(instruction), re.findall(r"\d+(?:\.\d+)?", instruction)
    arguments: Dict[str, Any] = {}
    for name in required:
        spec = properties.get(name) if isinstance(properties.get(name), dict) else {}
        kind = spec.get("type")
        if isinstance(spec.get("enum"), list) and spec["enum"]:
            arguments[name] = spec["enum"][0]
        elif kind == "boolean":
            arguments[name] = True
        elif kind in ("integer", "number"):
            value = numbers[0] if numbers else "1"
            arguments[name] = int(float(value)) if kind == "integer" else float(value)
        elif name == "id" or name.endswith(("_id", "Id")):
            arguments[name] = ids[0] if ids else instruction.strip()[:64]
        elif kind == "array":
            arguments[name] = []
        elif kind == "object":
            arguments[name] = {}
        else:  # free text: the instruction itself (a reason, a note, a query)
            arguments[name] = instruction
    return arguments


def is_read_tool(tool: str) -> bool:
    """A tool that reads (its name starts with a read verb, or it searches); any other tool acts."""
    words = _words(tool)
    return bool(words) and (words[0] in READ_VERBS or "search" in words)


def plan(instruction: str, tools: Sequence[Tuple[str, Any]], done: Sequence[Tuple[str, Any]]) -> Plan:
    """The next turn, from the instruction, the tools offered (name, schema) and the calls made (name, result)."""
    words = {_stem(w) for w in _words(instruction)}
    called = [name for name, _ in done]
    tool_turns_left = MAX_TOOL_TURNS - _turns(done)
    if tools and tool_turns_left > 0 and not called:
        reads = [(n, s) for n, s in tools if is_read_tool(n)
                 and any(_stem(w) in words for w in _words(n)[1:])]
        if not reads:
            reads = [(n, s) for n, s in tools if "search" in n.lower() or n.lower().startswith(("find", "lookup"))][:1]
        if reads:
            return Plan(tuple(Call(n, _fill(s, instruction)) for n, s in reads))
    if tools and tool_turns_left > 0:
        acts = [(n, s) for n, s in tools if not is_read_tool(n) and n not in called
                and _words(n) and _stem(_words(n)[0]) in words]
        if acts:
            return Plan(tuple(Call(n, _fill(s, instruction)) for n, s in acts))
    return Plan(text=_answer(instruction, done))


def _turns(done: Sequence[Tuple[str, Any]]) -> int:
    return len({name for name, _ in done})


def _answer(instruction: str, done: Sequence[Tuple[str, Any]]) -> str:
    if not done:
        return f"I have no tool for this, so I cannot act on: {instruction.strip()[:200]}"
    parts = []
    for name, result in done:
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
        try:
            parsed = json.loads(text) if isinstance(text, str) else text
        except ValueError:
            parsed = text
        if isinstance(parsed, dict) and "error" in parsed:
            parts.append(f"{name} failed: {str(parsed['error'])[:160]}")
        else:
            parts.append(f"{name} returned {text[:160]}")
    return "Done. " + "; ".join(parts) + "."


# ---------------------------------------------------------------------------
# The three wire shapes
# ---------------------------------------------------------------------------


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(b.get("text", "")) for b in content if isinstance(b, dict) and b.get("type") in
                        ("text", "input_text", "output_text"))
    return ""


def _usage_tokens(body: Any, text: str) -> Tuple[int, int]:
    return max(1, len(json.dumps(body)) // 4), max(1, len(text) // 4)


def _responses(body: Dict[str, Any], number: int) -> Dict[str, Any]:
    items = body.get("input")
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items or []
    instruction = next((_text_of(i.get("content")) for i in items if i.get("role") == "user"), "")
    names = {i.get("call_id"): i.get("name") for i in items if i.get("type") == "function_call"}
    done = [(names.get(i.get("call_id"), "?"), i.get("output"))
            for i in items if i.get("type") == "function_call_output"]
    tools = [(t.get("name"), t.get("parameters")) for t in body.get("tools") or [] if t.get("type") == "function"]
    step = plan(instruction, tools, done)
    output: List[Dict[str, Any]] = []
    for i, call in enumerate(step.calls, 1):
        output.append({"type": "function_call", "id": f"fc_{number}_{i}", "call_id": f"call_{number}_{i}",
                       "name": call.name, "arguments": json.dumps(call.arguments), "status": "completed"})
    if step.text:
        output.append({"type": "message", "id": f"msg_{number}", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": step.text, "annotations": []}]})
    tokens_in, tokens_out = _usage_tokens(body, step.text or json.dumps(output))
    return {"id": f"resp_{number}", "object": "response", "created_at": 1700000000 + number, "status": "completed",
            "model": body.get("model") or MODEL_NAME, "output": output, "parallel_tool_calls": True,
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "usage": {"input_tokens": tokens_in, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens": tokens_out, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": tokens_in + tokens_out}}


def _role_name(body: Dict[str, Any]) -> str:
    """The kit role a request names in ``response_format.json_schema.name`` (``""``: an agent's request)."""
    response_format = body.get("response_format")
    schema = response_format.get("json_schema") if isinstance(response_format, dict) else None
    return str(schema.get("name") or "") if isinstance(schema, dict) else ""


def _chat(body: Dict[str, Any], number: int) -> Dict[str, Any]:
    messages = body.get("messages") or []
    role = answer_role(_role_name(body), messages)
    if role is not None:  # the judge, a simulated tool or the simulated user: one JSON answer
        text = json.dumps(role, ensure_ascii=False)
        tokens_in, tokens_out = _usage_tokens(body, text)
        return {"id": f"chatcmpl-{number}", "object": "chat.completion", "created": 1700000000 + number,
                "model": body.get("model") or MODEL_NAME,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                             "logprobs": None, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": tokens_in, "completion_tokens": tokens_out,
                          "total_tokens": tokens_in + tokens_out}}
    instruction = next((_text_of(m.get("content")) for m in messages if m.get("role") == "user"), "")
    names = {c.get("id"): (c.get("function") or {}).get("name") for m in messages if m.get("role") == "assistant"
             for c in m.get("tool_calls") or []}
    done = [(names.get(m.get("tool_call_id"), "?"), m.get("content")) for m in messages if m.get("role") == "tool"]
    tools = [((t.get("function") or {}).get("name"), (t.get("function") or {}).get("parameters"))
             for t in body.get("tools") or []]
    step = plan(instruction, tools, done)
    message: Dict[str, Any] = {"role": "assistant", "content": step.text or None, "refusal": None}
    if step.calls:
        message["tool_calls"] = [{"id": f"call_{number}_{i}", "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                 for i, c in enumerate(step.calls, 1)]
    tokens_in, tokens_out = _usage_tokens(body, step.text or json.dumps(message))
    return {"id": f"chatcmpl-{number}", "object": "chat.completion", "created": 1700000000 + number,
            "model": body.get("model") or MODEL_NAME,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": "tool_calls" if step.calls else "stop"}],
            "usage": {"prompt_tokens": tokens_in, "completion_tokens": tokens_out,
                      "total_tokens": tokens_in + tokens_out}}


def _messages(body: Dict[str, Any], number: int) -> Dict[str, Any]:
    messages = body.get("messages") or []
    instruction = next((_text_of(m.get("content")) for m in messages if m.get("role") == "user"
                        and _text_of(m.get("content"))), "")
    names = {b.get("id"): b.get("name") for m in messages if m.get("role") == "assistant"
             and isinstance(m.get("content"), list) for b in m["content"] if b.get("type") == "tool_use"}
    done = [(names.get(b.get("tool_use_id"), "?"), b.get("content") if isinstance(b.get("content"), str)
             else _text_of(b.get("content"))) for m in messages if isinstance(m.get("content"), list)
            for b in m["content"] if b.get("type") == "tool_result"]
    tools = [(t.get("name"), t.get("input_schema")) for t in body.get("tools") or []]
    step = plan(instruction, tools, done)
    content: List[Dict[str, Any]] = []
    if body.get("thinking"):
        content.append({"type": "thinking", "thinking": "Planning from the instruction and the tools.",
                        "signature": f"scripted-{number}"})
    if step.text:
        content.append({"type": "text", "text": step.text})
    for i, call in enumerate(step.calls, 1):
        content.append({"type": "tool_use", "id": f"toolu_{number}_{i}", "name": call.name, "input": call.arguments})
    tokens_in, tokens_out = _usage_tokens(body, step.text or json.dumps(content))
    return {"id": f"msg_{number}", "type": "message", "role": "assistant", "model": body.get("model") or MODEL_NAME,
            "content": content, "stop_reason": "tool_use" if step.calls else "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": tokens_in, "output_tokens": tokens_out}}


ENDPOINTS = {"/v1/responses": _responses, "/v1/chat/completions": _chat, "/v1/messages": _messages}


class ScriptedModel:
    """The three endpoints on 127.0.0.1 (a free port by default); ``requests`` counts what it answered."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        model = self
        self.requests = 0
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 30

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(min(length, 32 << 20)) or b"{}")
                except ValueError:
                    return self._send(400, {"error": {"type": "invalid_request_error", "message": "invalid JSON"}})
                answer = ENDPOINTS.get(self.path.split("?")[0])
                if answer is None or not isinstance(body, dict):
                    return self._send(404, {"error": {"type": "not_found_error",
                                                      "message": f"no endpoint {self.path}"}})
                with model._lock:
                    model.requests += 1
                    number = model.requests
                self._send(200, answer(body, number))

            def _send(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode("utf-8")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="scripted-model", daemon=True)

    @property
    def origin(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def environment(self) -> Dict[str, str]:
        """The variables that point the templates at this server."""
        return {"OPENAI_BASE_URL": self.origin + "/v1", "ANTHROPIC_BASE_URL": self.origin}

    def __enter__(self) -> ScriptedModel:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextlib.contextmanager
def scripted_endpoint() -> Iterator[Endpoint]:
    """The stand-in as a model :class:`~.client.Endpoint` for the kit's roles (no key), serving for the scope."""
    with ScriptedModel() as model:
        yield Endpoint(model.origin + "/v1", "scripted", None, timeout_s=30.0, concurrency=64)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=prog("model"), description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        model = ScriptedModel(args.host, args.port)
    except OSError as exc:
        print(f"{prog('model')}: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    with model:
        print(f"{prog('model')}: listening on {model.origin}", flush=True)
        for name, value in model.environment().items():
            print(f"export {name}={value}", flush=True)
        print("export OPENAI_API_KEY=scripted ANTHROPIC_API_KEY=scripted   # any key is accepted", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            print(f"{prog('model')}: stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
