"""The interop tier's real OpenAI-compatible server (llama.cpp's, through ``llama-cpp-python[server]``, on a tiny
model the test writes itself): what it answers, in plain ``urllib``, so the kit's model client
(``conformance/models/client.py``) is written against facts.

Each test holds one behaviour a client meets: the reply's shape, the JSON-schema constraint in the server's own
form (``{"type": "json_object", "schema": ...}``), the 500 it gives for OpenAI's ``json_schema`` form, a
``max_tokens`` cut, ``stop``, ``seed``, the fields it ignores, its error bodies, streaming, and concurrent
requests.  Skipped when ``llama_cpp`` or ``gguf`` is not installed (tests/interop/requirements-model.txt).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from tests.interop.hosts import http_call
from tests.interop.model_server import MODEL_NAME, ModelServer, chat, missing, model_server, write_tiny_gguf

VERDICT_SCHEMA: Dict[str, Any] = {
    "type": "object",
    "properties": {
        "task_completion": {"type": "integer", "minimum": 1, "maximum": 5},
        "verdict": {"type": "string", "enum": ["PASS", "FAIL"]},
        "failure_mode": {"type": ["string", "null"]},
        "explanation": {"type": "string"},
    },
    "required": ["task_completion", "verdict", "failure_mode", "explanation"],
    "additionalProperties": False,
}
MESSAGES = [
    {"role": "system", "content": "You grade an agent's run. Answer with the verdict as JSON."},
    {"role": "user", "content": "Instruction: refund order #4521.\nFinal response: Order 4521 is refunded."},
]
JSON_OBJECT = {"type": "json_object", "schema": VERDICT_SCHEMA}
ENOUGH = 1000  # tokens: the shortest verdict is ~80 (one token per character), this model's answers ~150


def assert_verdict_shape(content: str) -> Dict[str, Any]:
    """``content`` parses as JSON and holds exactly the verdict schema's keys, with its types and enum values
    (not its integer range: the server does not enforce ``minimum``/``maximum``)."""
    verdict = json.loads(content)
    assert isinstance(verdict, dict)
    assert sorted(verdict) == sorted(VERDICT_SCHEMA["required"])
    assert type(verdict["task_completion"]) is int
    assert verdict["verdict"] in ("PASS", "FAIL")
    assert verdict["failure_mode"] is None or isinstance(verdict["failure_mode"], str)
    assert isinstance(verdict["explanation"], str)
    return verdict


def verdicts(server: ModelServer, schema: Dict[str, Any], seeds: range) -> List[Dict[str, Any]]:
    """The server's answers under ``schema`` for each seed, each checked for the verdict's shape."""
    answers = []
    for seed in seeds:
        status, reply = chat(server, {"messages": MESSAGES, "max_tokens": ENOUGH, "seed": seed,
                                      "response_format": {"type": "json_object", "schema": schema}})
        assert status == 200, reply
        assert reply["choices"][0]["finish_reason"] == "stop"
        answers.append(assert_verdict_shape(reply["choices"][0]["message"]["content"]))
    return answers


def test_the_model_file_is_written_the_same_every_time() -> None:
    if missing():
        pytest.skip(missing())
    digests = []
    for _ in range(2):
        with tempfile.TemporaryDirectory() as directory:
            path = write_tiny_gguf(Path(directory))
            digests.append(hashlib.sha256(path.read_bytes()).hexdigest())
            assert path.stat().st_size < 1_000_000
    assert digests[0] == digests[1]


def test_a_chat_completion_has_the_openai_reply_shape(openai_compatible_server: ModelServer) -> None:
    status, reply = chat(openai_compatible_server, {"messages": MESSAGES, "max_tokens": 64})
    assert status == 200, reply
    assert reply["object"] == "chat.completion"
    assert isinstance(reply["id"], str) and reply["id"]
    assert isinstance(reply["created"], int)
    assert reply["model"] == MODEL_NAME
    [choice] = reply["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = reply["usage"]
    assert usage["prompt_tokens"] > len(MESSAGES[1]["content"])  # a token per character, plus the template's
    assert 0 <= usage["completion_tokens"] <= 64
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_the_reply_validates_as_the_openai_packages_chat_completion(openai_compatible_server: ModelServer) -> None:
    chat_types = pytest.importorskip("openai.types.chat", reason="needs the openai package")
    status, reply = chat(openai_compatible_server,
                         {"messages": MESSAGES, "response_format": JSON_OBJECT, "max_tokens": ENOUGH})
    assert status == 200, reply
    parsed = chat_types.ChatCompletion.model_validate(reply)
    assert parsed.usage is not None and parsed.usage.completion_tokens > 0


def test_json_object_with_a_schema_holds_the_answer_to_the_verdict_schemas_keys_types_and_enums(
        openai_compatible_server: ModelServer) -> None:
    answers = verdicts(openai_compatible_server, VERDICT_SCHEMA, range(10))
    assert len({json.dumps(a, sort_keys=True) for a in answers}) > 1  # sampled, not one canned answer


def test_an_integers_minimum_and_maximum_are_not_enforced_but_an_integer_enum_is(
        openai_compatible_server: ModelServer) -> None:
    """The server's schema-to-grammar conversion drops ``minimum``/``maximum``: ``task_completion`` comes back as
    any integer (this model picks one in 1..5 about one time in four), so a client checks the range itself; an
    ``enum`` of the allowed integers is held by the grammar."""
    unconstrained = [a["task_completion"] for a in verdicts(openai_compatible_server, VERDICT_SCHEMA, range(10))]
    assert not all(1 <= n <= 5 for n in unconstrained), unconstrained
    with_enum = json.loads(json.dumps(VERDICT_SCHEMA))
    with_enum["properties"]["task_completion"]["enum"] = [1, 2, 3, 4, 5]
    assert all(1 <= a["task_completion"] <= 5 for a in verdicts(openai_compatible_server, with_enum, range(10)))


def test_openais_json_schema_form_is_refused_with_a_500_naming_the_forms_it_takes(
        openai_compatible_server: ModelServer) -> None:
    """The client's fallback has this reason: OpenAI's form is a request-validation error here, reported as a
    500 (not a 400), so a client that retries 5xx must tell it from a transient failure by its body."""
    response_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT_SCHEMA,
                                                              "strict": True}}
    status, reply = chat(openai_compatible_server, {"messages": MESSAGES, "response_format": response_format,
                                                    "max_tokens": ENOUGH})
    assert status == 500
    error = reply["error"]
    assert error["type"] == "internal_server_error"
    assert "response_format" in error["message"]
    assert "'text' or 'json_object'" in error["message"]


def test_json_object_without_a_schema_gives_some_json_object(openai_compatible_server: ModelServer) -> None:
    status, reply = chat(openai_compatible_server, {"messages": MESSAGES, "response_format": {"type": "json_object"},
                                                    "max_tokens": ENOUGH, "seed": 1})
    assert status == 200, reply
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(reply["choices"][0]["message"]["content"]), dict)


def test_a_max_tokens_cut_gives_finish_reason_length_and_truncated_json(openai_compatible_server: ModelServer) -> None:
    status, reply = chat(openai_compatible_server, {"messages": MESSAGES, "response_format": JSON_OBJECT,
                                                    "max_tokens": 10})
    assert status == 200, reply
    [choice] = reply["choices"]
    assert choice["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 10
    assert choice["message"]["content"].startswith("{")
    with pytest.raises(ValueError):
        json.loads(choice["message"]["content"])


def test_a_stop_sequence_ends_the_answer_before_it(openai_compatible_server: ModelServer) -> None:
    status, reply = chat(openai_compatible_server, {"messages": MESSAGES, "response_format": JSON_OBJECT,
                                                    "max_tokens": ENOUGH, "stop": [":"]})
    assert status == 200, reply
    [choice] = reply["choices"]
    assert choice["finish_reason"] == "stop"
    assert "".join(choice["message"]["content"].split()) == '{"task_completion"'


def test_the_same_seed_gives_the_same_answer(openai_compatible_server: ModelServer) -> None:
    body = {"messages": MESSAGES, "response_format": JSON_OBJECT, "max_tokens": ENOUGH, "temperature": 1.0}
    answers = [chat(openai_compatible_server, {**body, "seed": seed})[1]["choices"][0]["message"]["content"]
               for seed in (11, 12, 11, 12)]
    assert answers[0] == answers[2] and answers[1] == answers[3]
    assert answers[0] != answers[1]


def test_n_above_one_still_gives_one_choice(openai_compatible_server: ModelServer) -> None:
    status, reply = chat(openai_compatible_server, {"messages": MESSAGES, "max_tokens": 8, "n": 3})
    assert status == 200, reply
    assert len(reply["choices"]) == 1


def test_unknown_fields_are_ignored(openai_compatible_server: ModelServer) -> None:
    status, reply = chat(openai_compatible_server, {"messages": MESSAGES, "max_tokens": 8, "frobnicate": {"x": 1},
                                                    "parallel_tool_calls": False, "store": False})
    assert status == 200, reply
    assert reply["object"] == "chat.completion"


def test_any_model_name_is_answered_by_the_one_model_and_echoed(openai_compatible_server: ModelServer) -> None:
    status, reply = chat(openai_compatible_server, {"messages": MESSAGES, "max_tokens": 8, "model": "gpt-4o"})
    assert status == 200, reply
    assert reply["model"] == "gpt-4o"
    assert reply["choices"][0]["message"]["role"] == "assistant"


def test_a_bad_request_body_is_a_500_in_openais_error_shape(openai_compatible_server: ModelServer) -> None:
    status, reply = chat(openai_compatible_server, {"messages": "not a list", "max_tokens": 8})
    assert status == 500
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["type"] == "internal_server_error"
    assert "messages" in reply["error"]["message"]


def test_a_body_that_is_not_json_is_a_500_in_plain_text(openai_compatible_server: ModelServer) -> None:
    reply = http_call(openai_compatible_server.base_url, "POST", "/chat/completions",
                      {"Content-Type": "application/json"}, b"{not json")
    assert reply.status == 500
    assert reply.headers["content-type"].startswith("text/plain")
    assert reply.body == b"Internal Server Error"


def test_an_assistant_message_with_null_content_is_refused_but_an_empty_one_is_taken(
        openai_compatible_server: ModelServer) -> None:
    """OpenAI takes ``content: null`` beside ``tool_calls``; this server's request model wants a string (or no key)."""
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_order", "arguments": "{}"}}]
    result = {"role": "tool", "tool_call_id": "call_1", "content": '{"status": "shipped"}'}
    refused, reply = chat(openai_compatible_server, {"max_tokens": 8, "messages": [
        *MESSAGES, {"role": "assistant", "content": None, "tool_calls": calls}, result]})
    assert refused == 500 and "content" in reply["error"]["message"]
    for assistant in ({"role": "assistant", "content": "", "tool_calls": calls},
                      {"role": "assistant", "tool_calls": calls}):
        status, reply = chat(openai_compatible_server, {"max_tokens": 8, "messages": [*MESSAGES, assistant, result]})
        assert status == 200, reply


