"""Multi-turn runs as the platform runs them (CONTRACT §4.2, issue #42): a turn reply leaves every serving path as
the agent built it, over real sockets on 127.0.0.1.

Every path: the asyncio server and the ``http.server`` one (``pp.SERVERS``), WSGI under ``wsgiref`` and ASGI
(``DispatchApp.asgi``, driven in this process: the interop tier runs it under uvicorn and hypercorn), with sync and
``async def`` agents, and code mode's ``run()``.  A turn reply (``build_turn_reply``'s, or a mapping with
``message`` and ``session_done``) comes back as built in a multi-turn dispatch; the same value in a single-turn
dispatch, and anything else in a multi-turn one, is the response envelope (kit-turn-reply-detected,
kit-turn-reply-single-turn).  Malformed turn replies are treated as malformed envelopes are: lenient sends what
can go with a warning, strict answers 500 naming the problem.  Then 150 concurrent multi-turn dispatches, each with
its own run token and session, on the asyncio server and on the threads server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest

import pipelines_port as pp
from conformance.harness.mock_proxy import MockProxy
from tests.test_server import AUTH, Endpoint, http_call

RUN_TOKEN = "run-token-turns-3c3c3c3c"
CONCURRENT = 150
REPLY = {"message": "Which order do you mean?", "metadata": {"model": "m-1", "total_input_tokens": 12},
         "session_done": True}


@pytest.fixture(autouse=True)
def quick_client() -> Iterator[None]:
    previous = pp.set_default_client(pp.ProxyClient(rate_per_minute=0, timeout=30))
    yield
    pp.set_default_client(previous)


@pytest.fixture
def proxy() -> Iterator[MockProxy]:
    tokens = [RUN_TOKEN] + [f"run-token-turns-{i:04d}-xxxxxxxx" for i in range(CONCURRENT)]
    with MockProxy(tokens=tokens) as p:
        p.script("get_order", lambda r: {"response": {"order_id": (r.json or {}).get("order_id"), "status": "paid",
                                                      "asked_by": (r.json or {}).get("session")}})
        yield p


def turn_fields(session: Any = "sess-1", turn: int = 0) -> Dict[str, Any]:
    return {"latest_user_prompt": "Cancel my order", "session_id": session, "turn_id": f"{session}-t{turn}",
            "messages": [], "scenario_state": {}}


def body_for(proxy: MockProxy, instruction: str, *, multi_turn: bool = True, run_id: int = 17,
             session: Any = "sess-1") -> Dict[str, Any]:
    task: Dict[str, Any] = {"task_id": 42, "user_instruction": instruction, "input": {}}
    if multi_turn:
        task.update(turn_fields(session))
    return {"task_id": 42, "run_id": run_id, "odyssey_proxy_url": proxy.url, "input": task}


def returned(instruction: str) -> Any:
    """What the test agents return for an instruction: ``reply``, ``string``, ``envelope``, or a JSON value."""
    if instruction == "reply":
        return pp.build_turn_reply(REPLY["message"], metadata=REPLY["metadata"], session_done=True)
    if instruction == "string":
        return "Which order?"
    if instruction == "envelope":
        return {"final_response": "done", "metadata": {"model": "m-1"}}
    return json.loads(instruction)


def sync_agent(env: pp.Envelope) -> Any:
    pp.proxy_call("get_order", {"order_id": "4521", "session": env.session_id})
    return returned(env.user_instruction)


async def async_agent(env: pp.Envelope) -> Any:
    await pp.aproxy_call("get_order", {"order_id": "4521", "session": env.session_id})
    return returned(env.user_instruction)


AGENTS = {"sync": sync_agent, "async": async_agent}
PATHS = [*pp.SERVERS, "wsgi", "asgi"]


class Path:
    """One serving path: ``post(body, headers)`` over it gives (status, JSON body)."""

    def __init__(self, kind: str, agent: Callable[[pp.Envelope], Any], **options: Any) -> None:
        self.kind = kind
        self.server: Any = None
        self.endpoint: Optional[Endpoint] = None
        if kind in pp.SERVERS:
            self.server = pp.start_server(agent, server=kind, token="agent-token-5a5a5a", **options)
        else:
            self.endpoint = Endpoint("http" if kind == "http" else kind,
                                     pp.DispatchApp(agent, token="agent-token-5a5a5a", **options))

    def post(self, body: Dict[str, Any], token: str = RUN_TOKEN) -> Tuple[int, Any]:
        headers = {**AUTH, "X-Pipelines-Run-Token": token, "Content-Type": "application/json"}
        raw = json.dumps(body).encode()
        if self.server is not None:
            status, _, payload = http_call(self.server.url, "POST", "/dispatch", headers, raw)
        else:
            assert self.endpoint is not None
            status, _, payload = self.endpoint.call("POST", headers=headers, body=raw)
        return status, json.loads(payload)

    def close(self) -> None:
        if self.server is not None:
            self.server.close(2)
        if self.endpoint is not None:
            self.endpoint.close()


@pytest.fixture
def paths() -> Iterator[Callable[..., Path]]:
    opened: List[Path] = []

    def open_path(kind: str, agent: Callable[[pp.Envelope], Any], **options: Any) -> Path:
        opened.append(Path(kind, agent, **options))
        return opened[-1]

    yield open_path
    for path in opened:
        path.close()


# -- every serving path, sync and async agents ------------------------------------------------------------------


@pytest.mark.parametrize("agent", AGENTS)
@pytest.mark.parametrize("kind", PATHS)
def test_a_turn_reply_leaves_every_path_as_built(paths: Callable[..., Path], proxy: MockProxy, kind: str,
                                                 agent: str) -> None:
    path = paths(kind, AGENTS[agent])
    status, body = path.post(body_for(proxy, "reply"))
    assert (status, body) == (200, REPLY)
    assert list(body) == ["message", "session_done", "metadata"]  # build_turn_reply's keys, in its order
    # The same value in a single-turn dispatch: the response envelope (kit-turn-reply-single-turn).
    status, body = path.post(body_for(proxy, "reply", multi_turn=False))
    assert (status, body) == (200, {"final_response": REPLY["message"], "metadata": REPLY["metadata"]})
    # Anything else in a multi-turn dispatch: the response envelope, no session_done invented.
    assert path.post(body_for(proxy, "string")) == (200, {"final_response": "Which order?"})
    assert path.post(body_for(proxy, "envelope")) == (200, {"final_response": "done", "metadata": {"model": "m-1"}})
    calls = proxy.calls("get_order")
    assert len(calls) == 4 and all(c.bearer == RUN_TOKEN for c in calls)
    assert [c.json["session"] for c in calls] == ["sess-1", None, "sess-1", "sess-1"]


@pytest.mark.parametrize("kind", PATHS)
def test_a_hand_built_turn_reply_lenient_and_strict(paths: Callable[..., Path], proxy: MockProxy, kind: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A mapping with message and session_done is a turn reply too; malformed parts are dropped with a warning
    naming them (lenient) or refused with a 500 naming them (strict), as a malformed envelope's are."""
    lenient, strict = paths(kind, sync_agent, strict=False), paths(kind, sync_agent, strict=True)
    hand_built = json.dumps({"message": "ok", "session_done": True, "trace": {"step": 2}})
    assert lenient.post(body_for(proxy, hand_built)) == (200, json.loads(hand_built))
    assert strict.post(body_for(proxy, hand_built)) == (200, json.loads(hand_built))
    malformed = json.dumps({"message": "ok", "session_done": "yes", "metadata": [1, 2]})
    with caplog.at_level(logging.WARNING, logger="pipelines_port"):
        assert lenient.post(body_for(proxy, malformed)) == (200, {"message": "ok", "session_done": False})
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("session_done: must be a boolean" in w for w in warned), warned
    assert any(w.startswith("response: metadata: must be an object") for w in warned), warned
    status, body = strict.post(body_for(proxy, malformed))
    assert status == 500 and "session_done: must be a boolean" in body["detail"] and "metadata" in body["detail"]
    assert body["detail"].startswith("agent returned a value that cannot become a response")
    for empty in ('{"message": "", "session_done": false}', '{"message": null, "session_done": true}'):
        for served in (lenient, strict):
            status, body = served.post(body_for(proxy, empty))
            assert status == 500 and "message: required" in body["detail"], body


