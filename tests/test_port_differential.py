"""Python, TypeScript and Go answer the same dispatches the same way: a differential over 127.0.0.1.

A seeded generator makes dispatches (bodies and headers, well formed and not) and agent results.  Each one
is posted to the conformance agent served by three implementations: pipelines_port (in process), the
TypeScript port (``node dist/server.js``) and the Go port (``go build``).  The conformance check holds each
port to fixed cases; this holds them to each other on cases nobody wrote by hand:

- echo mode shows each port's parsed envelope: the same status, and for a 200 every echoed field equal,
  JSON types included (``17`` is not ``"17"``);
- script mode with a ``return`` step shows each port's response building (lenient, the default): the same
  status, and for a 200 the same body.  One documented difference is allowed: a non-string
  ``final_response`` becomes JSON text, and Go, whose maps keep no order, writes its keys sorted; such texts
  are compared as JSON.

A port whose toolchain is missing is left out (CI has both).  Network: 127.0.0.1 only, bounded counts.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import pathlib
import queue
import random
import re
import shutil
import signal
import subprocess
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest

import pipelines_port as pp
from conformance.checker import agent as conformance_agent

ROOT = pathlib.Path(__file__).resolve().parent.parent
TS_SERVER = ROOT / "conformance" / "ports" / "typescript" / "dist" / "server.js"
GO_PORT = ROOT / "conformance" / "ports" / "go"
NODE = shutil.which("node")
GO = shutil.which("go")
AGENT_TOKEN = "differential-agent-token-4f4f4f"
SEED = 20261123
N_DISPATCHES = 300
N_RESULTS = 200

Reply = Tuple[int, Any]


# -- the three servers ----------------------------------------------------------------------------------


class Endpoint:
    """One implementation's dispatch URL, posted to over one keep-alive connection."""

    def __init__(self, name: str, url: str) -> None:
        self.name = name
        host_port = url.split("//", 1)[1].split("/", 1)[0]
        host, port = host_port.rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)

    def post(self, body: bytes, headers: Dict[str, str]) -> Reply:
        for attempt in (1, 2):  # a server may close a kept-alive connection after a refusal
            try:
                self.conn.request("POST", "/dispatch", body=body, headers={
                    "Authorization": f"Bearer {AGENT_TOKEN}", "Content-Type": "application/json", **headers})
                resp = self.conn.getresponse()
                raw = resp.read()
                break
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                if attempt == 2:
                    raise
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw.decode("utf-8", "replace")


