"""The kit's one model client (conformance/models/client.py) against a misbehaving server on 127.0.0.1."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Dict, List

import pytest

from conformance.models import roles
from conformance.models.cache import AnswerCache
import pipelines_port as pp
from conformance.models.client import ChatClient, Endpoint, ModelError, ModelServers, endpoint_from_options, object_root
from tests.fake_chat_server import DROP, FakeChatServer, Reply

SCHEMA = roles.judge_schema(False)
GOOD = json.dumps({"task_completion": 4, "verdict": "PASS", "failure_mode": None, "instruction_adherence": None,
                   "explanation": "done"})
MESSAGES = [{"role": "system", "content": "grade"}, {"role": "user", "content": json.dumps({"final_response": "x"})}]


def client(server: FakeChatServer, waits: List[float], **options: Any) -> ChatClient:
    endpoint = Endpoint(server.base_url, "fake-model", options.pop("key_env", None), timeout_s=options.pop(
        "timeout_s", 10.0), concurrency=options.pop("concurrency", 16))
    return ChatClient(endpoint, sleep=waits.append, **options)


def ask(c: ChatClient, **options: Any) -> Any:
    return c.ask_json(MESSAGES, SCHEMA, name=roles.JUDGE, **options)


def test_an_answer_with_its_usage_and_the_request_as_openai_takes_it() -> None:
    waits: List[float] = []
    with FakeChatServer([Reply(GOOD, prompt_tokens=300, completion_tokens=40)]) as server:
        answer = ask(client(server, waits))
    assert answer.value["verdict"] == "PASS" and not answer.cached
    assert answer.usage == {"requests": 1, "prompt_tokens": 300, "completion_tokens": 40}
    sent = server.requests[0]
    assert sent.path == "/v1/chat/completions"
    assert sent.json["model"] == "fake-model" and sent.json["temperature"] == 0
    assert sent.json["response_format"] == {"type": "json_schema", "json_schema": {
        "name": roles.JUDGE, "schema": SCHEMA, "strict": True}}
    assert sent.json["messages"][0]["content"].startswith("grade") and json.dumps(SCHEMA) in \
        sent.json["messages"][0]["content"]  # the schema is in the prompt too, for servers that ignore the form
    assert "authorization" not in sent.headers  # no key variable: nothing sent


def test_429_and_500_are_retried_honouring_retry_after() -> None:
    waits: List[float] = []
    script = [Reply(status=429, headers={"Retry-After": "2"}), Reply(status=500),
              Reply(status=503, headers={"retry-after-ms": "1500"}), Reply(GOOD)]
    with FakeChatServer(script) as server:
        c = client(server, waits)
        answer = ask(c)
    assert answer.value["verdict"] == "PASS"
    assert len(server.requests) == 4
    assert waits[0] == 2.0 and waits[2] == 1.5 and 0.5 <= waits[1] <= 4.0
    assert answer.usage["retries"] == 3 and answer.usage["requests"] >= 1


def test_a_retry_after_beyond_the_bound_is_not_waited_and_the_row_says_why() -> None:
    waits: List[float] = []
    with FakeChatServer([Reply(status=429, headers={"Retry-After": "3600"})]) as server:
        with pytest.raises(ModelError) as caught:
            ask(client(server, waits))
    assert 3600.0 not in waits and "HTTP 429" in str(caught.value) and "the server asked to wait 3600 s" in str(
        caught.value) and "proxy" not in str(caught.value)


def test_5xx_after_every_retry_is_an_error_naming_the_status() -> None:
    waits: List[float] = []
    with FakeChatServer([Reply(status=502, body={"error": {"message": "bad gateway"}})]) as server:
        with pytest.raises(ModelError) as caught:
            ask(client(server, waits))
    assert "HTTP 502" in str(caught.value) and "bad gateway" in str(caught.value)
    assert len(server.requests) == 4  # the policy's 4 attempts


def test_a_dropped_connection_is_retried() -> None:
    waits: List[float] = []
    with FakeChatServer([DROP, Reply(GOOD)]) as server:
        answer = ask(client(server, waits))
    assert answer.value["verdict"] == "PASS" and len(server.requests) == 2


def test_a_slow_answer_times_out_and_is_retried_then_given_up_on() -> None:
    waits: List[float] = []
    with FakeChatServer([Reply(GOOD, delay=1.5)]) as server:
        with pytest.raises(ModelError) as caught:
            ask(client(server, waits, timeout_s=0.3))
    assert "timed out" in str(caught.value).lower() or "timeout" in str(caught.value).lower()


def test_not_json_is_asked_again_once_with_the_problem_named() -> None:
    waits: List[float] = []
    with FakeChatServer([Reply("Sure! The verdict is PASS."), Reply(GOOD)]) as server:
        answer = ask(client(server, waits))
    assert answer.value["verdict"] == "PASS"
    reask = server.requests[1].json["messages"]
    assert reask[-2] == {"role": "assistant", "content": "Sure! The verdict is PASS."}
    assert "not JSON" in reask[-1]["content"] and reask[-1]["role"] == "user"
    assert answer.usage["requests"] == 2


def test_two_unusable_answers_are_an_error_never_an_answer() -> None:
    waits: List[float] = []
    bad = json.dumps({"task_completion": 9, "verdict": "MAYBE", "failure_mode": None, "explanation": ""})
    with FakeChatServer([Reply(bad)]) as server:
        with pytest.raises(ModelError) as caught:
            ask(client(server, waits))
    assert "schema" in str(caught.value) and "verdict" in str(caught.value)
    assert len(server.requests) == 2  # one re-ask, no more


def test_an_answer_cut_at_max_tokens_is_asked_again() -> None:
    waits: List[float] = []
    with FakeChatServer([Reply('{"task_completion": 4, "verd', finish_reason="length"), Reply(GOOD)]) as server:
        answer = ask(client(server, waits))
    assert answer.value["verdict"] == "PASS"
    assert "token limit" in server.requests[1].json["messages"][-1]["content"]


def test_a_fenced_answer_is_taken_out_of_its_fence() -> None:
    waits: List[float] = []
    with FakeChatServer([Reply(f"```json\n{GOOD}\n```")]) as server:
        assert ask(client(server, waits)).value["verdict"] == "PASS"
    assert len(server.requests) == 1


def test_the_role_check_can_ask_again() -> None:
    waits: List[float] = []
    fail_without_mode = json.dumps({"task_completion": 2, "verdict": "FAIL", "failure_mode": None,
                                    "instruction_adherence": None, "explanation": "no"})
    with FakeChatServer([Reply(fail_without_mode), Reply(GOOD)]) as server:
        answer = ask(client(server, waits), check=lambda v: "name the mode" if v["failure_mode"] is None and
                     v["verdict"] == "FAIL" else None)
    assert answer.value["verdict"] == "PASS" and "name the mode" in server.requests[1].json["messages"][-1]["content"]


def test_a_server_that_refuses_json_schema_gets_its_own_form_once_per_endpoint() -> None:
    """llama.cpp's server: json_schema gets a 500; json_object with a schema is what it constrains by."""
    waits: List[float] = []
    with FakeChatServer([Reply(GOOD)], refuse_json_schema=True) as server:
        c = client(server, waits)
        ask(c)
        ask(c)
    forms = [r.json.get("response_format") for r in server.requests]
    assert [f["type"] for f in forms[:4]] == ["json_schema"] * 4  # a 500 may be passing: the policy's retries
    assert forms[4:] == [{"type": "json_object", "schema": SCHEMA}] * 2  # then its form, for the later request too
    assert len(waits) == 3


