"""The fake model APIs and the kit's scripted model cannot drift from the real APIs: each reply validates as the
official SDK's response model, each template request body as the SDK's request type.

The model-API templates run whole agent loops (tool calls, reasoning, a final answer) against the test fakes
(tests/fake_model_apis.py) and against the scripted model (conformance/models/scripted.py); every reply is then validated
with ``openai.types.responses.Response``, ``openai.types.chat.ChatCompletion`` or ``anthropic.types.Message``,
and every request body with the SDK's create-params TypedDict (pydantic's TypeAdapter, which also checks the
nested tool and message shapes).  Skipped when the ``openai`` or ``anthropic`` package is missing.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from conformance.harness.mock_proxy import MockProxy
from conformance.models.scripted import ScriptedModel
from tests.fake_model_apis import FakeAnthropicAPI, FakeChatAPI, FakeResponsesAPI, Turn
from tests.interop.hosts import ROOT

pydantic = pytest.importorskip("pydantic", reason="validating against the SDK types needs pydantic")
openai_types = pytest.importorskip("openai.types.responses", reason="needs the openai package")
pytest.importorskip("anthropic.types", reason="needs the anthropic package")

from anthropic.types import Message  # noqa: E402
from anthropic.types.message_create_params import MessageCreateParamsNonStreaming  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402
from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming  # noqa: E402
from openai.types.responses import Response  # noqa: E402
from openai.types.responses.response_create_params import ResponseCreateParamsNonStreaming  # noqa: E402

TASK = {"user_instruction": "Refund order #4521 if it shipped more than 30 days ago.", "input": {}, "task_id": 42}
SHAPES = {  # template: (fake, base-URL variable, key variable, reply model, request type)
    "openai_responses": (FakeResponsesAPI, "OPENAI_BASE_URL", "OPENAI_API_KEY", Response,
                         ResponseCreateParamsNonStreaming),
    "openai_chat": (FakeChatAPI, "OPENAI_BASE_URL", "OPENAI_API_KEY", ChatCompletion,
                    CompletionCreateParamsNonStreaming),
    "anthropic_messages": (FakeAnthropicAPI, "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", Message,
                           MessageCreateParamsNonStreaming),
}
SCRIPT = [Turn(reasoning="Look the order up first.", tool_calls=[("get_order", {"order_id": "4521"})]),
          Turn(text="Order 4521 is refunded.")]


def load(template: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"shape_{template}", ROOT / "templates" / f"{template}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def proxy() -> Iterator[Tuple[MockProxy, str]]:
    token = "shape-run-token-0123456789"
    with MockProxy(tokens=[token]) as p:
        yield p, token


def validate(requests: List[Tuple[Any, Any]], reply_model: Any, request_type: Any) -> None:
    adapter = pydantic.TypeAdapter(request_type)
    assert requests
    for body, reply in requests:
        adapter.validate_python(body)
        parsed = reply_model.model_validate(reply)
        assert parsed.model  # a field every one of the three has


@pytest.mark.parametrize("template", sorted(SHAPES))
def test_the_fakes_replies_and_the_templates_requests_are_the_sdks_types(
        template: str, proxy: Tuple[MockProxy, str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake_class, base_env, key_env, reply_model, request_type = SHAPES[template]
    mock, token = proxy
    with fake_class() as fake:
        monkeypatch.setenv(base_env, fake.base_url)
        monkeypatch.setenv(key_env, fake.api_key)
        monkeypatch.setenv("OPENAI_MODEL" if template.startswith("openai") else "ANTHROPIC_MODEL", "test-model-7")
        fake.script(SCRIPT)
        body = load(template).run(TASK, proxy_url=mock.url, run_token=token)
        answered = [(r.json, r.reply) for r in fake.answered()]
    assert body["final_response"] == "Order 4521 is refunded." and len(answered) == 2
    validate(answered, reply_model, request_type)


@pytest.mark.parametrize("template", sorted(SHAPES))
def test_the_scripted_models_replies_are_the_sdks_types(template: str, proxy: Tuple[MockProxy, str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _, base_env, key_env, reply_model, request_type = SHAPES[template]
    mock, token = proxy
    recorded: List[Tuple[Any, Any]] = []
    import conformance.models.scripted as model_module

    for path, answer in list(model_module.ENDPOINTS.items()):
        def spy(body: Dict[str, Any], number: int, answer: Any = answer) -> Dict[str, Any]:
            reply = answer(body, number)
            recorded.append((body, reply))
            return reply
        monkeypatch.setitem(model_module.ENDPOINTS, path, spy)
    with ScriptedModel() as model:
        for name, value in model.environment().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv(key_env, "scripted")
        body = load(template).run(TASK, proxy_url=mock.url, run_token=token)
    assert body["final_response"].startswith("Done.") and len(recorded) >= 2
    validate(recorded, reply_model, request_type)
    assert os.environ.get(base_env)  # the template did use the scripted model's URL
