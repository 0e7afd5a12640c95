"""The asyncio driver and the asyncio server under load and at their edges, over real sockets on 127.0.0.1.

- 1,000 concurrent dispatches of an ``async def`` agent (each fanning out two proxy calls as tasks of its own)
  through :class:`AsyncDispatchServer`, distinct run tokens, zero crossings; the load comes from an asyncio
  client so the test itself needs no thousand threads.
- A drain whose grace period runs out answers every dispatch still running 503 (retryable), with
  ``Connection: close``, and logs which runs were cut.
- Cancelling an ``acall`` closes the connection it was using and leaves no task behind; each event loop has
  a pool of its own, so one client serves several loops (sequential ``asyncio.run``\\ s and concurrent ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, Tuple
from urllib.parse import urlsplit

import pytest

import pipelines_port as pp
from conformance.harness.mock_proxy import MockProxy

AGENT_TOKEN = "agent-token-async-0123456789"


def _file_limit() -> int:
    try:
        import resource
    except ImportError:  # not on POSIX: the default is generous enough
        return 8192
    pp._raise_file_limit()
    return int(resource.getrlimit(resource.RLIMIT_NOFILE)[0])


# Four sockets per dispatch in this one process (client, server, proxy client, proxy server) and headroom.
DISPATCHES = max(100, min(1000, (_file_limit() - 400) // 4))


async def post(port: int, body: Dict[str, Any], headers: Dict[str, str]) -> Tuple[int, Dict[str, str], bytes]:
    """One HTTP/1.1 POST /dispatch on a connection of its own; status, headers (lower-case) and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {**headers, "Content-Length": str(len(raw)),
                                                  "Content-Type": "application/json", "Host": "127.0.0.1",
                                                  "Connection": "close"}.items())
    writer.write(f"POST /dispatch HTTP/1.1\r\n{head}\r\n".encode() + raw)
    data = await reader.read()
    writer.close()
    head_bytes, _, payload = data.partition(b"\r\n\r\n")
    status_line, *lines = head_bytes.decode("latin-1").split("\r\n")
    fields = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    return int(status_line.split()[1]), fields, payload


def dispatch(proxy: MockProxy, run_id: int, token: str) -> Tuple[Dict[str, Any], Dict[str, str]]:
    body = {"run_id": run_id, "task_id": 42, "odyssey_proxy_url": proxy.url,
            "input": {"user_instruction": f"run {run_id}", "input": {}}}
    return body, {"Authorization": f"Bearer {AGENT_TOKEN}", "X-Pipelines-Run-Token": token}


def fan_out(agent: Any, proxy: MockProxy, tokens: Dict[int, str]) -> List[Tuple[int, Dict[str, str], bytes]]:
    """Every run of ``tokens`` dispatched at once to ``agent`` under the asyncio server; the replies in run order."""
    server = pp.start_server(agent, token=AGENT_TOKEN)
    assert isinstance(server, pp.AsyncDispatchServer)
    port = server.server_address[1]

    async def load() -> List[Tuple[int, Dict[str, str], bytes]]:
        return await asyncio.gather(*(post(port, *dispatch(proxy, i, token)) for i, token in tokens.items()))

    try:
        return asyncio.run(load())
    finally:
        server.close(5)


@pytest.fixture(autouse=True)
def quick_client() -> Iterator[None]:
    previous = pp.set_default_client(pp.ProxyClient(rate_per_minute=0, timeout=60))
    yield
    pp.set_default_client(previous)


