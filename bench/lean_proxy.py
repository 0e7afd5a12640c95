"""A lean per-run proxy for fan-out benchmarks: asyncio, keep-alive, one process, standard library only.

    BENCH_RUN_TOKEN=... python3 bench/lean_proxy.py --latency 1.0 [--record FILE]

The threaded MockProxy (bench/proxy_process.py) spends a thread per connection; at thousands of concurrent
tool calls the proxy, not the server under test, would be what is measured.  This one answers every
``POST .../tools/{name}`` whose bearer starts with BENCH_RUN_TOKEN with the echo envelope
``{"response": {"tool": name, "args": args}, ...}`` after ``--latency`` seconds (a timer, not a sleeping
thread), and anything else with 401 or 404.  It prints one JSON line ``{"url": ..., "pid": ...}`` once
listening and serves until stdin closes or SIGTERM.  With ``--record FILE`` it writes, when it stops, every
request it read as ``[time.monotonic(), run token, tool name]`` (a JSON list): bench_fanout.py ``--steps`` reads
it to see where each dispatch's time went.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from typing import Any, List, Optional, Tuple

BASE = "/api/odyssey-proxy/runs/bench"
RECORD: Optional[List[Tuple[float, str, str]]] = None  # with --record: every request read, in order


class _Connection(asyncio.Protocol):
    def __init__(self, token_prefix: str, latency_s: float) -> None:
        self.token_prefix = token_prefix
        self.latency_s = latency_s
        self.buffer = bytearray()
        self.transport: Any = None
        self.busy = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._next()

    def _next(self) -> None:
        if self.busy:
            return
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
        length = int(fields.get("content-length") or 0)
        if len(self.buffer) < end + 4 + length:
            return
        body = bytes(self.buffer[end + 4:end + 4 + length])
        del self.buffer[:end + 4 + length]
        method, target, _ = head[0].split(" ", 2)
        authorization = fields.get("authorization", "")
        if RECORD is not None:
            RECORD.append((time.monotonic(), authorization[len("Bearer "):], target.rsplit("/", 1)[-1]))
        status, reply = self._answer(method, target, authorization, body)
        self.busy = True
        delay = self.latency_s if status == 200 else 0.0
        asyncio.get_running_loop().call_later(delay, self._send, status, reply)

    def _answer(self, method: str, target: str, authorization: str, body: bytes) -> "tuple[int, Any]":
        if not authorization.startswith("Bearer " + self.token_prefix):
            return 401, {"detail": {"error_class": "run_token_invalid", "message": "unknown run token"}}
        if method != "POST" or not target.startswith(BASE + "/tools/"):
            return 404, {"detail": {"error_class": "unknown_tool", "message": "no such tool"}}
        name = target[len(BASE) + len("/tools/"):]
        return 200, {"response": {"tool": name, "args": json.loads(body or b"{}")}, "source": "odyssey",
                     "cached": False, "matched_rule_index": None}

    def _send(self, status: int, reply: Any) -> None:
        if self.transport.is_closing():
            return
        data = json.dumps(reply).encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                             % (status, b"OK" if status == 200 else b"Error", len(data)) + data)
        self.busy = False
        self._next()


async def _serve(token_prefix: str, latency_s: float) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(token_prefix, latency_s), "127.0.0.1", 0, backlog=4096)
    port = server.sockets[0].getsockname()[1]
    done = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, done.set)
    # stdin may be a pipe, a file or /dev/null (which epoll cannot watch): a thread waits for its end
    threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(done.set)), daemon=True).start()
    print(json.dumps({"url": f"http://127.0.0.1:{port}{BASE}", "pid": os.getpid()}), flush=True)
    await done.wait()
    server.close()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before each tool call is answered")
    parser.add_argument("--record", metavar="FILE", help="on stopping, write every request read to FILE (JSON)")
    args = parser.parse_args(argv)
    global RECORD
    RECORD = [] if args.record else None
    token = os.environ.get("BENCH_RUN_TOKEN")
    if not token:
        print("error: set BENCH_RUN_TOKEN to the run token prefix the proxy should accept", file=sys.stderr)
        return 2
    asyncio.run(_serve(token, args.latency))
    if args.record:
        with open(args.record, "w") as f:
            json.dump(RECORD, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
