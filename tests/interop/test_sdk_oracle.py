"""pipelines_port against the platform's own Python SDK, used as an oracle.

The SDK (``pipelines-sdk`` 0.1.15, import name ``pipelines``) is proprietary:
nothing of it is copied here.  These tests install it (see
``tests/interop/requirements.txt``) and call it as a black box:

1. the envelope differential: the SDK's dispatch parser
   (``pipelines.odyssey.Envelope.parse``) and ``pipelines_port.Envelope.from_dispatch``
   read the same generated dispatches; every field must agree unless the
   difference is listed in ``DELIBERATE_DIFFERENCES``;
2. response acceptance: every body ``pipelines_port.build_response`` returns
   must pass the SDK's response coercion (``pipelines.odyssey.build_response``)
   unchanged and survive the SDK's FastAPI dispatch route byte for byte;
3. the SDK's ``odyssey doctor`` run against a ``pipelines_port.DispatchApp``,
   in process (its design: ``--app module:attr`` under Starlette's TestClient)
   and against the app served by uvicorn on 127.0.0.1 (through a relay), plus
   ``odyssey sync --from-app URL --dry-run``, the SDK's only reader of a
   running app's URL;
4. the same doctor against the TypeScript and Go reference ports
   (``conformance/ports``), served as their own processes.

Everything skips when the SDK, FastAPI or httpx is missing.  Network: 127.0.0.1
only; every loop is bounded; every server is stopped by its fixture.

Run: ``/tmp/sdkvenv/bin/python -m pytest -q tests/interop/test_sdk_oracle.py -s``
(``-s`` shows the counts).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import decimal
import json
import math
import os
import pathlib
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Mapping, Optional, Tuple

import pytest

fastapi = pytest.importorskip("fastapi", reason="the SDK oracle tests need fastapi")
httpx = pytest.importorskip("httpx", reason="the SDK oracle tests need httpx")
sdk = pytest.importorskip("pipelines.odyssey",
                          reason="the SDK oracle tests need pipelines-sdk (import name `pipelines`)")
sdk_handler = pytest.importorskip("pipelines.odyssey.handler", reason="the SDK's FastAPI extra is missing")

try:
    from importlib.metadata import version as _dist_version

    SDK_VERSION = _dist_version("pipelines-sdk")
except Exception:  # noqa: BLE001 - a `pipelines` package that is not the platform SDK
    pytest.skip("the importable `pipelines` package is not pipelines-sdk", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pipelines_port as pp  # noqa: E402

SEED = 20240611
N_ENVELOPE_CASES = 600
N_RESPONSE_CASES = 400


def _test_client(app: Any) -> Any:
    with warnings.catch_warnings():  # starlette's "install httpx2" notice
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient
    return TestClient(app, raise_server_exceptions=False)


# ---------------------------------------------------------------------------
# Strict comparison: 17 != "17", True != 1, read-only containers read as plain
# ---------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    a, b = _plain(a), _plain(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


# ---------------------------------------------------------------------------
# 1. The envelope differential
# ---------------------------------------------------------------------------

H_TOKEN = "x-pipelines-run-token"
H_PROXY = "x-pipelines-odyssey-proxy-url"
H_PROXY_LEGACY = "x-pipelines-pwsa-proxy-url"
H_RUN_ID = "x-pipelines-run-id"
H_TASK_ID = "x-pipelines-task-id"
H_JTI = "x-pipelines-run-token-jti"
ID_HEADERS = {"run_id": H_RUN_ID, "task_id": H_TASK_ID, "agent_id": None}
OUTCOME = "(outcome)"  # one side raised, the other did not

# field -> (read it from the SDK's Envelope, read it from ours)
FIELDS: Dict[str, Tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "proxy_url": (lambda s: s.proxy_url, lambda o: o.proxy_url),
    "run_token": (lambda s: s.run_token, lambda o: o.run_token),
    "run_id": (lambda s: s.run_id, lambda o: o.run_id),
    "task_id": (lambda s: s.task_id, lambda o: o.task_id),
    "agent_id": (lambda s: s.agent_id, lambda o: o.agent_id),
    "jti": (lambda s: s.run_token_jti, lambda o: o.run_token_jti),
    "user_instruction": (lambda s: s.user_instruction, lambda o: o.user_instruction),
    "task_input": (lambda s: s.task_input, lambda o: o.task_input),
    "latest_user_prompt": (lambda s: s.latest_user_prompt, lambda o: o.latest_user_prompt),
    "session_id": (lambda s: s.session_id, lambda o: o.session_id),
    "turn_id": (lambda s: s.turn_id, lambda o: o.turn_id),
    "messages": (lambda s: s.messages, lambda o: o.messages),
    "scenario_state": (lambda s: s.scenario_state, lambda o: o.scenario_state),
    "workspace": (lambda s: s.workspace, lambda o: o.workspace),
    "tools_schema": (lambda s: s.tools_schema, lambda o: o.tools_schema),
    # the SDK keeps a frozenset (None when empty), ours an ordered tuple without repeats
    "sub_agents": (lambda s: sorted(s.declared_actor_ids or ()), lambda o: sorted(set(o.sub_agents))),
    "raw": (lambda s: s.raw, lambda o: o.raw),
}


@dataclasses.dataclass
class Case:
    body: Any
    headers: Dict[str, str]


def _is_clean_id(value: Any) -> bool:
    """An id both sides keep as is: an int (not a bool), or a non-blank string without surrounding space."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, str) and bool(value) and value == value.strip()


def _headers_named(case: Case, name: str) -> List[str]:
    return [v for k, v in case.headers.items() if k.lower() == name]


def _sdk_header(case: Case, name: str) -> Optional[str]:
    """The header value the SDK's parser reads: a lower-cased dict, so the last case variant wins."""
    values = _headers_named(case, name)
    return values[-1] if values else None


def _body(case: Case) -> Dict[str, Any]:
    return case.body if isinstance(case.body, dict) else {}


def _task(case: Case) -> Dict[str, Any]:
    task = _body(case).get("input")
    return task if isinstance(task, dict) else {}


def _sdk_proxy_pick(case: Case) -> Any:
    """What the SDK's parser picks as the proxy URL: the first *truthy* value, in its order."""
    body = _body(case)
    return (body.get("odyssey_proxy_url") or body.get("pwsa_proxy_url")
            or _sdk_header(case, H_PROXY) or _sdk_header(case, H_PROXY_LEGACY))


