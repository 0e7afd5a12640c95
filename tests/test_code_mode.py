"""Code mode (CONTRACT §5) as the sandbox runs it: run() called from a thread whose event loop is running."""

from __future__ import annotations

import asyncio
import threading
import traceback
import uuid
from typing import Any, Callable, Dict, Iterator, List

import pytest

import pipelines_port as pp
from conformance.mock_proxy import MockProxy
from tests.conftest import Together


def in_running_loop(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` the way a Jupyter kernel runs a cell: synchronously, on a thread whose asyncio loop is running."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="kernel", daemon=True)
    thread.start()

    async def cell() -> Any:
        asyncio.get_running_loop()  # raises unless a loop is running here, as in the kernel
        return fn(*args, **kwargs)

    try:
        return asyncio.run_coroutine_threadsafe(cell(), loop).result(timeout=20)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def fresh_token() -> str:
    """A run token of its own per test, so the shared client's pacing never carries over between tests."""
    return f"run-token-{uuid.uuid4().hex}"


@pytest.fixture
def token() -> str:
    return fresh_token()


@pytest.fixture
def proxy(token: str) -> Iterator[MockProxy]:
    with MockProxy(tokens=[token]) as p:
        yield p


TASK = {"user_instruction": "Refund order #4521.", "input": {"order_id": "4521"}, "task_id": 42}


def test_the_kernel_fake_really_has_a_running_loop() -> None:
    async def nothing() -> None:
        pass

    def cell() -> None:
        coroutine = nothing()
        try:
            asyncio.run(coroutine)
        finally:
            coroutine.close()

    with pytest.raises(RuntimeError, match="running event loop"):
        in_running_loop(cell)


def test_sync_agent_runs_on_a_fresh_thread_with_the_envelope_bound(proxy: MockProxy, token: str) -> None:
    seen: Dict[str, Any] = {}

    def agent(envelope: pp.Envelope) -> str:
        seen["thread"] = threading.current_thread().name
        seen["bound"] = pp.current_envelope() is envelope
        seen["envelope"] = envelope
        order = pp.proxy_call("get_order", {"order_id": envelope.task_input["order_id"]})
        return f"Order {order['args']['order_id']} looked up."

    body = in_running_loop(pp.code_mode(agent), TASK, proxy_url=proxy.url, run_token=token)
    assert body == {"final_response": "Order 4521 looked up."}
    assert pp.validate_response(body) == []
    assert seen["thread"] != "kernel" and seen["bound"] is True
    envelope = seen["envelope"]
    assert (envelope.user_instruction, envelope.task_id, envelope.proxy_url) == ("Refund order #4521.", 42, proxy.url)
    [call] = proxy.calls("get_order")
    assert call.bearer == token and call.json == {"order_id": "4521"}


def test_async_agent_gathers_tool_calls_under_the_kernel_loop(proxy: MockProxy, token: str) -> None:
    proxy.script("*", Together(3)(lambda r: {"response": {"tool": r.name}}))
    kernel_loops: List[Any] = []

    async def agent(envelope: pp.Envelope) -> Dict[str, Any]:
        kernel_loops.append(asyncio.get_running_loop())
        names = ["get_order", "search_kb", "refund_order"]
        results = await asyncio.gather(*(pp.aproxy_call(name, {"i": i}) for i, name in enumerate(names)))
        calls = [{"id": f"c{i}", "name": name, "arguments": {"i": i}} for i, name in enumerate(names)]
        messages = [{"role": "user", "content": envelope.user_instruction},
                    {"role": "assistant", "content": None, "tool_calls": calls}]
        messages += [{"role": "tool", "tool_call_id": f"c{i}", "content": str(r)} for i, r in enumerate(results)]
        messages.append({"role": "assistant", "content": "done"})
        return {"final_response": "done", "messages": messages, "metadata": {"model": "none"}}

    body = in_running_loop(pp.code_mode(agent), TASK, proxy_url=proxy.url, run_token=token)
    assert pp.validate_response(body) == []
    assert body["final_response"] == "done" and len(body["messages"]) == 6
    assert sorted(r.name for r in proxy.calls()) == ["get_order", "refund_order", "search_kb"]
    assert {r.bearer for r in proxy.calls()} == {token}
    assert proxy.max_in_flight == 3  # awaited together, so the three calls overlapped
    assert kernel_loops and kernel_loops[0].is_closed()  # the agent had a loop of its own, now finished


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_raising_agent_gives_agent_error_with_the_cause_and_its_traceback(
        proxy: MockProxy, token: str, is_async: bool) -> None:
    def fail_deep_inside(order_id: str) -> None:
        raise ValueError(f"order {order_id} is malformed")

    def sync_agent(envelope: pp.Envelope) -> str:
        fail_deep_inside("45x1")
        return "unreachable"

    async def async_agent(envelope: pp.Envelope) -> str:
        await asyncio.sleep(0)
        fail_deep_inside("45x1")
        return "unreachable"

    run = pp.code_mode(async_agent if is_async else sync_agent)
    with pytest.raises(pp.AgentError) as info:
        in_running_loop(run, TASK, proxy_url=proxy.url, run_token=token)
    assert "ValueError: order 45x1 is malformed" in str(info.value)
    cause = info.value.__cause__
    assert isinstance(cause, ValueError)
    frames = [frame.name for frame in traceback.extract_tb(cause.__traceback__)]
    assert frames[-2:] == ["async_agent" if is_async else "sync_agent", "fail_deep_inside"]
    assert token not in str(info.value)


def test_a_stale_run_token_is_not_wrapped(proxy: MockProxy, token: str) -> None:
    proxy.script("get_order", [{"status": 401, "error_class": "run_token_expired", "message": "run is over"}])

    def agent(envelope: pp.Envelope) -> str:
        return str(pp.proxy_call("get_order", {"order_id": "1"}))

    with pytest.raises(pp.StaleRunTokenError):
        in_running_loop(pp.code_mode(agent), TASK, proxy_url=proxy.url, run_token=token)


@pytest.mark.parametrize("result,needle,lenient", [
    (42, "cannot build a response from int", None),
    ("", "final_response", None),
    ("   ", "final_response", {"final_response": "   "}),
    ({"final_response": 7}, "final_response must be a string", {"final_response": "7"}),
    ({"final_response": "ok", "messages": [{"role": "tool", "content": "x"}]}, "tool_call_id",
     {"final_response": "ok"}),
    ({"final_response": "ok", "metadata": {"total_input_tokens": "many"}}, "total_input_tokens",
     {"final_response": "ok", "metadata": {"total_input_tokens": "many"}}),
], ids=["int", "empty", "blank", "non-string", "orphan-tool-message", "bad-metadata"])
def test_a_result_that_cannot_become_a_response_gives_response_error(
        proxy: MockProxy, token: str, result: Any, needle: str, lenient: Any) -> None:
    """Strict mode refuses every problem; the default sends what the platform grades (None: refused in both)."""
    with pytest.raises(pp.ResponseError, match=needle):
        in_running_loop(pp.code_mode(lambda envelope: result, strict=True), TASK, proxy_url=proxy.url,
                        run_token=token)
    run = pp.code_mode(lambda envelope: result)
    if lenient is None:
        with pytest.raises(pp.ResponseError, match=needle):
            in_running_loop(run, TASK, proxy_url=proxy.url, run_token=token)
    else:
        assert in_running_loop(run, TASK, proxy_url=proxy.url, run_token=token) == lenient


@pytest.mark.parametrize("task_input,proxy_url,run_token,needle", [
    (["not", "a", "mapping"], None, None, "task_input must be a mapping"),
    ({}, "ftp://proxy.invalid/runs/1", None, "proxy_url"),
    ({}, None, "", "run_token"),
], ids=["task-input", "proxy-url", "run-token"])
def test_bad_run_arguments_give_a_clear_error_before_the_agent_runs(
        proxy: MockProxy, token: str, task_input: Any, proxy_url: Any, run_token: Any, needle: str) -> None:
    called: List[bool] = []
    run = pp.code_mode(lambda envelope: called.append(True) or "ran")
    with pytest.raises(pp.EnvelopeError, match=needle) as info:
        run(task_input, proxy_url=proxy_url or proxy.url, run_token=token if run_token is None else run_token)
    assert called == [] and "\n" not in str(info.value) and token not in str(info.value)


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_two_runs_on_two_threads_never_see_each_other_token(is_async: bool) -> None:
    tokens = {"a": fresh_token(), "b": fresh_token()}
    both_inside = threading.Barrier(2, timeout=10)
    seen: Dict[str, List[str]] = {"a": [], "b": []}

    def sync_agent(envelope: pp.Envelope) -> str:
        run_name = envelope.task_input["run"]
        both_inside.wait()  # both runs are now in flight at once
        for i in range(3):
            pp.proxy_call("whoami", {"run": run_name, "i": i})
            seen[run_name].append(pp.current_envelope().run_token)
        return f"run {run_name} done"

    async def async_agent(envelope: pp.Envelope) -> str:
        run_name = envelope.task_input["run"]
        await asyncio.get_running_loop().run_in_executor(None, both_inside.wait)
        await asyncio.gather(*(pp.aproxy_call("whoami", {"run": run_name, "i": i}) for i in range(3)))
        seen[run_name].append(pp.current_envelope().run_token)
        return f"run {run_name} done"

    run = pp.code_mode(async_agent if is_async else sync_agent)
    bodies: Dict[str, Any] = {}
    with MockProxy(tokens=list(tokens.values())) as proxy:
        proxy.script("whoami", lambda r: {"response": {"ok": True}, "delay_s": 0.05})

        def kernel(run_name: str) -> None:
            task = {"user_instruction": "who am I?", "input": {"run": run_name}}
            bodies[run_name] = in_running_loop(run, task, proxy_url=proxy.url, run_token=tokens[run_name])

        threads = [threading.Thread(target=kernel, args=(name,)) for name in tokens]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        requests = proxy.calls("whoami")

    assert bodies == {"a": {"final_response": "run a done"}, "b": {"final_response": "run b done"}}
    assert len(requests) == 6
    for request in requests:
        assert request.bearer == tokens[request.json["run"]]
    for run_name, run_tokens in seen.items():
        assert run_tokens and set(run_tokens) == {tokens[run_name]}


def test_run_in_fresh_thread_binds_the_envelope_and_runs_coroutines(proxy: MockProxy, token: str) -> None:
    envelope = pp.Envelope.from_run(TASK, proxy_url=proxy.url, run_token=token)

    async def lookup(order_id: str, *, suffix: str) -> Dict[str, Any]:
        assert pp.current_envelope() is envelope
        result = await pp.aproxy_call("get_order", {"order_id": order_id})
        return {"thread": threading.current_thread().name, "result": result, "suffix": suffix}

    got = in_running_loop(pp.run_in_fresh_thread, lookup, "4521", envelope=envelope, suffix="!")
    assert got["thread"] not in ("kernel", threading.current_thread().name)
    assert got["result"] == {"tool": "get_order", "args": {"order_id": "4521"}} and got["suffix"] == "!"
    assert proxy.calls("get_order")[0].bearer == token

    def inherits() -> str:
        with pp.bind_envelope(envelope):  # bound on the kernel's thread...
            return pp.run_in_fresh_thread(lambda: pp.current_envelope().run_token)  # ...and seen in the new one

    assert in_running_loop(inherits) == token


def test_run_in_fresh_thread_reraises_as_is() -> None:
    def unbound() -> Any:
        return pp.current_envelope()

    with pytest.raises(pp.EnvelopeError, match="no dispatch envelope"):
        in_running_loop(pp.run_in_fresh_thread, unbound)

    class Boom(Exception):
        pass

    async def explode() -> None:
        raise Boom("kaput")

    with pytest.raises(Boom, match="kaput") as info:
        in_running_loop(pp.run_in_fresh_thread, explode)
    assert "explode" in [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
