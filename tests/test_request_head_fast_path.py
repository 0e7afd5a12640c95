"""The servers' fast path for request heads reads exactly what parse_request_head reads, or hands the head over.

``_well_formed_head`` is one regular expression per line for the heads every dispatch sends;
``parse_request_head`` (the full reading) checks each rule on its own and names what is wrong.  The fast path may decline any
head (``None``), but a head it accepts must come out exactly as the full reading gives it, and a head the full
reading refuses must never be accepted.  Checked on the smuggling heads of the conformance suite and on
thousands of seeded mutations of well-formed heads.
"""

from __future__ import annotations

import random
from typing import List, Optional

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


def _full(head: bytes) -> Optional[pp.RequestHead]:
    try:
        return pp.parse_request_head(head)
    except pp.PipelinesError:
        return None


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


def test_the_heads_every_dispatch_sends_take_the_fast_path() -> None:
    for head in WELL_FORMED:
        fast = pp._well_formed_head(head)
        assert fast is not None, head
        assert fast == pp.parse_request_head(head)


@pytest.mark.parametrize("case", [name for name, _ in SMUGGLING_HEADS])
def test_the_fast_path_never_accepts_a_smuggling_head(case: str) -> None:
    lines = dict(SMUGGLING_HEADS)[case]
    head = ("POST /dispatch HTTP/1.1\r\nHost: x\r\n" + "\r\n".join(lines)).format(n=12).encode("latin-1")
    assert pp._well_formed_head(head) is None
    with pytest.raises(pp.PipelinesError):
        pp.parse_request_head(head)


def test_on_thousands_of_mutated_heads_the_fast_path_agrees_with_the_full_reading() -> None:
    accepted = declined = refused = 0
    for head in _mutations(seed=20261125, count=6000):
        fast, full = pp._well_formed_head(head), _full(head)
        if fast is None:
            declined += 1
            refused += full is None
        else:
            accepted += 1
            assert full is not None, f"the fast path accepted a head the full reading refuses: {head!r}"
            assert fast == full, head
    # Both sides of the comparison were exercised, not only one.
    assert accepted > 500 and refused > 500 and declined > refused