def _ours_url(url: Any) -> Optional[str]:
    try:
        return pp.validate_proxy_url(url, "test")
    except pp.EnvelopeError:
        return None


def _label_invalid(label: Any) -> bool:
    try:
        pp.validate_actor_label(label)
    except pp.ProxyRequestError:
        return True
    return False


@dataclasses.dataclass(frozen=True)
class Deliberate:
    reason: str
    fields: FrozenSet[str]
    applies: Callable[[Case, Any, str], bool]  # (case, the SDK's Envelope or None, the differing field)


def _non_object(case: Case, sdk_env: Any, field: str) -> bool:
    return not isinstance(case.body, dict)


def _url_checked(case: Case, sdk_env: Any, field: str) -> bool:
    return sdk_env is not None and _ours_url(sdk_env.proxy_url) != sdk_env.proxy_url


def _url_skip_blank(case: Case, sdk_env: Any, field: str) -> bool:
    pick = _sdk_proxy_pick(case)
    return pick is not None and not (isinstance(pick, str) and pick.strip())


def _token_checked(case: Case, sdk_env: Any, field: str) -> bool:
    token = _sdk_header(case, H_TOKEN)
    return isinstance(token, str) and (
        token != token.strip() or not token.strip() or any(ord(c) < 32 or ord(c) == 127 for c in token))


def _id_native(case: Case, sdk_env: Any, field: str) -> bool:
    value, header = _body(case).get(field), ID_HEADERS[field]
    if value is not None and not _is_clean_id(value):
        return True
    return header is not None and any(not _is_clean_id(v) for v in _headers_named(case, header))


def _task_id_from_input(case: Case, sdk_env: Any, field: str) -> bool:
    return _task(case).get("task_id") is not None


def _jti_trimmed(case: Case, sdk_env: Any, field: str) -> bool:
    jti = _body(case).get("run_token_jti")
    return (isinstance(jti, str) and jti != "" and not _is_clean_id(jti)) or any(
        not _is_clean_id(v) for v in _headers_named(case, H_JTI))


def _session_id_native(case: Case, sdk_env: Any, field: str) -> bool:
    value = _task(case).get("session_id")
    return isinstance(value, bool) or (isinstance(value, str) and not _is_clean_id(value))


def _turn_id_any(case: Case, sdk_env: Any, field: str) -> bool:
    value = _task(case).get("turn_id")
    return value is not None and not isinstance(value, str)


def _sub_agents_checked(case: Case, sdk_env: Any, field: str) -> bool:
    entries = _body(case).get("sub_agents")
    if not isinstance(entries, list):
        return False
    for entry in entries:
        label = entry.get("actor_id") if isinstance(entry, dict) else entry
        if isinstance(label, str) and label.strip() and _label_invalid(label):
            return True
    return False


HEADERS_OF_FIELD = {"proxy_url": (H_PROXY, H_PROXY_LEGACY), "run_token": (H_TOKEN,), "run_id": (H_RUN_ID,),
                    "task_id": (H_TASK_ID,), "jti": (H_JTI,), OUTCOME: (H_TOKEN, H_PROXY, H_PROXY_LEGACY)}


def _repeated_header(case: Case, sdk_env: Any, field: str) -> bool:
    return any(len(_headers_named(case, name)) > 1 for name in HEADERS_OF_FIELD.get(field, ()))


HEADER_FIELDS = frozenset(HEADERS_OF_FIELD)

# Known, deliberate differences between pipelines_port and SDK 0.1.15.  A case whose every
# differing field is explained by one of these counts as "deliberate"; anything else fails.
# An entry no generated case needs is stale and fails too (remove it once the two agree).
DELIBERATE_DIFFERENCES: Dict[str, Deliberate] = {
    "non-object-body": Deliberate(
        "ours refuses a body that is not a JSON object (kit-non-object-body-400); the SDK reads a falsy one "
        "([], 0, \"\", null) as {} and crashes (AttributeError) on any other",
        frozenset({OUTCOME}), _non_object),
    "proxy-url-checked": Deliberate(
        "ours trims the proxy URL and refuses one that is not http(s) with a host, or has a query, fragment or "
        "inner whitespace (kit-proxy-url-checked); the SDK keeps any non-empty string verbatim",
        frozenset({"proxy_url", OUTCOME}), _url_checked),
    "proxy-url-blank-or-non-string-skipped": Deliberate(
        "ours skips a blank or non-string proxy-URL value and tries the next source; the SDK's `or` chain takes "
        "the first truthy value, then raises if it is not a string or keeps a blank one",
        frozenset({"proxy_url", OUTCOME}), _url_skip_blank),
    "run-token-checked": Deliberate(
        "ours trims the run token and refuses a blank one or one with control characters (kit-run-token-checked); "
        "the SDK keeps any non-empty header value verbatim",
        frozenset({"run_token", OUTCOME}), _token_checked),
    "ids-native-types": Deliberate(
        "ours keeps an id only as an int (not a bool) or a non-blank trimmed string, else reads the header "
        "(native-id-types); the SDK keeps any non-null body value (bool, float, object, \"\") and headers verbatim",
        frozenset({"run_id", "task_id", "agent_id"}), _id_native),
    "task-id-from-input": Deliberate(
        "ours falls back to body.input.task_id before the X-Pipelines-Task-Id header (kit-task-id-fallback); "
        "the SDK reads body.task_id and the header only",
        frozenset({"task_id"}), _task_id_from_input),
    "jti-trimmed": Deliberate(
        "ours trims run_token_jti and treats a blank one as absent (then reads the header); the SDK keeps a "
        "padded or whitespace-only body value [undocumented: no kit rule in CONTRACT.md section 7.2]",
        frozenset({"jti"}), _jti_trimmed),
    "session-id-native": Deliberate(
        "ours reads session_id like an id (no bools, blank strings absent, trimmed); the SDK keeps any int or str, "
        "True and \"\" included [undocumented: no kit rule in CONTRACT.md section 7.2]",
        frozenset({"session_id"}), _session_id_native),
    "turn-id-any-json": Deliberate(
        "ours keeps a non-string turn_id (a number, an object) as sent; the SDK reads it as None "
        "[undocumented: no kit rule in CONTRACT.md section 7.2]",
        frozenset({"turn_id"}), _turn_id_any),
    "sub-agents-validated": Deliberate(
        "ours skips sub_agents entries that are not valid actor labels (kit-sub-agents-normalised); the SDK keeps "
        "any non-blank string",
        frozenset({"sub_agents"}), _sub_agents_checked),
    "repeated-header-first-wins": Deliberate(
        "handed a dict with case-variant duplicates of a header, ours uses the first (kit-repeated-header), the "
        "SDK's parse() the last (its own route passes starlette's dict(request.headers), which keeps the first)",
        HEADER_FIELDS, _repeated_header),
}

