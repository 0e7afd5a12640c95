"""The model-backed roles' answers: one JSON Schema and one name each, the same for a real model and the stand-in.

- the **judge** grades a run: ``{"task_completion": 1-5, "verdict": "PASS"|"FAIL", "failure_mode": str|null,
  "explanation": str}``, the platform's names;
- the **simulated tool** answers a call no rule, fixture or ledger lookup answers:
  ``{"response": <any JSON>, "effects": [<ledger effects>]}``;
- the **simulated user** writes the user's next message: ``{"message": str|null, "done": bool}``.

The name goes out as ``response_format.json_schema.name``: the scripted stand-in (``scripted.py``) knows a
role's request by it.
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["JUDGE", "TOOL", "USER", "JUDGE_SCHEMA", "TOOL_SCHEMA", "USER_SCHEMA"]

JUDGE = "pipelines_judge_verdict"
TOOL = "pipelines_tool_response"
USER = "pipelines_user_turn"

JUDGE_SCHEMA: Dict[str, Any] = {
    "type": "object",
    "properties": {
        # An enum, not minimum/maximum: servers that constrain sampling to the schema (llama.cpp's) enforce enums
        # but not integer ranges.
        "task_completion": {"type": "integer", "enum": [1, 2, 3, 4, 5]},
        "verdict": {"type": "string", "enum": ["PASS", "FAIL"]},
        "failure_mode": {"type": ["string", "null"]},
        "explanation": {"type": "string"},
    },
    "required": ["task_completion", "verdict", "failure_mode", "explanation"],
    "additionalProperties": False,
}

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