def test_a_thousand_concurrent_async_dispatches_never_cross(caplog: pytest.LogCaptureFixture) -> None:
    tokens = {i: f"run-token-{i:04d}-async-xxxxxxxx" for i in range(DISPATCHES)}
    loops: List[Any] = []

    async def agent(env: pp.Envelope) -> str:
        loops.append(asyncio.get_running_loop())

        async def step(n: int) -> Any:  # a task of the agent's own: the envelope must follow it there
            return await pp.aproxy_call("whoami", {"run_id": env.run_id, "step": n})

        got = await asyncio.gather(step(0), step(1))
        assert [g["args"] for g in got] == [{"run_id": env.run_id, "step": 0}, {"run_id": env.run_id, "step": 1}]
        assert pp.current_envelope() is env
        return f"run {env.run_id} done"

    with MockProxy(tokens=list(tokens.values())) as proxy:
        proxy.script("whoami", lambda r: {"response": {"args": r.json}, "delay_s": 0.3})
        replies = fan_out(agent, proxy, tokens)
        calls = proxy.calls("whoami")
        max_in_flight = proxy.max_in_flight
    bad = [(i, s, b[:200]) for i, (s, _, b) in enumerate(replies) if s != 200
           or json.loads(b) != {"final_response": f"run {i} done"}]
    assert not bad, f"{len(bad)} of {DISPATCHES} dispatches went wrong, e.g. {bad[:3]}"
    assert len(calls) == 2 * DISPATCHES
    assert all(c.bearer == tokens[c.json["run_id"]] for c in calls)  # every call carried its own run's token
    assert sorted((c.json["run_id"], c.json["step"]) for c in calls) == [
        (i, n) for i in range(DISPATCHES) for n in (0, 1)]
    assert len(set(loops)) == 1 and len(loops) == DISPATCHES  # one event loop ran every dispatch
    assert max_in_flight >= 50  # they really overlapped
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_sync_agents_calls_run_on_the_servers_loop_while_its_thread_waits() -> None:
    """A sync agent under the asyncio server keeps its own thread, but each proxy exchange runs on the server's
    loop (the asyncio transport): 150 at once, distinct run tokens, none crossing, none on an agent thread."""
    count = 150
    tokens = {i: f"run-token-{i:04d}-bridge-xxxxxxx" for i in range(count)}
    client = pp.ProxyClient(rate_per_minute=0, timeout=60)
    ran_on: List[str] = []
    agent_threads: List[str] = []
    exchange = client._transport.aexchange

    async def recording(*args: Any) -> Any:
        ran_on.append(threading.current_thread().name)
        return await exchange(*args)

    client._transport.aexchange = recording  # type: ignore[method-assign]

    def agent(env: pp.Envelope) -> str:
        agent_threads.append(threading.current_thread().name)
        got = [client.call(env, "whoami", {"run_id": env.run_id, "step": n}) for n in (0, 1)]
        assert [g["args"] for g in got] == [{"run_id": env.run_id, "step": n} for n in (0, 1)]
        return f"run {env.run_id} done"

    with MockProxy(tokens=list(tokens.values())) as proxy:
        proxy.script("whoami", lambda r: {"response": {"args": r.json}, "delay_s": 0.2})
        replies = fan_out(agent, proxy, tokens)
        calls = proxy.calls("whoami")
    assert [(s, json.loads(b)) for s, _, b in replies] == [(200, {"final_response": f"run {i} done"})
                                                           for i in range(count)]
    assert all(c.bearer == tokens[c.json["run_id"]] for c in calls) and len(calls) == 2 * count
    assert len(ran_on) == 2 * count and set(ran_on) == {"pipelines-server"}  # every exchange on the server's loop
    assert len(agent_threads) == count and "pipelines-server" not in agent_threads
    # Outside a server's dispatch the same client's exchange runs on the module's own loop thread.
    with MockProxy(tokens=["run-token-outside-xxxxxxxxxx"]) as proxy:
        proxy.script("whoami", lambda r: {"response": {"args": r.json}})
        env = pp.Envelope(proxy_url=proxy.url, run_token="run-token-outside-xxxxxxxxxx")
        assert client.call(env, "whoami", {"n": 1}) == {"args": {"n": 1}}
    assert len(ran_on) == 2 * count + 1 and ran_on[-1] == "pipelines-loop"
    client.close()