# --- the generator ----------------------------------------------------------

GOOD_URLS = [
    "https://api.example.com/api/odyssey-proxy/runs/abc",
    "https://api.example.com/api/odyssey-proxy/runs/abc/",
    "https://api.example.com/api/odyssey-proxy/runs/abc//",
    "http://127.0.0.1:8080/api/odyssey-proxy/runs/r1",
    "http://127.0.0.1:8080/",
    "https://proxy.pipelines.tech/api/odyssey-proxy",
]
ODD_URLS = ["https://h.example/p?x=1", "https://h.example/p#frag", "ftp://h.example/p", "not a url", "/relative/path",
            "  https://h.example/p  ", "https://", "   ", "", None, 123, ["https://h.example/p"], False]
ODD_IDS = [None, "", "  ", " 17 ", True, False, 1.5, {"id": 1}, [1], -3, 0]
LABELS = ["triage", "refunds", "supervisor/refund_worker", "billing.v2", " padded ", "", "   ", "bad label!",
          "a//b", "x" * 70, "trailing/", "ünicode", "ok:1-2"]


def _case_variant(rng: random.Random, name: str) -> str:
    style = rng.random()
    if style < 0.4:
        return "-".join(p.capitalize() for p in name.split("-"))
    if style < 0.7:
        return name
    if style < 0.85:
        return name.upper()
    return "".join(c.upper() if rng.random() < 0.5 else c for c in name)


