"""A reference port's conformance server as a subprocess, for the tests of each port (TypeScript, Go)."""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import subprocess
import tempfile
import threading
from typing import Any, Dict, Optional, Sequence, Tuple

Reply = Tuple[int, Dict[str, str], bytes]


class PortServer:
    """``CMD --port 0 ARGS`` as a subprocess; ``url`` is its dispatch URL, ``host`` and ``port`` its address.

    The server must print ``listening on http://HOST:PORT/PATH`` as its first stdout line.  Its stderr is kept
    for :meth:`log`; ``AGENT_TOKEN`` is ``agent_token`` unless ``env`` says otherwise.
    """

    def __init__(self, cmd: Sequence[str], *args: str, agent_token: str, env: Optional[Dict[str, str]] = None) -> None:
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [*cmd, "--port", "0", *args], stdout=subprocess.PIPE, stderr=self.stderr, text=True,
            env={**os.environ, "AGENT_TOKEN": agent_token, **(env or {})},
        )
        lines: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout or ()], daemon=True).start()
        try:
            first = lines.get(timeout=15)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError(f"{cmd[-1]} did not start: {self.log()}") from None
        assert "listening on http://" in first, first
        self.url = first.split("listening on ", 1)[1].strip()
        self.host, rest = self.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        self.port = int(rest)

    def log(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode("utf-8", "replace")

    def stop(self) -> int:
        """SIGTERM, then the exit status (the server lets in-flight dispatches finish first)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(15)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.stderr.close()


def post(server: PortServer, body: Any, headers: Optional[Dict[str, str]] = None, *, method: str = "POST",
         path: str = "/dispatch") -> Reply:
    """One request on a fresh connection: status, lower-cased headers, body (``body`` bytes as they are, else JSON)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        conn.request(method, path, body=raw if method == "POST" else None,
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()
