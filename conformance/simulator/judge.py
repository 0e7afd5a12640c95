"""The local judge: grade each simulated run as the platform's judge does, with any OpenAI-compatible model.

What the judge is shown, as one JSON case (``case_for``): the user instruction; ``expected_outcome`` when the
row sets it; the behavior instructions; the trajectory (each tool call's name, arguments, result and source,
injected failures marked); for a session, the conversation turn by turn (each turn's tool calls by step);
the final response (a session's last agent message); the last few messages; the run's own errors.  Long values are
cut to the bounds in ``LIMITS`` and the case's ``cut`` list says where, as does the report.

The rubric is ``prompts/judge.md`` (the platform's documented semantics in the kit's words), which users can
read and replace (``--judge-prompt FILE``).  The answer is the platform's
``{"task_completion": 1-5, "verdict": "PASS"|"FAIL", "failure_mode": str|null, "instruction_adherence":
1-5|null, "explanation": str}``: ``instruction_adherence`` scores how well the agent's actions kept the
backend's rules, only when the row has behavior instructions (null when it has none).  The schema is built per
row (``..models.roles.judge_schema``) and carries the verdict's rules, so a server that constrains decoding
to it cannot break them: a PASS has ``task_completion`` 4 or 5 and ``failure_mode`` null, a FAIL names a
snake_case ``failure_mode``.  The same rules are checked after every answer, whatever the server
(:func:`verdict_problem` and the schema; one re-ask, the rule named).  Judge requests wait behind the requests
an agent waits on (the simulated backend's, the simulated user's) when they share a server.

A row is **not judged**, with the reason, when it was not run (the dataset check rejected it), when the run
ended in an error before any final response (there is nothing to grade), or when the judge could not answer
(transport, an error status after the retries, two unusable answers).  Not judged is never a PASS.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from . import prompts
from ..models import roles
from ..models.client import DEFERRED, ChatClient, ModelError

__all__ = ["LIMITS", "PROMPT_FILE", "load_prompt", "case_for", "verdict_problem", "Judge", "judged"]

PROMPT_FILE = prompts.JUDGE
LIMITS = {
    "user_instruction": 8000, "behavior_instructions": 4000, "final_response": 20000,  # characters
    "arguments": 2000, "result": 4000, "message": 2000, "error": 1000,
    "steps": 60,  # tool calls shown: the first 20 and the last 40 of a longer run
    "messages": 6,  # the transcript's last messages
}
_HEAD_STEPS = 20
_SNAKE_CASE = re.compile(roles.FAILURE_MODE_PATTERN)


def load_prompt(path: Optional[str] = None) -> str:
    """The rubric: ``path`` (``--judge-prompt``) or the kit's own; ``ValueError`` names an unreadable file."""
    return prompts.load(path, default=PROMPT_FILE, option="--judge-prompt")