def _id_value(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.45:
        return rng.randint(1, 10**6)
    if r < 0.78:
        return str(rng.randint(1, 10**6))
    if r < 0.88:
        return f"run-{rng.randrange(16**6):06x}"
    return rng.choice(ODD_IDS)


def _maybe(rng: random.Random, p: float, make: Callable[[], Any]) -> Any:
    return make() if rng.random() < p else _MISSING


_MISSING = object()


def _put(target: Dict[str, Any], key: str, value: Any) -> None:
    if value is not _MISSING:
        target[key] = value


def _task_payload(rng: random.Random) -> Any:
    if rng.random() < 0.08:
        return rng.choice(["a string", [1, 2], 5, None, True])
    task: Dict[str, Any] = {}
    _put(task, "user_instruction", _maybe(rng, 0.85, lambda: rng.choice(
        ["Refund order #4521 if it shipped > 30 days ago.", "", "  ", "héllo ☃", 5, None, ["x"]])))
    _put(task, "input", _maybe(rng, 0.8, lambda: rng.choice(
        [{"customer_id": "c9", "order_id": "4521"}, {}, {"nested": {"deep": [1, {"x": None}]}}, [1], "x", None, 3])))
    _put(task, "task_id", _maybe(rng, 0.15, lambda: _id_value(rng)))
    if rng.random() < 0.4:  # a multi-turn run
        _put(task, "latest_user_prompt", _maybe(rng, 0.8, lambda: rng.choice(["and now?", "", 7, None])))
        _put(task, "session_id", _maybe(rng, 0.8, lambda: rng.choice([123, "sess-1"] * 3 + [
            "", " s2 ", True, None, 1.5, {"id": 1}, 0])))
        _put(task, "turn_id", _maybe(rng, 0.8, lambda: rng.choice(["123-t0"] * 5 + ["", 5, None, {"t": 1}, ["t"]])))
        _put(task, "messages", _maybe(rng, 0.7, lambda: rng.choice(
            [[], [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "x", None, {}])))
        _put(task, "scenario_state", _maybe(rng, 0.6, lambda: rng.choice([{}, {"orders": {"1": {"s": "x"}}}, [], "x"])))
    _put(task, "workspace", _maybe(rng, 0.15, lambda: rng.choice(
        [{"cwd": "/work/repo", "setup_mode": "platform", "setup_instructions": None}, "x", None])))
    if rng.random() < 0.2:
        task[f"unknown_{rng.randrange(100)}"] = rng.choice([1, "x", None, {"a": [1]}])
    return task


def _sub_agents(rng: random.Random) -> Any:
    if rng.random() < 0.1:
        return rng.choice(["triage", {"actor_id": "triage"}, 5, None])
    out: List[Any] = []
    for _ in range(rng.randint(0, 5)):
        r = rng.random()
        if r < 0.5:
            out.append(rng.choice(LABELS[:4]) if rng.random() < 0.7 else rng.choice(LABELS))
        elif r < 0.85:
            out.append({"actor_id": rng.choice(LABELS) if rng.random() < 0.3 else rng.choice(LABELS[:4]),
                        **({"description": "d"} if rng.random() < 0.3 else {})})
        else:
            out.append(rng.choice([5, None, {"name": "x"}, {"actor_id": 7}, ["triage"]]))
    return out


def generate_case(rng: random.Random) -> Case:
    headers: Dict[str, str] = {"Content-Type": "application/json"}
    if rng.random() < 0.04:
        body: Any = rng.choice([[], [1], "text", 0, None, True])
    else:
        body = {}
        for key in ("task_id", "run_id", "agent_id"):
            _put(body, key, _maybe(rng, 0.7, lambda: _id_value(rng)))
        _put(body, "input", _maybe(rng, 0.9, lambda: _task_payload(rng)))
        _put(body, "run_token_jti", _maybe(rng, 0.6, lambda: f"{rng.randrange(16**12):012x}" if rng.random() < 0.8
                                            else rng.choice(["", "  ", " j-1 ", 5, None])))
        _put(body, "tools_schema", _maybe(rng, 0.4, lambda: rng.choice(
            [[{"name": "get_order", "input_schema": {"type": "object"}}], [], "x", {"tools": []}, None, [1, "x"]])))
        _put(body, "sub_agents", _maybe(rng, 0.35, lambda: _sub_agents(rng)))
        for _ in range(rng.randint(0, 2)):
            body[f"future_field_{rng.randrange(1000)}"] = rng.choice([1, "x", None, {"k": [True]}])

    # the proxy URL: body (current or legacy name), header (current or legacy), both, or nowhere
    placement = rng.random()
    url = rng.choice(GOOD_URLS) if rng.random() < 0.85 else rng.choice(ODD_URLS)
    if isinstance(body, dict):
        if placement < 0.45:
            body["odyssey_proxy_url"] = url
        elif placement < 0.55:
            body["pwsa_proxy_url"] = url
        elif placement < 0.62:
            body["odyssey_proxy_url"] = rng.choice(ODD_URLS)
            body["pwsa_proxy_url"] = url
    if placement >= 0.55 or rng.random() < 0.3:
        value = url if isinstance(url, str) else rng.choice(GOOD_URLS)
        if rng.random() < 0.8:
            headers[_case_variant(rng, H_PROXY)] = value
        else:
            headers[_case_variant(rng, H_PROXY_LEGACY)] = value
    if placement > 0.97:  # nowhere at all
        for key in [k for k in headers if "proxy-url" in k.lower()]:
            del headers[key]
        if isinstance(body, dict):
            body.pop("odyssey_proxy_url", None)
            body.pop("pwsa_proxy_url", None)

    # the run token
    r = rng.random()
    if r < 0.9:
        headers[_case_variant(rng, H_TOKEN)] = f"rt-{rng.randrange(16**16):016x}"
    elif r < 0.95:
        headers[_case_variant(rng, H_TOKEN)] = rng.choice(["", "   ", " padded-token ", "tok\x01en"])
    # correlation headers: alone (header-only ids) or duplicating the body
    for name in (H_RUN_ID, H_TASK_ID):
        if rng.random() < 0.4:
            headers[_case_variant(rng, name)] = str(rng.randint(1, 999)) if rng.random() < 0.85 else \
                rng.choice(["", " 9 ", "  "])
    if rng.random() < 0.35:
        headers[_case_variant(rng, H_JTI)] = f"{rng.randrange(16**12):012x}" if rng.random() < 0.85 else \
            rng.choice(["", " j-2 ", "   "])
    if rng.random() < 0.04:  # the same header twice, in two spellings
        name = rng.choice([H_TOKEN, H_PROXY, H_RUN_ID, H_JTI])
        headers[name.upper()] = "https://dup.example/p" if "proxy" in name else "dup-1"
        headers[name] = "https://dup.example/q" if "proxy" in name else "dup-2"
    return Case(body, headers)


def _parse_sdk(case: Case) -> Tuple[Any, Optional[BaseException]]:
    try:
        return sdk.Envelope.parse(case.body, case.headers), None
    except Exception as exc:  # noqa: BLE001 - the SDK raises AttributeError for some bodies
        return None, exc


def _parse_ours(case: Case) -> Tuple[Any, Optional[BaseException]]:
    try:
        return pp.Envelope.from_dispatch(case.body, case.headers), None
    except pp.EnvelopeError as exc:
        return None, exc


def compare_case(case: Case) -> Tuple[List[str], Any]:
    """The fields that differ (``OUTCOME`` when exactly one side raised) and the SDK's result."""
    sdk_env, sdk_exc = _parse_sdk(case)
    ours, ours_exc = _parse_ours(case)
    if (sdk_exc is None) != (ours_exc is None):
        return [OUTCOME], sdk_env
    if sdk_exc is not None:
        return [], None  # both refused the dispatch
    return [name for name, (read_sdk, read_ours) in FIELDS.items()
            if not _same(read_sdk(sdk_env), read_ours(ours))], sdk_env


def explain(case: Case, sdk_env: Any, field: str) -> List[str]:
    return [key for key, d in DELIBERATE_DIFFERENCES.items()
            if field in d.fields and d.applies(case, sdk_env, field)]


def test_envelope_differential_against_the_sdk_parser() -> None:
    rng = random.Random(SEED)
    counts: collections.Counter[str] = collections.Counter()
    used: collections.Counter[str] = collections.Counter()
    fields_differing: collections.Counter[str] = collections.Counter()
    unexplained: List[str] = []
    for _ in range(N_ENVELOPE_CASES):
        case = generate_case(rng)
        counts["run"] += 1
        diffs, sdk_env = compare_case(case)
        if not diffs:
            counts["agree"] += 1
            continue
        fields_differing.update(diffs)
        open_fields = []
        for field in diffs:
            keys = explain(case, sdk_env, field)
            used.update(keys)
            if not keys:
                open_fields.append(field)
        if open_fields:
            counts["unexplained"] += 1
            if len(unexplained) < 8:
                sdk_side, sdk_exc = _parse_sdk(case)
                ours, ours_exc = _parse_ours(case)
                detail = {f: (repr(FIELDS[f][0](sdk_side)) if sdk_side is not None else repr(sdk_exc),
                              repr(_plain(FIELDS[f][1](ours))) if ours is not None else repr(ours_exc))
                          for f in open_fields if f in FIELDS}
                if OUTCOME in open_fields:
                    detail[OUTCOME] = (repr(sdk_exc), repr(ours_exc))
                unexplained.append(f"body={case.body!r} headers={case.headers!r}: {detail}")
        else:
            counts["deliberate"] += 1

    print(f"\n[envelope differential] pipelines-sdk {SDK_VERSION}, seed {SEED}: {counts['run']} cases run, "
          f"{counts['agree']} agree on every field, {counts['deliberate']} differ only deliberately, "
          f"{counts['unexplained']} unexplained")
    print(f"  fields differing: {dict(fields_differing.most_common())}")
    print(f"  deliberate differences used: {dict(used.most_common())}")

    assert counts["run"] >= 500
    assert counts["agree"] + counts["deliberate"] + counts["unexplained"] == counts["run"]
    assert counts["agree"] >= counts["run"] // 3, "the generator should produce mostly ordinary dispatches"
    assert not unexplained, "undeclared differences from the SDK's parser:\n" + "\n".join(unexplained)
    stale = sorted(set(DELIBERATE_DIFFERENCES) - set(used))
    assert not stale, f"DELIBERATE_DIFFERENCES entries no case needed (stale, or the generator lost them): {stale}"


@pytest.mark.parametrize("body,headers", [
    ({"odyssey_proxy_url": "https://h.example/p/", "run_id": 17, "task_id": "42",
      "input": {"user_instruction": "go", "input": {"a": 1}}},
     {"X-Pipelines-Run-Token": "rt", "X-Pipelines-Run-Id": "99"}),
    ({"input": {}}, {"x-pipelines-odyssey-proxy-url": "http://127.0.0.1:1/p", "x-pipelines-run-token": "rt",
                     "x-pipelines-run-id": "5", "x-pipelines-task-id": "6", "x-pipelines-run-token-jti": "j"}),
    ({"pwsa_proxy_url": "https://h.example/legacy"}, {"X-PIPELINES-RUN-TOKEN": "rt"}),
    ({}, {"X-Pipelines-Pwsa-Proxy-Url": "https://h.example/legacy/", "X-Pipelines-Run-Token": "rt"}),
])
def test_envelope_fixed_examples_agree(body: Dict[str, Any], headers: Dict[str, str]) -> None:
    """Hand-written dispatches of the documented shape: no field may differ."""
    diffs, _ = compare_case(Case(body, headers))
    assert diffs == []


@pytest.mark.parametrize("body,headers", [
    ({}, {"X-Pipelines-Run-Token": "rt"}),                      # no proxy URL anywhere
    ({"odyssey_proxy_url": "https://h.example/p"}, {}),         # no run token
])
def test_envelope_both_refuse_a_dispatch_missing_its_credentials(body: Dict[str, Any],
                                                                 headers: Dict[str, str]) -> None:
    assert isinstance(_parse_sdk(Case(body, headers))[1], sdk.EnvelopeError)
    assert isinstance(_parse_ours(Case(body, headers))[1], pp.EnvelopeError)


# ---------------------------------------------------------------------------
# 2. Response acceptance: what our builder returns, the SDK passes unchanged
# ---------------------------------------------------------------------------


class _Result:
    """A framework result object (OpenAI Agents' RunResult & co.)."""

    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)

    def __repr__(self) -> str:
        return f"_Result({self.__dict__!r})"


def _tool_call(rng: random.Random, call_id: str) -> Any:
    r = rng.random()
    args = rng.choice([{"order_id": "4521"}, '{"order_id": "4521"}', {}, None, 5, ["x"]])
    if r < 0.4:
        call: Dict[str, Any] = {"id": call_id, "name": rng.choice(["get_order", "issue_refund"])}
        if rng.random() < 0.8:
            call["arguments"] = args
        return call
    if r < 0.7:
        return {"id": call_id, "type": "function", "function": {"name": "get_order", "arguments": args}}
    if r < 0.8:  # both forms in one call
        return {"id": call_id, "name": "get_order", "type": "function",
                "function": {"name": "issue_refund", "arguments": args}}
    return rng.choice([{"id": call_id}, {"id": call_id, "function": {"arguments": {}}}, {"name": ""},
                       {"id": 5, "name": "get_order"}, "get_order", None, {"id": None, "name": "get_order"}])


def _message(rng: random.Random, known_ids: List[str]) -> Any:
    if rng.random() < 0.03:
        return rng.choice(["not a message", 5, None, ["x"]])
    role = rng.choice(["user", "assistant", "assistant", "tool", "system"]) if rng.random() < 0.92 else \
        rng.choice(["developer", None, 5, "ASSISTANT", _MISSING])
    msg: Dict[str, Any] = {}
    _put(msg, "role", role)
    _put(msg, "content", rng.choice(["some text", None, [{"type": "text", "text": "part"}], "", 5, {"x": 1},
                                     _MISSING]))
    if role == "assistant" or rng.random() < 0.05:
        r = rng.random()
        if r < 0.5:
            calls = []
            for _ in range(rng.randint(1, 3)):
                call_id = f"c{rng.randrange(10**6)}"
                known_ids.append(call_id)
                calls.append(_tool_call(rng, call_id))
            msg["tool_calls"] = calls
        elif r < 0.7:
            msg["tool_calls"] = rng.choice([None, [], "not a list"])
        if rng.random() < 0.3:
            msg["thinking"] = rng.choice([None, [], [{"type": "text", "text": "hmm"}], [{"signature": "s"}],
                                          ["loose"], "x"])
    if role == "tool" or rng.random() < 0.05:
        msg["tool_call_id"] = rng.choice(
            [rng.choice(known_ids) if known_ids else "c0", "c-unknown", None, 5, ""])
    if rng.random() < 0.1:
        msg["name"] = "helper"
    return msg


def _messages(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.1:
        return rng.choice([None, "a transcript", 5, {"role": "user"}, []])
    known: List[str] = []
    out = [{"role": "user", "content": "Refund order #4521"}] if rng.random() < 0.7 else []
    for _ in range(rng.randint(0, 6)):
        out.append(_message(rng, known))
    return out


def _metadata(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.1:
        return rng.choice([None, "meta", 5, [1]])
    meta: Dict[str, Any] = {}
    if rng.random() < 0.7:
        meta["model"] = rng.choice(["claude-sonnet-4-5", "gpt-5", 5, None])
    for key in ("total_input_tokens", "total_output_tokens"):
        if rng.random() < 0.6:
            meta[key] = rng.choice([1842, 0, 217, -1, "10", True, 1.5, None])
    if rng.random() < 0.5:
        meta["agent_runtime_ms"] = rng.choice([4815, 12.5, 0, -1, float("nan"), float("inf"), "fast", None])
    if rng.random() < 0.15:
        meta["system_prompt_id"] = rng.choice(["sp-1", 3, None])
    if rng.random() < 0.3:
        meta["custom"] = rng.choice([{"k": [1, "x"]}, "v", float("nan"), float("-inf"),
                                     datetime.datetime(2024, 1, 2, 3, 4, 5), decimal.Decimal("1.5"), {1, 2},
                                     b"bytes", ("a", "b")])
    return meta


def _valid_messages(rng: random.Random) -> List[Dict[str, Any]]:
    """A well-formed transcript in one of the many shapes section 4 allows."""
    out: List[Dict[str, Any]] = []
    if rng.random() < 0.3:
        out.append({"role": "system", "content": "You are a support agent."})
    out.append({"role": "user", "content": rng.choice(["Refund order #4521", [{"type": "text", "text": "hi"}]])})
    for turn in range(rng.randint(0, 3)):
        calls = []
        for k in range(rng.randint(1, 2)):
            call_id = f"call_{turn}_{k}"
            args = rng.choice([{"order_id": "4521"}, '{"order_id": "4521"}', {}, _MISSING])
            form = rng.random()
            if form < 0.45:
                call: Dict[str, Any] = {"id": call_id, "name": "get_order"}
                _put(call, "arguments", args)
            elif form < 0.85:
                function: Dict[str, Any] = {"name": "get_order"}
                _put(function, "arguments", args)
                call = {"id": call_id, "type": "function", "function": function}
            else:  # both forms at once
                call = {"id": call_id, "name": "get_order", "type": "function",
                        "function": {"name": "get_order", "arguments": {}}}
            calls.append(call)
        assistant: Dict[str, Any] = {"role": "assistant", "content": rng.choice([None, "", "Let me look.", _MISSING]),
                                     "tool_calls": calls}
        if rng.random() < 0.4:
            assistant["thinking"] = rng.choice([None, [], [{"type": "text", "text": "checking"}], [{"signature": "s"}]])
        out.append({k: v for k, v in assistant.items() if v is not _MISSING})
        for call in calls:
            out.append({"role": "tool", "tool_call_id": call["id"],
                        "content": rng.choice(['{"status": "shipped"}', "plain text", None, []])})
    final: Dict[str, Any] = {"role": "assistant", "content": "The refund has been issued."}
    for key, choices in (("tool_calls", [None, []]), ("thinking", [None, [], [{"text": "done"}]]),
                         ("tool_call_id", [None]), ("name", ["agent"])):
        if rng.random() < 0.2:
            final[key] = rng.choice(choices)
    out.append(final)
    return out


def _valid_metadata(rng: random.Random) -> Optional[Dict[str, Any]]:
    if rng.random() < 0.1:
        return None
    meta: Dict[str, Any] = {}
    for key, choices in (("model", ["claude-sonnet-4-5", "gpt-5", None]), ("system_prompt_id", ["sp-1", None]),
                         ("total_input_tokens", [1842, 0, None]), ("total_output_tokens", [217, 0, None]),
                         ("agent_runtime_ms", [4815, 12.5, 0, None]),
                         ("extra", [{"k": [1, "x", None, True]}, "v", 3.25, []])):
        if rng.random() < 0.6:
            meta[key] = rng.choice(choices)
    return meta


def generate_result(rng: random.Random) -> Any:
    if rng.random() < 0.35:  # well-formed, in the many shapes the contract allows
        value: Dict[str, Any] = {"final_response": rng.choice(["Refund issued.", "x" * 50_001, "héllo ☃ 😀", "a\nb"])}
        if rng.random() < 0.9:
            value["messages"] = rng.choice([_valid_messages(rng), _valid_messages(rng), None, []])
        if rng.random() < 0.8:
            value["metadata"] = _valid_metadata(rng)
        if rng.random() < 0.2:
            value["trace_id"] = rng.choice(["t-1", 7, None, {"nested": [1]}])
        return value
    r = rng.random()
    if r < 0.12:
        return rng.choice(["Refund issued.", "", "   ", "x" * 50_001, "héllo ☃ 😀", "tab\tand\nnewline", "\x00"])
    if r < 0.2:
        return rng.choice([
            _Result(final_output="done"), _Result(final_output={"answer": 42}), _Result(final_output=None),
            _Result(output=5), _Result(message="a message"), _Result(final_response="fr", messages=[]),
            _Result(), {"output": "from output"}, {"final_output": ["a", 1]}, {"message": ""}, {}, None, 42,
        ])
    value = {}
    _put(value, "final_response", rng.choice(
        ["The refund of $79.50 has been issued."] * 6 + ["", "  ", 5, 1.5, True, {"a": 1}, ["x"], None,
                                                       float("nan"), _MISSING]))
    if rng.random() < 0.75:
        value["messages"] = _messages(rng)
    if rng.random() < 0.6:
        value["metadata"] = _metadata(rng)
    if rng.random() < 0.2:
        value[rng.choice(["trace_id", "score", "debug"])] = rng.choice(["t-1", 0.5, float("nan"), {"x": None}])
    return value


def _problem_kind(problem: str) -> str:
    """``messages[3].tool_calls[0].name: no resolvable ...`` -> ``messages[].tool_calls[].name``."""
    kind = re.sub(r"\[\d+\]", "[]", problem)
    head, sep, _ = kind.partition(":")
    if sep and " " not in head:
        return head
    return kind.split(", got")[0].split(" (")[0][:60]


def _sdk_expected(body: Dict[str, Any]) -> Dict[str, Any]:
    """What the SDK's coercion makes of an accepted body: the same, less a null messages or metadata."""
    return {k: v for k, v in body.items() if not (k in ("messages", "metadata") and v is None)}


@pytest.fixture(scope="module")
def sdk_echo_client() -> Iterator[Tuple[Any, Dict[str, Any]]]:
    """An SDK-built dispatch app whose handler returns whatever the test put in ``slot['value']``."""
    app = fastapi.FastAPI()
    slot: Dict[str, Any] = {}

    @sdk.register_dispatch_route(app, agent_token="agent-token", manage_env=False)
    def handler(envelope: Any) -> Any:
        return slot["value"]

    client = _test_client(app)
    yield client, slot
    client.close()


def test_every_response_we_build_is_accepted_by_the_sdk(sdk_echo_client: Tuple[Any, Dict[str, Any]]) -> None:
    client, slot = sdk_echo_client
    dispatch = json.dumps({"odyssey_proxy_url": "http://127.0.0.1:9/p", "input": {"user_instruction": "x"}})
    headers = {"Authorization": "Bearer agent-token", "X-Pipelines-Run-Token": "rt",
               "Content-Type": "application/json"}
    rng = random.Random(SEED + 1)
    counts: collections.Counter[str] = collections.Counter()
    refusals: collections.Counter[str] = collections.Counter()
    rejected_by_sdk: List[str] = []
    crashed: List[str] = []
    for _ in range(N_RESPONSE_CASES):
        value = generate_result(rng)
        counts["run"] += 1
        try:
            body = pp.build_response(value)
        except pp.ResponseError as exc:
            counts["refused by pipelines_port"] += 1
            refusals.update({_problem_kind(p) for p in exc.problems})
            continue
        except Exception as exc:  # noqa: BLE001 - anything but ResponseError is a builder bug
            crashed.append(f"{value!r:.200}: {type(exc).__name__}: {exc}")
            continue
        counts["built"] += 1
        problems = []
        try:
            strict = json.loads(json.dumps(body, allow_nan=False))
        except (TypeError, ValueError) as exc:
            problems.append(f"not strict JSON: {exc}")
            strict = None
        try:
            coerced = sdk.build_response(body)
        except Exception as exc:  # noqa: BLE001 - the SDK's ResponseShapeError or worse
            problems.append(f"SDK build_response raised {type(exc).__name__}: {exc}")
        else:
            if not _same(coerced, _sdk_expected(body)):
                problems.append(f"SDK build_response changed it: {coerced!r:.300}")
        slot["value"] = body
        reply = client.post("/dispatch", content=dispatch, headers=headers)
        if reply.status_code != 200:
            problems.append(f"SDK route answered {reply.status_code}: {reply.text[:200]}")
        elif strict is not None and not _same(reply.json(), _sdk_expected(strict)):
            problems.append(f"SDK route changed it on the wire: {reply.text[:300]}")
        if problems:
            rejected_by_sdk.append(f"{body!r:.300} -> {problems}")
        else:
            counts["accepted by the SDK"] += 1

    print(f"\n[response acceptance] pipelines-sdk {SDK_VERSION}, seed {SEED + 1}: {counts['run']} results, "
          f"{counts['built']} built by pipelines_port, {counts['accepted by the SDK']} of them accepted unchanged "
          f"by the SDK; {counts['refused by pipelines_port']} refused by pipelines_port (expected to shrink with a "
          f"lenient mode), {len(crashed)} crashed the builder")
    print(f"  refused results by kind of problem (one result may have several): {dict(refusals.most_common())}")

    assert counts["run"] >= 300
    assert counts["built"] >= 50, "the generator should produce enough buildable results"
    assert not crashed, "build_response raised something other than ResponseError:\n" + "\n".join(crashed[:8])
    assert not rejected_by_sdk, "bodies the SDK does not accept as built:\n" + "\n".join(rejected_by_sdk[:8])


# ---------------------------------------------------------------------------
# 3. The SDK's doctor (and sync) against a pipelines_port DispatchApp
# ---------------------------------------------------------------------------

AGENT_TOKEN = "interop-agent-token-0123456789"

TOOLS_VARIANTS: Dict[str, List[Dict[str, Any]]] = {
    # exactly the fields pipelines_port's platform form carries
    "canonical": [
        {"name": "get_order", "description": "Look an order up by id.",
         "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}},
                          "required": ["order_id"]}},
        {"name": "issue_refund", "description": "Refund an order.",
         "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"},
                                                           "amount": {"type": "number"}}}},
    ],
    # as a registration exports it: description left out or null, output schema, execution mode
    "as_exported": [
        {"name": "get_order", "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}}},
         "output_schema": {"type": "object"}, "default_execution_mode": "sandbox"},
        {"name": "issue_refund", "description": None,
         "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}}},
         "default_execution_mode": "passthrough"},
    ],
}

