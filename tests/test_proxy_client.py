"""The proxy client over real sockets on 127.0.0.1 (§3): retries, transport, caps, reuse, pacing."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from typing import Any, Dict, List

import pytest

import pipelines_port as pp
from conformance.harness.mock_proxy import MockProxy
from tests.conftest import TOKEN, Driver, FakeSleep, Together, envelope_for

FAST = pp.RetryPolicy(base_delay_s=0.001, max_delay_s=0.002)


def test_unwraps_over_tls_and_reuses_one_connection(tls_proxy: MockProxy, client: pp.ProxyClient, driver: Driver) -> None:
    env = envelope_for(tls_proxy)
    tls_proxy.script("get_order", [{"response": {"status": "shipped"}}])
    for _ in range(20):
        assert driver.call(client, env, "get_order", {"order_id": "1"}) == {"status": "shipped"}
    assert tls_proxy.connections == 1
    assert {r.connection for r in tls_proxy.requests} == {1}


def test_reuses_one_connection_over_plain_http(proxy: MockProxy, client: pp.ProxyClient, driver: Driver) -> None:
    env = envelope_for(proxy)
    for i in range(20):
        assert driver.call(client, env, "echo", {"i": i}) == {"tool": "echo", "args": {"i": i}}
    assert proxy.connections == 1


def test_tls_refuses_an_untrusted_certificate_without_retrying(tls_proxy: MockProxy, fake_sleep: FakeSleep, driver: Driver) -> None:
    import ssl

    client = pp.ProxyClient(rate_per_minute=0, sleep=fake_sleep, ssl_context=ssl.create_default_context())
    with pytest.raises(pp.ProxyTransportError) as info:
        driver.call(client, envelope_for(tls_proxy), "get_order", {})
    assert info.value.status_code is None and "certificate" in str(info.value).lower()
    assert fake_sleep.waits == []  # a certificate failure is not transient


# -- retries (§3.3) ----------------------------------------------------------------------


def test_429_retried_with_retry_after_and_one_idempotency_key(proxy: MockProxy, client: pp.ProxyClient,
                                                               fake_sleep: FakeSleep, driver: Driver) -> None:
    proxy.script("refund", [
        {"status": 429, "headers": {"Retry-After": "2"}},
        {"status": 429, "headers": {"Retry-After": "1"}},
        {"status": 503, "error_class": "lock_contention"},
        {"response": {"refunded": True}},
    ])
    assert driver.call(client, envelope_for(proxy), "refund", {"order_id": "1"}) == {"refunded": True}
    calls = proxy.calls("refund")
    assert len(calls) == 4
    assert len({c.idempotency_key for c in calls}) == 1
    assert fake_sleep.waits[:2] == [2.0, 1.0]
    assert 0.5 * 4 * 0.75 <= fake_sleep.waits[2] <= 4.0  # third retry: backoff 2 s ±25 %, capped at 4 s


def test_retries_stop_after_max_attempts(proxy: MockProxy, client: pp.ProxyClient, fake_sleep: FakeSleep, driver: Driver) -> None:
    proxy.script("busy", [{"status": 503, "error_class": "trace_sequence_contended", "message": "busy"}])
    with pytest.raises(pp.ProxyError) as info:
        driver.call(client, envelope_for(proxy), "busy", {})
    assert info.value.status_code == 503 and info.value.error_class == "trace_sequence_contended"
    assert len(proxy.calls("busy")) == 4 and len(fake_sleep.waits) == 3


def test_every_knob_of_the_retry_policy_is_honoured(proxy: MockProxy, fake_sleep: FakeSleep, driver: Driver) -> None:
    policy = pp.RetryPolicy(max_attempts=2, base_delay_s=0.1, max_delay_s=0.1, jitter=0.0, max_retry_after_s=5)
    client = pp.ProxyClient(rate_per_minute=0, sleep=fake_sleep, retry=policy)
    proxy.script("a", [{"status": 429}])
    with pytest.raises(pp.ProxyError):
        driver.call(client, envelope_for(proxy), "a", {})
    assert len(proxy.calls("a")) == 2 and fake_sleep.waits == [0.1]
    proxy.script("b", [{"status": 429, "headers": {"Retry-After": "5"}}, {"response": 1}])
    assert driver.call(client, envelope_for(proxy), "b", {}) == 1
    assert fake_sleep.waits[-1] == 5  # a Retry-After up to max_retry_after_s is waited
    proxy.script("c", [{"status": 429, "headers": {"Retry-After": "6"}}, {"response": 1}])
    with pytest.raises(pp.ProxyError) as info:  # past it: no wait, no retry
        driver.call(client, envelope_for(proxy), "c", {})
    assert len(proxy.calls("c")) == 1 and fake_sleep.waits[-1] == 5
    assert info.value.retry_after == 6 and "asked to wait 6 s" in str(info.value) and "5 s this client" in str(info.value)


def test_backoff_grows_with_jitter_and_is_capped() -> None:
    policy = pp.RetryPolicy()
    for n, centre in ((1, 0.5), (2, 1.0), (3, 2.0)):
        waits = [policy.delay(n) for _ in range(200)]
        assert min(waits) >= centre * 0.75 - 1e-9 and max(waits) <= centre * 1.25 + 1e-9
        assert len(set(waits)) > 1  # jittered
    assert all(policy.delay(n) <= 4.0 for n in range(1, 10) for _ in range(20))
    assert policy.delay(1, retry_after=2.5) == 2.5


@pytest.mark.parametrize("status,error_class,kind", [
    (400, None, pp.ProxyError), (401, None, pp.ProxyError), (404, "unknown_tool", pp.ProxyError),
    (422, None, pp.ProxyError), (500, "internal", pp.ProxyError), (503, "maintenance", pp.ProxyError),
    (401, "run_token_expired", pp.StaleRunTokenError),
])
def test_terminal_errors_raise_at_once(proxy: MockProxy, client: pp.ProxyClient, fake_sleep: FakeSleep,
                                       status: int, error_class: Any, kind: type, driver: Driver) -> None:
    proxy.script("t", [{"status": status, "error_class": error_class, "message": "nope"}])
    with pytest.raises(kind) as info:
        driver.call(client, envelope_for(proxy), "t", {"x": 1})
    assert info.value.status_code == status and info.value.error_class == error_class
    assert info.value.tool_name == "t" and isinstance(info.value.body, dict)
    assert len(proxy.calls("t")) == 1 and fake_sleep.waits == []


def test_a_fresh_idempotency_key_per_logical_call(proxy: MockProxy, client: pp.ProxyClient, driver: Driver) -> None:
    env = envelope_for(proxy)
    for _ in range(5):
        driver.call(client, env, "t", {})
    driver.call(client, env, "t", {}, idempotency_key="my-key-1")
    keys = [c.idempotency_key for c in proxy.calls("t")]
    assert len(set(keys[:5])) == 5 and keys[5] == "my-key-1"


def test_a_retry_after_a_processed_call_is_replayed_not_rerun(proxy: MockProxy, client: pp.ProxyClient, driver: Driver) -> None:
    counter = {"n": 0}

    def mutate(request: Any) -> Dict[str, Any]:
        counter["n"] += 1
        return {"response": {"balance": 100 - 10 * counter["n"]}, "close_after": counter["n"] == 1}

    proxy.script("debit", mutate)
    env = envelope_for(proxy)
    first = driver.call(client, env, "debit", {}, idempotency_key="k-1")
    again = driver.call(client, env, "debit", {}, idempotency_key="k-1")
    assert first == again == {"balance": 90} and counter["n"] == 1


def test_a_retry_while_the_call_is_still_being_answered_waits_for_it_not_reruns(proxy: MockProxy) -> None:
    """A slow tool (a simulated backend asking a slow model): the client's attempt times out and it retries with
    the same key while the proxy is still answering the first; the retry gets the first's answer, the tool runs
    once."""
    counter = {"n": 0}
    release = threading.Event()

    def slow_debit(request: Any) -> Dict[str, Any]:
        counter["n"] += 1
        release.wait(10)  # until the retry has arrived
        return {"response": {"balance": 100 - 10 * counter["n"]}}

    proxy.script("debit", slow_debit)
    client = pp.ProxyClient(timeout=0.3, rate_per_minute=0, retry=FAST)
    try:
        def free_when_retried() -> None:
            while len(proxy.calls("debit")) < 2:
                threading.Event().wait(0.01)
            release.set()

        threading.Thread(target=free_when_retried, daemon=True).start()
        assert client.call(envelope_for(proxy), "debit", {}, idempotency_key="k-1") == {"balance": 90}
    finally:
        release.set()
        client.close()
    calls = proxy.calls("debit")
    assert counter["n"] == 1 and len(calls) >= 2 and {c.idempotency_key for c in calls} == {"k-1"}


# -- transport failures --------------------------------------------------------------------


def test_dropped_connections_are_retried_with_the_same_key(proxy: MockProxy, client: pp.ProxyClient,
                                                           fake_sleep: FakeSleep, driver: Driver) -> None:
    proxy.script("flaky", [{"drop": True}, {"drop": True}, {"response": "made it"}])
    assert driver.call(client, envelope_for(proxy), "flaky", {}) == "made it"
    calls = proxy.calls("flaky")
    assert len(calls) == 3 and len({c.idempotency_key for c in calls}) == 1
    assert len(fake_sleep.waits) == 2


def test_transport_retries_are_bounded(proxy: MockProxy, client: pp.ProxyClient, driver: Driver) -> None:
    proxy.script("gone", [{"drop": True}])
    with pytest.raises(pp.ProxyTransportError) as info:
        driver.call(client, envelope_for(proxy), "gone", {})
    assert info.value.status_code is None and isinstance(info.value, pp.ProxyError)
    assert len(proxy.calls("gone")) == 3  # first try + 2 transport retries


def test_refused_connection_is_a_transport_error(fake_sleep: FakeSleep, driver: Driver) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    env = pp.Envelope.from_dispatch({"odyssey_proxy_url": f"http://127.0.0.1:{port}/p"}, {"X-Pipelines-Run-Token": TOKEN})
    client = pp.ProxyClient(rate_per_minute=0, sleep=fake_sleep, retry=pp.RetryPolicy(transport_retries=1))
    with pytest.raises(pp.ProxyTransportError) as info:
        driver.call(client, env, "t", {})
    assert "Connection" in str(info.value) and TOKEN not in str(info.value)
    assert len(fake_sleep.waits) == 1


def test_timeout_default_env_and_per_call_override(proxy: MockProxy, fake_sleep: FakeSleep,
                                                   monkeypatch: pytest.MonkeyPatch, driver: Driver) -> None:
    assert pp.ProxyClient().timeout == 120.0
    monkeypatch.setenv("PIPELINES_PROXY_TIMEOUT_S", "7.5")
    assert pp.ProxyClient().timeout == 7.5
    monkeypatch.setenv("PIPELINES_PROXY_TIMEOUT_S", "soon")
    with pytest.raises(pp.PipelinesError, match="PIPELINES_PROXY_TIMEOUT_S"):
        pp.ProxyClient()
    monkeypatch.delenv("PIPELINES_PROXY_TIMEOUT_S")
    client = pp.ProxyClient(rate_per_minute=0, sleep=fake_sleep, retry=pp.RetryPolicy(transport_retries=0))
    proxy.script("slow", [{"response": "late", "delay_s": 1.0}])
    with pytest.raises(pp.ProxyTransportError, match="timed out"):
        driver.call(client, envelope_for(proxy), "slow", {}, timeout=0.2)
    assert driver.call(client, envelope_for(proxy), "slow", {}, timeout=10) == "late"


def test_stale_pooled_connection_is_replaced(proxy: MockProxy, client: pp.ProxyClient, driver: Driver) -> None:
    env = envelope_for(proxy)
    proxy.script("t", [{"response": 1, "close_after": True}, {"response": 2}])
    assert driver.call(client, env, "t", {}) == 1
    assert driver.call(client, env, "t", {}) == 2
    assert proxy.connections == 2 and len(proxy.calls("t")) == 2


def test_a_connection_the_server_closed_while_idle_is_not_reused(fake_sleep: FakeSleep, driver: Driver) -> None:
    """A real keep-alive server (``http.server``, HTTP/1.1) that closes a connection idle for 0.3 s, as uvicorn does
    after 5 s: a call after that goes out on a fresh connection without a backoff wait, a failure or a lost
    request; one within the idle time reuses the connection."""
    import http.server

    seen: Dict[str, int] = {"connections": 0, "requests": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 0.3  # an idle keep-alive connection is closed after this

        def setup(self) -> None:
            super().setup()
            seen["connections"] += 1

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            seen["requests"] += 1
            body = json.dumps({"response": seen["requests"]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = pp.Envelope.from_dispatch({"odyssey_proxy_url": f"http://127.0.0.1:{server.server_address[1]}/p"},
                                        {"X-Pipelines-Run-Token": TOKEN})
        client = pp.ProxyClient(rate_per_minute=0, sleep=fake_sleep, retry=pp.RetryPolicy(transport_retries=0))
        assert driver.call(client, env, "t", {}) == 1
        assert driver.call(client, env, "t", {}) == 2  # within the server's idle time: the same connection
        assert seen == {"connections": 1, "requests": 2}
        threading.Event().wait(0.8)  # the server has closed it meanwhile
        assert driver.call(client, env, "t", {}) == 3  # not reused (its EOF was seen), or re-sent at once if it was
        assert seen == {"connections": 2, "requests": 3} and fake_sleep.waits == []
    finally:
        server.shutdown()
        server.server_close()


def test_stale_connection_caught_mid_request_is_retried_once_on_a_fresh_one(
        proxy: MockProxy, client: pp.ProxyClient, fake_sleep: FakeSleep, monkeypatch: pytest.MonkeyPatch) -> None:
    # The server closes after its reply: the connection is not reused, or re-sent at once on a fresh one.
    env = envelope_for(proxy)
    proxy.script("t", [{"response": 1, "close_after": True}, {"response": 2}])
    assert client.call(env, "t", {}) == 1
    assert client.call(env, "t", {}) == 2
    assert len(proxy.calls("t")) == 2 and fake_sleep.waits == []  # retried at once, no backoff


def test_a_drop_on_a_reused_connection_counts_as_a_transport_retry(proxy: MockProxy, client: pp.ProxyClient, driver: Driver) -> None:
    env = envelope_for(proxy)
    driver.call(client, env, "warm_up", {})  # the next call reuses this keep-alive connection
    proxy.script("gone", [{"drop": True}])
    with pytest.raises(pp.ProxyTransportError):
        driver.call(client, env, "gone", {})
    assert len(proxy.calls("gone")) == 3  # first try + 2 transport retries, never more


# -- caps (§3.1) ---------------------------------------------------------------------------


def test_reply_at_the_cap_is_read_and_over_it_refused(proxy: MockProxy, client: pp.ProxyClient, driver: Driver) -> None:
    env = envelope_for(proxy)
    proxy.script("exact", [{"body": "x" * pp.MAX_REPLY_BYTES}])
    assert len(driver.call(client, env, "exact", {})) == pp.MAX_REPLY_BYTES
    proxy.script("big", [{"body": "x" * (pp.MAX_REPLY_BYTES + 1)}])
    with pytest.raises(pp.ProxyError, match="cap"):
        driver.call(client, env, "big", {})
    proxy.script("chunked", [{"body": "y" * (pp.MAX_REPLY_BYTES + 10), "chunked": True}])
    with pytest.raises(pp.ProxyError, match="cap"):
        driver.call(client, env, "chunked", {})
    assert driver.call(client, env, "after", {}) == {"tool": "after", "args": {}}  # the client still works


def test_oversized_reply_refused_from_content_length_without_reading_it(driver: Driver) -> None:
    """A server announces 2 MiB, sends a little and waits: the client must refuse at once,
    not wait for bytes that never come (that would end in a timeout instead)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    client_closed = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2097152\r\n\r\n{\"resp")
        conn.settimeout(10)
        try:
            while conn.recv(65536):  # the rest of the request (headers and body may come apart), then EOF
                pass
            client_closed.set()
        except ConnectionResetError:
            client_closed.set()  # closed with bytes unread: Linux resets instead of a clean FIN
        except OSError:
            pass  # a timeout: the client kept the connection open, waiting for the body
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    env = pp.Envelope.from_dispatch({"odyssey_proxy_url": f"http://127.0.0.1:{port}/p"}, {"X-Pipelines-Run-Token": TOKEN})
    client = pp.ProxyClient(rate_per_minute=0, timeout=8)
    with pytest.raises(pp.ProxyError) as info:
        driver.call(client, env, "big", {})
    assert not isinstance(info.value, pp.ProxyTransportError)
    assert "2097152" in str(info.value)
    assert client_closed.wait(5)
    t.join(5)
    listener.close()


