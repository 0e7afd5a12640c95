"""Model-as-user sessions: a conversation with the agent, the user played by a model (``turn_mode = model_as_user``).

A row runs as a session when its ``turn_mode`` cell is ``model_as_user`` (or ``simulate --turn-mode
model_as_user`` for every row).  One session is one run: one proxy, one run token, one ledger that every
turn's tool calls share.  Each turn is a dispatch carrying the multi-turn fields (CONTRACT
``multi-turn-fields``), in HTTP mode and code mode alike::

    input: {"task_id", "user_instruction", "input": {},
            "latest_user_prompt": "<this turn's user message>", "session_id": "<one per session>",
            "turn_id": "<session>-t<n>", "messages": [<the earlier turns: user, assistant, ...>],
            "scenario_state": {}}

The first turn's prompt is the user instruction; each later prompt is the user model's, given the
instruction, the behavior instructions and the conversation so far (``prompts/user.md``); it answers
``{"message": str|null, "done": bool}`` (``..models.roles.USER_SCHEMA``; not done needs a message).  The
agent answers each turn ``{"message", "session_done"}`` (CONTRACT ``turn-reply-shape``) or with a response
envelope whose ``final_response`` is the turn's message (the platform's SDK route serves only that shape;
this kit's runtime sends a turn reply as built: both are taken as they come).  Each turn records the
reply's ``session_done``: ``true`` or ``false``, or ``null`` when the reply was an envelope (no hint).  The
session ends when the user model says done (the goal met, or given up), which it is asked after every
reply, the agent's ``session_done`` shown to it as a hint (the platform owns termination, so the hint alone
ends nothing); at ``--max-turns``; or at a turn that fails (an agent error, an invalid reply, a user model
that cannot answer).  ``Conversation.ended`` says who ended it and ``ended_by`` names it: ``user``,
``agent_hint`` (the user was done on a turn whose reply said ``session_done: true``), ``turn_limit``,
``agent_failed``, ``user_failed``, or ``no_user``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

from . import dataset as datasets
from ..models import roles
from ..models.client import ChatClient, ModelError, add_usage

__all__ = ["TURN_MODES", "DEFAULT_MAX_TURNS", "UserModel", "TurnReply", "turn_reply", "Conversation"]

TURN_MODES = datasets.TURN_MODES
DEFAULT_MAX_TURNS = 8


class TurnReply(NamedTuple):
    """One turn's answer, read from the agent's reply body: its message, its hint (``None``: the reply gave
    none, a response envelope), and what was wrong."""

    message: Optional[str]
    session_done: Optional[bool]
    error: Optional[str] = None


def turn_reply(body: Any) -> TurnReply:
    """The agent's reply to one turn (CONTRACT §4.2), or why it is not one."""
    if not isinstance(body, Mapping):
        return TurnReply(None, None, error=f"the turn's reply is not a JSON object: {json.dumps(body)[:120]}")
    done = body.get("session_done")
    if "session_done" in body and not isinstance(done, bool):
        return TurnReply(None, None, error=f"session_done must be a boolean, got {json.dumps(done)[:60]}")
    message = body.get("message")
    if message is None and isinstance(body.get("final_response"), str) and body["final_response"].strip():
        return TurnReply(body["final_response"], done)  # what single-turn servers (the SDK's own, ours) send
    if not isinstance(message, str) or not message.strip():
        return TurnReply(None, done, error='the turn\'s reply needs a non-empty "message" (§4.2)')
    return TurnReply(message, done)


def _user_check(answer: Dict[str, Any]) -> Optional[str]:
    if not answer.get("done") and not (isinstance(answer.get("message"), str) and answer["message"].strip()):
        return "a user who is not done must say something: give message, or set done to true"
    return None


