"""Response envelope behaviour beyond the vectors: result objects, warnings, multi-turn replies (§4)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Optional

import pytest

import pipelines_port as pp


@dataclasses.dataclass
class Result:
    final_response: str
    messages: Optional[List[Dict[str, Any]]] = None
    metadata: Optional[Dict[str, Any]] = None


class FakeModel:
    """Stands in for a pydantic model as a framework's final_output."""

    def model_dump_json(self) -> str:
        return '{"answer": 42}'


def test_envelope_shaped_object_brings_its_transcript() -> None:
    body = pp.build_response(Result("done", [{"role": "assistant", "content": "done"}], {"model": "m"}))
    assert body == {"final_response": "done", "messages": [{"role": "assistant", "content": "done"}],
                    "metadata": {"model": "m"}}


def test_framework_outputs_become_text() -> None:
    class RunResult:
        final_output = FakeModel()

    assert pp.build_response(RunResult())["final_response"] == '{"answer": 42}'

    class Numeric:
        output = 3.5

    assert pp.build_response(Numeric())["final_response"] == "3.5"


def test_unusable_values_name_the_problem() -> None:
    with pytest.raises(pp.ResponseError, match="cannot build a response from int"):
        pp.build_response(42)
    with pytest.raises(pp.ResponseError) as info:
        pp.build_response({"final_response": "", "messages": [{"role": "bot"}]})
    assert len(info.value.problems) == 2
    assert isinstance(info.value, ValueError)


def test_input_is_not_mutated_and_output_is_independent() -> None:
    messages = [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]},
                {"role": "tool", "tool_call_id": "c", "content": "r"}]
    body = pp.build_response("ok", messages=messages)
    assert body["messages"][0]["tool_calls"] == [{"id": "c", "name": "f"}]
    assert messages[0]["tool_calls"][0]["function"] == {"name": "f"}


def test_long_final_response_is_kept_with_a_logged_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pipelines_port")
    body = pp.build_response("a" * 60_000)
    assert len(body["final_response"]) == 60_000
    assert any("truncates" in r.getMessage() for r in caplog.records)
    assert pp.validate_response(body)[0].startswith("warning: final_response")


def test_non_json_metadata_is_reported() -> None:
    problems = pp.validate_response({"final_response": "x", "metadata": {"when": object()}})
    assert problems and problems[0].startswith("metadata:")


def test_turn_reply() -> None:
    assert pp.build_turn_reply("Which order?") == {"message": "Which order?", "session_done": False}
    assert pp.build_turn_reply("Bye", metadata={"model": "m"}, session_done=True) == {
        "message": "Bye", "metadata": {"model": "m"}, "session_done": True}
    for bad in ("", "  ", None):
        with pytest.raises(pp.ResponseError, match="message"):
            pp.build_turn_reply(bad)
    with pytest.raises(pp.ResponseError, match="session_done"):
        pp.build_turn_reply("x", session_done="yes")  # type: ignore[arg-type]
    with pytest.raises(pp.ResponseError, match="metadata.total_input_tokens"):
        pp.build_turn_reply("x", metadata={"total_input_tokens": "many"})
