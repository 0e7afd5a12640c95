"""Turn replies (CONTRACT §4.2) against the platform's own Python SDK, used as the oracle.

What the SDK (``pipelines-sdk`` 0.1.15) has for a multi-turn run's per-turn reply is one builder,
``pipelines.odyssey.build_turn_response(message, *, metadata=None, session_done=False)``.  It has no reader of an
agent's replies: the platform parses them on its side, and neither the SDK's API client nor its CLI (``odyssey
doctor`` sends pings only; ``dev`` pings too) reads a dispatch's reply body.  Its own dispatch route
(``register_dispatch_route``) passes every handler result through ``build_response``, which refuses a body
without ``final_response``: that route answers 500 to a turn reply.  So the oracle is the builder:

1. ``build_turn_reply`` builds exactly what ``build_turn_response`` builds, for every well-formed input (equal
   dicts, equal JSON text with sorted keys), and where they differ the difference is listed in ``DIFFERENCES``;
2. an agent answering with the SDK's own ``build_turn_response`` gets that very body back from our servers (the
   asyncio server, the ``http.server`` one, ``DispatchApp`` under uvicorn as ASGI) in a multi-turn dispatch, over
   127.0.0.1, 120 sessions at once on the asyncio server; the SDK's envelope parser reads the same dispatch as one
   carrying ``session_id`` and ``turn_id``, the fields that make it a turn for us (``Envelope.is_multi_turn``);
3. the SDK's route answers the same agent 500 (the fact CONTRACT §4.2 records).

Everything skips when the SDK, FastAPI, httpx or uvicorn is missing.  Network: 127.0.0.1 only, bounded.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import pathlib
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest

fastapi = pytest.importorskip("fastapi", reason="the SDK oracle tests need fastapi")
pytest.importorskip("httpx", reason="the SDK oracle tests need httpx")
pytest.importorskip("uvicorn", reason="serving the apps needs uvicorn")
sdk = pytest.importorskip("pipelines.odyssey", reason="the SDK oracle tests need pipelines-sdk")

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pipelines_port as pp  # noqa: E402
from conformance.harness.mock_proxy import MockProxy  # noqa: E402
from tests.interop.test_sdk_oracle import _UvicornThread  # noqa: E402
from tests.test_server import http_call  # noqa: E402

AGENT_TOKEN = "agent-token-sdk-turns-5f5f"
MESSAGES = ["Which order do you mean?", "Ihre Bestellung 4521 ist storniert. 👋", "x", "a\nb\tc \"quoted\"",
            "long " * 2000]
METADATA: List[Optional[Dict[str, Any]]] = [
    None, {}, {"model": "m-1", "system_prompt_id": "p", "total_input_tokens": 12, "total_output_tokens": 3,
               "agent_runtime_ms": 41.5},
    {"trace": {"steps": [1, 2, {"k": None}]}, "note": "ünïcode"}]

# Where the SDK's builder and ours part (each a kit rule): input -> (what the SDK builds, what ours does).
DIFFERENCES: Dict[str, Tuple[Dict[str, Any], Callable[[], Any]]] = {
    "a blank message: the SDK builds it, ours refuses (kit-turn-reply-checked)": (
        {"message": "   "}, lambda: pp.build_turn_reply("   ")),
    "a session_done that is not a boolean: the SDK takes its truth, ours refuses (kit-turn-reply-checked)": (
        {"message": "x", "session_done": "yes"}, lambda: pp.build_turn_reply("x", session_done="yes")),  # type: ignore[arg-type]
    "a message that is not a string: the SDK keeps it so, ours sends its JSON text (kit-lenient-response)": (
        {"message": 42}, lambda: pp.build_turn_reply(42)),
    "mistyped first-class metadata: the SDK keeps it, ours refuses (kit-metadata-types)": (
        {"message": "x", "metadata": {"total_input_tokens": "many"}},
        lambda: pp.build_turn_reply("x", metadata={"total_input_tokens": "many"})),
}


def sdk_reply(message: Any, metadata: Any = None, session_done: Any = False) -> Dict[str, Any]:
    return dict(sdk.build_turn_response(message, metadata=metadata, session_done=session_done))


def test_our_builder_builds_what_the_sdks_builds() -> None:
    cases = 0
    for message, metadata, done in itertools.product(MESSAGES, METADATA, (False, True)):
        theirs = sdk_reply(message, metadata, done)
        ours = pp.build_turn_reply(message, metadata=metadata, session_done=done)
        assert ours == theirs, (message[:40], metadata, done)
        assert json.dumps(ours, sort_keys=True, ensure_ascii=False) == json.dumps(theirs, sort_keys=True,
                                                                                   ensure_ascii=False)
        cases += 1
    assert cases == len(MESSAGES) * len(METADATA) * 2
    with pytest.raises(sdk.ResponseShapeError):
        sdk_reply("")
    with pytest.raises(pp.ResponseError, match="message: required"):
        pp.build_turn_reply("")


@pytest.mark.parametrize("difference", sorted(DIFFERENCES))
def test_where_the_two_builders_part(difference: str) -> None:
    given, ours = DIFFERENCES[difference]
    theirs = sdk_reply(**given)
    if "JSON text" in difference:
        assert theirs["message"] == 42 and ours()["message"] == "42"
        return
    assert theirs["message"] == given["message"]
    with pytest.raises(pp.ResponseError):
        ours()


# -- the SDK's replies through our servers --------------------------------------------------------------------


def turn_dispatch(proxy_url: str, instruction: str, session: str = "sess-1", run_id: int = 17) -> Dict[str, Any]:
    return {"run_id": run_id, "task_id": 42, "odyssey_proxy_url": proxy_url,
            "input": {"task_id": 42, "user_instruction": instruction, "input": {}, "latest_user_prompt": "Cancel it",
                      "session_id": session, "turn_id": f"{session}-t0", "messages": [], "scenario_state": {}}}


def headers(run_token: str) -> Dict[str, str]:
    return {"Authorization": f"Bearer {AGENT_TOKEN}", "X-Pipelines-Run-Token": run_token,
            "Content-Type": "application/json"}


def sdk_agent(env: pp.Envelope) -> Dict[str, Any]:
    """An agent whose turn replies are the SDK's own: the case named by its instruction."""
    index = int(env.user_instruction)
    message, metadata, done = list(itertools.product(MESSAGES, METADATA, (False, True)))[index]
    pp.proxy_call("get_order", {"order_id": "4521", "session": env.session_id})
    return sdk_reply(message, metadata, done)