_INPROCESS_APP = '''
import os
import pipelines_port as pp

def agent(envelope):
    return "ok"

app = pp.DispatchApp(agent, token=os.environ["AGENT_TOKEN"], tools_schema=os.environ["PP_INTEROP_TOOLS"]).asgi
'''

_RELAY_APP = '''
"""An ASGI relay: the doctor's in-process TestClient talks, through it, to the app uvicorn serves."""
import os
import httpx

UPSTREAM = os.environ["PP_INTEROP_UPSTREAM"]
HOP = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    chunks = []
    for _ in range(100000):  # bounded: the doctor's bodies are a few bytes
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    query = scope.get("query_string", b"").decode("latin-1")
    url = UPSTREAM + scope["path"] + ("?" + query if query else "")
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
               if k.decode("latin-1").lower() not in HOP]
    async with httpx.AsyncClient(timeout=20.0) as client:
        reply = await client.request(scope["method"], url, headers=headers, content=b"".join(chunks))
    out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items() if k.lower() not in HOP]
    out.append((b"content-length", str(len(reply.content)).encode()))
    await send({"type": "http.response.start", "status": reply.status_code, "headers": out})
    await send({"type": "http.response.body", "body": reply.content})
'''


def _agent(envelope: Any) -> str:
    return "ok"