def test_the_developer_role_is_refused(openai_compatible_server: ModelServer) -> None:
    status, reply = chat(openai_compatible_server, {"max_tokens": 8,
                                                    "messages": [{"role": "developer", "content": "Grade."}]})
    assert status == 500
    assert "'system'" in reply["error"]["message"]


def test_max_completion_tokens_is_ignored_only_max_tokens_bounds_the_answer(
        openai_compatible_server: ModelServer) -> None:
    status, reply = chat(openai_compatible_server, {"messages": MESSAGES, "response_format": JSON_OBJECT,
                                                    "max_completion_tokens": 5})
    assert status == 200, reply
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] > 5
    assert_verdict_shape(reply["choices"][0]["message"]["content"])


def test_a_server_started_with_a_key_refuses_requests_without_it_in_fastapis_error_shape() -> None:
    if missing():
        pytest.skip(missing())
    key = "sk-local-0123456789"
    with tempfile.TemporaryDirectory() as directory, model_server(Path(directory), api_key=key) as server:
        assert chat(server, {"messages": MESSAGES, "max_tokens": 4})[0] == 200
        for wrong in (None, "sk-other", key.upper()):
            status, reply = chat(server._replace(api_key=wrong), {"messages": MESSAGES, "max_tokens": 4})
            assert (status, reply) == (401, {"detail": "Invalid API key"})
        bare = http_call(server.base_url, "POST", "/chat/completions",
                         {"Content-Type": "application/json", "Authorization": key},  # no "Bearer "
                         json.dumps({"model": server.model, "messages": MESSAGES}).encode())
        assert bare.status == 401
        assert key not in server.process.log()


