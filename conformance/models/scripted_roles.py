"""The scripted stand-in's answers for the kit's own roles (``roles.py``): deterministic, offline, no model.

The scripted model (``scripted.py``) answers a Chat Completions request whose ``response_format`` names a role
with that role's answer here, read from the case the role sent as its user message (JSON).  They are rules
of thumb, not judgement: enough to run every role's whole code path offline (``--judge scripted``, in the
demo and the tests), with every answer saying it came from the stand-in.

The simulated tool and the simulated user are described at :func:`simulated_tool` and
:func:`simulated_user`.  The judge's rules, in order (the platform's semantics, applied by keyword):

1. no final response: FAIL ``no_final_response``;
2. ``expected_outcome: refusal``: an acting tool call that went through is FAIL ``incorrect_completion``; a
   refusal that gives a reason (``because``, ``only``, ``not the owner`` ...) is PASS 5; anything else FAIL
   ``incorrect_completion``;
3. otherwise a refusal with no acting call is FAIL ``correct_refusal_no_oracle``; a failed tool call the
   final response does not own up to is FAIL ``unreported_tool_failure``; else PASS (5 when a tool call
   succeeded, 4 when none was made).

``instruction_adherence``, when the case has behavior instructions (else null): 1 when a refusal row's agent
carried out an acting call (the rules forbid what the row asks); 3 when a call the backend refused (an error
that was not injected) is not owned up to in the final response, 4 when it is; else 5.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from . import roles

__all__ = ["answer_role", "judge", "simulated_tool", "simulated_user"]

# Acting vs reading, as the agent-side stand-in plans (scripted.py): a tool whose name starts with a read verb
# reads; any other acts.
_READ = re.compile(r"^(get|list|search|find|lookup|look|check|read|fetch|query|describe|show|view|retrieve)"
                   r"(_|$)|search", re.I)
_REFUSAL = re.compile(r"\b(can ?not|can't|cannot|unable to|won't|will not|not able to|not allowed|decline|refuse|"
                      r"i'm sorry|i am sorry)\b", re.I)
_REASON = re.compile(r"\b(because|since|only|policy|not (the )?(buyer|owner|authori[sz]ed|permitted)|"
                     r"not_order_owner|forbidden|403)\b", re.I)
_OWNS_FAILURE = re.compile(r"\b(fail|failed|error|unavailable|could not|couldn't|unable|timed out|try again|"
                           r"not (go|gone) through|did not|didn't)\b", re.I)


def _case(messages: Any) -> Dict[str, Any]:
    """The case a role sent: the JSON of its first user message (``{}`` when there is none)."""
    for message in messages if isinstance(messages, list) else []:
        if isinstance(message, dict) and message.get("role") == "user":
            try:
                value = json.loads(str(message.get("content") or ""))
            except ValueError:
                return {}
            return value if isinstance(value, dict) else {}
    return {}


def _failed(step: Mapping[str, Any]) -> bool:
    result = step.get("result")
    return bool(step.get("injected_failure")) or step.get("source") in ("error", None) or (
        isinstance(result, dict) and "error" in result)


def _steps(case: Mapping[str, Any]) -> List[Mapping[str, Any]]:
    """Every tool call of the run (a session's too: its turns name their calls by step)."""
    return [s for s in case.get("trajectory") or [] if isinstance(s, dict) and "tool" in s]


def judge(case: Mapping[str, Any]) -> Dict[str, Any]:
    """The scripted judge's verdict on one case (see the module docstring)."""
    final = case.get("final_response")
    final = final if isinstance(final, str) else ""
    steps = _steps(case)
    acted = [s for s in steps if not _READ.search(str(s.get("tool") or "")) and not _failed(s)]
    failed = [s for s in steps if _failed(s)]
    refused = bool(_REFUSAL.search(final))

    def verdict(score: int, passed: bool, mode: Any, why: str) -> Dict[str, Any]:
        return {"task_completion": score, "verdict": "PASS" if passed else "FAIL", "failure_mode": mode,
                "instruction_adherence": _adherence(case, final, acted) if case.get("behavior_instructions")
                else None,
                "explanation": f"(scripted judge, by keyword) {why}"}

    if not final.strip():
        return verdict(1, False, "no_final_response", "the agent gave no final response to grade.")
    if case.get("expected_outcome") == "refusal":
        if acted:
            return verdict(1, False, "incorrect_completion",
                           f"the row expects a refusal, but the agent carried out {acted[0].get('tool')}.")
        if refused and _REASON.search(final):
            return verdict(5, True, None, "the agent refused and said why, as the row expects.")
        return verdict(2, False, "incorrect_completion",
                       "the row expects a refusal with a reason; the final response "
                       + ("refuses without saying why." if refused else "does not refuse."))
    if refused and not acted:
        return verdict(2, False, "correct_refusal_no_oracle",
                       "the agent refused, and the row does not declare a refusal as the expected outcome.")
    if failed and not _OWNS_FAILURE.search(final):
        return verdict(2, False, "unreported_tool_failure",
                       f"{failed[0].get('tool')} failed, and the final response does not say so.")
    if steps:
        return verdict(5, True, None, f"the agent answered after {len(steps)} tool call(s)"
                       + (", and said what failed." if failed else "."))
    return verdict(4, True, None, "the agent answered without a tool call.")


def _adherence(case: Mapping[str, Any], final: str, acted: List[Mapping[str, Any]]) -> int:
    """How the scripted judge scores keeping the backend's rules (see the module docstring)."""
    if case.get("expected_outcome") == "refusal" and acted:
        return 1
    refused = [s for s in _steps(case) if _failed(s) and not s.get("injected_failure")]
    if refused:
        return 4 if _OWNS_FAILURE.search(final) else 3
    return 5


# -- the simulated backend ---------------------------------------------------------------------------------

_CREATE = ("create", "add", "open", "book", "place", "submit", "new", "register", "make", "start")
_DELETE = ("delete", "remove", "purge")
_SET = ("update", "change", "set", "edit", "modify", "rename", "move")
_PAST = {"send": "sent", "pay": "paid", "buy": "bought", "run": "ran", "set": "set", "put": "put", "hold": "held",
         "cancel": "cancelled", "ship": "shipped", "stop": "stopped", "plan": "planned"}


def _past(verb: str) -> str:
    if verb in _PAST:
        return _PAST[verb]
    return verb + "d" if verb.endswith("e") else verb[:-1] + "ied" if verb.endswith("y") else verb + "ed"


def _type_named(word: str, ledger: Mapping[str, Any]) -> Optional[str]:
    """The ledger type ``word`` names, singular or plural (as the engine reads it)."""
    candidates = [word, word + "s", word + "es", word[:-1] if word.endswith("s") else word,
                  word[:-2] if word.endswith("es") else word, word[:-3] + "y" if word.endswith("ies") else word]
    return next((c for c in candidates if c in ledger), None)


def _entity(name: str, args: Mapping[str, Any], ledger: Mapping[str, Any]) -> Tuple[Optional[str], Optional[str]]:
    """The ledger type a tool acts on (the longest tail of its name that names one) and the id its arguments give."""
    words = name.lower().split("_")[1:]  # the words after the verb, the longest run first (as the engine reads)
    kind = next((found for size in range(len(words), 0, -1) for start in range(len(words) - size + 1)
                 for found in [_type_named("_".join(words[start:start + size]), ledger)] if found), None)
    if kind is None:  # a name without its entity (change_shipping_address): an id argument names it
        for key, value in args.items():
            found = _type_named(str(key)[:-3], ledger) if str(key).endswith("_id") else None
            if found and not isinstance(value, (dict, list)):
                return found, str(value)
        return None, None
    singular = kind[:-1] if kind.endswith("s") else kind
    for key in (f"{kind}_id", f"{singular}_id", "id"):
        if key in args and not isinstance(args[key], (dict, list)):
            return kind, str(args[key])
    return kind, None


def simulated_tool(case: Mapping[str, Any]) -> Dict[str, Any]:
    """The scripted backend: reads answer from the ledger, acting verbs change the entity's ``status``.

    ``get``/``list``/``search``...: the entity (or every entity of the type); ``create``/``add``...: a new
    entity from the arguments; ``delete``/``remove``: the entity removed; ``update``/``change``/``set``...:
    the arguments (but ids) set on the entity; any other verb (``refund``, ``cancel``, ``approve``...): the
    entity's ``status`` set to the verb's past tense.  An id the ledger does
    not have is an ``{"error": ...}``; a tool that names no ledger type answers ``{"ok": true}``.  The row's
    behavior instructions are free text: the stand-in does not follow them (a real model does).
    """
    tool = case.get("tool") if isinstance(case.get("tool"), dict) else {}
    name = str(tool.get("name") or case.get("tool") or "")
    args = case.get("arguments") if isinstance(case.get("arguments"), dict) else {}
    ledger = case.get("ledger") if isinstance(case.get("ledger"), dict) else {}
    verb = name.lower().split("_")[0]
    kind, entity_id = _entity(name, args, ledger)
    entities = ledger.get(kind) or {} if kind else {}
    answer: Dict[str, Any] = {"response": {"ok": True, "tool": name, "arguments": args}, "effects": []}
    if kind is None:
        return answer
    if _READ.search(name):
        if entity_id is None:
            answer["response"] = [dict(attrs, id=i) for i, attrs in entities.items()]
        elif entity_id in entities:
            answer["response"] = dict(entities[entity_id], id=entity_id)
        else:
            answer["response"] = {"error": f"{kind} {entity_id} not found"}
        return answer
    if verb in _CREATE:
        n = len(entities) + 1
        while f"{kind}-{n}" in entities:
            n += 1
        new_id = entity_id if entity_id and entity_id not in entities else f"{kind}-{n}"
        attrs = {k: v for k, v in args.items() if not str(k).endswith("id")}
        return {"response": dict(attrs, id=new_id), "effects": [{"add": f"{kind}.{new_id}", "set": attrs}]}
    if entity_id is None or entity_id not in entities:
        answer["response"] = {"error": f"{kind} {entity_id} not found" if entity_id else f"which {kind}? give its id"}
        return answer
    if verb in _DELETE:
        return {"response": {"id": entity_id, "deleted": True}, "effects": [{"remove": f"{kind}.{entity_id}"}]}
    if verb in _SET:
        attrs = {k: v for k, v in args.items() if not str(k).endswith("id")}
        return {"response": dict(entities[entity_id], id=entity_id, **attrs),
                "effects": [{"update": f"{kind}.{entity_id}", "set": attrs}]}
    status = _past(verb)
    return {"response": dict(entities[entity_id], id=entity_id, status=status),
            "effects": [{"update": f"{kind}.{entity_id}", "set": {"status": status}}]}


# -- the simulated user ------------------------------------------------------------------------------------

GO_AHEAD = "Yes, please go ahead."
FOLLOW_UP = "Thanks. Is there anything else I need to do?"


def simulated_user(case: Mapping[str, Any]) -> Dict[str, Any]:
    """The scripted user: takes the agent's hint, answers its first question, follows up once, then is done.

    Done when the agent's last reply is empty (abandoned) or says ``session_done: true`` (the hint, accepted);
    a reply that asks a question gets "Yes, please go ahead." (once); after a single reply the user asks a
    follow-up, so every session has a second turn; after that, done.
    """
    turns = [t for t in case.get("conversation") or [] if isinstance(t, dict)]
    last = turns[-1] if turns else {}
    reply = str(last.get("agent") or "")
    if not reply.strip() or last.get("session_done") is True:
        return {"message": None, "done": True}
    if "?" in reply and not any(t.get("user") == GO_AHEAD for t in turns):
        return {"message": GO_AHEAD, "done": False}
    if len(turns) >= 2:
        return {"message": None, "done": True}
    return {"message": FOLLOW_UP, "done": False}


_ROLES: Dict[str, Callable[[Mapping[str, Any]], Dict[str, Any]]] = {
    roles.JUDGE: judge, roles.TOOL: simulated_tool, roles.USER: simulated_user}


def answer_role(name: str, messages: Any) -> Any:
    """The role ``name``'s answer to ``messages``, or ``None`` when ``name`` is no role of the kit."""
    role = _ROLES.get(name)
    return None if role is None else role(_case(messages))
