"""A corpus of agent return values JSON (or UTF-8, or the platform's parser) cannot carry as they are.

Shared by tests/test_no_run_lost.py (the built-in servers, WSGI, ASGI and code mode) and
tests/interop/test_hostile_values.py (uvicorn, gunicorn): an agent whose instruction names a case returns
``HOSTILE[name].make()``.  Each case says what a strict builder answers (200: it is JSON after all; 500: refused,
the detail naming ``where``); a lenient one always answers 200 with a body the platform can parse.
"""

from __future__ import annotations

import datetime
import decimal
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, NamedTuple


class Case(NamedTuple):
    make: Callable[[], Any]
    strict_status: int  # what strict mode answers
    where: str  # what the strict 500's detail names ("" for a 200)


class Unprintable:
    """An object whose ``__str__`` and ``__repr__`` both raise."""

    def __str__(self) -> str:
        raise RuntimeError("no text for you")

    def __repr__(self) -> str:
        raise RuntimeError("no repr either")


class OnlyRepr:
    def __str__(self) -> str:
        raise ValueError("str refused")

    def __repr__(self) -> str:
        return "OnlyRepr()"


class StrKeyStrRaises(str):
    """A str subclass (an enum's value, a pydantic type) whose own ``__str__`` raises: still a string key."""

    def __str__(self) -> str:
        raise RuntimeError("no text for you")


class FloatReprRaises(float):
    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


class BrokenMapping(Mapping):  # type: ignore[type-arg]
    """A mapping that raises when read (a lazy proxy whose backend went away)."""

    def __getitem__(self, key: Any) -> Any:
        raise RuntimeError("the backend went away")

    def __iter__(self) -> Iterator[Any]:
        return iter(["a"])

    def __len__(self) -> int:
        return 1


def _cyclic_dict() -> Dict[str, Any]:
    value: Dict[str, Any] = {"name": "loop"}
    value["self"] = value
    return value


def _cyclic_list() -> Any:
    value: Any = [1, 2]
    value.append(value)
    return value


def _deep(levels: int, kind: str) -> Any:
    root: Any = {} if kind == "dict" else []
    node = root
    for _ in range(levels):
        child: Any = {} if kind == "dict" else []
        if kind == "dict":
            node["d"] = child
        else:
            node.append(child)
        node = child
    return root


def keyed(*pairs: Any) -> Dict[Any, Any]:
    """A dict from pairs (linters fold keys like ``"k\\ud800"`` and ``"k\\ufffd"`` into one in a literal)."""
    return dict(pairs)


def _answer(**extra: Any) -> Dict[str, Any]:
    return {"final_response": "done", **extra}


CUT = "The order ships on Monday \ud83d"  # a model's text cut mid-emoji: a lone high surrogate

