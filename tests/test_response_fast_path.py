"""build_response answers, warns and refuses exactly as response_envelope (the full path) does.

Every body the public function builds must be the full path's body, key for key and in the same order,
lenient and strict alike, and a refusal the same refusal.  Checked on edge cases and on thousands of seeded
random results."""

from __future__ import annotations

import logging
import math
import random
from typing import Any, List, Tuple

import pytest

import pipelines_port as pp


class _Str(str):
    pass


class _Int(int):
    pass


class _Float(float):
    pass


TEXTS = ["done", "refund issued for order 4521", "café ✓", "", "   ", "\t\n", "x" * (pp.FINAL_RESPONSE_SOFT_LIMIT + 1),
         "x" * pp.FINAL_RESPONSE_SOFT_LIMIT, "lone \ud800 surrogate", "pair \ud83d\ude00 split", "nul \x00 ok",
         _Str("a str subclass")]
SCALARS: List[Any] = [None, True, False, 0, -7, 2 ** 62, 10 ** 5000, 1.5, -0.0, math.nan, math.inf, -math.inf,
                      _Int(3), _Float(2.5), "v", "", "\udfff", _Str("s"), b"bytes", [1], (1, 2), {"a": 1}, {1, 2},
                      object()]
KEYS: List[Any] = ["a", "b", "run", "extra key", "messages", "metadata", "final_output", "k\ud800", 1, None, _Str("s")]


def _results(seed: int, count: int) -> List[Any]:
    rng = random.Random(seed)
    out: List[Any] = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.25:
            out.append(rng.choice(TEXTS))
            continue
        value: dict = {}
        for _ in range(rng.randint(0, 4)):
            value[rng.choice(KEYS)] = rng.choice(SCALARS)
        if rng.random() < 0.9:
            value["final_response"] = rng.choice([*TEXTS, None, 42, {"a": 1}])
            if rng.random() < 0.5:  # final_response first, last or between the others
                value = dict(sorted(value.items(), key=lambda _: rng.random()))
        out.append(value)
    return out


def _full(value: Any, strict: bool) -> Tuple[str, Any]:
    try:
        return "ok", pp.response_envelope(value, strict=strict)
    except pp.ResponseError as exc:
        return "refused", str(exc)


def _public(value: Any, strict: bool) -> Tuple[str, Any]:
    """What build_response answers: the body, or the refusal."""
    try:
        return "ok", pp.build_response(value, strict=strict)
    except pp.ResponseError as exc:
        return "refused", str(exc)


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN included, with the same key order and the same types all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_on_seeded_random_results_build_response_agrees_with_the_full_path(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="pipelines_port")  # build_response's warnings: not what is compared
    built = refused = 0
    for value in _results(seed=21, count=6000):
        for strict in (False, True):
            full = _full(value, strict)
            assert _same(_public(value, strict), (full[0], full[1][0] if full[0] == "ok" else full[1])), value
            built, refused = built + (full[0] == "ok"), refused + (full[0] != "ok")
    assert built > 500 and refused > 500, (built, refused)


def test_build_response_warns_as_the_full_path_does(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pipelines_port"):
        assert pp.build_response("done") == {"final_response": "done"}
        assert not caplog.records
        assert pp.build_response({"final_response": "ok", "n": math.nan}) == {"n": None, "final_response": "ok"}
    assert any("NaN" in r.getMessage() or "nan" in r.getMessage() for r in caplog.records)
