"""The model-backed simulated backend: any tool answered by a model, held to the ledger (``simulate --simulator``).

The engine (``engine.py``) decides: failure rules first, then fixtures, then the ledger's own lookups, and
only a call none of them answers reaches the model, through :meth:`ToolModel.asker`.  The model is shown
the tool's name, description and input schema (``--tools``, else ``tools_schema.json`` beside a ``--code``
agent, else what a ``--url`` agent serves at ``GET /tools_schema``), the call's arguments, the row's
behavior instructions, the ledger as it stands, its flags and the earlier calls of the run; the rules are
``prompts/simulator.md``.  It answers ``{"response": ..., "effects": [...]}`` (``..models.roles.TOOL_SCHEMA``).
The client asks once more, the problem named, when the answer is not the schema or the engine's
:meth:`~engine.Backend.answer_problem` finds it inconsistent with the ledger; a second bad answer is the
call's ``{"error": ...}``.  Answers are cached with the judge's, by everything the model was sent, so a
re-run of an unchanged dataset and agent replays the same responses.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from . import engine, prompts
from ..models import roles
from ..models.client import ChatClient, ModelError, add_usage

__all__ = ["PROMPT_FILE", "ToolModel", "tool_definitions"]

PROMPT_FILE = prompts.SIMULATOR
_LIMIT = 20_000  # characters of the ledger and the earlier calls shown, each


def tool_definitions(tools: Optional[Sequence[Mapping[str, Any]]]) -> Dict[str, Dict[str, Any]]:
    """``{name: {"name", "description", "input_schema"}}`` from a tools schema in the platform's shape."""
    found: Dict[str, Dict[str, Any]] = {}
    for tool in tools or []:
        if isinstance(tool, Mapping) and isinstance(tool.get("name"), str):
            found[tool["name"]] = {"name": tool["name"], "description": tool.get("description") or "",
                                   "input_schema": tool.get("input_schema") or {}}
    return found


def _bounded(value: Any) -> Any:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return value if len(text) <= _LIMIT else text[:_LIMIT] + f" [... {len(text) - _LIMIT:,} characters cut]"


class ToolModel:
    """Asks one model for the tool answers of every run; ``asker`` binds it to one run's backend and row."""

    def __init__(self, client: ChatClient, prompt: str, tools: Optional[Sequence[Mapping[str, Any]]]) -> None:
        self.client = client
        self.prompt = prompt
        self.tools = tool_definitions(tools)

    def identity(self) -> Dict[str, Any]:
        """What makes two runs' simulated backends the same (for result files): model and rules."""
        return {"model": self.client.endpoint.model,
                "prompt_sha256": hashlib.sha256(self.prompt.encode("utf-8")).hexdigest()}

    def asker(self, backend: engine.Backend, behavior_instructions: str,
              usage: Dict[str, int]) -> Callable[[Dict[str, Any]], Any]:
        """The engine's ``ask`` for one run: the question shown with the tool and the row; usage summed in."""
        def ask(question: Dict[str, Any]) -> Any:
            name = str(question.get("tool"))
            shown = dict(question, tool=self.tools.get(name, {"name": name, "description": "(no definition given: "
                                                                         "--tools names the tools)"}),
                         ledger=_bounded(question.get("ledger")), earlier_calls=_bounded(question.get("earlier_calls")))
            if behavior_instructions:
                shown["behavior_instructions"] = behavior_instructions
            messages = [{"role": "system", "content": self.prompt},
                        {"role": "user", "content": json.dumps(shown, ensure_ascii=False, indent=1, default=str)}]
            args = question.get("arguments") if isinstance(question.get("arguments"), dict) else {}
            try:
                answer = self.client.ask_json(messages, roles.TOOL_SCHEMA, name=roles.TOOL, strict=False,
                                              check=lambda value: backend.answer_problem(name, args, value))
            except ModelError as exc:
                add_usage(usage, exc.usage)
                raise
            add_usage(usage, answer.usage)
            return answer.value

        return ask