HOSTILE: Dict[str, Case] = {
    "surrogate-in-final-response": Case(lambda: {"final_response": CUT}, 500, "final_response"),
    "surrogate-low-alone": Case(lambda: {"final_response": "ok \udc00 then"}, 500, "final_response"),
    "surrogate-in-message-content": Case(lambda: _answer(messages=[{"role": "user", "content": CUT},
                                                                    {"role": "assistant", "content": "done"}]),
                                         500, "messages[0].content"),
    "surrogate-in-tool-arguments": Case(lambda: _answer(messages=[
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "name": "get_order",
                                                               "arguments": {"note": CUT}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"}]), 500, "arguments.note"),
    "surrogate-in-metadata-value": Case(lambda: _answer(metadata={"model": CUT}), 500, "metadata.model"),
    "surrogate-in-metadata-key": Case(lambda: _answer(metadata={"k\ud800": 1}), 500, "metadata"),
    "surrogate-in-extra-top-level-key": Case(lambda: _answer(note=CUT), 500, "note"),
    "huge-int-in-metadata": Case(lambda: _answer(metadata={"n": 10 ** 5000}), 500, "metadata.n"),
    "huge-negative-int": Case(lambda: _answer(metadata={"n": -(10 ** 5000) - 7}), 500, "metadata.n"),
    "huge-int-at-top-level": Case(lambda: _answer(count=10 ** 4400), 500, "count"),
    "nan": Case(lambda: _answer(metadata={"score": float("nan")}), 500, "metadata.score"),
    "infinities": Case(lambda: _answer(metadata={"hi": float("inf"), "lo": float("-inf")}), 500, "metadata.hi"),
    "bytes": Case(lambda: _answer(metadata={"raw": b"\xff\xfe bytes"}), 500, "metadata.raw"),
    "bytearray": Case(lambda: _answer(metadata={"raw": bytearray(b"abc")}), 500, "metadata.raw"),
    "set": Case(lambda: _answer(metadata={"tags": {"b", "a"}}), 500, "metadata.tags"),
    "frozenset": Case(lambda: _answer(metadata={"tags": frozenset({1, 2})}), 500, "metadata.tags"),
    "tuple": Case(lambda: _answer(metadata={"pair": (1, 2)}), 200, ""),
    "tuple-key": Case(lambda: _answer(metadata={(1, 2): "pair"}), 500, "metadata"),
    "object-key": Case(lambda: _answer(metadata={OnlyRepr(): 1}), 500, "metadata"),
    "none-bool-float-keys": Case(lambda: _answer(metadata={None: 1, True: 2, 1.5: 3}), 500, "metadata"),
    "colliding-keys": Case(lambda: _answer(metadata={1: "int one", "1": "string one"}), 500, "metadata"),
    "non-string-top-level-key": Case(lambda: {"final_response": "done", 7: "seven"}, 500, "key 7"),
    "cyclic-dict": Case(lambda: _answer(metadata=_cyclic_dict()), 500, "metadata.self"),
    "cyclic-list": Case(lambda: _answer(metadata={"items": _cyclic_list()}), 500, "metadata.items[2]"),
    "deep-dict-5000": Case(lambda: _answer(metadata=_deep(5000, "dict")), 500, "metadata.d.d"),
    "deep-list-5000": Case(lambda: _answer(metadata={"l": _deep(5000, "list")}), 500, "metadata.l[0][0]"),
    "unprintable-value": Case(lambda: _answer(metadata={"o": Unprintable()}), 500, "metadata.o"),
    "unprintable-key": Case(lambda: _answer(metadata={Unprintable(): 1}), 500, "metadata"),
    "datetime": Case(lambda: _answer(metadata={"at": datetime.datetime(2026, 11, 24, 12, 0)}), 500, "metadata.at"),
    "cyclic-final-response": Case(lambda: {"final_response": _cyclic_dict()}, 500, "final_response"),
    "final-response-object-str-raises": Case(lambda: {"final_output": OnlyRepr()}, 200, ""),
    "surrogate-in-top-level-key": Case(lambda: _answer(**{"note\ud800": 1}), 500, "body: key"),
    "surrogate-keys-colliding": Case(lambda: _answer(metadata=keyed(("k\ud800", 1), ("k\ud801", 2), ("k\ufffd", 3))),
                                     500, "metadata: key"),
    "surrogate-keys-colliding-at-top-level": Case(
        lambda: keyed(("final_response", "done"), ("k\ud800", 1), ("k\ufffd", 2)), 500, "body: key"),
    "colliding-top-level-keys": Case(lambda: {"final_response": "done", 1: "int one", "1": "string one"},
                                     500, "key 1"),
    "surrogate-in-tool-call-id-and-name": Case(lambda: _answer(messages=[
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c\ud800", "name": "get\ud800",
                                                               "arguments": {}}]},
        {"role": "tool", "tool_call_id": "c\ud800", "content": "x"}]), 500, "tool_calls[0]"),
    "huge-int-key": Case(lambda: _answer(metadata={10 ** 5000: "big"}), 500, "metadata: key"),
    "decimal-and-complex": Case(lambda: _answer(metadata={"d": decimal.Decimal("NaN"), 1j: "i"}), 500, "metadata"),
    "str-subclass-key-whose-str-raises": Case(lambda: _answer(metadata={StrKeyStrRaises("k"): 1}), 200, ""),
    "float-subclass-nan-whose-repr-raises": Case(lambda: _answer(metadata={"f": FloatReprRaises("nan")}),
                                                 500, "metadata.f"),
    "mapping-that-raises-when-read": Case(lambda: _answer(metadata={"m": BrokenMapping()}), 500, "metadata.m"),
    "metadata-that-raises-when-read": Case(lambda: _answer(metadata=BrokenMapping()), 500, "metadata"),
}

# Each strict refusal says how to fix it, in one of these words (kit-json-safe-response: "the path and the fix").
FIXES = ("replace it", "send it as a string", "send null or a string", "convert it", "use string keys",
         "send a copy without the back-reference", "flatten it", "send plain dicts", "must be a string")