def _write_tools(tmp_path: pathlib.Path, variant: str) -> pathlib.Path:
    path = tmp_path / "tools_schema.json"
    path.write_text(json.dumps(TOOLS_VARIANTS[variant], indent=2), encoding="utf-8")
    return path


def _cli_env(tmp_path: pathlib.Path, **extra: str) -> Dict[str, str]:
    """A closed environment for the SDK's CLI: no config, keyring or platform reachable, ours importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINES_", "AGENT_TOKEN"))}
    env.update({
        "HOME": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "PIPELINES_CONFIG_FILE": str(tmp_path / "no-config.json"),
        "PIPELINES_API_KEY": "unused-by-these-commands",
        "PIPELINES_BASE_URL": "http://127.0.0.1:9",
        "AGENT_TOKEN": AGENT_TOKEN,
        "NO_PROXY": "127.0.0.1,localhost",
    })
    env.update(extra)
    return env


def _run_odyssey(tmp_path: pathlib.Path, args: List[str], env: Dict[str, str]) -> subprocess.CompletedProcess:
    code = "import sys; from pipelines.odyssey.cli.main import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, "--no-dotenv", *args], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=180)


def _doctor_lines(stdout: str) -> Dict[str, Tuple[str, str]]:
    """``{label: (status, detail)}`` from the doctor's ``[PASS] label — detail`` lines."""
    marks = {"[PASS]": "PASS", "[FAIL]": "FAIL", "[WARN]": "WARN", "[skip]": "SKIP"}
    out: Dict[str, Tuple[str, str]] = {}
    for line in stdout.splitlines():
        for mark, status in marks.items():
            if line.startswith(mark + " "):
                label, _, detail = line[len(mark) + 1:].partition(" — ")
                out[label.strip()] = (status, detail.strip())
    return out