# -- concurrency ----------------------------------------------------------------------------


def test_fifty_threads_with_fifty_tokens_never_mix() -> None:
    tokens = [f"tok-thread-{i:02d}" for i in range(50)]
    with MockProxy(tokens=tokens) as proxy:
        client = pp.ProxyClient(rate_per_minute=0)
        barrier = threading.Barrier(50)
        errors: List[BaseException] = []

        def worker(i: int) -> None:
            try:
                with pp.bind_envelope(envelope_for(proxy, token=tokens[i])):
                    barrier.wait()
                    for j in range(5):
                        got = pp.proxy_call("whoami", {"thread": i, "j": j}, client=client)
                        assert got == {"tool": "whoami", "args": {"thread": i, "j": j}}
                client.close()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert len(proxy.requests) == 250
        for r in proxy.requests:
            assert r.bearer == tokens[r.json["thread"]]
        assert proxy.max_in_flight > 1


def test_asyncio_calls_overlap_and_keep_their_own_envelope() -> None:
    tokens = [f"tok-task-{i}" for i in range(10)]
    with MockProxy(tokens=tokens) as proxy:
        proxy.script("slow", Together(10)(lambda r: {"response": r.json}))
        client = pp.ProxyClient(rate_per_minute=0)

        async def one(i: int) -> Any:
            with pp.bind_envelope(envelope_for(proxy, token=tokens[i])):
                return await pp.aproxy_call("slow", {"i": i}, client=client)

        async def main() -> List[Any]:
            return await asyncio.gather(*(one(i) for i in range(10)))

        assert asyncio.run(main()) == [{"i": i} for i in range(10)]
        assert proxy.max_in_flight == 10  # all ten were in flight together
        assert all(r.bearer == tokens[r.json["i"]] for r in proxy.requests)


