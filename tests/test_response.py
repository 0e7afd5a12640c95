"""Response envelope behaviour beyond the vectors: result objects, warnings, multi-turn replies (§4)."""

from __future__ import annotations

import dataclasses
import json
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
        pp.build_response({"final_response": "", "messages": [{"role": "bot"}]}, strict=True)
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
    assert problems and problems[0].startswith("metadata.when:") and "not a JSON type" in problems[0]


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


def test_a_turn_reply_is_json_safe_as_an_envelope_is() -> None:
    """kit-json-safe-response holds for turn replies: lenient converts (each change named), strict refuses."""
    reply = {"message": "cut \ud83d", "session_done": True, "metadata": {"cost": float("nan")}}
    body, warnings = pp.response_envelope(reply, multi_turn=True)
    assert body == {"message": "cut \ufffd", "session_done": True, "metadata": {"cost": None}}
    assert any(w.startswith("message: lone surrogates") for w in warnings)
    assert any(w.startswith("metadata.cost: nan") for w in warnings)
    with pytest.raises(pp.ResponseError, match="message: lone surrogates"):
        pp.response_envelope(reply, multi_turn=True, strict=True)
    assert list(pp.response_envelope({"session_done": False, "message": "a", "x": 1}, multi_turn=True)[0]) == [
        "session_done", "message", "x"]  # the keys as built, in their order
    with pytest.raises(pp.ResponseError, match="final_response: must not be empty"):
        pp.build_response({"message": "", "session_done": True})  # single-turn: the message is the final_response


def test_values_json_cannot_carry_never_make_a_200_that_is_not_json(caplog: pytest.LogCaptureFixture) -> None:
    """NaN, infinities, datetimes, sets, bytes, other objects: converted with a warning naming the path, or refused."""
    import datetime

    caplog.set_level(logging.WARNING, logger="pipelines_port")
    value = {"final_response": "x" * 60_000, "extra": float("inf"),
             "messages": [{"role": "assistant", "content": "hi", "when": datetime.datetime(2026, 1, 2, 3, 4, 5)}],
             "metadata": {"score": float("nan"), "tags": {"b", "a"}, "raw": b"\xff", "obj": Exception("boom")}}
    body = pp.build_response(value)
    json.dumps(body, allow_nan=False)  # strict JSON, always
    assert body["extra"] is None and body["messages"][0]["when"] == "2026-01-02T03:04:05"
    assert body["metadata"]["score"] is None and body["metadata"]["tags"] == ["a", "b"]
    assert body["metadata"]["raw"] == "\ufffd" and isinstance(body["metadata"]["obj"], str)
    logged = " ".join(r.getMessage() for r in caplog.records)
    for path in ("extra:", "messages[0].when:", "metadata.score:", "metadata.tags:", "metadata.raw:", "final_response:"):
        assert path in logged, path
    with pytest.raises(pp.ResponseError, match=r"extra: inf is not JSON"):
        pp.build_response(value, strict=True)
    with pytest.raises(pp.ResponseError, match=r"metadata.when: date is not a JSON type"):
        pp.build_response({"final_response": "x", "metadata": {"when": datetime.date(2026, 1, 1)}}, strict=True)


def test_strict_mode_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    value = {"final_response": "x", "messages": [{"role": "bot"}]}
    assert pp.build_response(value) == {"final_response": "x"}
    monkeypatch.setenv("PIPELINES_PORT_STRICT", "1")
    with pytest.raises(pp.ResponseError, match="messages\\[0\\].role"):
        pp.build_response(value)
    assert pp.build_response(value, strict=False) == {"final_response": "x"}


def test_a_container_that_contains_itself_is_cut_there_but_one_met_twice_is_sent_twice() -> None:
    """§7.7 kit-json-safe-response: a back-reference is cut with a note; a shared, acyclic value is not one."""
    looped: List[Any] = [1]
    looped.append(looped)
    body, warnings = pp.response_envelope({"final_response": "ok", "metadata": {"trail": looped}})
    assert body["metadata"] == {"trail": [1, "[cycle]"]}
    assert any("metadata.trail[1]: contains itself; cut there" in w for w in warnings), warnings

    shared = frozenset({1, 2})  # converted on each visit: a set's sorted copy is not the set
    listed = [3, 4]
    value = {"a": shared, "b": [shared, shared], "c": [listed, listed]}
    body, warnings = pp.response_envelope({"final_response": value})
    assert json.loads(body["final_response"]) == {"a": [1, 2], "b": [[1, 2], [1, 2]], "c": [[3, 4], [3, 4]]}
    assert not any("contains itself" in w for w in warnings), warnings