def _assert_doctor_green(proc: subprocess.CompletedProcess) -> None:
    report = f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-3000:]}"
    lines = _doctor_lines(proc.stdout)
    assert lines, report
    failing = {k: v for k, v in lines.items() if v[0] == "FAIL"}
    assert not failing, report
    assert lines.get("Wrapper boots + ping 2xx", ("?",))[0] == "PASS", report
    assert lines.get("Auth runs before ping", ("?",))[0] == "PASS", report
    # PASS, not WARN: a WARN here means the doctor could not read GET /tools_schema at all
    assert lines.get("tools_schema valid + matches app", ("?",))[0] == "PASS", report
    assert proc.returncode == 0, report


@pytest.mark.parametrize("variant", sorted(TOOLS_VARIANTS))
def test_sdk_doctor_in_process_against_our_asgi_app(tmp_path: pathlib.Path, variant: str) -> None:
    """``odyssey doctor --app module:app`` as documented: the SDK imports the app, drives it with TestClient."""
    tools = _write_tools(tmp_path, variant)
    (tmp_path / "pp_interop_app.py").write_text(_INPROCESS_APP, encoding="utf-8")
    proc = _run_odyssey(tmp_path, ["doctor", "--app", "pp_interop_app:app", "--tools-schema", str(tools),
                                   "--no-network"], _cli_env(tmp_path, PP_INTEROP_TOOLS=str(tools)))
    _assert_doctor_green(proc)