def test_a_blocking_call_made_on_the_servers_own_loop_thread_does_not_wait_for_that_loop() -> None:
    """A context copied from a sync agent's thread may end up running on the server's loop thread (a framework
    scheduling work there); a blocking call made there must drive its own socket, not wait on its own loop."""
    client = pp.ProxyClient(rate_per_minute=0, timeout=2)
    with MockProxy(tokens=["run-token-loop-thread-xxxxxxx"]) as proxy:
        proxy.script("whoami", lambda r: {"response": {"args": r.json}})
        env = pp.Envelope(proxy_url=proxy.url, run_token="run-token-loop-thread-xxxxxxx")

        async def on_the_loop() -> Any:
            pp._server_loop.set(asyncio.get_running_loop())  # as in a copy of a sync agent's context
            return client.call(env, "whoami", {"n": 1})

        assert asyncio.run(on_the_loop()) == {"args": {"n": 1}}
    client.close()


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async agent", "sync agent"])
def test_when_the_grace_period_runs_out_each_running_dispatch_gets_a_503(
        asynchronous: bool, caplog: pytest.LogCaptureFixture) -> None:
    started = threading.Semaphore(0)
    release = threading.Event()

    async def slow_async(env: pp.Envelope) -> str:
        started.release()
        await asyncio.sleep(30)
        return "too late"

    def slow_sync(env: pp.Envelope) -> str:
        started.release()
        release.wait(30)
        return "too late"

    caplog.set_level(logging.WARNING, logger="pipelines_port")
    with MockProxy(tokens=["run-token-cut-1-xxxxxxxx", "run-token-cut-2-xxxxxxxx"]) as proxy:
        server = pp.start_server(slow_async if asynchronous else slow_sync, token=AGENT_TOKEN)
        port = server.server_address[1]
        replies: List[Any] = []

        def client(run_id: int) -> None:
            replies.append(asyncio.run(post(port, *dispatch(proxy, run_id, f"run-token-cut-{run_id}-xxxxxxxx"))))

        threads = [threading.Thread(target=client, args=(i,)) for i in (1, 2)]
        for t in threads:
            t.start()
        assert started.acquire(timeout=10) and started.acquire(timeout=10)
        finished = server.close(grace_s=0.3)
        release.set()
        for t in threads:
            t.join(10)
    assert finished is False and len(replies) == 2
    for status, headers, body in replies:
        assert status == 503 and headers["connection"] == "close"
        assert "shut down before this dispatch finished" in json.loads(body)["detail"]
    text = caplog.text
    assert "grace period of 0.3 s over with 2 dispatches still running" in text
    if asynchronous:
        assert "run 1 " in text and "run 2 " in text and "was cut" in text
    assert "run-token-cut" not in text


@pytest.mark.parametrize("server_kind", pp.SERVERS)
def test_a_close_racing_the_start_stops_the_server_at_once(server_kind: str) -> None:
    """``serve`` calls ``close`` on SIGTERM, which may come before the serving thread has its loop: the close
    must not be lost (it was: the thread then served forever and the process hung until killed)."""
    import socket
    import time

    # close() before serve_forever: serve_forever returns at once and the port is free.
    server = pp.make_server(lambda env: "ok", token=AGENT_TOKEN, port=0, server=server_kind)
    port = server.server_address[1]
    assert server.close(5) is True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    # close() at every moment of the start: each returns promptly and leaves no serving thread.
    for delay in [0.0] * 20 + [0.0005 * i for i in range(20)]:
        server = pp.start_server(lambda env: "ok", token=AGENT_TOKEN)
        time.sleep(delay)
        assert server.close(5) is True  # a lost close leaves the thread serving past close's 10 s join
        assert server._thread is not None and not server._thread.is_alive()


def test_cancelling_a_call_closes_its_connection_and_leaves_no_task() -> None:
    """A proxy that reads the request and never answers: after the cancel, it must see the client's EOF."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    seen: Dict[str, Any] = {}
    got_request = threading.Event()

    def silent_proxy() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            seen["request"] = conn.recv(65536)
            got_request.set()
            try:
                seen["after"] = conn.recv(65536)  # b"" once the client closes its side
            except OSError as exc:
                seen["after"] = exc

    thread = threading.Thread(target=silent_proxy, daemon=True)
    thread.start()
    client = pp.ProxyClient(rate_per_minute=0, timeout=30)
    envelope = pp.Envelope.from_run({"user_instruction": "x"}, run_token="run-token-cancel-xxxxxxxx",
                                    proxy_url=f"http://127.0.0.1:{listener.getsockname()[1]}/api/odyssey-proxy/runs/1")

    async def main() -> Tuple[int, List[Any]]:
        call = asyncio.ensure_future(client.acall(envelope, "slow", {}))
        while not got_request.is_set():
            await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        pooled = sum(len(c) for c in client._transport._pool(asyncio.get_running_loop())._idle.values())
        return pooled, left

    try:
        pooled, left = asyncio.run(main())
        thread.join(10)
    finally:
        listener.close()
    assert seen["request"].startswith(b"POST /api/odyssey-proxy/runs/1/tools/slow HTTP/1.1")
    assert seen["after"] == b""  # the interrupted connection was closed, not left open or pooled
    assert (pooled, left) == (0, [])


def _unanswered_listener() -> Tuple[Any, List[Any]]:
    """A loopback listener whose accept queue is full: a further connect gets no answer (Linux drops its SYN)."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    held = []
    for _ in range(3):
        sock = socket.socket()
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            sock.connect(listener.getsockname())
        held.append(sock)
    time.sleep(0.1)
    return listener, held