@pytest.mark.parametrize("kind", PATHS)
def test_the_run_token_never_leaves_in_a_turn_reply(paths: Callable[..., Path], proxy: MockProxy, kind: str) -> None:
    path = paths(kind, sync_agent)
    leaky = json.dumps({"message": f"your token is {RUN_TOKEN}", "session_done": False,
                        "metadata": {"note": RUN_TOKEN}})
    status, body = path.post(body_for(proxy, leaky))
    assert status == 200 and RUN_TOKEN not in json.dumps(body)
    assert body == {"message": "your token is [redacted]", "session_done": False, "metadata": {"note": "[redacted]"}}


# -- code mode ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("agent", AGENTS)
def test_code_mode_run_returns_the_turn_reply(proxy: MockProxy, agent: str) -> None:
    run = pp.code_mode(AGENTS[agent])
    task = {"task_id": 42, "user_instruction": "reply", "input": {}, **turn_fields()}
    assert run(task, proxy_url=proxy.url, run_token=RUN_TOKEN) == REPLY
    single = {"task_id": 42, "user_instruction": "reply", "input": {}}
    assert run(single, proxy_url=proxy.url, run_token=RUN_TOKEN) == {
        "final_response": REPLY["message"], "metadata": REPLY["metadata"]}
    assert run({**task, "user_instruction": "string"}, proxy_url=proxy.url, run_token=RUN_TOKEN) == {
        "final_response": "Which order?"}
    strict = pp.code_mode(AGENTS[agent], strict=True)
    bad = {**task, "user_instruction": json.dumps({"message": "ok", "session_done": 1})}
    with pytest.raises(pp.ResponseError, match="session_done: must be a boolean"):
        strict(bad, proxy_url=proxy.url, run_token=RUN_TOKEN)
    assert run(bad, proxy_url=proxy.url, run_token=RUN_TOKEN) == {"message": "ok", "session_done": False}
    assert [c.bearer for c in proxy.calls("get_order")] == [RUN_TOKEN] * 5