@contextlib.contextmanager
def process(cmd: List[str]) -> Iterator[str]:
    """A server process that prints ``listening on URL`` first; yield the URL; SIGTERM it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "AGENT_TOKEN": AGENT_TOKEN})
    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or ()], daemon=True).start()
    try:
        first = lines.get(timeout=30)
        match = re.search(r"listening on (http://\S+)", first)
        assert match, first
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def endpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[List[Endpoint]]:
    with contextlib.ExitStack() as stack:
        server = pp.start_server(conformance_agent.agent, token=AGENT_TOKEN, port=0)
        stack.callback(server.close, 5)
        found = [Endpoint("python", server.url)]
        if NODE and TS_SERVER.exists():
            found.append(Endpoint("typescript", stack.enter_context(process([NODE, str(TS_SERVER), "--port", "0"]))))
        if GO:
            exe = tmp_path_factory.mktemp("go-differential") / "conformance-server"
            done = subprocess.run([GO, "build", "-o", str(exe), "./cmd/conformance-server"], cwd=GO_PORT,
                                  capture_output=True, text=True, timeout=300,
                                  env={**os.environ, "GOFLAGS": "-mod=mod", "GOPROXY": "off"})
            assert done.returncode == 0, done.stderr
            found.append(Endpoint("go", stack.enter_context(process([str(exe), "--port", "0"]))))
        if len(found) < 2:
            pytest.skip("neither node nor go is on PATH: nothing to compare pipelines_port with")
        yield found
        for endpoint in found:
            endpoint.conn.close()


# -- generated dispatches ------------------------------------------------------------------------------------

GOOD_URLS = ["http://127.0.0.1:9/api/odyssey-proxy/runs/r1", "https://proxy.example/api/odyssey-proxy/runs/7/",
             "http://[::1]:8080/p", "https://h.example:443/a/b//", " http://127.0.0.1:9/p "]
ODD_URLS: List[Any] = ["https://h.example/p?x=1", "https://h.example/p#frag", "ftp://h.example/p", "not a url",
                       "/relative/path", "", "   ", 17, None, "http://", "http://h.example:99999/p", "http://h ex/p"]
IDS: List[Any] = [17, "17", " 42 ", "run-9", 0, -3, 12345678901, True, False, 1.5, None, "", "  ", {"id": 1}, [1]]
LABELS: List[Any] = ["triage", "refunds", " padded ", "", "   ", "bad label!", "supervisor/refund_worker", "a//b",
                     {"actor_id": "billing.v2"}, {"actor_id": 7}, {"name": "x"}, 7, None, "x" * 70, "triage"]
WORDS = ["refund", "order", "4521", "please", "the", "ünïcødé", "emoji 🚀", "tab\there", "line\nbreak", '"quoted"']


def _pick(rng: random.Random, choices: List[Any]) -> Any:
    return rng.choice(choices)


def _maybe(rng: random.Random, p: float, make: Callable[[], Any]) -> Any:
    return make() if rng.random() < p else _ABSENT


_ABSENT = object()


def _put(target: Dict[str, Any], key: str, value: Any) -> None:
    if value is not _ABSENT:
        target[key] = value


def _case_of(rng: random.Random, name: str) -> str:
    return rng.choice([name, name.lower(), name.upper()])


def _task(rng: random.Random) -> Any:
    if rng.random() < 0.08:
        return _pick(rng, ["a string", [1, 2], 7, None])
    task: Dict[str, Any] = {}
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 6)))
    _put(task, "user_instruction", _maybe(rng, 0.9, lambda: text if rng.random() < 0.85 else _pick(rng, [7, None, ["a"]])))
    _put(task, "input", _maybe(rng, 0.7, lambda: _pick(rng, [{"order_id": "4521", "n": 3, "nested": {"ok": True}},
                                                             {}, "a string", [1], None])))
    _put(task, "latest_user_prompt", _maybe(rng, 0.3, lambda: _pick(rng, ["and now?", "", 5, None])))
    _put(task, "session_id", _maybe(rng, 0.3, lambda: _pick(rng, IDS)))
    _put(task, "turn_id", _maybe(rng, 0.3, lambda: _pick(rng, [3, "t-1", None, {"x": 1}, 2.5])))
    _put(task, "messages", _maybe(rng, 0.3, lambda: _pick(rng, [[{"role": "user", "content": "hi"}], [], "x", None])))
    _put(task, "scenario_state", _maybe(rng, 0.3, lambda: _pick(rng, [{"stock": 3}, [1], None, "s"])))
    _put(task, "workspace", _maybe(rng, 0.2, lambda: _pick(rng, [
        {"cwd": "/work/repo", "setup_mode": "platform", "setup_instructions": None}, "w", None])))
    _put(task, "task_id", _maybe(rng, 0.2, lambda: _pick(rng, IDS)))
    return task


def generate_dispatch(rng: random.Random) -> Tuple[bytes, Dict[str, str]]:
    """A dispatch body (bytes) and its headers, as the platform might send them, or not quite."""
    if rng.random() < 0.04:
        return json.dumps(_pick(rng, [[1, 2], "text", 7, None])).encode(), {"X-Pipelines-Run-Token": "rt-nonobject-1"}
    body: Dict[str, Any] = {}
    headers: Dict[str, str] = {}
    url = lambda: _pick(rng, GOOD_URLS) if rng.random() < 0.85 else _pick(rng, ODD_URLS)  # noqa: E731
    _put(body, "odyssey_proxy_url", _maybe(rng, 0.75, url))
    _put(body, "pwsa_proxy_url", _maybe(rng, 0.15, url))
    for field in ("run_id", "task_id", "agent_id"):
        _put(body, field, _maybe(rng, 0.6, lambda: _pick(rng, IDS)))
    _put(body, "run_token_jti", _maybe(rng, 0.4, lambda: _pick(rng, ["jti-1", " jti-2 ", "", 5, None])))
    _put(body, "input", _maybe(rng, 0.9, lambda: _task(rng)))
    _put(body, "tools_schema", _maybe(rng, 0.2, lambda: _pick(rng, [[{"name": "get_order"}], [], {"x": 1}, None])))
    _put(body, "sub_agents", _maybe(rng, 0.3, lambda: [rng.choice(LABELS) for _ in range(rng.randint(0, 5))]
                                    if rng.random() < 0.9 else _pick(rng, ["triage", {"a": 1}, None])))
    _put(body, "future_field", _maybe(rng, 0.2, lambda: {"kept": True, "n": [1, "2"]}))
    if rng.random() < 0.95:
        headers[_case_of(rng, "X-Pipelines-Run-Token")] = _pick(rng, [f"run-token-{rng.randrange(10**6):06d}"] * 4 + [
            f"  padded-token-{rng.randrange(99)}  ", "   "])
    if rng.random() < 0.3:
        headers[_case_of(rng, "X-Pipelines-Odyssey-Proxy-Url")] = _pick(rng, [u for u in GOOD_URLS + ODD_URLS
                                                                            if isinstance(u, str) and u.strip()])
    if rng.random() < 0.1:
        headers["X-Pipelines-Pwsa-Proxy-Url"] = _pick(rng, GOOD_URLS)
    for name in ("X-Pipelines-Run-Id", "X-Pipelines-Task-Id", "X-Pipelines-Run-Token-Jti"):
        if rng.random() < 0.25:
            headers[_case_of(rng, name)] = _pick(rng, ["17", " 42 ", "h-9", "   "])
    return json.dumps(body).encode(), headers


# -- generated agent results ---------------------------------------------------------------------------------


def _tool_call(rng: random.Random, call_id: str) -> Any:
    return _pick(rng, [
        {"id": call_id, "name": "get_order", "arguments": {"order_id": "1"}},
        {"id": call_id, "type": "function", "function": {"name": "get_order", "arguments": "{\"order_id\": \"1\"}"}},
        {"id": call_id, "arguments": {}},  # no name: dropped
        {"id": call_id, "name": "lookup", "arguments": 5},
        "not a call",
    ])


def _messages(rng: random.Random) -> Any:
    if rng.random() < 0.1:
        return _pick(rng, ["text", {"role": "user"}, 3])
    out: List[Any] = [{"role": "user", "content": "hi"}]
    for n in range(rng.randint(0, 3)):
        call_id = f"call_{n}"
        out.append({"role": "assistant", "content": None, "tool_calls": [_tool_call(rng, call_id)]})
        out.append({"role": "tool", "tool_call_id": _pick(rng, [call_id, call_id, "call_unknown"]), "content": "{}"})
    if rng.random() < 0.1:
        out.append({"role": "robot", "content": "beep"})
    out.append({"role": "assistant", "content": _pick(rng, ["done", None, [{"type": "text", "text": "x"}], 7])})
    return out


def _metadata(rng: random.Random) -> Any:
    return _pick(rng, [{"model": "m-1", "total_input_tokens": 12, "agent_runtime_ms": 3.5}, {"model": 7},
                       {"total_output_tokens": -1}, {"custom": {"a": [1, 2]}}, "meta", None, {}])


def generate_result(rng: random.Random) -> Any:
    """What an agent might return: text, an envelope-shaped object, a framework result, or something unusable."""
    kind = rng.random()
    if kind < 0.2:
        return _pick(rng, ["Your order shipped.", "", "   ", "ünïcødé 🚀", "x" * 300])
    if kind < 0.3:
        return _pick(rng, [{"final_output": "from a framework"}, {"output": {"answer": 42, "ok": True}},
                           {"message": "hi"}, {"final_output": None, "output": "fallback"}, {}])
    if kind < 0.36:
        return _pick(rng, [[1, 2], 7, None, True])
    result: Dict[str, Any] = {"final_response": _pick(rng, [
        "The refund is done.", "The refund is done.", "", "  ", 42, {"b": 1, "a": [1, 2]}, ["x", "y"], None, True, 2.25])}
    _put(result, "messages", _maybe(rng, 0.6, lambda: _messages(rng)))
    _put(result, "metadata", _maybe(rng, 0.5, lambda: _metadata(rng)))
    _put(result, "trace_id", _maybe(rng, 0.2, lambda: "t-1"))
    return result


# -- comparing ----------------------------------------------------------------------------------------------


def _json_text_equal(a: Any, b: Any) -> bool:
    """Two final_response texts that are the same JSON (Go writes object keys sorted)."""
    try:
        return isinstance(a, str) and isinstance(b, str) and json.loads(a) == json.loads(b)
    except ValueError:
        return False


def _differences(replies: Dict[str, Reply], *, echo: bool) -> List[str]:
    (base_name, (base_status, base_body)), *others = replies.items()
    found = []
    for name, (status, body) in others:
        if status != base_status:
            found.append(f"{name} answered {status}, {base_name} {base_status}: {str(body)[:200]} / {str(base_body)[:200]}")
        elif status == 200 and echo:
            mine = json.loads(body["final_response"])["envelope"]
            theirs = json.loads(base_body["final_response"])["envelope"]
            for key in sorted(set(mine) | set(theirs)):
                if json.dumps(mine.get(key), sort_keys=True) != json.dumps(theirs.get(key), sort_keys=True):
                    found.append(f"{name} echoes {key}={json.dumps(mine.get(key))[:120]}, "
                                 f"{base_name} {json.dumps(theirs.get(key))[:120]}")
        elif status == 200:
            if body.keys() != base_body.keys() or any(
                    body[k] != base_body[k] and not (k == "final_response" and _json_text_equal(body[k], base_body[k]))
                    for k in body):
                found.append(f"{name} answered {json.dumps(body)[:300]}, {base_name} {json.dumps(base_body)[:300]}")
    return found


def test_the_ports_parse_every_generated_dispatch_as_pipelines_port_does(endpoints: List[Endpoint]) -> None:
    rng = random.Random(SEED)
    disagreements: List[str] = []
    statuses: Dict[int, int] = {}
    for n in range(N_DISPATCHES):
        body, headers = generate_dispatch(rng)
        replies = {e.name: e.post(body, headers) for e in endpoints}
        statuses[replies["python"][0]] = statuses.get(replies["python"][0], 0) + 1
        for difference in _differences(replies, echo=True):
            disagreements.append(f"dispatch {n} {body[:300]!r} {headers}: {difference}")
    assert not disagreements, f"{len(disagreements)} disagreements:\n" + "\n".join(disagreements[:15])
    assert statuses.get(200, 0) > N_DISPATCHES // 3 and statuses.get(400, 0) > N_DISPATCHES // 10, statuses


def test_the_ports_build_every_generated_result_as_pipelines_port_does(endpoints: List[Endpoint]) -> None:
    rng = random.Random(SEED + 1)
    disagreements: List[str] = []
    statuses: Dict[int, int] = {}
    headers = {"X-Pipelines-Run-Token": "run-token-results-7a7a7a"}
    for n in range(N_RESULTS):
        value = generate_result(rng)
        body = json.dumps({"odyssey_proxy_url": GOOD_URLS[0],
                           "input": {"user_instruction": json.dumps({"steps": [{"return": value}]})}}).encode()
        replies = {e.name: e.post(body, headers) for e in endpoints}
        statuses[replies["python"][0]] = statuses.get(replies["python"][0], 0) + 1
        for difference in _differences(replies, echo=False):
            disagreements.append(f"result {n} {json.dumps(value)[:300]}: {difference}")
    assert not disagreements, f"{len(disagreements)} disagreements:\n" + "\n".join(disagreements[:15])
    assert statuses.get(200, 0) > N_RESULTS // 2 and statuses.get(500, 0) > N_RESULTS // 20, statuses