def test_the_key_is_sent_as_bearer_and_is_in_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "sk-test-SECRET-0123456789"
    monkeypatch.setenv("FAKE_KEY", secret)
    waits: List[float] = []
    with FakeChatServer([Reply(GOOD)], require_key=secret) as server:
        assert ask(client(server, waits, key_env="FAKE_KEY")).value["verdict"] == "PASS"
        assert server.requests[0].headers["authorization"] == f"Bearer {secret}"
    monkeypatch.setenv("FAKE_KEY", secret + "-wrong")
    with FakeChatServer([Reply(GOOD)], require_key=secret) as server:  # its 401 body echoes the key it got
        c = client(server, waits, key_env="FAKE_KEY")
        with pytest.raises(ModelError) as caught:
            ask(c)
    assert "401" in str(caught.value) and "FAKE_KEY" in str(caught.value) and "SECRET" not in str(caught.value)
    assert secret not in repr(c)


def test_concurrency_is_limited_per_endpoint() -> None:
    waits: List[float] = []
    with FakeChatServer([Reply(GOOD, delay=0.05)]) as server:
        c = client(server, waits, concurrency=3)
        threads = [threading.Thread(target=ask, args=(c,)) for _ in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert len(server.requests) == 24 and server.max_active == 3
    assert c.usage.requests == 24


def test_the_cache_answers_an_unchanged_request_without_asking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "sk-cache-SECRET-42"
    monkeypatch.setenv("FAKE_KEY", secret)
    waits: List[float] = []
    with FakeChatServer([Reply(GOOD)], require_key=secret) as server:
        first = ask(client(server, waits, key_env="FAKE_KEY", cache=AnswerCache(str(tmp_path))))
        second = ask(client(server, waits, key_env="FAKE_KEY", cache=AnswerCache(str(tmp_path))))
        other = client(server, waits, key_env="FAKE_KEY", cache=AnswerCache(str(tmp_path))).ask_json(
            [*MESSAGES[:1], {"role": "user", "content": "{}"}], SCHEMA, name=roles.JUDGE)
    assert len(server.requests) == 2  # the first and the changed request; the second was the cache's
    assert second.cached and second.value == first.value and second.usage == {"cached": 1}
    assert not other.cached
    stored = [p.read_text() for p in tmp_path.rglob("*.json")]
    assert len(stored) == 2 and all(secret not in text and "FAKE_KEY" not in text for text in stored)


def test_a_broken_cache_entry_asks_the_model(tmp_path: Path) -> None:
    waits: List[float] = []
    with FakeChatServer([Reply(GOOD)]) as server:
        ask(client(server, waits, cache=AnswerCache(str(tmp_path))))
        for entry in tmp_path.rglob("*.json"):
            entry.write_text("{not json")
        cache = AnswerCache(str(tmp_path))
        again = ask(client(server, waits, cache=cache))
    assert not again.cached and len(server.requests) == 2 and cache.problem and "cannot read" in cache.problem


def test_endpoint_options_name_what_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ValueError, match="OPENAI_API_KEY .* is not set"):
        endpoint_from_options("gpt-x", None, None, what="--judge")
    local = endpoint_from_options("llama", "http://127.0.0.1:8080/v1/", None, what="--judge")
    assert local.base_url == "http://127.0.0.1:8080/v1" and local.url.endswith("/v1/chat/completions")
    with pytest.raises(ValueError, match="credentials"):
        endpoint_from_options("m", "https://user:pw@example.com/v1", "", what="--judge")
    with pytest.raises(ValueError, match="http:// or https://"):
        endpoint_from_options("m", "ftp://example.com", "", what="--judge")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://localhost:11434/v1")
    assert endpoint_from_options("qwen", None, None, what="--judge").base_url == "http://localhost:11434/v1"