@pytest.fixture(scope="module")
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[f"run-token-sdk-turns-{i:04d}" for i in range(130)]) as p:
        p.script("get_order", lambda r: {"response": {"status": "paid"}})
        yield p


@pytest.fixture(scope="module", autouse=True)
def quick_client() -> Iterator[None]:
    previous = pp.set_default_client(pp.ProxyClient(rate_per_minute=0, timeout=30))
    yield
    pp.set_default_client(previous)


@pytest.fixture(scope="module")
def servers() -> Iterator[Dict[str, str]]:
    """Our servers on 127.0.0.1 serving ``sdk_agent``: name -> base URL (the dispatch path is /dispatch)."""
    ours = {kind: pp.start_server(sdk_agent, server=kind, token=AGENT_TOKEN) for kind in pp.SERVERS}
    with _UvicornThread(pp.DispatchApp(sdk_agent, token=AGENT_TOKEN)) as uvicorn:
        bases = {f"pipelines_port {kind}": f"http://127.0.0.1:{s.server_address[1]}" for kind, s in ours.items()}
        bases["DispatchApp under uvicorn (ASGI)"] = uvicorn.url
        try:
            yield bases
        finally:
            for server in ours.values():
                server.close(2)


def test_the_sdks_turn_replies_leave_our_servers_as_built(servers: Dict[str, str], proxy: MockProxy) -> None:
    grid = list(itertools.product(MESSAGES, METADATA, (False, True)))
    for name, base in servers.items():
        for index, (message, metadata, done) in enumerate(grid):
            body = turn_dispatch(proxy.url, str(index))
            status, _, raw = http_call(base, "POST", "/dispatch", headers("run-token-sdk-turns-0000"),
                                       json.dumps(body).encode())
            assert status == 200, (name, raw[:200])
            assert json.loads(raw) == sdk_reply(message, metadata, done), (name, index)
    # The SDK's parser reads that dispatch as a turn too: the fields our runtime decides on are there.
    parsed = sdk.Envelope.parse(turn_dispatch(proxy.url, "0"), {"X-Pipelines-Run-Token": "rt"})
    ours = pp.Envelope.from_dispatch(turn_dispatch(proxy.url, "0"), {"X-Pipelines-Run-Token": "rt"})
    assert (parsed.session_id, parsed.turn_id) == (ours.session_id, ours.turn_id) == ("sess-1", "sess-1-t0")
    assert ours.is_multi_turn


def test_120_sessions_at_once_each_get_the_sdks_reply(servers: Dict[str, str], proxy: MockProxy) -> None:
    base = servers["pipelines_port asyncio"]
    port = int(base.rsplit(":", 1)[1])
    grid_size = len(MESSAGES) * len(METADATA) * 2
    grid = list(itertools.product(MESSAGES, METADATA, (False, True)))

    async def post(i: int) -> Tuple[int, Any]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        raw = json.dumps(turn_dispatch(proxy.url, str(i % grid_size), session=f"sess-{i}", run_id=i)).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in headers(f"run-token-sdk-turns-{i:04d}").items())
        writer.write(f"POST /dispatch HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{head}"
                     f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        data = await reader.read()
        writer.close()
        head_bytes, _, payload = data.partition(b"\r\n\r\n")
        return int(head_bytes.split()[1]), json.loads(payload)

    async def load() -> List[Tuple[int, Any]]:
        return await asyncio.gather(*(post(i) for i in range(120)))

    before = len(proxy.calls("get_order"))
    replies = asyncio.run(load())
    for i, (status, body) in enumerate(replies):
        message, metadata, done = grid[i % grid_size]
        assert (status, body) == (200, sdk_reply(message, metadata, done)), i
    calls = proxy.calls("get_order")[before:]
    assert len(calls) == 120
    assert all(c.bearer == f"run-token-sdk-turns-{int(c.json['session'][5:]):04d}" for c in calls)


def test_the_sdks_own_route_answers_a_turn_reply_500() -> None:
    """What the SDK's hosting does with its own per-turn reply: its route's response builder refuses it."""
    app = fastapi.FastAPI()

    @sdk.register_dispatch_route(app, agent_token=AGENT_TOKEN, manage_env=False)
    def handler(envelope: Any) -> Any:
        return sdk.build_turn_response("Which order?", session_done=True)

    with _UvicornThread(app) as served:
        status, _, raw = http_call(served.url, "POST", "/dispatch", headers("rt"),
                                   json.dumps(turn_dispatch("http://127.0.0.1:9/p", "0")).encode())
    assert status == 500 and "final_response" in json.loads(raw)["detail"]
