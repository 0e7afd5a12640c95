"""The model-backed roles' answers: one JSON Schema and one name each, the same for a real model and the stand-in.

- the **judge** grades a run: ``{"task_completion": 1-5, "verdict": "PASS"|"FAIL", "failure_mode": str|null,
  "instruction_adherence": 1-5|null, "explanation": str}``, the platform's names, in a schema built per row
  (:func:`judge_schema`) that says the verdict's rules: a PASS has ``task_completion`` 4 or 5 and
  ``failure_mode`` null, a FAIL names a snake_case ``failure_mode``, and ``instruction_adherence`` is a score
  exactly when the row has behavior instructions (two ``anyOf`` branches at the root, which a server that
  constrains decoding to the schema enforces; ``client.object_root`` is the plainer form for a server that
  wants an object there);
- the **simulated tool** answers a call no rule, fixture or ledger lookup answers:
  ``{"response": <any JSON>, "effects": [<ledger effects>]}``;
- the **simulated user** writes the user's next message: ``{"message": str|null, "done": bool}``.

The name goes out as ``response_format.json_schema.name``: the scripted stand-in (``scripted.py``) knows a
role's request by it.
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["JUDGE", "TOOL", "USER", "FAILURE_MODE_PATTERN", "judge_schema", "TOOL_SCHEMA", "USER_SCHEMA"]

JUDGE = "pipelines_judge_verdict"
TOOL = "pipelines_tool_response"
USER = "pipelines_user_turn"

FAILURE_MODE_PATTERN = "^[a-z][a-z0-9]*(_[a-z0-9]+)*$"  # snake_case: incorrect_completion, no_final_response
# Enums, not minimum/maximum: servers that constrain sampling to the schema (llama.cpp's) enforce enums but not
# integer ranges.
_SCORE = {"type": "integer", "enum": [1, 2, 3, 4, 5]}


def judge_schema(adherence: bool) -> Dict[str, Any]:
    """The judge's answer for one row; ``adherence``: the row has behavior instructions to score it against."""
    def branch(verdict: str, task_completion: Dict[str, Any], failure_mode: Dict[str, Any]) -> Dict[str, Any]:
        return {"type": "object",
                "properties": {"task_completion": task_completion, "verdict": {"type": "string", "enum": [verdict]},
                               "failure_mode": failure_mode,
                               "instruction_adherence": _SCORE if adherence else {"type": "null"},
                               "explanation": {"type": "string"}},
                "required": ["task_completion", "verdict", "failure_mode", "instruction_adherence", "explanation"],
                "additionalProperties": False}

    return {"anyOf": [branch("PASS", {"type": "integer", "enum": [4, 5]}, {"type": "null"}),
                      branch("FAIL", _SCORE, {"type": "string", "pattern": FAILURE_MODE_PATTERN})]}


TOOL_SCHEMA: Dict[str, Any] = {
    "type": "object",
    "properties": {
        "response": {},  # any JSON: what the tool returns
        "effects": {  # the fixtures' effect syntax (simulator/engine.py): one operation key per effect
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "update": {"type": "string"},  # "type.id", with "set"
                    "add": {"type": "string"},  # "type.id" or "type", with "set"
                    "remove": {"type": "string"},  # "type.id"
                    "set_flag": {"type": "string"},  # a flag name
                    "set": {"type": "object"},
                },
                "additionalProperties": False,
            },
        },
    },
    "required": ["response", "effects"],
    "additionalProperties": False,
}

USER_SCHEMA: Dict[str, Any] = {
    "type": "object",
    "properties": {
        "message": {"type": ["string", "null"]},
        "done": {"type": "boolean"},
    },
    "required": ["message", "done"],
    "additionalProperties": False,
}