def _bounded(value: Any, limit: int, where: str, cuts: List[str]) -> Any:
    """``value`` as it is when its text fits ``limit`` characters, else its text cut there (noted in ``cuts``)."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    if len(text) <= limit:
        return value
    cuts.append(f"{where}: the first {limit:,} of {len(text):,} characters shown")
    return text[:limit] + f" [... {len(text) - limit:,} characters cut]"


def _step(call: Mapping[str, Any], cuts: List[str]) -> Dict[str, Any]:
    where = f"trajectory step {call.get('index')}"
    source = call.get("source") or "rejected"
    step: Dict[str, Any] = {"step": call.get("index"), "tool": call.get("tool_name"),
                            "arguments": _bounded(call.get("arguments"), LIMITS["arguments"], where + " arguments",
                                                  cuts),
                            "result": _bounded(call.get("response"), LIMITS["result"], where + " result", cuts),
                            "source": source}
    if source == "injected":
        step["injected_failure"] = True
    if source == "rejected":
        step["result"] = f"the proxy rejected the call (HTTP {call.get('http_status')})"
    if call.get("replayed"):
        step["replayed"] = True
    return step


def _trajectory(calls: List[Mapping[str, Any]], cuts: List[str]) -> List[Dict[str, Any]]:
    limit = LIMITS["steps"]
    if len(calls) <= limit:
        return [_step(c, cuts) for c in calls]
    tail = limit - _HEAD_STEPS
    cuts.append(f"trajectory: {len(calls)} tool calls, the first {_HEAD_STEPS} and the last {tail} shown")
    return ([_step(c, cuts) for c in calls[:_HEAD_STEPS]]
            + [{"omitted": f"{len(calls) - limit} tool calls"}]
            + [_step(c, cuts) for c in calls[-tail:]])


def case_for(record: Mapping[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """What the judge is shown of one run record, and where something was cut (see the module docstring)."""
    cuts: List[str] = []
    case: Dict[str, Any] = {"user_instruction": _bounded(record.get("user_instruction") or "",
                                                         LIMITS["user_instruction"], "user_instruction", cuts)}
    if record.get("expected_outcome_given"):
        case["expected_outcome"] = record.get("expected_outcome")
    if record.get("behavior_instructions"):
        case["behavior_instructions"] = _bounded(record["behavior_instructions"], LIMITS["behavior_instructions"],
                                                 "behavior_instructions", cuts)
    case["trajectory"] = _trajectory(list(record.get("tool_calls") or []), cuts)
    if record.get("conversation"):  # a model_as_user session: the judge grades the whole conversation
        case["conversation"] = [
            {"turn": turn.get("turn"), "user": _bounded(turn.get("user") or "", LIMITS["message"],
                                                         f"conversation turn {turn.get('turn')} user", cuts),
             "agent": _bounded(turn.get("agent"), LIMITS["message"], f"conversation turn {turn.get('turn')} agent",
                               cuts),
             "session_done": bool(turn.get("session_done")), "tool_calls": list(turn.get("tool_calls") or [])}
            for turn in record["conversation"]]
    final = record.get("final_response")
    case["final_response"] = _bounded(final, LIMITS["final_response"], "final_response", cuts) \
        if isinstance(final, str) else None
    messages = record.get("messages")
    if isinstance(messages, list) and messages:
        shown = messages[-LIMITS["messages"]:]
        if len(messages) > len(shown):
            cuts.append(f"last_messages: the last {len(shown)} of {len(messages)} messages shown")
        case["last_messages"] = [_bounded(m, LIMITS["message"], f"last_messages[{i}]", cuts)
                                 for i, m in enumerate(shown)]
    if record.get("errors"):
        case["run_errors"] = [_bounded(e, LIMITS["error"], "run_errors", cuts) for e in record["errors"]]
    if cuts:
        case["cut"] = list(cuts)
    return case, cuts


def verdict_problem(answer: Mapping[str, Any]) -> Optional[str]:
    """The verdict's rules, which every answer is held to whatever the server (the row's schema says them too,
    and its ``instruction_adherence`` member is checked as the schema's): ``None`` when kept."""
    mode = answer.get("failure_mode")
    if answer.get("verdict") == "FAIL" and not (isinstance(mode, str) and mode.strip()):
        return "a FAIL must name its failure_mode"
    if answer.get("verdict") == "FAIL" and not _SNAKE_CASE.fullmatch(mode):
        return f"a FAIL names its failure_mode in snake_case (such as incorrect_completion), not {mode[:60]!r}"
    if answer.get("verdict") == "PASS" and mode is not None:
        return "a PASS has failure_mode null"
    if answer.get("verdict") == "PASS" and answer.get("task_completion") not in (4, 5):
        return "a PASS has task_completion 4 or 5 (the task was done); below that it is a FAIL"
    return None


class Judge:
    """Grades run records through one :class:`ChatClient`; ``grade`` is safe to call from many threads."""

    def __init__(self, client: ChatClient, prompt: str) -> None:
        self.client = client
        self.prompt = prompt

    @property
    def model(self) -> str:
        return self.client.endpoint.model

    def identity(self) -> Dict[str, Any]:
        """What makes two runs' judges the same (for result files): model, server, rubric."""
        return {"model": self.model, "server": self.client.endpoint.describe(),
                "prompt_sha256": hashlib.sha256(self.prompt.encode("utf-8")).hexdigest()}

    def grade(self, record: Mapping[str, Any]) -> Dict[str, Any]:
        """The record's ``judge`` entry; the usage of this row goes under ``usage``'s ``judge`` key."""
        status = record.get("status")
        if status == "invalid":
            return {"verdict": None, "error": "not run: the dataset check rejected the row", "model": self.model}
        if status == "error" and not isinstance(record.get("final_response"), str):
            first = next(iter(record.get("errors") or []), "an error")
            return {"verdict": None, "model": self.model,
                    "error": f"the run ended in an error before a final response, so there is nothing to grade: "
                             f"{str(first)[:300]}"}
        case, cuts = case_for(record)
        messages = [{"role": "system", "content": self.prompt},
                    {"role": "user", "content": json.dumps(case, ensure_ascii=False, indent=1)}]
        adherence = "behavior_instructions" in case
        try:
            answer = self.client.ask_json(messages, roles.judge_schema(adherence), name=roles.JUDGE, strict=True,
                                          check=verdict_problem, priority=DEFERRED)
        except ModelError as exc:
            return {"verdict": None, "error": f"the judge could not grade this run: {exc}", "model": self.model,
                    "usage": exc.usage}
        verdict: Dict[str, Any] = {key: answer.value[key] for key in ("verdict", "task_completion", "failure_mode",
                                                                      "instruction_adherence", "explanation")}
        verdict["model"] = self.model
        if answer.cached:
            verdict["cached"] = True
        if cuts:
            verdict["cuts"] = cuts
        verdict["usage"] = dict(answer.usage)
        return verdict


def judged(record: Dict[str, Any], judge: Judge) -> Dict[str, Any]:
    """``record`` with its ``judge`` entry and the judge's ``usage`` (the report's shape)."""
    verdict = judge.grade(record)
    usage = verdict.pop("usage", None) or {}
    record["judge"] = verdict
    record.setdefault("usage", {})["judge"] = usage
    return record