# -- pacing (§3.1 rate limit) ----------------------------------------------------------------


def test_pacer_keeps_any_window_under_the_limit() -> None:
    pacer = pp._Pacer(limit=60, window_s=60)
    waits = [pacer.reserve("tok", now=0.0) for _ in range(60)]
    assert waits == [0.0] * 60
    assert pacer.reserve("tok", now=0.0) == 60.0  # the 61st waits for the first to leave the window
    assert pacer.reserve("tok", now=30.0) == 30.0
    assert pacer.reserve("other-token", now=0.0) == 0.0  # per token
    # slots handed out never put more than 60 in any 60 s window
    slots = sorted([0.0] * 60 + [60.0, 60.0] + [pacer.reserve("tok", now=61.0) + 61.0 for _ in range(100)])
    for i in range(len(slots) - 60):
        assert slots[i + 60] - slots[i] >= 60.0 - 1e-9


def test_client_paces_a_burst_instead_of_collecting_429s(proxy: MockProxy, fake_sleep: FakeSleep) -> None:
    client = pp.ProxyClient(rate_per_minute=3, sleep=fake_sleep)
    env = envelope_for(proxy)
    for _ in range(5):
        client.call(env, "t", {})
    assert len(fake_sleep.waits) == 2 and all(55 < w <= 60 for w in fake_sleep.waits)
    assert len(proxy.calls("t")) == 5


