"""A small HTTP/1.1 load generator: asyncio protocols over raw sockets, keep-alive, fixed duration.

    result = run_load("127.0.0.1", 8080, request_bytes, connections=16, duration=3.0,
                      check=lambda status, body: status == 200)

Each connection sends one request, reads the whole reply (Content-Length or
chunked), and sends the next, for ``warmup + duration`` seconds; only replies
completed inside the measured window count.  ``request`` is the bytes to send,
or a function returning fresh bytes for each request.  A reply that fails
``check`` (in the warm-up too) is an error, not a request.  A connection the
server closes is reopened.  asyncio protocols (not streams) keep the
generator's own CPU per request low, since it shares the machine with the
server under test; ``client_cpu_us_per_request`` reports what it used.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

Check = Callable[[int, bytes], bool]
RequestSource = Union[bytes, Callable[[], bytes]]


def build_request(host: str, port: int, path: str, body: bytes, headers: Dict[str, str]) -> bytes:
    """The bytes of one keep-alive POST with a JSON body."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
             f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def parse_reply(buffer: bytes) -> Optional[Tuple[int, bytes, bool, int]]:
    """``(status, body, server_closes, bytes_used)`` of the complete reply at the start of ``buffer``, else None."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = buffer[:end].decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length: Optional[int] = None
    chunked = closes = False
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "transfer-encoding":
            chunked = "chunked" in value.lower()
        elif name == "connection":
            closes = "close" in value.lower()
    start = end + 4
    if chunked:
        parts, at = [], start
        while True:
            line_end = buffer.find(b"\r\n", at)
            if line_end < 0:
                return None
            size = int(buffer[at:line_end].split(b";")[0], 16)
            at = line_end + 2
            if size == 0:
                if buffer.find(b"\r\n", at) < 0:
                    return None
                return status, b"".join(parts), closes, buffer.find(b"\r\n", at) + 2
            if len(buffer) < at + size + 2:
                return None
            parts.append(buffer[at:at + size])
            at += size + 2
    if length is None:
        raise ValueError("reply without Content-Length or chunked encoding")
    if len(buffer) < start + length:
        return None
    return status, buffer[start:start + length], closes, start + length


def exchange_once(host: str, port: int, request: bytes, timeout: float = 60.0) -> Tuple[int, bytes]:
    """Send one request on a fresh connection and wait for its whole reply: ``(status, body)``."""
    import socket

    buffer = b""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(request)
        while True:
            parsed = parse_reply(buffer)
            if parsed is not None:
                return parsed[0], parsed[1]
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection before replying")
            buffer += data


class _Tally:
    """What all connections of one run counted."""

    def __init__(self, measure_from: float, measure_to: float) -> None:
        self.measure_from = measure_from
        self.measure_to = measure_to
        self.requests = 0
        self.errors = 0
        self.reconnects = 0
        self.latencies_us: List[float] = []
        self.first_error: Optional[str] = None
        self.pending: Set["asyncio.Future[None]"] = set()

    def error(self, what: str) -> None:
        self.errors += 1
        if self.first_error is None:
            self.first_error = what


class _Client(asyncio.Protocol):
    """One keep-alive connection sending requests back to back until the run ends."""

    def __init__(self, host_port: Tuple[str, int], request: RequestSource, check: Check, tally: _Tally,
                 finished: "asyncio.Future[None]") -> None:
        self.host_port = host_port
        self.request = request
        self.check = check
        self.tally = tally
        self.finished = finished
        self.transport: Optional[asyncio.Transport] = None
        self.buffer = b""
        self.started = 0.0
        self.awaiting = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.send()

    def send(self) -> None:
        assert self.transport is not None
        self.started = time.monotonic()
        if self.started >= self.tally.measure_to:
            self.awaiting = False
            self.transport.close()
            return
        self.awaiting = True
        self.transport.write(self.request if isinstance(self.request, bytes) else self.request())

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        try:
            parsed = parse_reply(self.buffer)
        except (ValueError, IndexError) as exc:
            self.fail(f"unreadable reply: {exc}")
            return
        if parsed is None:
            return
        status, body, closes, used = parsed
        self.buffer = self.buffer[used:]
        self.awaiting = False
        done = time.monotonic()
        tally = self.tally
        try:
            good = self.check(status, body)
        except Exception:  # noqa: BLE001 - a reply the check cannot read is a wrong reply
            good = False
        if not good:
            tally.error(f"HTTP {status}: {body[:200]!r}")
        elif tally.measure_from <= done < tally.measure_to:
            tally.requests += 1
            tally.latencies_us.append((done - self.started) * 1e6)
        if closes:
            tally.reconnects += 1
            assert self.transport is not None
            self.transport.close()  # connection_lost reconnects
        else:
            self.send()

    def fail(self, what: str) -> None:
        self.tally.error(what)
        self.awaiting = False
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if self.awaiting:
            self.tally.error(f"connection lost mid-reply: {exc!r}")
        if time.monotonic() < self.tally.measure_to and not self.finished.done():
            reconnect = asyncio.ensure_future(
                _connect(self.host_port, self.request, self.check, self.tally, self.finished))
            self.tally.pending.add(reconnect)  # the loop keeps only a weak reference to a task
            reconnect.add_done_callback(self.tally.pending.discard)
        elif not self.finished.done():
            self.finished.set_result(None)


async def _connect(host_port: Tuple[str, int], request: RequestSource, check: Check, tally: _Tally,
                   finished: "asyncio.Future[None]") -> None:
    loop = asyncio.get_running_loop()
    try:
        await loop.create_connection(lambda: _Client(host_port, request, check, tally, finished), *host_port)
    except OSError as exc:
        tally.error(f"cannot connect: {exc}")
        if not finished.done():
            finished.set_result(None)


async def _run(host: str, port: int, request: RequestSource, connections: int, warmup: float, duration: float,
               check: Check) -> _Tally:
    loop = asyncio.get_running_loop()
    start = time.monotonic()
    tally = _Tally(start + warmup, start + warmup + duration)
    finished = [loop.create_future() for _ in range(connections)]
    for future in finished:
        await _connect((host, port), request, check, tally, future)
    try:
        await asyncio.wait_for(asyncio.gather(*finished), timeout=warmup + duration + 60)
    except asyncio.TimeoutError:
        tally.error("a reply took more than 60 s past the end of the run")
    return tally


def run_load(host: str, port: int, request: RequestSource, *, connections: int = 16, warmup: float = 0.5,
             duration: float = 3.0, check: Check = lambda status, body: status == 200) -> Dict[str, Any]:
    """Load ``host:port`` with ``request`` on ``connections`` keep-alive connections; return the figures."""
    cpu_before = time.process_time()
    tally = asyncio.run(_run(host, port, request, connections, warmup, duration, check))
    cpu = time.process_time() - cpu_before
    latencies = sorted(tally.latencies_us)
    return {
        "requests": tally.requests,
        "errors": tally.errors,
        "first_error": tally.first_error,
        "reconnects": tally.reconnects,
        "duration_s": duration,
        "rps": tally.requests / duration,
        "latency_median_us": latencies[len(latencies) // 2] if latencies else None,
        "latency_p90_us": latencies[int(len(latencies) * 0.9)] if latencies else None,
        "client_cpu_us_per_request": cpu * 1e6 / tally.requests if tally.requests else None,
    }
