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
from conformance.mock_proxy import MockProxy  # noqa: E402

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
