"""The client transport reads each HTTP/1.1 reply framing a proxy may send (RFC 9112), over real loopback sockets:
chunked (extensions, trailers), Content-Length, close-delimited, 1xx interim replies skipped, obs-fold joined;
a 101 or a malformed chunk size is a transport failure, never a hang."""

from __future__ import annotations

import socket
import threading
from typing import Any, Dict, List, Tuple
from urllib.parse import urlsplit

import pytest

import pipelines_port as pp


def _serve_once(reply: bytes) -> Tuple[socket.socket, threading.Thread]:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def _exchange(reply: bytes) -> Tuple[int, Dict[str, str], bytes]:
    listener, thread = _serve_once(reply)
    try:
        base = urlsplit(f"http://127.0.0.1:{listener.getsockname()[1]}")
        status, headers, body = pp._Transport().exchange(base, "POST", "/x", {}, b"{}", 5.0, 1 << 20)
    finally:
        thread.join(10)
        listener.close()
    return status, dict(headers), body


CASES: List[Tuple[str, bytes, int, bytes, Dict[str, Any]]] = [
    ("chunked", (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\nabcd\r\n2\r\nef\r\n0\r\n"
                 b"X-Trailer: t\r\n\r\n"), 200, b"abcdef", {}),
    ("content-length", b"HTTP/1.1 201 Created\r\nContent-Length: 3\r\n\r\nxyz", 201, b"xyz", {}),
    ("close-delimited", b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nto the end", 200, b"to the end", {}),
    ("1xx skipped", (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
                     b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"), 200, b"ok", {}),
    ("obs-fold", b"HTTP/1.1 200 OK\r\nX-Folded: a\r\n  b\r\nContent-Length: 0\r\n\r\n", 200, b"",
     {"X-Folded": "a   b"}),
    ("no body on 204", b"HTTP/1.1 204 No Content\r\n\r\n", 204, b"", {}),
]


@pytest.mark.parametrize("name,reply,status,body,headers", CASES, ids=[c[0] for c in CASES])
def test_each_framing_is_read(name: str, reply: bytes, status: int, body: bytes, headers: Dict[str, Any]) -> None:
    got_status, got_headers, got_body = _exchange(reply)
    assert (got_status, got_body) == (status, body)
    for key, value in headers.items():
        assert " ".join(got_headers[key].split()) == " ".join(value.split())


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabcd\r\n0\r\n\r\n",
    b"NOT HTTP\r\n\r\n",
], ids=["101", "chunk-size", "chunk-longer-than-its-size", "status-line"])
def test_a_malformed_reply_is_a_transport_failure(reply: bytes) -> None:
    with pytest.raises(pp._TransportFailure) as caught:
        _exchange(reply)
    assert "malformed HTTP reply" in str(caught.value.__cause__)
