"""The floor for the fan-out: a lean standard-library asyncio server and keep-alive proxy client.

    AGENT_TOKEN=... python3 bench/lean_server.py --port PORT

The same agent as bench/agents.py (three proxy calls one after another, then the response envelope), served
with nothing a real port needs: no envelope validation, no retries, no timeouts, no size caps, no redaction.
A dispatch is read by an ``asyncio.Protocol``, its agent runs as a task on the one loop, and its proxy calls
go over keep-alive connections pooled per proxy origin (``asyncio`` streams).  bench_fanout.py runs it as the
``lean`` server, to show in the same run how close pipelines_port comes to what the loop itself costs.  It is
not a port: never copy it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any, Dict, List, Set, Tuple
from urllib.parse import urlsplit

IDLE: Dict[Tuple[str, int], List[Tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
RUNNING: Set[asyncio.Future[Dict[str, Any]]] = set()  # the loop keeps only weak references to tasks


async def call(proxy_url: str, run_token: str, name: str, args: Dict[str, Any]) -> Any:
    """POST one tool call over a pooled keep-alive connection; its ``response``."""
    parts = urlsplit(proxy_url)
    origin = (parts.hostname or "127.0.0.1", parts.port or 80)
    pool = IDLE.setdefault(origin, [])
    reader, writer = pool.pop() if pool else await asyncio.open_connection(*origin)
    body = json.dumps(args).encode()
    writer.write((f"POST {parts.path.rstrip('/')}/tools/{name} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                  f"Authorization: Bearer {run_token}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-length":
            length = int(value)
    reply = json.loads(await reader.readexactly(length))
    pool.append((reader, writer))
    return reply["response"]


async def agent(body: Dict[str, Any], run_token: str, proxy_url: str) -> Dict[str, Any]:
    task_input = body["input"]["input"]
    order = await call(proxy_url, run_token, "get_order", {"order_id": task_input.get("order_id")})
    customer = await call(proxy_url, run_token, "get_customer", {"customer_id": task_input.get("customer_id")})
    refund = await call(proxy_url, run_token, "issue_refund", {"order_id": order["args"]["order_id"],
                                                               "reason": body["input"]["user_instruction"]})
    final = f"{refund['tool']} done for order {order['args']['order_id']} of {customer['args']['customer_id']}"
    return {"final_response": final, "messages": [], "metadata": {}, "agent_logs": {}}


class Dispatch(asyncio.Protocol):
    """One connection: read the request, run the agent, answer, close."""

    def __init__(self, agent_token: str) -> None:
        self.agent_token = agent_token
        self.buffer = bytearray()
        self.transport: Any = None
        self.started = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if self.started or end < 0:
            return
        fields = {}
        for line in bytes(self.buffer[:end]).decode("latin-1").split("\r\n")[1:]:
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        length = int(fields.get("content-length") or 0)
        if len(self.buffer) < end + 4 + length:
            return
        self.started = True
        if fields.get("authorization") != f"Bearer {self.agent_token}":
            self._send(401, {"detail": "bad agent token"})
            return
        body = json.loads(bytes(self.buffer[end + 4:end + 4 + length]))
        task = asyncio.ensure_future(agent(body, fields["x-pipelines-run-token"],
                                           fields["x-pipelines-odyssey-proxy-url"]))
        RUNNING.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future[Dict[str, Any]]) -> None:
        RUNNING.discard(task)
        failed = task.exception()
        self._send(500, {"detail": str(failed)}) if failed else self._send(200, task.result())

    def _send(self, status: int, reply: Any) -> None:
        data = json.dumps(reply).encode()
        self.transport.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: "
                             f"{len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        self.transport.close()


async def main(port: int) -> None:
    token = os.environ["AGENT_TOKEN"]
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Dispatch(token), "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    try:
        asyncio.run(main(parser.parse_args().port))
    except KeyboardInterrupt:
        sys.exit(0)
