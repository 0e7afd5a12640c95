"""Shared fixtures: a mock proxy on 127.0.0.1 (plain and TLS) and fast proxy clients."""

from __future__ import annotations

import pathlib
import ssl
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pipelines_port as pp  # noqa: E402
from conformance.harness.mock_proxy import MockProxy  # noqa: E402

CERT = ROOT / "tests" / "data" / "test_cert.pem"
KEY = ROOT / "tests" / "data" / "test_key.pem"
TOKEN = "tok-secret-0123456789"


class FakeSleep:
    """Records the waits a client asks for instead of sleeping."""

    def __init__(self) -> None:
        self.waits: List[float] = []

    def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


class Together:
    """Holds the proxy's first ``n`` replies until all ``n`` calls are in flight: proves overlap without timing.

    ``proxy.script(name, together(reply_fn))``; later calls are answered at once.
    If the first ``n`` never gather, they get a 500 ``not_concurrent`` reply.
    """

    def __init__(self, n: int, timeout: float = 15.0) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=timeout)
        self._arrived = 0
        self._lock = threading.Lock()

    def __call__(self, reply: Callable[[Any], Dict[str, Any]]) -> Callable[[Any], Dict[str, Any]]:
        def script(request: Any) -> Dict[str, Any]:
            with self._lock:
                self._arrived += 1
                gather = self._arrived <= self.n
            if gather:
                try:
                    self.barrier.wait()
                except threading.BrokenBarrierError:
                    return {"status": 500, "error_class": "not_concurrent",
                            "message": f"fewer than {self.n} calls were in flight together"}
            return reply(request)
        return script


def server_tls() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(CERT), str(KEY))
    return ctx


def client_tls() -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(CERT))


@pytest.fixture(scope="session")
def tsc() -> pathlib.Path:
    """The TypeScript port's locked compiler: ``npm ci`` in the port when its ``node_modules`` is missing or stale."""
    from tests.registries import need, npm_ci
    from tests.ts_mutants import PORT, TSC

    need(npm_ci, PORT)
    return TSC


@pytest.fixture(scope="session")
def ts_tarball(tmp_path_factory: pytest.TempPathFactory, tsc: pathlib.Path) -> Any:
    """The TypeScript port as its npm package: ``npm pack`` of a copy of the port, once per session (a Tarball)."""
    from tests.ts_package import pack

    return pack(tmp_path_factory.mktemp("typescript-tarball"))


@pytest.fixture
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[TOKEN]) as p:
        yield p


@pytest.fixture
def tls_proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[TOKEN], tls=server_tls()) as p:
        yield p


@pytest.fixture
def fake_sleep() -> FakeSleep:
    return FakeSleep()


@pytest.fixture
def client(fake_sleep: FakeSleep) -> Iterator[pp.ProxyClient]:
    c = pp.ProxyClient(timeout=10, rate_per_minute=0, sleep=fake_sleep, ssl_context=client_tls())
    yield c
    c.close()


def envelope_for(proxy: MockProxy, token: str = TOKEN, **body: object) -> pp.Envelope:
    payload = {"odyssey_proxy_url": proxy.url, "run_id": 1, "task_id": 2, "input": {"user_instruction": "hi"}}
    payload.update(body)
    return pp.Envelope.from_dispatch(payload, {"X-Pipelines-Run-Token": token})


class Driver:
    """One of the proxy client's two drivers, called alike: ``blocking`` (``call``) or ``asyncio`` (``acall``).

    The asyncio driver runs every call on one event loop in a thread of its own, as a server's loop does
    (keep-alive connections live on across calls), in a copy of the caller's context (its bound envelope).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: Any = None
        self._thread: Any = None

    def __repr__(self) -> str:
        return self.name

    @property
    def loop(self) -> Any:
        import asyncio

        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="driver-loop", daemon=True)
            self._thread.start()
        return self._loop

    def run(self, coroutine: Any, timeout: float = 60) -> Any:
        """Run ``coroutine`` on the driver's loop, in a copy of this context; its result or exception."""
        import concurrent.futures
        import contextvars

        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        context = contextvars.copy_context()

        def start() -> None:
            task = context.run(self.loop.create_task, coroutine)
            task.add_done_callback(lambda t: done.set_exception(t.exception()) if t.exception() is not None
                                   else done.set_result(t.result()))

        self.loop.call_soon_threadsafe(start)
        return done.result(timeout)

    def stop(self) -> None:
        """Cancel what is left on the loop (the pools close their connections), then stop it."""
        import asyncio

        if self._loop is None:
            return

        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._loop = None

    def _call(self, sync: Callable[..., Any], asynchronous: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.name == "blocking":
            return sync(*args, **kwargs)
        return self.run(asynchronous(*args, **kwargs))

    def call(self, client: pp.ProxyClient, *args: Any, **kwargs: Any) -> Any:
        return self._call(client.call, client.acall, *args, **kwargs)

    def trace(self, client: pp.ProxyClient, *args: Any, **kwargs: Any) -> Any:
        return self._call(client.trace, client.atrace, *args, **kwargs)

    def handoff(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(pp.post_handoff, pp.apost_handoff, *args, **kwargs)

    def proxy_call(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(pp.proxy_call, pp.aproxy_call, *args, **kwargs)


@pytest.fixture(params=["blocking", "asyncio"])
def driver(request: Any) -> Iterator[Driver]:
    d = Driver(request.param)
    yield d
    d.stop()
