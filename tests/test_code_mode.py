"""Code mode (CONTRACT §5) as the sandbox runs it: run() called from a thread whose event loop is running."""

from __future__ import annotations

import asyncio
import threading
import traceback
import uuid
from typing import Any, Callable, Dict, Iterator, List

import pytest

import pipelines_port as pp
from conformance.harness.mock_proxy import MockProxy
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


# -- issue: no token anywhere in the exception chain, a run timeout, the environment path ---------------------


class HeadersError(Exception):
    """A client error that builds its text from an attribute, as some HTTP libraries do (cleaned in place)."""

    def __init__(self, headers: Dict[str, str]) -> None:
        super().__init__("request failed")
        self.headers = headers

    def __str__(self) -> str:
        return f"request failed, headers: {self.headers}"


class RequestError(Exception):
    """One whose text comes from an object the cleaning cannot reach: replaced in the chain by a stand-in."""

    def __init__(self, token: str) -> None:
        import types

        super().__init__("request failed")
        self.request = types.SimpleNamespace(headers={"Authorization": f"Bearer {token}"})

    def __str__(self) -> str:
        return f"request failed, headers: {self.request.headers}"


def chain_of(error: BaseException) -> List[BaseException]:
    seen: List[BaseException] = []
    link: Any = error
    while link is not None and link not in seen:
        seen.append(link)
        link = link.__cause__ or link.__context__
    return seen


def test_the_run_token_is_in_no_link_of_a_raised_exception_chain(proxy: MockProxy, token: str) -> None:
    """IPython prints the whole chain of what run() raises: the cause, its context, their notes, any __str__."""
    def agent(envelope: pp.Envelope) -> str:
        try:
            try:
                try:
                    raise OSError(2, f"cannot open cache for {envelope.run_token}", f"/tmp/{envelope.run_token}.json")
                except OSError:
                    raise HeadersError({"Authorization": f"Bearer {envelope.run_token}"})
            except HeadersError:
                raise RequestError(envelope.run_token)
        except RequestError as exc:
            error = ValueError(f"request failed, headers: Authorization: Bearer {envelope.run_token}", 7)
            if hasattr(error, "add_note"):
                error.add_note(f"retry with token {envelope.run_token}")
            raise error from exc

    with pytest.raises(pp.AgentError) as info:
        in_running_loop(pp.code_mode(agent), TASK, proxy_url=proxy.url, run_token=token)
    links = chain_of(info.value)
    # AgentError, ValueError, a stand-in for RequestError, HeadersError (cleaned in place), OSError
    assert len(links) == 5 and isinstance(links[1], ValueError)
    assert "[redacted]" in str(links[1]) and links[1].args[1] == 7
    assert type(links[2]).__name__ == "_RedactedError" and "RequestError" in str(links[2])
    assert isinstance(links[3], HeadersError) and "[redacted]" in str(links[3])
    assert isinstance(links[4], OSError) and links[4].errno == 2 and "[redacted]" in links[4].filename
    printed = "".join(traceback.format_exception(type(info.value), info.value, info.value.__traceback__))
    assert token not in printed and "Traceback" in printed and "agent" in printed  # frames kept, token gone
    for link in links:
        assert token not in f"{link}{link!r}{getattr(link, '__notes__', '')}{getattr(link, 'filename', '')}"


def test_http_mode_logs_the_chain_without_the_token(caplog: pytest.LogCaptureFixture, proxy: MockProxy,
                                                     token: str) -> None:
    def agent(envelope: pp.Envelope) -> str:
        try:
            raise HeadersError({"Authorization": f"Bearer {envelope.run_token}"})
        except HeadersError as exc:
            raise RuntimeError("the model call failed") from exc

    app = pp.DispatchApp(agent, no_auth=True)
    envelope = pp.Envelope.from_run(TASK, proxy_url=proxy.url, run_token=token)
    with caplog.at_level("ERROR", logger="pipelines_port"):
        reply = app.run_agent(envelope)
    assert reply.status == 500 and token.encode() not in reply.body
    logged = "\n".join(record.getMessage() + (record.exc_text or "") for record in caplog.records)
    assert "HeadersError" in logged and "the model call failed" in logged and token not in logged


def test_run_in_fresh_thread_redacts_the_bound_runs_token(proxy: MockProxy, token: str) -> None:
    envelope = pp.Envelope.from_run(TASK, proxy_url=proxy.url, run_token=token)

    def leak() -> None:
        raise KeyError(f"no cache entry for {token}")

    with pytest.raises(KeyError) as info:
        in_running_loop(pp.run_in_fresh_thread, leak, envelope=envelope)
    assert token not in str(info.value) and "[redacted]" in str(info.value)