def test_pacing_is_on_by_default_and_env_can_turn_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pp.ProxyClient()._pacer is not None and pp.ProxyClient()._pacer.limit == 60
    monkeypatch.setenv("PIPELINES_PROXY_RATE_PER_MINUTE", "0")
    assert pp.ProxyClient()._pacer is None


# -- actors (§3.5) ------------------------------------------------------------------------------


def test_actor_handle_stamps_the_header_and_warns_off_catalog(proxy: MockProxy, client: pp.ProxyClient,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    env = envelope_for(proxy, sub_agents=["triage", {"actor_id": "refunds"}])
    caplog.set_level(logging.WARNING, logger="pipelines_port")
    with pp.bind_envelope(env):
        refunds = pp.as_actor("supervisor/refunds", client=client)
        refunds.call("refund_order", {"order_id": "1", "actor_id": "cust"})
        assert caplog.records == []  # the leaf 'refunds' is declared
        stranger = pp.as_actor("stranger", envelope=env, client=client)
        stranger.call("get_order", {})
        stranger.call("get_order", {})
        pp.proxy_call("get_order", {}, client=client)
    warnings = [r.getMessage() for r in caplog.records if "stranger" in r.getMessage()]
    assert len(warnings) == 1 and "undeclared" in warnings[0]
    actors = [r.actor for r in proxy.calls()]
    assert actors == ["supervisor/refunds", "stranger", "stranger", None]
    assert proxy.calls("refund_order")[0].json == {"order_id": "1", "actor_id": "cust"}


def test_actor_labels_are_validated_when_the_handle_is_made() -> None:
    for bad in ("", "a//b", "x" * 65):
        with pytest.raises(pp.ProxyRequestError) as info:
            pp.as_actor(bad)
        assert info.value.error_class == "actor_id_invalid"
    assert pp.as_actor("supervisor").actor("refunds").label == "supervisor/refunds"


# -- errors as values and secrecy ------------------------------------------------------------------


def test_errors_return_mode_gives_the_model_an_error_value(proxy: MockProxy, client: pp.ProxyClient, driver: Driver) -> None:
    env = envelope_for(proxy)
    proxy.script("bad", [{"status": 422, "error_class": "schema_mismatch", "message": "order_id required"}])
    got = driver.call(client, env, "bad", {}, errors="return")
    assert set(got) == {"error", "error_class", "status_code"}
    assert got["error_class"] == "schema_mismatch" and got["status_code"] == 422
    assert "order_id required" in got["error"]
    assert "error" in driver.call(client, env, "no such tool!", {}, errors="return")
    proxy.script("gone", [{"drop": True}])
    assert driver.call(client, env, "gone", {}, errors="return")["error"].startswith("proxy call 'gone' failed before")
    proxy.script("stale", [{"status": 401, "error_class": "run_token_rejected"}])
    with pytest.raises(pp.StaleRunTokenError):
        driver.call(client, env, "stale", {}, errors="return")  # the run is over: never a value


def test_no_message_or_log_line_ever_contains_the_run_token(proxy: MockProxy, client: pp.ProxyClient,
                                                            caplog: pytest.LogCaptureFixture, driver: Driver) -> None:
    caplog.set_level(logging.DEBUG, logger="pipelines_port")
    env = envelope_for(proxy)
    proxy.script("echo_token", [
        {"status": 429, "json": {"detail": {"error_class": "rate_limited", "message": f"slow down {TOKEN}"}},
         "headers": {"Retry-After": "0"}},
        {"status": 400, "json": {"detail": {"error_class": "bad", "message": f"token {TOKEN} refused"}}},
    ])
    with pytest.raises(pp.ProxyError) as info:
        driver.call(client, env, "echo_token", {})
    assert TOKEN not in str(info.value) and TOKEN not in json.dumps(info.value.body)
    assert "[redacted]" in str(info.value)
    assert caplog.records and all(TOKEN not in r.getMessage() for r in caplog.records)


def test_successful_results_are_never_scrubbed(fake_sleep: FakeSleep, driver: Driver) -> None:
    with MockProxy(tokens=["t"]) as proxy:  # a token that occurs in ordinary text
        env = pp.Envelope.from_dispatch({"odyssey_proxy_url": proxy.url}, {"X-Pipelines-Run-Token": "t"})
        proxy.script("get_text", [{"response": "the total is ten"}])
        client = pp.ProxyClient(rate_per_minute=0, sleep=fake_sleep)
        assert driver.call(client, env, "get_text", {}) == "the total is ten"


def test_dispatch_stats_count_calls_of_the_bound_dispatch(proxy: MockProxy, client: pp.ProxyClient, driver: Driver) -> None:
    stats = pp._DispatchStats()
    token = pp._dispatch_stats.set(stats)
    try:
        env = envelope_for(proxy)
        driver.call(client, env, "a", {})
        driver.trace(client, env, "custom", {})
    finally:
        pp._dispatch_stats.reset(token)
    driver.call(client, env, "b", {})
    assert stats.proxy_calls == 2


# -- trace events (§3.4) ---------------------------------------------------------------------------


def test_trace_retries_keep_one_timestamp_and_key(proxy: MockProxy, client: pp.ProxyClient, driver: Driver) -> None:
    proxy.script("thinking", [{"status": 503, "error_class": "trace_sequence_contended"},
                              {"json": {"accepted": True, "sequence": 7}}])
    assert driver.trace(client, envelope_for(proxy), "thinking", {"text": "hmm"}) == {"accepted": True, "sequence": 7}
    first, second = proxy.calls("thinking", kind="traces")
    assert first.json == second.json and first.idempotency_key == second.idempotency_key


def test_trace_from_an_older_platform_with_an_empty_body(proxy: MockProxy, client: pp.ProxyClient, driver: Driver) -> None:
    proxy.script("custom", [{"body": b"", "headers": {"Content-Type": "application/json"}}])
    assert driver.trace(client, envelope_for(proxy), "custom", {"a": 1}) is None


def test_best_effort_trace_logs_instead_of_raising(proxy: MockProxy, client: pp.ProxyClient,
                                                   caplog: pytest.LogCaptureFixture, driver: Driver) -> None:
    caplog.set_level(logging.WARNING, logger="pipelines_port")
    proxy.script("custom", [{"status": 500, "error_class": "internal", "message": "boom"}])
    env = envelope_for(proxy)
    with pytest.raises(pp.ProxyError):
        driver.trace(client, env, "custom", {})
    assert driver.trace(client, env, "custom", {}, best_effort=True) is None
    assert pp.post_trace("custom", {}, best_effort=True) is None  # no envelope bound: logged, not raised
    assert driver.trace(client, env, "not_a_type", {}, best_effort=True) is None
    messages = " | ".join(r.getMessage() for r in caplog.records)
    assert "boom" in messages and "no dispatch envelope" in messages and "not_a_type" in messages


def test_bound_forms_of_trace_and_handoff(proxy: MockProxy, client: pp.ProxyClient) -> None:
    with pp.bind_envelope(envelope_for(proxy)):
        pp.post_trace("assistant_message", {"text": "hi"}, client=client)
        pp.post_handoff("triage", "refunds", reason="money", client=client)
        assert pp.post_handoff("triage", "triage", client=client) is None
        pp.as_actor("triage", client=client).handoff_to("billing")

        async def main() -> Any:
            return await pp.apost_trace("thinking", {"text": "t"}, client=client)

        assert asyncio.run(main()) == {"accepted": True, "sequence": 4}
    names = [r.name for r in proxy.calls(kind="traces")]
    assert names == ["assistant_message", "handoff", "handoff", "thinking"]
    assert proxy.calls("handoff", kind="traces")[1].json["from_sub_agent"] == "triage"