def test_a_prompt_over_the_context_window_is_a_400_context_length_exceeded(
        openai_compatible_server: ModelServer) -> None:
    long = [{"role": "user", "content": "x" * 20_000}]  # a token per character: over the 16,384 of n_ctx
    status, reply = chat(openai_compatible_server, {"messages": long, "max_tokens": 8})
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["code"] == "context_length_exceeded"


def test_streaming_sends_chunks_then_done_and_no_usage(openai_compatible_server: ModelServer) -> None:
    body = json.dumps({"model": MODEL_NAME, "messages": MESSAGES, "response_format": JSON_OBJECT,
                       "max_tokens": ENOUGH, "stream": True, "stream_options": {"include_usage": True}}).encode()
    reply = http_call(openai_compatible_server.base_url, "POST", "/chat/completions",
                      {"Content-Type": "application/json"}, body, timeout=60)
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in reply.body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    content = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any(chunk.get("usage") for chunk in chunks)  # stream_options.include_usage is not honoured
    assert_verdict_shape(content)


def test_concurrent_requests_are_all_answered(openai_compatible_server: ModelServer) -> None:
    """Eight requests at once (the server runs one at a time behind a lock): every one gets its verdict."""
    results: List[Tuple[int, Any]] = []
    lock = threading.Lock()

    def one(seed: int) -> None:
        result = chat(openai_compatible_server, {"messages": MESSAGES, "response_format": JSON_OBJECT,
                                                 "max_tokens": ENOUGH, "seed": seed}, timeout=120)
        with lock:
            results.append(result)

    threads = [threading.Thread(target=one, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    assert len(results) == 8
    for status, reply in results:
        assert status == 200, reply
        assert_verdict_shape(reply["choices"][0]["message"]["content"])