class _UvicornThread:
    """``app`` served by uvicorn (default settings: interface auto-detected) on 127.0.0.1, in a thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="interop-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> _UvicornThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.02)
        if not self.server.started:
            self.__exit__()
            raise RuntimeError("uvicorn did not start within 20 s")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


@pytest.fixture(params=sorted(TOOLS_VARIANTS))
def served(request: Any, tmp_path: pathlib.Path) -> Iterator[Tuple[_UvicornThread, pathlib.Path, str]]:
    pytest.importorskip("uvicorn", reason="serving the app needs uvicorn")
    tools = _write_tools(tmp_path, request.param)
    app = pp.DispatchApp(_agent, token=AGENT_TOKEN, tools_schema=str(tools))
    with _UvicornThread(app.asgi) as server:
        yield server, tools, request.param


def test_sdk_doctor_against_our_app_served_by_uvicorn(tmp_path: pathlib.Path,
                                                     served: Tuple[_UvicornThread, pathlib.Path, str]) -> None:
    """The doctor reads only an importable app, so a relay app forwards its requests to the served one."""
    server, tools, _ = served
    (tmp_path / "pp_interop_relay.py").write_text(_RELAY_APP, encoding="utf-8")
    proc = _run_odyssey(tmp_path, ["doctor", "--app", "pp_interop_relay:app", "--tools-schema", str(tools),
                                   "--no-network"], _cli_env(tmp_path, PP_INTEROP_UPSTREAM=server.url))
    _assert_doctor_green(proc)


def test_sdk_sync_reads_our_tools_schema_from_the_running_app(tmp_path: pathlib.Path,
                                                             served: Tuple[_UvicornThread, pathlib.Path, str]) -> None:
    """``odyssey sync --from-app URL --dry-run``: the SDK's unauthenticated GET {URL}/tools_schema."""
    server, tools, _ = served
    proc = _run_odyssey(tmp_path, ["sync", "--agent-id", "1", "--from-app", server.url, "--dry-run"],
                        _cli_env(tmp_path))
    names = [t["name"] for t in json.loads(tools.read_text(encoding="utf-8"))]
    report = f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-2000:]}"
    assert proc.returncode == 0, report
    assert f"Fetched {len(names)} tool(s) from {server.url}: {names}" in proc.stdout, report


# ---------------------------------------------------------------------------
# 4. The SDK's doctor against the reference ports (conformance/ports)
# ---------------------------------------------------------------------------


def _port_server_command(port: str, tmp_path: pathlib.Path) -> List[str]:
    """The command that serves a reference port's conformance agent; skip when its toolchain is missing."""
    ports = ROOT / "conformance" / "ports"
    if port == "typescript":
        node = shutil.which("node")
        if node is None:
            pytest.skip("node is not on PATH")
        return [node, str(ports / "typescript" / "dist" / "server.js")]
    go = shutil.which("go")
    if go is None:
        pytest.skip("go is not on PATH")
    exe = tmp_path / "conformance-server"
    done = subprocess.run([go, "build", "-o", str(exe), "./cmd/conformance-server"], cwd=str(ports / "go"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return [str(exe)]


@pytest.mark.parametrize("port", ["typescript", "go"])
def test_sdk_doctor_against_the_reference_ports(tmp_path: pathlib.Path, port: str) -> None:
    """``odyssey doctor`` (through the relay) finds each port's wrapper booting, answering ping, auth first.

    The ports do not serve ``GET /tools_schema`` (their READMEs say so), which the doctor reports as a warning.
    """
    cmd = _port_server_command(port, tmp_path) + ["--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "AGENT_TOKEN": AGENT_TOKEN})
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        match = re.search(r"listening on (http://[^/\s]+)", first)
        assert match, first
        tools = _write_tools(tmp_path, sorted(TOOLS_VARIANTS)[0])
        (tmp_path / "pp_interop_relay.py").write_text(_RELAY_APP, encoding="utf-8")
        doctor = _run_odyssey(tmp_path, ["doctor", "--app", "pp_interop_relay:app", "--tools-schema", str(tools),
                                         "--no-network"], _cli_env(tmp_path, PP_INTEROP_UPSTREAM=match.group(1)))
    finally:
        proc.terminate()
        proc.wait(15)
    report = f"exit {doctor.returncode}\n--- stdout\n{doctor.stdout}\n--- stderr\n{doctor.stderr[-3000:]}"
    lines = _doctor_lines(doctor.stdout)
    assert lines.get("Wrapper boots + ping 2xx", ("?",))[0] == "PASS", report
    assert lines.get("Auth runs before ping", ("?",))[0] == "PASS", report
    assert not {k: v for k, v in lines.items() if v[0] == "FAIL"}, report
    schema = lines.get("tools_schema valid + matches app", ("?", ""))
    assert schema[0] == "WARN" and "no GET /tools_schema" in schema[1], report
    assert doctor.returncode == 0, report
