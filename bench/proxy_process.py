"""Run a MockProxy in its own process, so it does not share a GIL with the code under test.

    BENCH_RUN_TOKEN=... python3 bench/proxy_process.py [--tls]

Prints one JSON line ``{"url": ..., "pid": ...}`` once listening, then serves
until stdin closes or the process is terminated.  It accepts every run token
that starts with BENCH_RUN_TOKEN (a benchmark gives each dispatch a token of
its own, as the platform gives each run).  Every tool answers with the echo
envelope, with no scripts and no Idempotency-Key replay memory, and requests
are counted, not recorded, so memory stays flat over a long run.  The tool
``__bench_stats__`` answers ``{"connections": N, "requests": M}``: the
connections accepted and requests received so far.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any, Dict, List, Optional

import benchlib  # noqa: F401  (puts the repository root on sys.path)
from conformance.harness.mock_proxy import MockProxy, RecordedRequest

STATS_TOOL = "__bench_stats__"


class CountingProxy(MockProxy):
    """A MockProxy that echoes every tool for a family of run tokens and counts requests instead of keeping them."""

    def __init__(self, token_prefix: str, latency_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(tokens=[token_prefix], **kwargs)
        self.token_prefix = token_prefix
        self.latency_s = latency_s  # each tool call answered this late (a simulated tool takes seconds)
        self.count = 0

    def _decide(self, request: RecordedRequest) -> Dict[str, Any]:
        token = request.bearer or ""
        if request.kind != "tools" or not token.startswith(self.token_prefix):
            return super()._decide(request)  # 404 or 401, as the mock answers them
        if request.name == STATS_TOOL:
            with self._lock:
                return {"response": {"connections": self.connections, "requests": self.count}}
        if self.latency_s:
            import time

            time.sleep(self.latency_s)
        return {"response": {"tool": request.name, "args": request.json}}

    def _record(self, request: RecordedRequest) -> None:
        with self._lock:
            self.count += 1


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tls", action="store_true", help="serve https with tests/data/test_cert.pem")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before each tool call is answered")
    args = parser.parse_args(argv)
    token = os.environ.get("BENCH_RUN_TOKEN")
    if not token:
        print("error: set BENCH_RUN_TOKEN to the run token the proxy should accept", file=sys.stderr)
        return 2
    proxy = CountingProxy(token, latency_s=args.latency, tls=benchlib.server_tls() if args.tls else None).start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    print(json.dumps({"url": proxy.url, "pid": os.getpid()}), flush=True)
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