def test_the_scripted_stand_in_answers_the_judge_role_over_http() -> None:
    from conformance.models.scripted import scripted_endpoint

    case: Dict[str, Any] = {"user_instruction": "Cancel order 9001", "expected_outcome": "refusal",
                            "trajectory": [{"tool": "cancel_order", "arguments": {"order_id": "9001"},
                                            "result": {"status": "cancelled"}, "source": "odyssey"}],
                            "final_response": "Cancelled."}
    with scripted_endpoint() as endpoint:
        answer = ChatClient(endpoint).ask_json([MESSAGES[0], {"role": "user", "content": json.dumps(case)}], SCHEMA,
                                               name=roles.JUDGE)
    assert answer.value["verdict"] == "FAIL" and answer.value["failure_mode"] == "incorrect_completion"
    assert "cancel_order" in answer.value["explanation"]


def test_a_newer_openai_model_gets_max_completion_tokens_and_its_own_temperature() -> None:
    """gpt-5 and the o-series refuse max_tokens and temperature 0 with a 400 naming the parameter."""
    max_tokens = {"error": {"message": "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                                       "'max_completion_tokens' instead.", "type": "invalid_request_error",
                            "param": "max_tokens", "code": "unsupported_parameter"}}
    temperature = {"error": {"message": "Unsupported value: 'temperature' does not support 0 with this model. Only "
                                        "the default (1) value is supported.", "type": "invalid_request_error",
                             "param": "temperature", "code": "unsupported_value"}}
    waits: List[float] = []
    with FakeChatServer([Reply(status=400, body=max_tokens), Reply(status=400, body=temperature),
                         Reply(GOOD)]) as server:
        c = client(server, waits)
        assert ask(c).value["verdict"] == "PASS"
        ask(c)
        sent = [r.json for r in server.requests]
    assert "max_tokens" in sent[0] and sent[0]["temperature"] == 0
    assert "max_tokens" not in sent[1] and sent[1]["max_completion_tokens"] == 2048 and sent[1]["temperature"] == 0
    assert "temperature" not in sent[2] and "temperature" not in sent[3] and sent[3]["max_completion_tokens"] == 2048
    assert len(sent) == 4 and waits == []  # no backoff: a refused parameter is no transient failure


