"""The kit's model-backed roles against the real ecosystem's types and readers.

- Every request the kit's model client sends (each ``response_format`` form a server may need) is a valid
  ``openai.types.chat.completion_create_params.CompletionCreateParamsNonStreaming`` (pydantic's TypeAdapter,
  nested message and response-format shapes included), and the scripted stand-in's role answers parse as
  ``openai.types.chat.ChatCompletion``.
- The JUnit XML of ``--junit`` reads in ``junitparser``, the library CI result publishers (such as
  EnricoMi/publish-unit-test-result-action) read JUnit with: the counts, each FAIL a failure, each row not
  judged an error, their messages.

Skipped when ``openai``, ``pydantic`` or ``junitparser`` is missing (``.ci/run`` installs them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List

import pytest

from conformance.models import roles
from conformance.models.client import FORMS, ChatClient, Endpoint, ModelServers
from conformance.simulator import gate
from tests.fake_chat_server import FakeChatServer, Reply

pydantic = pytest.importorskip("pydantic", reason="validating against the SDK types needs pydantic")
pytest.importorskip("openai.types.chat", reason="needs the openai package")
junitparser = pytest.importorskip("junitparser", reason="needs junitparser")

from openai.types.chat import ChatCompletion  # noqa: E402
from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming  # noqa: E402

ROLES = [(roles.JUDGE, roles.judge_schema(True), True), (roles.JUDGE, roles.judge_schema(False), True),
         (roles.TOOL, roles.TOOL_SCHEMA, False), (roles.USER, roles.USER_SCHEMA, True)]
CASE = {"user_instruction": "What is the status of order 4521?", "trajectory": [], "final_response": "Shipped."}


@pytest.mark.parametrize("name,schema,strict", ROLES)
def test_every_form_of_every_role_request_is_openais_request_type(name: str, schema: Any, strict: bool) -> None:
    adapter = pydantic.TypeAdapter(CompletionCreateParamsNonStreaming)
    sent: List[Any] = []
    with FakeChatServer([Reply("{}")]) as server:
        for form, _ in enumerate(FORMS):
            if FORMS[form] == "json_object+schema":
                continue  # llama.cpp's own form: not OpenAI's, sent only after OpenAI's form was refused
            client = ChatClient(Endpoint(server.base_url, "gpt-4.1-mini", None), servers=ModelServers())
            client._dialect.form = form
            with pytest.raises(Exception):  # noqa: B017 - "{}" answers no role's schema: only the request matters
                client.ask_json([{"role": "system", "content": "rubric"},
                                 {"role": "user", "content": json.dumps(CASE)}], schema, name=name, strict=strict)
        sent = [r.json for r in server.requests]
    assert {(s.get("response_format") or {}).get("type") for s in sent} == {"json_schema", "json_object", None}
    for body in sent:
        adapter.validate_python(body)
    reask = sent[1]["messages"]  # the re-ask: the model's own answer, then the problem named
    assert [m["role"] for m in reask] == ["system", "user", "assistant", "user"]


def test_the_scripted_stand_ins_role_answers_are_openais_completion_type() -> None:
    from conformance.models.scripted import scripted_endpoint

    with scripted_endpoint() as endpoint:
        with FakeChatServer() as recorder:  # the same request, to the stand-in, read raw
            ChatClient(Endpoint(recorder.base_url, "scripted", None)).ask_json(
                [{"role": "system", "content": "rubric"}, {"role": "user", "content": json.dumps(CASE)}],
                roles.judge_schema(False), name=roles.JUDGE)
            body = recorder.requests[0].json
        import pipelines_port as pp

        reply = pp.post_json(endpoint.url, body)
    completion = ChatCompletion.model_validate(reply)
    verdict = json.loads(completion.choices[0].message.content or "")
    assert verdict["verdict"] in ("PASS", "FAIL") and completion.usage and completion.usage.prompt_tokens > 0


def test_junit_reads_in_junitparser(tmp_path: Path) -> None:
    result = {"dataset": {"file": "tasks.csv"}, "started_at": "2026-11-26T10:00:00Z", "runs": [
        {"row": 1, "user_instruction": "What is the status of order 4521?", "duration_ms": 812,
         "judge": {"verdict": "PASS", "task_completion": 5, "failure_mode": None, "explanation": "Answered."}},
        {"row": 2, "user_instruction": "Cancel order 9001 <for Sam & co>", "duration_ms": 1200,
         "judge": {"verdict": "FAIL", "task_completion": 1, "failure_mode": "incorrect_completion",
                   "explanation": "It cancelled an order the user does not own."}},
        {"row": 3, "user_instruction": "Refund it", "duration_ms": 90,
         "judge": {"verdict": None, "error": "the judge could not grade this run: HTTP 503"}}]}
    path = tmp_path / "results.xml"
    path.write_text(gate.junit_xml(result), encoding="utf-8")
    xml = junitparser.JUnitXml.fromfile(str(path))
    suites = list(xml) if isinstance(xml, junitparser.JUnitXml) else [xml]
    assert len(suites) == 1
    suite = suites[0]
    assert (suite.tests, suite.failures, suite.errors, suite.skipped) == (3, 1, 1, 0)
    cases = list(suite)
    assert [c.name for c in cases] == ["row 1: What is the status of order 4521?",
                                       "row 2: Cancel order 9001 <for Sam & co>", "row 3: Refund it"]
    assert cases[0].is_passed and abs(cases[0].time - 0.812) < 1e-9
    failure = cases[1].result[0]
    assert isinstance(failure, junitparser.Failure) and failure.type == "incorrect_completion"
    assert failure.message == "It cancelled an order the user does not own."
    error = cases[2].result[0]
    assert isinstance(error, junitparser.Error) and "HTTP 503" in error.message