def agent_threads() -> List[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pipelines-agent"]


def looping_agent(calls: List[float]) -> Callable[[pp.Envelope], str]:
    """An agent that never finishes on its own: a tool call every 50 ms until one fails."""
    def agent(envelope: pp.Envelope) -> str:
        import time

        while True:
            pp.proxy_call("poll", {})
            calls.append(time.monotonic())
            time.sleep(0.05)
    return agent


def test_run_times_out_naming_the_limit_and_the_abandoned_agent_is_refused(proxy: MockProxy, token: str) -> None:
    import time

    calls: List[float] = []
    run = pp.code_mode(looping_agent(calls), run_timeout_s=0.5)
    before = len(agent_threads())
    with pytest.raises(pp.RunTimeoutError, match=r"run_timeout_s=0\.5 s") as info:
        in_running_loop(run, TASK, proxy_url=proxy.url, run_token=token)
    ended = time.monotonic()
    assert info.value.http_status == 504 and calls
    deadline = time.monotonic() + 5
    while len(agent_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(agent_threads()) == before  # its next proxy call was refused, so it ended
    late = [r for r in proxy.requests if r.time > ended + 0.01]
    assert late == []  # nothing reached the proxy after run() gave up


@pytest.mark.parametrize("limit", [0, -1, 1800.5, "300", True])
def test_code_mode_refuses_a_run_timeout_out_of_range(limit: Any) -> None:
    with pytest.raises(ValueError, match="run_timeout_s"):
        pp.code_mode(lambda envelope: "x", run_timeout_s=limit)


def test_a_kernel_interrupt_while_run_waits_refuses_the_agents_further_calls(proxy: MockProxy, token: str) -> None:
    """A kernel interrupt is a KeyboardInterrupt in the waiting (main) thread: the agent must not act on."""
    import signal
    import time

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    calls: List[float] = []
    run = pp.code_mode(looping_agent(calls))
    before = len(agent_threads())

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.4)
    try:
        with pytest.raises(KeyboardInterrupt):
            run(TASK, proxy_url=proxy.url, run_token=token)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    interrupted = time.monotonic()
    deadline = interrupted + 5
    while len(agent_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert calls and len(agent_threads()) == before
    assert [r for r in proxy.requests if r.time > interrupted + 0.01] == []


def test_run_reads_missing_arguments_from_the_sandbox_environment(proxy: MockProxy, token: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    seen: List[pp.Envelope] = []

    def agent(envelope: pp.Envelope) -> str:
        seen.append(envelope)
        return str(pp.proxy_call("get_order", {"order_id": "1"}))

    run = pp.code_mode(agent)
    monkeypatch.setenv("PIPELINES_ODYSSEY_PROXY_URL", proxy.url)
    monkeypatch.setenv("PIPELINES_RUN_TOKEN", token)
    monkeypatch.setenv("PIPELINES_TASK_ID", "77")
    monkeypatch.setenv("PIPELINES_RUN_ID", "5")
    in_running_loop(run, {"user_instruction": "hi", "task_id": 77})  # the arguments absent
    monkeypatch.setenv("_PIPELINES_TASK_INPUT_JSON", '{"user_instruction": "from env", "input": {"k": 1}}')
    in_running_loop(run)  # nothing at all: the whole run from the environment
    assert [(e.user_instruction, e.task_id, e.run_id) for e in seen] == [("hi", 77, 5), ("from env", 77, 5)]
    assert all(r.run_token == token for r in proxy.requests) and len(proxy.requests) == 2
    monkeypatch.delenv("PIPELINES_RUN_TOKEN")
    with pytest.raises(pp.EnvelopeError, match="PIPELINES_RUN_TOKEN"):
        run({"user_instruction": "hi"}, proxy_url=proxy.url)


def test_an_unbound_proxy_call_uses_the_environments_run_only_when_it_has_one(
        proxy: MockProxy, token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIPELINES_RUN_TOKEN", raising=False)
    with pytest.raises(pp.EnvelopeError, match="PIPELINES_RUN_TOKEN is not set"):
        pp.proxy_call("get_order", {})
    monkeypatch.setenv("PIPELINES_ODYSSEY_PROXY_URL", proxy.url)
    monkeypatch.setenv("PIPELINES_RUN_TOKEN", token)
    assert pp.proxy_call("get_order", {"order_id": "9"}) == {"tool": "get_order", "args": {"order_id": "9"}}
    (request,) = proxy.requests
    assert request.run_token == token
