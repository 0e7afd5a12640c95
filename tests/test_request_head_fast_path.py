"""parse_request_head's one-pattern-per-line reading agrees with RFC 9112's rules checked one at a time.

``parse_request_head`` matches the request line and each field line against one regular expression, and only for a
head a pattern refuses reads the lines again, rule by rule, to name the problem.  Here a reference reader checks
each rule on its own (the way the module read every head before): on the smuggling heads of the conformance suite
and on thousands of seeded mutations of well-formed heads, the two must accept the same heads with the same result
and refuse the same heads with the same error class, and a refusal always names a rule.
"""

from __future__ import annotations

import random
import re
from typing import Callable, List, Optional, Tuple, Type

import pytest

import pipelines_port as pp
from conformance.checker.check import SMUGGLING_HEADS

DISPATCH = (b"POST /dispatch HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nAuthorization: Bearer agent-token\r\n"
            b"Content-Type: application/json\r\nContent-Length: 245\r\nX-Pipelines-Run-Token: rt-1\r\n"
            b"X-Pipelines-Odyssey-Proxy-Url: http://127.0.0.1:9/api/odyssey-proxy/runs/1\r\nConnection: close")
WELL_FORMED = [
    DISPATCH,
    b"GET /healthz HTTP/1.1\r\nHost: x",
    b"GET /healthz HTTP/1.0",
    b"POST /dispatch HTTP/1.0\r\nContent-Length: 2\r\nConnection: keep-alive",
    b"POST /dispatch?x=1 HTTP/1.1\r\nHost: x\r\nX-Empty:\r\nX-Tabs: \t a\tb \t\r\nX-Latin: caf\xe9",
    b"HEAD / HTTP/1.2\r\nhost: y\r\nContent-Length: 0",
]
# Bytes a mutation inserts: each breaks some rule, or is harmless, depending on where it lands.
INSERTS = [b"\r", b"\n", b"\r\n", b" ", b"\t", b":", b"\x00", b"\x7f", b"\xff", b",", b"0", b"a",
           b"\r\n ", b"\r\nContent-Length: 7", b"\r\nTransfer-Encoding: chunked", b"\r\nHost: z", b"\r\n\r\n"]


TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"


def _reference(head: bytes) -> pp.RequestHead:
    """RFC 9112's rules for a request head, each checked on its own, in the order the module names them."""
    while head.startswith(b"\r\n"):
        head = head[2:]
    end = head.find(b"\r\n")
    if (end if end >= 0 else len(head)) > pp.MAX_REQUEST_LINE_BYTES:
        raise pp.TargetTooLongError("request line too long")
    lines = head.split(b"\r\n")
    if len(head) > pp.MAX_REQUEST_HEAD_BYTES or len(lines) - 1 > pp.MAX_REQUEST_FIELDS:
        raise pp.HeadersTooLargeError("head too large")
    if any(b"\r" in line or b"\n" in line for line in lines):
        raise pp.FramingError("bare CR or LF")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not re.fullmatch(TOKEN, parts[0]) or not parts[1] or re.search(rb"[\x00-\x20\x7f-\xff]",
                                                                                         parts[1]):
        raise pp.FramingError("malformed request line")
    version = re.fullmatch(rb"HTTP/([0-9])\.([0-9])", parts[2])
    if version is None:
        raise pp.FramingError("malformed version")
    if version.group(1) != b"1":
        raise pp.VersionNotSupportedError("not HTTP/1")
    headers: List[Tuple[str, str]] = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if line[:1] in (b" ", b"\t") or not colon or not re.fullmatch(TOKEN, name):
            raise pp.FramingError("malformed field line")
        if re.search(rb"[\x00-\x08\x0a-\x1f\x7f]", value):
            raise pp.FramingError("control character")
        headers.append((name.decode("ascii"), value.strip(b" \t").decode("latin-1")))
    http_version = "HTTP/1.0" if version.group(2) == b"0" else "HTTP/1.1"

    def values(wanted: str) -> List[str]:
        return [v for k, v in headers if k.lower() == wanted]

    lengths = [v.strip() for value in values("content-length") for v in value.split(",")]
    if (http_version == "HTTP/1.1" and len(values("host")) != 1) or (lengths and (
            len(set(lengths)) != 1 or not all(v.isascii() and v.isdigit() for v in lengths))) or (
            values("transfer-encoding") and (lengths or http_version == "HTTP/1.0")):
        raise pp.FramingError("framing")
    return pp.RequestHead(parts[0].decode("ascii"), parts[1].decode("ascii"), http_version, headers)


def _outcome(read: Callable[[bytes], pp.RequestHead],
             head: bytes) -> Tuple[Optional[pp.RequestHead], Optional[Type[BaseException]], str]:
    try:
        return read(head), None, ""
    except pp.PipelinesError as exc:
        return None, type(exc), str(exc)


def _mutations(seed: int, count: int) -> List[bytes]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        head = bytearray(rng.choice(WELL_FORMED))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(head) + 1)
            kind = rng.random()
            if kind < 0.6:
                head[at:at] = rng.choice(INSERTS)
            elif kind < 0.8 and len(head) > 1:
                del head[min(at, len(head) - 1)]
            else:
                head[at:at + 1] = bytes([rng.randrange(256)])
        out.append(bytes(head))
    return out


def test_the_heads_every_dispatch_sends_are_read() -> None:
    for head in WELL_FORMED:
        read = pp.parse_request_head(head)
        assert read == _reference(head), head


@pytest.mark.parametrize("case", [name for name, _ in SMUGGLING_HEADS])
def test_a_smuggling_head_is_refused(case: str) -> None:
    lines = dict(SMUGGLING_HEADS)[case]
    head = ("POST /dispatch HTTP/1.1\r\nHost: x\r\n" + "\r\n".join(lines)).format(n=12).encode("latin-1")
    with pytest.raises(pp.PipelinesError):
        pp.parse_request_head(head)
    with pytest.raises(pp.PipelinesError):
        _reference(head)


def test_on_thousands_of_mutated_heads_the_reading_agrees_with_the_rules_one_by_one() -> None:
    accepted = refused = 0
    for head in _mutations(seed=20261125, count=6000):
        read, error, message = _outcome(pp.parse_request_head, head)
        expected, expected_error, _ = _outcome(_reference, head)
        assert (read, error) == (expected, expected_error), head
        assert message != "malformed request head", head  # every refusal names the rule it breaks
        accepted += read is not None
        refused += read is None
    # Both sides of the comparison were exercised, not only one.
    assert accepted > 500 and refused > 500