def test_a_400_for_another_reason_is_not_retried_as_a_parameter() -> None:
    waits: List[float] = []
    context = {"error": {"message": "This model's maximum context length is 8192 tokens.", "type":
                         "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}
    with FakeChatServer([Reply(status=400, body=context)]) as server:
        with pytest.raises(ModelError, match="context length"):
            ask(client(server, waits))
    assert len(server.requests) == 1


def ask_at_once(c: ChatClient, count: int, schema: Any = SCHEMA, **options: Any) -> List[Any]:
    """``count`` requests at once from as many threads: their answers (or errors), in order."""
    answers: List[Any] = [None] * count

    def one(i: int) -> None:
        try:
            answers[i] = c.ask_json(MESSAGES, schema, name=roles.JUDGE, **options)
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            answers[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return answers


ADHERED = json.dumps({"task_completion": 5, "verdict": "PASS", "failure_mode": None, "instruction_adherence": 4,
                      "explanation": "done"})


def test_openai_strict_mode_gets_the_object_root_form_found_by_one_request() -> None:
    """OpenAI's strict mode refuses an anyOf root with a 400: one request finds that out, the rest wait for it."""
    waits: List[float] = []
    schema = roles.judge_schema(True)
    with FakeChatServer([Reply(ADHERED, delay=0.05)], refuse_anyof_root=True) as server:
        c = client(server, waits)
        answers = ask_at_once(c, 16, schema)
    assert all(a.value["instruction_adherence"] == 4 for a in answers), answers
    sent = [r.json["response_format"]["json_schema"]["schema"] for r in server.requests]
    assert sent[0] == schema and sent[1:] == [object_root(schema)] * 16  # one refusal, then every request its form
    assert c.form == "json_schema+object_root" and not waits  # a 400 is not retried
    plain = object_root(schema)
    assert plain["type"] == "object" and "anyOf" not in plain and plain["additionalProperties"] is False
    assert plain["required"] == ["task_completion", "verdict", "failure_mode", "instruction_adherence", "explanation"]
    assert plain["properties"]["verdict"] == {"type": "string", "enum": ["PASS", "FAIL"]}
    assert plain["properties"]["task_completion"] == {"type": "integer", "enum": [1, 2, 3, 4, 5]}
    assert plain["properties"]["failure_mode"] == {"anyOf": [{"type": "null"}, {
        "type": "string", "pattern": roles.FAILURE_MODE_PATTERN}]}  # anyOf below the root: strict mode takes it
    assert object_root(roles.TOOL_SCHEMA) is roles.TOOL_SCHEMA  # an object root already: sent as it is


def test_the_rules_the_object_root_form_loses_are_checked_after_the_answer() -> None:
    """A PASS with task_completion 2 fits the object-root schema; the check after the answer asks again."""
    waits: List[float] = []
    loose = json.dumps({"task_completion": 2, "verdict": "PASS", "failure_mode": None, "instruction_adherence": 3,
                        "explanation": "x"})
    with FakeChatServer([Reply(ADHERED), Reply(loose), Reply(ADHERED)], refuse_anyof_root=True) as server:
        answer = client(server, waits).ask_json(MESSAGES, roles.judge_schema(True), name=roles.JUDGE)
    assert answer.value["task_completion"] == 5 and len(server.requests) == 3  # the refusal, the loose, the good
    assert "matches 0 of the anyOf alternatives" in server.requests[2].json["messages"][-1]["content"]


def test_concurrent_first_requests_to_llama_cpp_wait_for_one_discovery() -> None:
    """llama.cpp's server answers json_schema with a 500 (retried, as a 500 may pass): one request finds its form
    through those retries while the 21 others wait, instead of 22 requests each retrying their way there."""
    waits: List[float] = []
    with FakeChatServer([Reply(GOOD, delay=0.02)], refuse_json_schema=True) as server:
        c = client(server, waits)
        answers = ask_at_once(c, 22)
    assert all(a.value["verdict"] == "PASS" for a in answers), answers
    forms = [(r.json.get("response_format") or {}).get("type") for r in server.requests]
    assert forms == ["json_schema"] * 4 + ["json_object"] * 22  # 4 refusals (3 retries) for 22 answers, not 28
    assert c.form == "json_object+schema" and len(waits) == 3


def test_a_probe_that_gets_no_answer_lets_the_others_go_at_once() -> None:
    """A server that answers nothing: the waiting requests do not each probe in turn, one after another."""
    waits: List[float] = []
    with FakeChatServer([Reply(status=502)]) as server:
        c = ChatClient(Endpoint(server.base_url, "fake-model", None, timeout_s=10.0, concurrency=8),
                       sleep=waits.append, retry=pp.RetryPolicy(max_attempts=2, transport_retries=0))
        answers = ask_at_once(c, 8)
    assert all(isinstance(a, ModelError) and "502" in str(a) for a in answers)
    assert len(server.requests) == 16  # each request tried twice: nobody waited for a form that never came


def test_every_role_on_one_llama_cpp_server_waits_for_one_discovery() -> None:
    """The judge (an anyOf root) and the simulated backend (an object) on one server: one request finds the form
    for both, the others wait, whichever role they are."""
    servers = ModelServers()
    with FakeChatServer([Reply(delay=0.02)], refuse_json_schema=True) as server:  # each role its scripted answer
        judge = ChatClient(Endpoint(server.base_url, "m", None), sleep=lambda s: None, servers=servers, role="judge")
        tools = ChatClient(Endpoint(server.base_url, "m", None), sleep=lambda s: None, servers=servers,
                           role="simulator")
        threads = [threading.Thread(target=ask, args=(judge,)) for _ in range(6)] + [
            threading.Thread(target=lambda: tools.ask_json(MESSAGES, roles.TOOL_SCHEMA, name=roles.TOOL,
                                                           strict=False)) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    forms = [(r.json.get("response_format") or {}).get("type") for r in server.requests]
    assert forms.count("json_schema") == 4 and len(forms) == 16, forms  # one probe and its 3 retries, then 12
    assert judge.form == tools.form == "json_object+schema"