class UserModel:
    """Plays the user through one :class:`ChatClient`; :meth:`next_message` is one decision."""

    def __init__(self, client: ChatClient, prompt: str, max_turns: int = DEFAULT_MAX_TURNS) -> None:
        self.client = client
        self.prompt = prompt
        self.max_turns = max_turns

    def identity(self) -> Dict[str, Any]:
        """What makes two runs' simulated users the same (for result files)."""
        return {"model": self.client.endpoint.model, "max_turns": self.max_turns,
                "prompt_sha256": hashlib.sha256(self.prompt.encode("utf-8")).hexdigest()}

    def next_message(self, task: datasets.Task, turns: List[Dict[str, Any]],
                     usage: Dict[str, int]) -> Tuple[Optional[str], bool]:
        """The user's next message and whether the user is done; raises ``ModelError``."""
        case: Dict[str, Any] = {"user_instruction": task.user_instruction,
                                "conversation": [{"turn": t["turn"], "user": t["user"], "agent": t.get("agent"),
                                                  "session_done": t.get("session_done")} for t in turns],
                                "turns_left": self.max_turns - len(turns)}
        if task.behavior_instructions:
            case["behavior_instructions"] = task.behavior_instructions
        messages = [{"role": "system", "content": self.prompt},
                    {"role": "user", "content": json.dumps(case, ensure_ascii=False, indent=1)}]
        try:
            answer = self.client.ask_json(messages, roles.USER_SCHEMA, name=roles.USER, check=_user_check)
        except ModelError as exc:
            add_usage(usage, exc.usage)
            raise
        add_usage(usage, answer.usage)
        done = bool(answer.value.get("done"))
        message = answer.value.get("message")
        return (None if done else str(message)), done


class Conversation:
    """One session's turns as they happen; :meth:`run` drives it with ``send(prompt, fields) -> (body, error)``."""

    def __init__(self, task: datasets.Task, user: Optional[UserModel], session_id: str) -> None:
        self.task = task
        self.user = user
        self.session_id = session_id
        self.turns: List[Dict[str, Any]] = []
        self.errors: List[str] = []
        self.ended = ""
        self.ended_by = ""
        self.usage: Dict[str, int] = {}

    def fields(self, prompt: str) -> Dict[str, Any]:
        """The multi-turn fields of the next turn's dispatch (the module docstring)."""
        history: List[Dict[str, str]] = []
        for turn in self.turns:
            history.append({"role": "user", "content": turn["user"]})
            if turn.get("agent") is not None:
                history.append({"role": "assistant", "content": turn["agent"]})
        return {"latest_user_prompt": prompt, "session_id": self.session_id,
                "turn_id": f"{self.session_id}-t{len(self.turns)}", "messages": history, "scenario_state": {}}

    def run(self, send: Callable[[Dict[str, Any]], Tuple[Any, Optional[str]]], clock: Callable[[], float]) -> None:
        """Turn after turn until the session ends; ``clock()`` (ms into the run) stamps when each turn began."""
        prompt = self.task.user_instruction
        while True:
            number = len(self.turns) + 1
            fields = self.fields(prompt)
            turn: Dict[str, Any] = {"turn": number, "turn_id": fields["turn_id"], "at_ms": clock(), "user": prompt,
                                    "agent": None, "session_done": None}
            body, error = send(fields)
            self.turns.append(turn)
            if error:
                turn["error"] = error
                self.errors.append(f"turn {number}: {error}")
                self._end("agent_failed", "the agent's turn failed")
                return
            reply = turn_reply(body)
            turn["agent"], turn["session_done"] = reply.message, reply.session_done
            if isinstance(body, Mapping) and isinstance(body.get("metadata"), Mapping):
                turn["metadata"] = dict(body["metadata"])
            if reply.error:
                turn["error"] = reply.error
                self.errors.append(f"turn {number}: {reply.error}")
                self._end("agent_failed", "the agent's reply was not a turn reply")
                return
            if self.user is None:
                self._end("no_user", "no user model: the first turn only")
                return
            if number >= self.user.max_turns:
                self._end("turn_limit", f"the turn limit: --max-turns {self.user.max_turns} reached")
                return
            try:
                message, done = self.user.next_message(self.task, self.turns, self.usage)
            except ModelError as exc:
                self.errors.append(f"the simulated user could not answer after turn {number}: {exc}")
                self._end("user_failed", "the simulated user failed")
                return
            if done and reply.session_done:
                self._end("agent_hint", f"the agent's session_done hint (turn {number}), accepted by the user")
                return
            if done:
                self._end("user", "the user was done")
                return
            prompt = str(message)

    def _end(self, by: str, how: str) -> None:
        """The session is over: who ended it (``ended_by``) and how, in words (``ended``)."""
        self.ended_by, self.ended = by, how

    @property
    def final_message(self) -> Optional[str]:
        """The agent's last message: the session's final response, for the judge and the report."""
        return next((t["agent"] for t in reversed(self.turns) if t.get("agent")), None)

    def transcript(self) -> List[Dict[str, Any]]:
        """The session as messages, user and assistant in turn."""
        out: List[Dict[str, Any]] = []
        for turn in self.turns:
            out.append({"role": "user", "content": turn["user"]})
            if turn.get("agent") is not None:
                out.append({"role": "assistant", "content": turn["agent"]})
        return out