# -- many sessions at once ------------------------------------------------------------------------------------


async def _post(port: int, body: Dict[str, Any], token: str) -> Tuple[int, Any]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = json.dumps(body).encode()
    head = (f"POST /dispatch HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Authorization: {AUTH['Authorization']}\r\nX-Pipelines-Run-Token: {token}\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n")
    writer.write(head.encode() + raw)
    data = await reader.read()
    writer.close()
    head_bytes, _, payload = data.partition(b"\r\n\r\n")
    return int(head_bytes.split()[1]), json.loads(payload)


@pytest.mark.parametrize("kind", pp.SERVERS)
def test_concurrent_multi_turn_dispatches_each_get_their_own_turn_reply(kind: str) -> None:
    """150 sessions at once, each dispatch with its own run token: every turn reply is its own session's, built
    from its own proxy call, and every proxy call carried its own run's token."""
    tokens = {i: f"run-token-turns-{i:04d}-xxxxxxxx" for i in range(CONCURRENT)}
    threads: List[str] = []

    async def agent(env: pp.Envelope) -> Dict[str, Any]:
        threads.append(threading.current_thread().name)
        order = await pp.aproxy_call("get_order", {"order_id": str(env.run_id), "session": env.session_id})
        return pp.build_turn_reply(f"{env.session_id}: order {order['order_id']} is {order['status']}",
                                   metadata={"model": "m-1", "turn_id": env.turn_id},
                                   session_done=env.run_id % 2 == 0)

    with MockProxy(tokens=list(tokens.values())) as proxy:
        proxy.script("get_order", lambda r: {"response": {"order_id": r.json["order_id"], "status": "paid"},
                                             "delay_s": 0.2})
        server = pp.start_server(agent, server=kind, token="agent-token-5a5a5a")
        port = server.server_address[1]

        async def load() -> List[Tuple[int, Any]]:
            return await asyncio.gather(*(
                _post(port, body_for(proxy, "turn", run_id=i, session=f"sess-{i}"), token)
                for i, token in tokens.items()))

        try:
            replies = asyncio.run(load())
        finally:
            server.close(5)
        calls = proxy.calls("get_order")
        in_flight = proxy.max_in_flight
    wanted = [(200, {"message": f"sess-{i}: order {i} is paid", "session_done": i % 2 == 0,
                     "metadata": {"model": "m-1", "turn_id": f"sess-{i}-t0"}}) for i in range(CONCURRENT)]
    wrong = [(i, got) for i, (got, want) in enumerate(zip(replies, wanted)) if got != want]
    assert not wrong, f"{len(wrong)} of {CONCURRENT} wrong, e.g. {wrong[:3]}"
    assert len(calls) == CONCURRENT
    assert all(c.bearer == tokens[int(c.json["order_id"])] and c.json["session"] == f"sess-{c.json['order_id']}"
               for c in calls)
    assert in_flight >= 50  # they really overlapped
