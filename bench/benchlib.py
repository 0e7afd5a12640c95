"""Shared helpers of the benchmarks: paths, statistics, tables, result files, processes.

Benchmarks are run by hand (``python3 bench/bench_proxy.py``); nothing here is
collected by pytest or imported by the project.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import socket
import ssl
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
RESULTS = os.path.join(BENCH, "results")
CERT = os.path.join(ROOT, "tests", "data", "test_cert.pem")
KEY = os.path.join(ROOT, "tests", "data", "test_key.pem")

if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# -- statistics ------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    """The median; NaN for no values."""
    return percentile(values, 50)


def percentile(values: Sequence[float], pct: float) -> float:
    """The ``pct``-th percentile by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100.0
    low = int(math.floor(rank))
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``; NaN when the denominator is not positive."""
    return numerator / denominator if denominator > 0 else math.nan


# -- output ----------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table, numbers right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) if rows else False for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def verdict(value: float, target: float, *, at_most: bool = False) -> str:
    """``PASS``/``MISS`` of a figure against its target."""
    if math.isnan(value):
        return "n/a"
    met = value <= target if at_most else value >= target
    return "PASS" if met else "MISS"


def machine() -> Dict[str, Any]:
    """What the figures were measured on."""
    return {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def write_results(name: str, data: Dict[str, Any]) -> str:
    """Write ``data`` as ``bench/results/NAME-<UTC time>.json`` (and ``NAME-latest.json``); return the path."""
    os.makedirs(RESULTS, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    data = dict(data, benchmark=name, measured_at=stamp, machine=machine())
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    path = os.path.join(RESULTS, f"{name}-{stamp}.json")
    for target in (path, os.path.join(RESULTS, f"{name}-latest.json")):
        with open(target, "w", encoding="utf-8") as fh:
            fh.write(text)
    return path


# -- TLS -------------------------------------------------------------------------


def server_tls() -> ssl.SSLContext:
    """The test certificate as a server context."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(CERT, KEY)
    return context


def client_tls() -> ssl.SSLContext:
    """A verifying client context that trusts the test certificate as its CA."""
    return ssl.create_default_context(cafile=CERT)


# -- processes -------------------------------------------------------------------


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_kib(pid: int) -> Optional[int]:
    """Resident memory (VmRSS) of process ``pid`` in KiB, from /proc; None when unavailable."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time process ``pid`` has used so far, from /proc."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for_port(host: str, port: int, process: subprocess.Popen, timeout: float, log_path: str) -> None:
    """Wait until ``host:port`` accepts connections; exit with the log's tail if the process dies first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            fail(f"server exited with status {process.returncode} before listening; its log:\n{tail(log_path)}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    fail(f"server did not listen on {host}:{port} within {timeout:.0f} s; its log:\n{tail(log_path)}")


def stop(process: subprocess.Popen) -> None:
    """Terminate a process this script started, then kill it if it lingers."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def tail(path: str, lines: int = 20) -> str:
    """The last lines of a log file."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return "(no log)"


def fail(message: str) -> None:
    """Stop the benchmark with a one-line reason (plus any detail lines)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(text)
    return value


def summary(samples: List[float]) -> Dict[str, float]:
    """Median, p90, min and count of a list of samples."""
    return {
        "median": median(samples),
        "p90": percentile(samples, 90),
        "min": min(samples) if samples else math.nan,
        "n": len(samples),
    }


def start_proxy(token: str, *, tls: bool) -> "tuple[subprocess.Popen, str]":
    """Start ``proxy_process.py`` (a MockProxy in its own process); return it and its base URL.

    The proxy exits when its stdin closes, so it never outlives this process.
    """
    command = [sys.executable, os.path.join(BENCH, "proxy_process.py")] + (["--tls"] if tls else [])
    env = dict(os.environ, BENCH_RUN_TOKEN=token)
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    line = process.stdout.readline() if process.stdout else ""
    if not line:
        stop(process)
        fail("the mock proxy process did not start")
    return process, json.loads(line)["url"]


def stop_proxy(process: subprocess.Popen) -> None:
    """Stop a proxy started by :func:`start_proxy`."""
    if process.stdin:
        process.stdin.close()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        stop(process)
    if process.stdout:
        process.stdout.close()


def proxy_stats(proxy_url: str, token: str) -> Dict[str, int]:
    """Connections and requests a ``proxy_process.py`` proxy has seen so far (plain HTTP only)."""
    import urllib.request

    request = urllib.request.Request(f"{proxy_url}/tools/__bench_stats__", data=b"{}", method="POST",
                                     headers={"Authorization": f"Bearer {token}",
                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())["response"]