@pytest.mark.skipif(sys.platform != "linux", reason="a full accept queue drops SYNs on Linux")
@pytest.mark.parametrize("cancelling_known", [True, False], ids=["python-3.11+", "no-Task.uncancel"])
def test_a_connect_that_gets_no_answer_times_out_and_one_cancelled_leaves_no_task(
        cancelling_known: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The connect has its own deadline (a task the deadline cancels, not asyncio.wait_for): a proxy that never
    accepts is a transport failure within the call's timeout, and a call cancelled while connecting leaves
    neither a task nor a connection behind (told apart from a timeout without ``Task.uncancel`` too, as on
    Python 3.9 and 3.10)."""
    if not cancelling_known:
        monkeypatch.setattr(pp, "_uncancel", lambda task: 0)
    listener, held = _unanswered_listener()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/api/odyssey-proxy/runs/1"
    client = pp.ProxyClient(rate_per_minute=0, timeout=0.5, retry=pp.RetryPolicy(transport_retries=0))
    envelope = pp.Envelope.from_run({"user_instruction": "x"}, run_token="run-token-connect-xxxxxxxx", proxy_url=url)

    async def timed_out() -> Tuple[str, float, List[Any]]:
        started = time.monotonic()
        with pytest.raises(pp.ProxyTransportError) as caught:  # bounded here too: a broken deadline fails, not hangs
            await asyncio.wait_for(client.acall(envelope, "echo", {}), 10)
        elapsed = time.monotonic() - started
        return str(caught.value), elapsed, [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    async def cancelled() -> List[Any]:
        call = asyncio.ensure_future(pp.ProxyClient(rate_per_minute=0, timeout=30).acall(envelope, "echo", {}))
        await asyncio.sleep(0.2)
        assert not call.done()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, 10)
        await asyncio.sleep(0)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    try:
        message, elapsed, left = asyncio.run(timed_out())
        assert "no connection within 0.5 s" in message and "run-token-connect" not in message
        assert 0.4 < elapsed < 5 and left == []
        assert asyncio.run(cancelled()) == []
    finally:
        for sock in held:
            sock.close()
        listener.close()


@pytest.mark.skipif(sys.platform != "linux", reason="a full accept queue drops SYNs on Linux")
@pytest.mark.skipif(not hasattr(asyncio.Task, "uncancel"), reason="Task.uncancel is Python 3.11+")
@pytest.mark.parametrize("deadline_first", [True, False])
def test_a_cancel_in_the_turn_the_connect_deadline_fires_is_passed_on_not_taken_for_a_timeout(
        deadline_first: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    listener, held = _unanswered_listener()
    timers: List[Any] = []

    async def main() -> str:
        loop = asyncio.get_running_loop()
        real_call_at = loop.call_at

        def keep(when: float, callback: Any, *args: Any, **kwargs: Any) -> Any:
            if when > loop.time() + 20:  # the attempt's 30 s deadline, not a sleep's timer
                timers.append(callback)
            return real_call_at(when, callback, *args, **kwargs)

        monkeypatch.setattr(loop, "call_at", keep)
        base = urlsplit(f"http://127.0.0.1:{listener.getsockname()[1]}")
        attempt = asyncio.ensure_future(pp._Transport().aexchange(base, "POST", "/x", {}, b"", 30, 1 << 20))
        await asyncio.sleep(0.1)  # connecting, and getting no answer
        assert len(timers) == 1 and not attempt.done()
        if deadline_first:
            timers[0]()
            attempt.cancel()
        else:
            attempt.cancel()
            timers[0]()
        try:
            await asyncio.wait_for(attempt, 10)
        except asyncio.CancelledError:
            return "cancelled"
        except pp._TransportFailure:
            return "timed out"
        return "connected"

    try:
        assert asyncio.run(main()) == "cancelled"
    finally:
        for sock in held:
            sock.close()
        listener.close()


def test_a_connect_cancelled_at_any_moment_leaves_no_connection_open() -> None:
    """Cancelled after 0, 1, 2, ... loop turns (before the connect, during it, as it completes, after): each
    connection the listener accepted is closed by the client, unless the connect finished and handed it over."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    listener.settimeout(5)
    port = listener.getsockname()[1]

    async def main() -> Tuple[int, int, List[Any]]:
        loop = asyncio.get_running_loop()
        transport = pp._Transport()
        handed_over, cancelled = [], 0
        for turns in range(12):
            attempt = asyncio.ensure_future(transport._connect("http", "127.0.0.1", port))
            for _ in range(turns):
                await asyncio.sleep(0)
            attempt.cancel()
            try:
                handed_over.append(await attempt)
            except asyncio.CancelledError:
                cancelled += 1
        await asyncio.sleep(0.1)
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for conn in handed_over:
            conn.close()
        return len(handed_over), cancelled, left

    try:
        handed_over, cancelled, left = asyncio.run(main())
        accepted = []
        listener.settimeout(0.5)
        with contextlib.suppress(OSError):
            while True:
                accepted.append(listener.accept()[0])
        for conn in accepted:  # every connection the listener got is closed by now: EOF, or a reset
            conn.settimeout(5)
            try:
                assert conn.recv(1) == b""
            except ConnectionResetError:
                pass
            conn.close()
    finally:
        listener.close()
    assert cancelled >= 1 and handed_over >= 1 and cancelled + handed_over == 12 and left == []


def test_the_pool_reaper_closes_what_idled_too_long_and_keeps_the_rest() -> None:
    """Real connections to a loopback listener: the reaper closes each one idle past ``idle_s`` or closed by
    the server, keeps the fresh ones in their order, and ends once nothing is left idle."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    port = listener.getsockname()[1]
    key = ("http", "127.0.0.1", port)

    async def main() -> Tuple[List[bool], List[bool], int, bool]:
        loop = asyncio.get_running_loop()
        pool = pp._Pool(loop, max_idle=100, idle_s=1.0)  # a sweep every 0.5 s
        transport = pp._Transport()
        conns = [await transport._connect("http", "127.0.0.1", port) for _ in range(40)]
        for conn in conns[:30]:
            pool.give(key, conn)
        conns[3].close()  # as after the server's EOF
        await asyncio.sleep(0.6)
        for conn in conns[30:]:  # given later: still fresh at the sweep that closes the first 30
            pool.give(key, conn)
        await asyncio.sleep(0.7)  # the sweep at 0.5 s found none old enough; the one at 1 s closed the first 30
        kept = list(pool._idle[key])
        first_30 = [c.writer.is_closing() for c in conns[:30]]
        last_10 = [c.writer.is_closing() for c in conns[30:]]
        order_kept = kept == conns[30:]
        await asyncio.sleep(1.7)  # the rest age out at the 2 s sweep; the 2.5 s one finds nothing and ends
        return first_30, last_10, len(pool._idle[key]), order_kept and pool._reaper is None

    try:
        first_30, last_10, left, kept_in_order_then_ended = asyncio.run(main())
    finally:
        listener.close()
    assert all(first_30) and not any(last_10)
    assert left == 0 and kept_in_order_then_ended


def test_one_client_serves_many_event_loops_each_with_its_own_pool() -> None:
    with MockProxy(tokens=["run-token-loops-xxxxxxxx"]) as proxy:
        client = pp.ProxyClient(rate_per_minute=0, timeout=30)
        envelope = pp.Envelope.from_run({"user_instruction": "x"}, proxy_url=proxy.url,
                                        run_token="run-token-loops-xxxxxxxx")

        async def calls(n: int) -> List[Any]:
            return [await client.acall(envelope, "echo", {"n": i}) for i in range(n)]

        first = asyncio.run(calls(3))  # a loop that ends: its pool's connection is closed with it
        second = asyncio.run(calls(3))  # a new loop: a fresh pool, no connection of the dead loop reused
        results: Dict[int, Any] = {}

        def in_thread(k: int) -> None:
            results[k] = asyncio.run(calls(5))

        threads = [threading.Thread(target=in_thread, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        connections = proxy.connections
    assert first == second == [{"tool": "echo", "args": {"n": i}} for i in range(3)]
    assert all(results[k] == [{"tool": "echo", "args": {"n": i}} for i in range(5)] for k in range(4))
    assert connections == 6  # one kept-alive connection per loop: 2 sequential loops + 4 concurrent ones



def test_loops_that_ended_are_not_kept_alive_by_the_client_or_the_timeouts() -> None:
    """The per-loop pools are weakly keyed by their loop and hold it only weakly: code mode
    and tests run loop after loop (asyncio.run), and each must be freed once it ends."""
    import gc
    import weakref

    with MockProxy(tokens=["run-token-gone-xxxxxxxxx"]) as proxy:
        client = pp.ProxyClient(rate_per_minute=0, timeout=30)
        envelope = pp.Envelope.from_run({"user_instruction": "x"}, proxy_url=proxy.url,
                                        run_token="run-token-gone-xxxxxxxxx")
        loops: List[Any] = []

        async def one() -> Any:
            loop = asyncio.get_running_loop()
            loops.append(weakref.ref(loop))
            loop.call_at(loop.time() + 60, lambda: None)  # a far timeout, left pending
            return await client.acall(envelope, "echo", {"n": 1})  # a pooled connection, left idle

        answers = [asyncio.run(one()) for _ in range(5)]
    gc.collect()
    assert answers == [{"tool": "echo", "args": {"n": 1}}] * 5
    assert [ref() for ref in loops] == [None] * 5
    assert len(client._transport._pools) == 0


def test_replacing_the_agent_switches_between_the_loop_and_a_thread() -> None:
    """agent_is_async follows the agent: replacing it switches between the loop and a thread."""
    seen: List[str] = []

    async def on_the_loop(envelope: pp.Envelope) -> Dict[str, Any]:
        seen.append("loop" if threading.current_thread() is main_thread else "thread")
        return pp.build_response("a")

    def on_a_thread(envelope: pp.Envelope) -> Dict[str, Any]:
        seen.append("loop" if threading.current_thread() is main_thread else "thread")
        return pp.build_response("s")

    app = pp.DispatchApp(on_the_loop, token=AGENT_TOKEN)
    envelope = pp.Envelope(proxy_url="http://127.0.0.1:9/api", run_token="rt-switch")
    main_thread = threading.current_thread()

    async def main() -> List[bytes]:
        replies = [await app.arun_agent(envelope)]
        app.agent = on_a_thread
        replies.append(await app.arun_agent(envelope))
        app.agent = on_the_loop
        replies.append(await app.arun_agent(envelope))
        return [r.body for r in replies]

    bodies = asyncio.run(main())
    assert seen == ["loop", "thread", "loop"]
    assert [json.loads(b)["final_response"] for b in bodies] == ["a", "s", "a"]


def test_a_pipelined_request_waits_for_the_running_dispatch_and_then_is_answered() -> None:
    """Reading goes on while a dispatch runs: a second request sent on the same connection meanwhile is kept,
    and answered after the first, in order (with 120 such connections at once)."""
    gate: List[asyncio.Event] = []  # made on the server's loop by the first agent (an Event binds to one loop)
    order: List[str] = []

    async def agent(envelope: pp.Envelope) -> Dict[str, Any]:
        order.append(envelope.user_instruction)
        if envelope.user_instruction.endswith("first"):
            if not gate:
                gate.append(asyncio.Event())
            await gate[0].wait()
        return pp.build_response(envelope.user_instruction)

    server = pp.make_server(agent, token=AGENT_TOKEN, port=0)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def request(n: int, which: str, close: bool) -> bytes:
        body = json.dumps({"run_id": n, "odyssey_proxy_url": "http://127.0.0.1:9/api",
                           "input": {"user_instruction": f"{n} {which}"}}).encode()
        return (f"POST /dispatch HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {AGENT_TOKEN}\r\n"
                f"X-Pipelines-Run-Token: rt-{n}-{which}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{'Connection: close' if close else 'X-Keep: 1'}\r\n\r\n"
                ).encode() + body

    async def one(n: int) -> List[str]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request(n, "first", False) + request(n, "second", True))  # both at once, pipelined
        data = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        return [json.loads(part.split(b"\r\n\r\n", 1)[1].split(b"HTTP/1.1", 1)[0])["final_response"]
                for part in data.split(b"HTTP/1.1 200")[1:]]

    async def main() -> List[List[str]]:
        tasks = [asyncio.ensure_future(one(n)) for n in range(120)]
        while len(order) < 120:
            await asyncio.sleep(0.01)
        server.loop.call_soon_threadsafe(gate[0].set)
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(main())
    finally:
        server.close(5)
    assert results == [[f"{n} first", f"{n} second"] for n in range(120)]
    assert all(o.endswith("first") for o in order[:120])  # no second request started while its first ran
