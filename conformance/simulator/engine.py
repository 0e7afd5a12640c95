"""The simulated backend behind the local simulator: ledger, fixtures, failure rules (CONTRACT §6).

Pure and deterministic: no I/O, no clock, no global state.  One
:class:`Backend` answers the tool calls of one run::

    backend = Backend(state, rules, fixtures=load_fixtures(doc), seed=task_seed(row, user_instruction))
    result = backend.call("get_order", {"order_id": "4521"})
    result.response, result.source, result.matched_rule_index, result.changes

How a call is answered, in order:

1. **Failure rules** (the row's ``failure_rules``), in array order, first
   match wins.  ``tool`` is a literal name or ``"*"`` (any tool).  Every call
   counts towards every rule, whichever rule (if any) answers it:

   - ``after_n_calls``: active on the calls numbered ``n`` to
     ``n + duration - 1`` among the calls to ``tool`` (all calls for ``"*"``).
     The n-th call itself is the first of the ``duration`` calls: ``n: 1,
     duration: 1`` fails exactly the first call, so a retry succeeds.
     (``duration`` must be positive, so the other reading of "stays active for
     duration subsequent calls", n-th plus ``duration`` more, could never fail
     a single call.)
   - ``random``: the ``k``-th call to ``tool`` fires when
     ``draw(seed, rule_index, k) < probability``, where ``draw`` is the first
     8 bytes of ``sha256("{seed}:{rule_index}:{k}")`` as a big-endian integer
     divided by 2**64.  The seed comes from the task (:func:`task_seed`), so
     rerunning a task replays the same pattern, and each rule draws on its own
     whatever the other rules do.
   - ``after_state_change``: once the ledger flag ``condition`` is set, active
     for the next ``duration`` calls to ``tool``.  The call whose effects set
     the flag is not one of them.

   A rule's ``error`` with ``code: 200`` answers with its ``response``
   (forced success); any other code answers with ``{"error": message,
   "status_code": code}``.  Both are tagged ``source: "injected"`` with
   ``matched_rule_index``, and an injected answer changes no state: the real
   operation never ran.  The proxy reply is still HTTP 200 with the trace
   envelope (see ``conformance/simulator/simulate.py`` for why).

2. **Fixtures** (optional, ``--responses FILE.json``): the first fixture of
   the tool (then of ``"*"``) whose ``match`` and ``when`` hold.  Its
   ``effects`` run first, all or nothing, then its ``response`` is rendered
   against the updated ledger.  Source ``odyssey``.

3. **The ledger itself**: ``get_<type>`` with an id argument (``<type>_id``,
   ``id``, or the only argument) returns that entity with its ``id``;
   ``list_<type>s`` returns every entity of the type whose attributes equal the
   arguments that name an attribute.  Singular and plural type names both
   work (``order``/``orders``).

4. **A model** (``ask``, when the caller gives one: ``simulate --simulator``):
   it is shown :meth:`Backend.question` (the call, the ledger, the earlier
   calls; the caller adds the tool's definition and the row's behavior
   instructions) and answers ``{"response": ..., "effects": [...]}`` with the
   fixtures' effect syntax.  :meth:`Backend.answer_problem` holds the answer
   to the ledger, as the platform's strict consistency mode does: effects
   that cannot apply (a malformed one, an update of an entity that does not
   exist) and a response that contradicts the ledger where that can be
   checked (an id argument or answer naming no entity of the tool's type; an
   answer naming an entity with other values than the ledger's) are a
   problem; the caller asks once more with the problem named, and a second
   bad answer is an ``{"error": ...}`` with source ``error``.  A good
   answer's effects apply all or nothing and are logged like a fixture's;
   its source is ``odyssey``.  The engine does no I/O: ``ask`` does.

   Without a model, a call none of the above answers gets a clear
   ``{"error": ...}`` with source ``error``, and :attr:`Backend.unanswered`
   names the tool.

Fixtures file::

    {"tools": {
       "get_order": {"response": "{{order.<args.order_id>}}"},
       "refund_order": [
         {"when": {"order.<args.order_id>.status": "refunded"},
          "response": {"error": "order {{args.order_id}} was already refunded"}},
         {"match": {"order_id": "4521"},
          "effects": [{"update": "order.<args.order_id>", "set": {"status": "refunded"}},
                      {"set_flag": "refund_issued"}],
          "response": {"order_id": "{{args.order_id}}", "status": "{{order.<args.order_id>.status}}"}}]}}

A tool maps to one fixture or a list.  Fixture keys: ``response``
(required, any JSON, templates allowed), ``match`` (argument name -> value;
values compare as JSON, and a number matches its decimal string), ``when``
(path -> value, compared the same way; a missing path never matches),
``effects`` (list), ``description`` (ignored).  Effects:
``{"update": "type.id", "set": {...}}`` (the entity must exist),
``{"add": "type.id" or "type", "set": {...}}`` (a bare type gets the id
``type-N``, the first free N from 1; ``{{new_id}}`` is the last added id),
``{"remove": "type.id"}``, ``{"set_flag": "name"}``.  Each is recorded as a
ledger change (``op`` = add / update / remove / set_flag).

Template syntax: ``{{ path }}`` inside any string.  A path is dot-separated
segments; the first is ``args`` (the call's arguments), ``flags``,
``state``, ``new_id``, or else an entity type (``order.4521`` is short for
``state.order.4521``).  A segment ``<path>`` is replaced by the value of that
path (``order.<args.order_id>.status``); a number segment indexes a list.  A
string that is exactly one ``{{ path }}`` becomes the value itself (object,
number, ...); inside longer text the value is written as text (JSON for
non-strings).  A missing path makes the call answer ``{"error": "order '9'
not found"}`` (or ``... has no field ...``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import pipelines_port as pp


_kind = pp.json_type  # the JSON type name of a value, for messages


__all__ = [
    "TRIGGERS",
    "Finding",
    "state_findings",
    "rule_findings",
    "fixture_findings",
    "describe_rule",
    "task_seed",
    "draw",
    "TemplateError",
    "Missing",
    "check_template",
    "render",
    "Ledger",
    "Fixture",
    "load_fixtures",
    "flags_set_by",
    "ToolResult",
    "Backend",
]

TRIGGERS = ("after_n_calls", "random", "after_state_change")
_TRIGGER_FIELDS = {
    "after_n_calls": ("n", "duration"),
    "random": ("probability",),
    "after_state_change": ("condition", "duration"),
}
_RULE_KEYS = {"trigger", "tool", "error", "n", "duration", "probability", "condition", "description"}
_TOOL_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,127}")
_FIXTURE_KEYS = {"response", "match", "when", "effects", "description"}
_EFFECT_KINDS = ("update", "add", "remove", "set_flag")
_ROOTS = ("args", "flags", "state", "new_id")


# ---------------------------------------------------------------------------
# Shape checks, shared with the dataset validator
# ---------------------------------------------------------------------------


class Finding(NamedTuple):
    """One problem in a state, rule list or fixtures document: ``severity`` is ``error`` or ``warning``."""

    severity: str
    where: str  # a JSON-ish path into the checked value, e.g. "[0].error.code"
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}" if self.where else self.message


def _names(keys: Sequence[str]) -> str:
    """``a``, ``b`` for messages."""
    return ", ".join(f"`{k}`" for k in keys)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: Any, limit: int = 60) -> str:
    """A short JSON rendering of ``value`` for messages."""
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def state_findings(state: Any) -> List[Finding]:
    """Problems with an ``initial_state`` value: ``{entity_type: {entity_id: {attr: value}}}``."""
    if not isinstance(state, dict):
        shape = "{entity_type: {entity_id: {attrs}}}"
        return [Finding("error", "", f"must be a JSON object {shape}, got {_kind(state)}")]
    found: List[Finding] = []
    for entity_type, entities in state.items():
        if not entity_type.strip():
            found.append(Finding("error", "", "an entity type name is empty"))
        if not isinstance(entities, dict):
            shape = "{entity_id: {attrs}}"
            found.append(Finding("error", entity_type, f"must be an object {shape}, got {_kind(entities)}"))
            continue
        for entity_id, attrs in entities.items():
            if not isinstance(attrs, dict):
                found.append(Finding("error", f"{entity_type}.{entity_id}",
                                     f"must be an object of attributes, got {_kind(attrs)}"))
    return found


def _positive_int(rule: Mapping[str, Any], key: str, at: str) -> Optional[Finding]:
    if key not in rule:
        return Finding("error", at, f"`{rule['trigger']}` needs `{key}` (a positive integer)")
    if not _is_int(rule[key]) or rule[key] < 1:
        return Finding("error", f"{at}.{key}", f"must be a positive integer, got {_show(rule[key])}")
    return None


def _error_findings(error: Any, at: str) -> List[Finding]:
    if not isinstance(error, dict):
        shapes = "{code, message} or {code: 200, response}"
        return [Finding("error", at, f"must be an object {shapes}, got {_kind(error)}")]
    code = error.get("code")
    if "code" not in error:
        return [Finding("error", at, "needs `code` (200 for a forced response, or an HTTP error status)")]
    if not _is_int(code) or not 100 <= code <= 599:
        return [Finding("error", f"{at}.code", f"must be an integer HTTP status from 100 to 599, got {_show(code)}")]
    found = []
    if code == 200 and "response" not in error:
        found.append(Finding("error", at, "code 200 (forced success) needs `response`, the value the agent receives"))
    if code != 200:
        message = error.get("message")
        if not isinstance(message, str) or not message.strip():
            got = "nothing" if "message" not in error else _show(message)
            found.append(Finding("error", f"{at}.message",
                                 f"code {code} needs `message`, a non-empty string, got {got}"))
        if "response" in error:
            found.append(Finding("warning", f"{at}.response", "is ignored: only code 200 returns a response"))
    unknown = sorted(set(error) - {"code", "message", "response"})
    if unknown:
        found.append(Finding("warning", at, f"unknown key(s) {_names(unknown)} ignored"))
    return found


def rule_findings(rules: Any) -> List[Finding]:
    """Problems with a ``failure_rules`` value: a JSON array of ``{trigger, tool, ..., error}``."""
    if not isinstance(rules, list):
        return [Finding("error", "", f"must be a JSON array of rules, got {_kind(rules)}")]
    found: List[Finding] = []
    for i, rule in enumerate(rules):
        at = f"[{i}]"
        if not isinstance(rule, dict):
            shape = "{trigger, tool, ..., error}"
            found.append(Finding("error", at, f"a rule must be an object {shape}, got {_kind(rule)}"))
            continue
        trigger = rule.get("trigger")
        if trigger not in TRIGGERS:
            got = "nothing" if "trigger" not in rule else _show(trigger)
            found.append(Finding("error", f"{at}.trigger", f"must be one of {', '.join(TRIGGERS)}, got {got}"))
        tool = rule.get("tool")
        if not isinstance(tool, str) or not tool.strip():
            got = "nothing" if "tool" not in rule else _show(tool)
            found.append(Finding("error", f"{at}.tool", f"must be a tool name or \"*\", got {got}"))
        elif tool != "*" and not _TOOL_NAME_RE.fullmatch(tool):
            found.append(Finding("warning", f"{at}.tool",
                                 f"{_show(tool)} is not a valid tool name, so it never matches a call"))
        if trigger == "after_n_calls":
            found += [f for f in (_positive_int(rule, "n", at), _positive_int(rule, "duration", at)) if f]
        elif trigger == "after_state_change":
            condition = rule.get("condition")
            if not isinstance(condition, str) or not condition.strip():
                got = "nothing" if "condition" not in rule else _show(condition)
                found.append(Finding("error", f"{at}.condition",
                                     f"must be a ledger flag name (a non-empty string), got {got}"))
            found += [f for f in (_positive_int(rule, "duration", at),) if f]
        elif trigger == "random":
            p = rule.get("probability")
            ok = isinstance(p, (int, float)) and not isinstance(p, bool) and math.isfinite(p) and 0 <= p <= 1
            if not ok:
                got = "nothing" if "probability" not in rule else _show(p)
                found.append(Finding("error", f"{at}.probability", f"must be a number from 0 to 1, got {got}"))
        if "error" not in rule:
            found.append(Finding("error", at, "needs `error`: {code, message} or {code: 200, response}"))
        else:
            found += _error_findings(rule["error"], f"{at}.error")
        if trigger in TRIGGERS:
            trigger_keys = _RULE_KEYS - {"trigger", "tool", "error", "description"}
            foreign = sorted((set(rule) & trigger_keys) - set(_TRIGGER_FIELDS[trigger]))
            if foreign:
                found.append(Finding("warning", at, f"{_names(foreign)} is not used by `{trigger}`: ignored"))
        unknown = sorted(set(rule) - _RULE_KEYS)
        if unknown:
            found.append(Finding("warning", at, f"unknown key(s) {_names(unknown)} ignored"))
    return found


def describe_rule(rule: Mapping[str, Any]) -> str:
    """A one-line human summary of a (valid) rule, for reports."""
    trigger, tool = rule.get("trigger"), rule.get("tool")
    if trigger == "after_n_calls":
        first, last = rule.get("n", 1), rule.get("n", 1) + rule.get("duration", 1) - 1
        when = f"call {first} to {tool}" if first == last else f"calls {first} to {last} to {tool}"
    elif trigger == "random":
        when = f"each call to {tool} with probability {rule.get('probability')}"
    else:
        when = f"{rule.get('duration')} call(s) to {tool} after flag {rule.get('condition')!r} is set"
    error = rule.get("error") or {}
    if error.get("code") == 200:
        what = "forced response " + _show(error.get("response"), 40)
    else:
        what = f"HTTP-style error {error.get('code')} {error.get('message', '')}".rstrip()
    return f"{trigger}: {when} -> {what}"


# ---------------------------------------------------------------------------
# Deterministic randomness
# ---------------------------------------------------------------------------


def task_seed(row: int, user_instruction: str) -> str:
    """The RNG seed of one task: sha256 of ``"{row}\\n{user_instruction}"`` (1-based data row), hex."""
    return hashlib.sha256(f"{row}\n{user_instruction}".encode()).hexdigest()


def draw(seed: str, rule_index: int, call_number: int) -> float:
    """A uniform number in [0, 1) for the ``call_number``-th call a ``random`` rule sees."""
    digest = hashlib.sha256(f"{seed}:{rule_index}:{call_number}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


# ---------------------------------------------------------------------------
# Paths and templates
# ---------------------------------------------------------------------------


class TemplateError(ValueError):
    """A path or template is malformed (a fixture author's mistake)."""


class Missing(LookupError):
    """A path names nothing in the ledger or the arguments."""

    def __init__(self, described: str) -> None:
        super().__init__(described)
        self.described = described


_TEMPLATE_RE = re.compile(r"\{\{([^{}]*)\}\}")
_SEGMENT_CHARS = re.compile(r"[^.<>{}]+")

Segment = Any  # a literal str, or a nested parsed path (list of segments)


def _parse_path(text: str) -> List[Segment]:
    """Split ``a.<b.c>.d`` into ``["a", ["b", "c"], "d"]``; raises :class:`TemplateError`."""
    segments, pos = _parse_segments(text.strip(), 0, nested=False)
    if pos != len(text.strip()):
        raise TemplateError(f"unexpected {text.strip()[pos]!r} in path {text.strip()!r}")
    return segments


def _parse_segments(text: str, pos: int, *, nested: bool) -> Tuple[List[Segment], int]:
    segments: List[Segment] = []
    while True:
        if pos < len(text) and text[pos] == "<":
            inner, pos = _parse_segments(text, pos + 1, nested=True)
            if pos >= len(text) or text[pos] != ">":
                raise TemplateError(f"unclosed '<' in path {text!r}")
            segments.append(inner)
            pos += 1
        else:
            match = _SEGMENT_CHARS.match(text, pos)
            if not match or not match.group().strip():
                raise TemplateError(f"empty segment in path {text!r}")
            segments.append(match.group().strip())
            pos = match.end()
        if pos < len(text) and text[pos] == ".":
            pos += 1
            continue
        if nested and (pos >= len(text) or text[pos] != ">"):
            raise TemplateError(f"unclosed '<' in path {text!r}")
        return segments, pos


def _key(value: Any) -> str:
    """A value used as a path segment: strings as is, numbers in decimal, others as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, (int, float)) else json.dumps(value, sort_keys=True)


def _resolve(segments: Sequence[Segment], scope: Mapping[str, Any]) -> Any:
    """The value a parsed path names in ``scope``; raises :class:`Missing`."""
    keys = [_key(_resolve(s, scope)) if isinstance(s, list) else s for s in segments]
    if keys[0] not in _ROOTS:
        keys = ["state", *keys]
    value: Any = scope
    for depth, key in enumerate(keys):
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            raise Missing(_describe_missing(keys, depth))
    return value


def _describe_missing(keys: Sequence[str], depth: int) -> str:
    """``order '9' not found`` / ``order '4521' has no field 'x'`` / ``no argument 'order_id'``."""
    root = keys[0]
    if root == "state":
        if depth <= 1:
            return f"no {keys[1]} records" if len(keys) > 1 else "no state"
        if depth == 2:
            return f"{keys[1]} {keys[2]!r} not found"
        return f"{keys[1]} {keys[2]!r} has no field {'.'.join(keys[3:depth + 1])!r}"
    if root == "args":
        return f"missing argument {'.'.join(keys[1:depth + 1])!r}" if depth else "no arguments"
    if root == "flags":
        return f"flag {keys[1]!r} is not set" if len(keys) > 1 else "no flags"
    return f"nothing at {'.'.join(keys)!r}"


def check_template(value: Any) -> List[str]:
    """Syntax errors in every template string inside ``value``."""
    errors: List[str] = []
    if isinstance(value, str):
        for match in _TEMPLATE_RE.finditer(value):
            try:
                _parse_path(match.group(1))
            except TemplateError as exc:
                errors.append(str(exc))
        rest = _TEMPLATE_RE.sub("", value)
        if "{{" in rest or "}}" in rest:
            errors.append(f"unbalanced '{{{{' or '}}}}' in {_show(value)}")
    elif isinstance(value, dict):
        for v in value.values():
            errors += check_template(v)
    elif isinstance(value, list):
        for v in value:
            errors += check_template(v)
    return errors


def render(value: Any, scope: Mapping[str, Any]) -> Any:
    """``value`` with every ``{{ path }}`` replaced from ``scope`` (see the module docstring).

    Raises :class:`Missing` when a path names nothing, :class:`TemplateError`
    when one is malformed.  Returns a new value; ``value`` is not changed.
    """
    if isinstance(value, str):
        whole = _TEMPLATE_RE.fullmatch(value)
        if whole:
            return copy.deepcopy(_resolve(_parse_path(whole.group(1)), scope))
        if "{{" not in value:
            return value
        return _TEMPLATE_RE.sub(lambda m: _text(_resolve(_parse_path(m.group(1)), scope)), value)
    if isinstance(value, dict):
        return {k: render(v, scope) for k, v in value.items()}
    if isinstance(value, list):
        return [render(v, scope) for v in value]
    return value


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _same(expected: Any, actual: Any) -> bool:
    """JSON equality, except that a number equals its decimal string (4521 == "4521")."""
    if isinstance(expected, bool) or isinstance(actual, bool):
        return expected is actual if isinstance(expected, bool) and isinstance(actual, bool) else False
    if isinstance(expected, (int, float)) and isinstance(actual, str):
        return _key(expected) == actual
    if isinstance(actual, (int, float)) and isinstance(expected, str):
        return _key(actual) == expected
    return bool(expected == actual)


# ---------------------------------------------------------------------------
# The ledger
# ---------------------------------------------------------------------------


class Ledger:
    """World state of one run: ``entities[type][id] = attrs`` plus set flags; ``changes`` logs every write."""

    def __init__(self, state: Optional[Mapping[str, Any]] = None) -> None:
        problems = state_findings({} if state is None else state)
        if problems:
            raise ValueError(f"invalid state: {problems[0]}")
        self.entities: Dict[str, Dict[str, Dict[str, Any]]] = copy.deepcopy(dict(state or {}))
        self.flags: Dict[str, bool] = {}
        self.changes: List[Dict[str, Any]] = []

    def snapshot(self) -> Dict[str, Any]:
        """A deep copy of the entities (the state as the next run would boot from it)."""
        return copy.deepcopy(self.entities)

    def scope(self, args: Any, new_id: Optional[str] = None) -> Dict[str, Any]:
        """The names a template or path can see (not copied: read it, do not change it)."""
        return {"args": args, "state": self.entities, "flags": self.flags, "new_id": new_id}

    def type_named(self, word: str) -> Optional[str]:
        """The entity type ``word`` names, singular or plural (``orders`` -> ``order``), if any."""
        candidates = [word, word + "s", word + "es"]
        if word.endswith("ies"):
            candidates.append(word[:-3] + "y")
        if word.endswith("y"):
            candidates.append(word[:-1] + "ies")
        if word.endswith("es"):
            candidates.append(word[:-2])
        if word.endswith("s"):
            candidates.append(word[:-1])
        return next((c for c in candidates if c in self.entities), None)


def _entity_target(path: str, scope: Mapping[str, Any], *, allow_bare_type: bool = False) -> Tuple[str, Optional[str]]:
    """``(type, id)`` an effect's ``"type.id"`` path names (``id`` None for a bare type when allowed)."""
    segments = _parse_path(path)
    keys = [_key(_resolve(s, scope)) if isinstance(s, list) else s for s in segments]
    if keys[0] == "state":
        keys = keys[1:]
    if len(keys) == 1 and allow_bare_type:
        return keys[0], None
    if len(keys) != 2:
        raise TemplateError(f"an effect path must be \"type.id\", got {path!r}")
    return keys[0], keys[1]


# ---------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------


class Fixture(NamedTuple):
    """One canned answer for a tool (see the module docstring for the keys)."""

    response: Any
    match: Dict[str, Any]
    when: Dict[str, Any]
    effects: List[Dict[str, Any]]


def _effect_findings(effect: Any, at: str) -> List[Finding]:
    if not isinstance(effect, dict):
        return [Finding("error", at, f"an effect must be an object, got {_kind(effect)}")]
    kinds = [k for k in _EFFECT_KINDS if k in effect]
    if len(kinds) != 1:
        return [Finding("error", at, "an effect needs exactly one of " + ", ".join(f"`{k}`" for k in _EFFECT_KINDS))]
    kind = kinds[0]
    found = []
    target = effect[kind]
    if not isinstance(target, str) or not target.strip():
        return [Finding("error", f"{at}.{kind}", f"must be a non-empty string, got {_show(target)}")]
    if kind != "set_flag":
        try:
            parts = _parse_path(target)
        except TemplateError as exc:
            return [Finding("error", f"{at}.{kind}", str(exc))]
        if parts[0] == "state":
            parts = parts[1:]
        if not (len(parts) == 2 or (kind == "add" and len(parts) == 1)):
            shapes = '"type.id" or "type"' if kind == "add" else '"type.id"'
            found.append(Finding("error", f"{at}.{kind}", f"must be {shapes}, got {_show(target)}"))
    if kind in ("update", "add"):
        if not isinstance(effect.get("set", {}), dict):
            found.append(Finding("error", f"{at}.set", f"must be an object of attributes, got {_kind(effect['set'])}"))
        found += [Finding("error", f"{at}.set", e) for e in check_template(effect.get("set", {}))]
    allowed = {kind, "set"} if kind in ("update", "add") else {kind}
    unknown = sorted(set(effect) - allowed)
    if unknown:
        found.append(Finding("warning", at, f"unknown key(s) {_names(unknown)} ignored"))
    return found


def fixture_findings(doc: Any) -> List[Finding]:
    """Problems with a fixtures document ``{"tools": {name: fixture or [fixtures]}}``."""
    if not isinstance(doc, dict):
        return [Finding("error", "", f"must be a JSON object {{\"tools\": {{...}}}}, got {_kind(doc)}")]
    found: List[Finding] = []
    unknown = sorted(set(doc) - {"tools", "description"})
    if unknown:
        found.append(Finding("warning", "", f"unknown top-level key(s) {_names(unknown)} ignored"))
    tools = doc.get("tools")
    if not isinstance(tools, dict):
        shape = "{tool_name: fixture or [fixtures]}"
        found.append(Finding("error", "tools", f"must be an object {shape}, got {_kind(tools)}"))
        return found
    for name, entries in tools.items():
        if name != "*" and not _TOOL_NAME_RE.fullmatch(name):
            found.append(Finding("warning", f"tools.{name}", "is not a valid tool name, so it never matches a call"))
        entries = entries if isinstance(entries, list) else [entries]
        for i, fixture in enumerate(entries):
            at = f"tools.{name}[{i}]"
            if not isinstance(fixture, dict):
                found.append(Finding("error", at, f"a fixture must be an object, got {_kind(fixture)}"))
                continue
            if "response" not in fixture:
                found.append(Finding("error", at, "needs `response`, the value the agent receives"))
            found += [Finding("error", f"{at}.response", e) for e in check_template(fixture.get("response"))]
            for key in ("match", "when"):
                if not isinstance(fixture.get(key, {}), dict):
                    found.append(Finding("error", f"{at}.{key}", f"must be an object, got {_kind(fixture.get(key))}"))
            for path in fixture.get("when", {}) if isinstance(fixture.get("when"), dict) else ():
                try:
                    _parse_path(path)
                except TemplateError as exc:
                    found.append(Finding("error", f"{at}.when", str(exc)))
            effects = fixture.get("effects", [])
            if not isinstance(effects, list):
                found.append(Finding("error", f"{at}.effects", f"must be an array, got {_kind(effects)}"))
            else:
                for j, effect in enumerate(effects):
                    found += _effect_findings(effect, f"{at}.effects[{j}]")
            unknown = sorted(set(fixture) - _FIXTURE_KEYS)
            if unknown:
                found.append(Finding("warning", at, f"unknown key(s) {_names(unknown)} ignored"))
    return found


def load_fixtures(doc: Any) -> Dict[str, List[Fixture]]:
    """Fixtures by tool name from a checked document; raises ``ValueError`` with the first error."""
    errors = [f for f in fixture_findings(doc) if f.severity == "error"]
    if errors:
        raise ValueError(f"invalid fixtures: {errors[0]}")
    table: Dict[str, List[Fixture]] = {}
    for name, entries in doc["tools"].items():
        entries = entries if isinstance(entries, list) else [entries]
        table[name] = [
            Fixture(f["response"], dict(f.get("match", {})), dict(f.get("when", {})), list(f.get("effects", [])))
            for f in entries
        ]
    return table


def flags_set_by(fixtures: Mapping[str, Sequence[Fixture]]) -> set:
    """Every flag name some fixture effect sets (to spot ``after_state_change`` rules that can never fire)."""
    return {e["set_flag"] for entries in fixtures.values() for f in entries for e in f.effects if "set_flag" in e}


# ---------------------------------------------------------------------------
# The backend: one run's tool calls
# ---------------------------------------------------------------------------


class ToolResult(NamedTuple):
    """How one tool call was answered: the proxy's trace-envelope fields plus the ledger changes it made.

    ``answered_by`` says which step of the precedence answered: ``rule``, ``fixture``, ``ledger``, ``model``,
    or ``none`` (nothing could: an error).
    """

    tool_name: str
    response: Any
    source: str  # "odyssey" | "injected" | "error"
    matched_rule_index: Optional[int]
    changes: List[Dict[str, Any]]
    answered_by: str = "ledger"


HISTORY_SHOWN = 20  # the earlier calls a model is shown (the last ones)


class Backend:
    """The simulated backend of one run: a ledger, the row's failure rules and optional fixtures.

    Not thread-safe: callers serialise :meth:`call` (the simulator holds a
    lock per run).  Raises ``ValueError`` at construction for invalid
    ``state`` or ``rules`` (validate them first with the dataset checks).
    """

    def __init__(
        self,
        state: Optional[Mapping[str, Any]] = None,
        rules: Optional[Sequence[Mapping[str, Any]]] = None,
        *,
        fixtures: Optional[Mapping[str, Sequence[Fixture]]] = None,
        seed: str = "",
    ) -> None:
        errors = [f for f in rule_findings(list(rules or [])) if f.severity == "error"]
        if errors:
            raise ValueError(f"invalid failure_rules: {errors[0]}")
        self.ledger = Ledger(state)
        self.rules: List[Dict[str, Any]] = copy.deepcopy([dict(r) for r in rules or []])
        self.fixtures = dict(fixtures or {})
        self.seed = seed
        self.calls_by_tool: Dict[str, int] = {}
        self.calls = 0
        self._since_flag: Dict[int, int] = {}
        self.history: List[Dict[str, Any]] = []  # every call and its answer, for a model's view of the run
        self.unanswered: List[str] = []  # tools nothing could answer, in order of their first call

    def call(self, tool_name: str, args: Any, *, ask: Optional[Callable[[Dict[str, Any]], Any]] = None) -> ToolResult:
        """Answer one tool call (see the module docstring for the order of precedence).

        ``ask(question)`` is the model of step 4: it returns an answer that :meth:`answer_problem` accepts, or
        raises (any exception: its text becomes the call's error).
        """
        args = args if isinstance(args, dict) else {}
        question = self.question(tool_name, args) if ask is not None else None  # before this call is counted
        self.calls += 1
        self.calls_by_tool[tool_name] = self.calls_by_tool.get(tool_name, 0) + 1
        result = self._answer(tool_name, args, ask, question)
        # By reference: nothing changes a call's arguments or answer once made; question() copies what it shows.
        self.history.append({"tool": tool_name, "arguments": args, "response": result.response,
                             "source": result.source})
        if result.answered_by == "none" and tool_name not in self.unanswered:
            self.unanswered.append(tool_name)
        return result

    def _answer(self, tool_name: str, args: Dict[str, Any], ask: Optional[Callable[[Dict[str, Any]], Any]],
                question: Optional[Dict[str, Any]]) -> ToolResult:
        index = self._matching_rule(tool_name)
        if index is not None:
            return self._injected(tool_name, index)
        for name in (tool_name, "*"):
            for fixture in self.fixtures.get(name, ()):
                if self._applies(fixture, args):
                    return self._answer_with(tool_name, fixture, args)
        looked_up = self._answer_from_ledger(tool_name, args)
        if looked_up.answered_by != "none" or ask is None or question is None:
            return looked_up
        return self._answer_from_model(tool_name, args, ask, question)

    # -- failure rules ---------------------------------------------------------

    def _count(self, rule: Mapping[str, Any], tool_name: str) -> int:
        """How many calls the rule has seen so far, this one included (0 when the tool does not match)."""
        if rule["tool"] == "*":
            return self.calls
        return self.calls_by_tool.get(tool_name, 0) if rule["tool"] == tool_name else 0

    def _matching_rule(self, tool_name: str) -> Optional[int]:
        # Count first, for every rule, so a rule's window never depends on which rule answered.
        for i, rule in enumerate(self.rules):
            if rule["trigger"] != "after_state_change" or not self._count(rule, tool_name):
                continue
            if self.ledger.flags.get(rule["condition"]):
                self._since_flag[i] = self._since_flag.get(i, 0) + 1
        for i, rule in enumerate(self.rules):
            k = self._count(rule, tool_name)
            if not k:
                continue
            trigger = rule["trigger"]
            if trigger == "after_n_calls" and rule["n"] <= k < rule["n"] + rule["duration"]:
                return i
            if trigger == "random" and draw(self.seed, i, k) < rule["probability"]:
                return i
            if trigger == "after_state_change" and 1 <= self._since_flag.get(i, 0) <= rule["duration"]:
                return i
        return None

    def _injected(self, tool_name: str, index: int) -> ToolResult:
        error = self.rules[index]["error"]
        if error["code"] == 200:
            response = copy.deepcopy(error.get("response"))
        else:
            response = {"error": error["message"], "status_code": error["code"]}
        return ToolResult(tool_name, response, "injected", index, [], "rule")

    # -- fixtures ----------------------------------------------------------------

    def _applies(self, fixture: Fixture, args: Mapping[str, Any]) -> bool:
        if any(k not in args or not _same(v, args[k]) for k, v in fixture.match.items()):
            return False
        scope = self.ledger.scope(args)
        for path, expected in fixture.when.items():
            try:
                actual = _resolve(_parse_path(path), scope)
            except Missing:
                return False
            if not _same(expected, actual):
                return False
        return True

    def _answer_with(self, tool_name: str, fixture: Fixture, args: Mapping[str, Any]) -> ToolResult:
        ledger = self.ledger
        saved = (copy.deepcopy(ledger.entities), dict(ledger.flags), len(ledger.changes))
        new_id: Optional[str] = None
        try:
            for effect in fixture.effects:
                new_id = self._apply(effect, args, new_id)
            response = render(fixture.response, ledger.scope(args, new_id))
        except (Missing, TemplateError) as exc:
            ledger.entities, ledger.flags = saved[0], saved[1]
            del ledger.changes[saved[2]:]
            text = exc.described if isinstance(exc, Missing) else f"fixture for {tool_name} is malformed: {exc}"
            source = "odyssey" if isinstance(exc, Missing) else "error"
            return ToolResult(tool_name, {"error": text}, source, None, [], "fixture")
        return ToolResult(tool_name, response, "odyssey", None, ledger.changes[saved[2]:], "fixture")

    def _apply(self, effect: Mapping[str, Any], args: Mapping[str, Any], new_id: Optional[str]) -> Optional[str]:
        """Run one effect on the ledger and log it; returns the id of the entity it added, if any."""
        ledger = self.ledger
        scope = ledger.scope(args, new_id)
        if "set_flag" in effect:
            name = effect["set_flag"]
            if not ledger.flags.get(name):
                ledger.flags[name] = True
                ledger.changes.append({"op": "set_flag", "flag": name})
            return new_id
        kind = next(k for k in ("update", "add", "remove") if k in effect)
        entity_type, entity_id = _entity_target(effect[kind], scope, allow_bare_type=kind == "add")
        entities = ledger.entities.get(entity_type, {})
        if kind == "add":
            if entity_id is None:
                n = len(entities) + 1
                while f"{entity_type}-{n}" in entities:
                    n += 1
                entity_id = f"{entity_type}-{n}"
            attrs = render(dict(effect.get("set", {})), scope)
            before = entities.get(entity_id)
            ledger.entities.setdefault(entity_type, {})[entity_id] = attrs
            change: Dict[str, Any] = {"op": "add" if before is None else "update", "entity_type": entity_type,
                                      "entity_id": entity_id, "after": copy.deepcopy(attrs)}
            if before is not None:
                change["before"] = before
            ledger.changes.append(change)
            return entity_id
        if entity_id not in entities:
            raise Missing(f"{entity_type} {entity_id!r} not found")
        before = copy.deepcopy(entities[entity_id])
        if kind == "remove":
            del entities[entity_id]
            ledger.changes.append({"op": "remove", "entity_type": entity_type, "entity_id": entity_id,
                                   "before": before})
            return new_id
        entities[entity_id].update(render(dict(effect.get("set", {})), scope))
        ledger.changes.append({"op": "update", "entity_type": entity_type, "entity_id": entity_id, "before": before,
                               "after": copy.deepcopy(entities[entity_id])})
        return new_id

    # -- the ledger's own answers -------------------------------------------------

    def _answer_from_ledger(self, tool_name: str, args: Mapping[str, Any]) -> ToolResult:
        ledger = self.ledger
        verb, _, noun = tool_name.partition("_")
        entity_type = ledger.type_named(noun) if noun and verb in ("get", "list") else None
        if entity_type is None:
            hint = f" and the state has no `{noun}` entities" if noun and verb in ("get", "list") else ""
            text = (f"the simulator has no answer for {tool_name}: no fixture for it{hint} "
                    f"(the ledger itself answers get_<type> and list_<type>s; simulate --simulator MODEL "
                    f"answers any tool)")
            return ToolResult(tool_name, {"error": text}, "error", None, [], "none")
        entities = ledger.entities[entity_type]
        if verb == "list":
            filters = {k: v for k, v in args.items() if any(k in attrs for attrs in entities.values())}
            rows = [_with_id(i, a) for i, a in entities.items()
                    if all(k in a and _same(v, a[k]) for k, v in filters.items())]
            return ToolResult(tool_name, rows, "odyssey", None, [])
        singular = entity_type[:-1] if entity_type.endswith("s") and len(entity_type) > 1 else entity_type
        for key in (f"{entity_type}_id", f"{singular}_id", f"{noun}_id", "id"):
            if key in args:
                entity_id = args[key]
                break
        else:
            if len(args) != 1:
                text = f"{tool_name} needs an id argument ({singular}_id or id)"
                return ToolResult(tool_name, {"error": text}, "error", None, [], "ledger")
            entity_id = next(iter(args.values()))
        entity_id = _key(entity_id)
        if entity_id not in entities:
            return ToolResult(tool_name, {"error": f"{entity_type} {entity_id!r} not found"}, "odyssey", None, [])
        return ToolResult(tool_name, _with_id(entity_id, entities[entity_id]), "odyssey", None, [])


    # -- a model's answers (step 4), held to the ledger ----------------------------------

    def question(self, tool_name: str, args: Mapping[str, Any]) -> Dict[str, Any]:
        """What the engine shows a model of this call: the call, the ledger as it stands, the earlier calls."""
        earlier = self.history[-HISTORY_SHOWN:]
        view: Dict[str, Any] = {"tool": tool_name, "arguments": copy.deepcopy(dict(args)),
                                "ledger": self.ledger.snapshot(), "flags": sorted(self.ledger.flags),
                                "earlier_calls": copy.deepcopy(earlier)}
        if len(self.history) > len(earlier):
            view["earlier_calls_omitted"] = len(self.history) - len(earlier)
        return view

    def answer_problem(self, tool_name: str, args: Mapping[str, Any], answer: Any) -> Optional[str]:
        """Why a model's ``{"response", "effects"}`` cannot stand, in a sentence for the model; ``None`` when it can.

        Pure: the effects are tried on a copy of the ledger.
        """
        if not isinstance(answer, Mapping) or "response" not in answer:
            return 'the answer must be an object {"response": ..., "effects": [...]}'
        effects = answer.get("effects", [])
        if not isinstance(effects, list):
            return "effects must be an array"
        for i, effect in enumerate(effects):
            errors = [f for f in _effect_findings(effect, f"effects[{i}]") if f.severity == "error"]
            if errors:
                return f"{errors[0].where}: {errors[0].message}"
        trial = Backend(self.ledger.entities, fixtures={}, seed=self.seed)
        trial.ledger.flags = dict(self.ledger.flags)
        new_id: Optional[str] = None
        for i, effect in enumerate(effects):
            try:
                new_id = trial._apply(effect, args, new_id)
            except (Missing, TemplateError) as exc:
                what = exc.described if isinstance(exc, Missing) else str(exc)
                return f"effects[{i}] cannot apply: {what} (the ledger is shown in the question)"
        return _contradiction(tool_name, args, answer["response"], trial.ledger)

    def _answer_from_model(self, tool_name: str, args: Dict[str, Any], ask: Callable[[Dict[str, Any]], Any],
                           question: Dict[str, Any]) -> ToolResult:
        try:
            answer = ask(question)
            problem = self.answer_problem(tool_name, args, answer)
            if problem:  # ask should have asked again; a caller that did not still gets no inconsistent state
                raise ValueError(problem)
        except Exception as exc:  # noqa: BLE001 - the model's failure is this call's error, never the run's crash
            text = f"the simulated backend could not answer {tool_name}: {exc}"
            return ToolResult(tool_name, {"error": text}, "error", None, [], "model")
        ledger = self.ledger
        start = len(ledger.changes)
        new_id: Optional[str] = None
        for effect in answer.get("effects") or []:
            new_id = self._apply(effect, args, new_id)  # checked on a copy: applies here too, all of it
        return ToolResult(tool_name, copy.deepcopy(answer["response"]), "odyssey", None, ledger.changes[start:],
                          "model")


_ID_ARGUMENT = re.compile(r"^(?:(?P<type>[a-z][a-z0-9]*(?:_[a-z0-9]+)*?)_)?id$", re.I)


def _tool_type(tool_name: str, ledger: Ledger) -> Optional[str]:
    """The entity type a tool's name acts on (``refund_order`` -> ``order``), when the ledger has it.

    The words after the verb, the longest run first: ``cancel_line_item`` -> ``line_item``,
    ``get_order_status`` -> ``order``.
    """
    words = tool_name.lower().split("_")[1:]
    for size in range(len(words), 0, -1):
        for start in range(len(words) - size + 1):
            found = ledger.type_named("_".join(words[start:start + size]))
            if found:
                return found
    return None


def _contradiction(tool_name: str, args: Mapping[str, Any], response: Any, ledger: Ledger) -> Optional[str]:
    """Where a model's response contradicts the ledger (after its own effects), in the ways the kit can check."""
    if isinstance(response, Mapping) and "error" in response:
        return None  # an error answer claims nothing about the ledger
    tool_type = _tool_type(tool_name, ledger)
    for name, value in args.items():
        match = _ID_ARGUMENT.match(str(name))
        if not match or isinstance(value, (dict, list)) or value is None:
            continue
        entity_type = ledger.type_named(match.group("type")) if match.group("type") else tool_type
        if entity_type and _key(value) not in ledger.entities.get(entity_type, {}):
            return (f"the call names {entity_type} {_key(value)!r}, which the ledger does not have: answer with "
                    f'{{"error": ...}}, or add it in effects')
    if tool_type and isinstance(response, Mapping) and "id" in response and not isinstance(response["id"],
                                                                                           (dict, list)):
        entity = ledger.entities.get(tool_type, {}).get(_key(response["id"]))
        if entity is None:
            return (f"the response is {tool_type} {_key(response['id'])!r}, which the ledger does not have: answer "
                    "from the ledger, or add it in effects")
        differ = sorted(k for k in entity if k in response and not _same(entity[k], response[k]))
        if differ:
            k = differ[0]
            return (f"the response says {k} {json.dumps(response[k])} for {tool_type} {_key(response['id'])!r}, the "
                    f"ledger says {json.dumps(entity[k])}: change it in effects, or answer what the ledger holds")
    return None


def _with_id(entity_id: str, attrs: Mapping[str, Any]) -> Dict[str, Any]:
    entity = {"id": entity_id}
    entity.update(copy.deepcopy(dict(attrs)))
    return entity
