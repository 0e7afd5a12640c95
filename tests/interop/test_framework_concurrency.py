"""Async framework agents under concurrency: 200 dispatches at once, each with tool calls through the proxy.

The agents (tests/interop/concurrent_agents.py) are built once and share their model client, as a real
service's are: an OpenAI Agents SDK agent (``await Runner.run``) on one ``AsyncOpenAI``, and a LangGraph ReAct
agent (``await graph.ainvoke``) on one ``ChatOpenAI``.  Such a client binds to the first event loop that uses
it, so they only work when every dispatch runs on one loop: the kit's own server, and the ASGI app under
uvicorn (on asyncio's loop, and on uvloop as ``uvicorn[standard]`` runs it) and hypercorn.  Each dispatch has its own run (own proxy path and run token) and its own order
number; the fake model answers from each conversation's own history, so any crossing of envelopes, tool
results or answers between runs shows.

Skipped without the framework (and uvicorn, uvloop or hypercorn for those hosts).
"""

from __future__ import annotations

import importlib.util
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest

import pipelines_port as pp
from conformance.harness.mock_proxy import MockProxy, ProxyRun
from tests.fake_model_apis import FakeChatAPI, FakeModelAPI, FakeResponsesAPI, Step, Turn
from tests.interop import concurrent_agents
from tests.interop.hosts import dispatch_request, http_call, hypercorn_command, started, subprocess_env, uvicorn_command

DISPATCHES = 200
ORDER = re.compile(r"order (\d+)")

FRAMEWORKS: Dict[str, Tuple[str, Callable[[], FakeModelAPI]]] = {  # name -> (module it needs, its model API)
    "openai-agents": ("agents", FakeResponsesAPI),
    "langgraph": ("langchain_openai", FakeChatAPI),
}
HOSTS = ("serve", "uvicorn", "uvicorn-uvloop", "hypercorn")  # uvicorn[standard] runs on uvloop, not asyncio's loop


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or () if isinstance(part, dict))


def conversation(body: Dict[str, Any]) -> Tuple[str, List[str]]:
    """The user's instruction and the tool results so far, from a Responses or a Chat Completions request."""
    if "input" in body:
        items = body["input"] if isinstance(body["input"], list) else [{"role": "user", "content": body["input"]}]
        user = next(_text(i.get("content")) for i in items if i.get("role") == "user")
        return user, [str(i["output"]) for i in items if i.get("type") == "function_call_output"]
    messages = body["messages"]
    user = next(_text(m.get("content")) for m in messages if m.get("role") == "user")
    return user, [_text(m.get("content")) for m in messages if m.get("role") == "tool"]


def answer(body: Dict[str, Any]) -> Step:
    """The model: look the order up, then its refund, then answer with both results."""
    user, results = conversation(body)
    match = ORDER.search(user)
    assert match, f"no order number in {user!r}"
    order_id = match.group(1)
    if not results:
        return Turn(tool_calls=[("get_order", {"order_id": order_id})])
    if len(results) == 1:
        return Turn(tool_calls=[("get_refund", {"order_id": order_id})])
    return Turn(text=f"order {order_id}: " + " | ".join(results))


@pytest.fixture(params=list(FRAMEWORKS))
def framework(request: pytest.FixtureRequest) -> Iterator[Tuple[str, FakeModelAPI]]:
    module, fake_class = FRAMEWORKS[request.param]
    pytest.importorskip(module, reason=f"needs {module}")
    if request.param == "langgraph":
        pytest.importorskip("langgraph.prebuilt", reason="needs langgraph")
    with fake_class() as fake:
        fake.answer_by(answer)
        yield request.param, fake


@pytest.fixture(params=HOSTS)
def served(request: pytest.FixtureRequest, framework: Tuple[str, FakeModelAPI],
           tmp_path: Path) -> Iterator[str]:
    """The base URL of the framework's agent served by one host."""
    name, fake = framework
    host = request.param
    if host == "serve":
        agent = concurrent_agents.FRAMEWORKS[name](fake.base_url, fake.api_key)

        def blocking_call(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("an async framework's proxied tool used the blocking driver")

        monkeypatch = request.getfixturevalue("monkeypatch")  # the bridges must await the asyncio driver
        monkeypatch.setattr(pp.ProxyClient, "call", blocking_call)
        server = pp.start_server(agent, no_auth=True)
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.close(5)
        return
    for module in host.split("-"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}")

    def command(port: int) -> List[str]:
        if host == "hypercorn":
            return hypercorn_command("concurrent_agents:app", port)
        return uvicorn_command("concurrent_agents:app", port) + (["--loop", "uvloop"] if "uvloop" in host else [])

    env = subprocess_env(Path(concurrent_agents.__file__).parent, CONCURRENT_FRAMEWORK=name,
                         MODEL_BASE_URL=fake.base_url, MODEL_API_KEY=fake.api_key)
    with started(host, command, cwd=tmp_path, env=env) as base:
        yield base


def test_200_concurrent_framework_dispatches_all_answer_on_one_loop(served: str,
                                                                   framework: Tuple[str, FakeModelAPI]) -> None:
    with MockProxy() as proxy:
        runs: List[ProxyRun] = [proxy.new_run() for _ in range(DISPATCHES)]

        def dispatch(i: int) -> Any:
            headers, body = dispatch_request(runs[i].url, "unused", runs[i].token, f"Where is order {5000 + i}?",
                                             run_id=i + 1)
            return http_call(served, "POST", "/dispatch", headers, body, timeout=120)

        with ThreadPoolExecutor(max_workers=DISPATCHES) as pool:
            replies = list(pool.map(dispatch, range(DISPATCHES)))

    failed = [(i, r.status, r.body[:300]) for i, r in enumerate(replies) if r.status != 200]
    assert not failed, f"{len(failed)} of {DISPATCHES} failed, e.g. {failed[:3]}"
    for i, (reply, run) in enumerate(zip(replies, runs)):
        order_id = str(5000 + i)
        final = reply.json()["final_response"]
        assert final.startswith(f"order {order_id}: "), final
        calls = [(c.name, c.json) for c in run.calls()]
        assert calls == [("get_order", {"order_id": order_id}), ("get_refund", {"order_id": order_id})]
        assert all(c.run_token == run.token for c in run.requests)
        results = final.split(": ", 1)[1].split(" | ")  # each tool result the model saw was this run's own
        assert len(results) == 2 and all(set(re.findall(r"\b5\d{3}\b", r)) == {order_id} for r in results), final
    assert len(framework[1].answered()) == 3 * DISPATCHES
