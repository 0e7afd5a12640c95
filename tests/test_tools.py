"""Tools from code: schemas from signatures, local validation, proxied inside a dispatch (§3.6)."""

from __future__ import annotations

import asyncio
import enum
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

import pytest

import pipelines_port as pp
from conformance.harness.mock_proxy import MockProxy
from tests.conftest import envelope_for


class Priority(enum.Enum):
    LOW = "low"
    HIGH = "high"


@pp.tool
def refund_order(order_id: str, amount: Optional[float] = None, reason: Literal["damaged", "late"] = "late",
                 priority: Priority = Priority.LOW, tags: List[str] = (), notify: bool = True) -> Dict[str, Any]:
    """Refund an order in full or in part.

    Only for orders the policy allows.

    Args:
        order_id: The order to refund,
            as printed on the receipt.
        amount (float): How much; omit for everything.

    Returns:
        The refund record.
    """
    return {"local": True, "order_id": order_id, "amount": amount, "priority": priority.value}


@pp.tool(name="lookup", description="Find things.", default_execution_mode="passthrough")
async def async_search(query: str, limit: int = 5) -> List[str]:
    """:param query: what to look for
    :param limit: at most this many
    """
    await asyncio.sleep(0)
    return [f"local:{query}"] * limit


def test_schema_is_derived_from_signature_hints_and_docstring() -> None:
    schema = refund_order.schema
    assert schema["name"] == "refund_order"
    assert schema["description"] == "Refund an order in full or in part.\n\nOnly for orders the policy allows."
    inp = schema["input_schema"]
    assert inp["required"] == ["order_id"] and inp["additionalProperties"] is False
    props = inp["properties"]
    assert props["order_id"] == {"type": "string", "description": "The order to refund, as printed on the receipt."}
    assert props["amount"] == {"type": ["number", "null"], "description": "How much; omit for everything.", "default": None}
    assert props["reason"] == {"enum": ["damaged", "late"], "type": "string", "default": "late"}
    assert props["priority"] == {"enum": ["low", "high"], "type": "string", "default": "low"}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}, "default": []}
    assert props["notify"] == {"type": "boolean", "default": True}
    lookup = async_search.schema
    assert lookup["name"] == "lookup" and lookup["description"] == "Find things."
    assert lookup["default_execution_mode"] == "passthrough"
    assert lookup["input_schema"]["properties"]["query"]["description"] == "what to look for"
    assert lookup["input_schema"]["properties"]["limit"] == {"type": "integer", "description": "at most this many",
                                                             "default": 5}


@pytest.mark.parametrize("hint,schema", [
    (str, {"type": "string"}), (int, {"type": "integer"}), (float, {"type": "number"}), (bool, {"type": "boolean"}),
    (type(None), {"type": "null"}), (Any, {}), (list, {"type": "array"}), (dict, {"type": "object"}),
    (Optional[int], {"type": ["integer", "null"]}),
    (Union[int, str], {"anyOf": [{"type": "integer"}, {"type": "string"}]}),
    (Optional[List[int]], {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "null"}]}),
    (Dict[str, float], {"type": "object", "additionalProperties": {"type": "number"}}),
    (Dict[str, Any], {"type": "object"}),
    (Tuple[int, ...], {"type": "array", "items": {"type": "integer"}}),
    (Tuple[int, str], {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}),
    (Literal[1, 2], {"enum": [1, 2], "type": "integer"}),
    (Literal["a", 1], {"enum": ["a", 1]}),
    (Priority, {"enum": ["low", "high"], "type": "string"}),
])
def test_schema_for_type(hint: Any, schema: Dict[str, Any]) -> None:
    assert pp.schema_for_type(hint) == schema


class Custom:
    pass


def test_unsupported_declarations_are_clear_errors() -> None:
    def bad(thing: Custom) -> None:
        """Takes something with no JSON Schema."""

    def star(*args: int) -> None:
        """Takes positional leftovers."""

    with pytest.raises(TypeError, match="argument 'thing'"):
        pp.tool(bad)
    with pytest.raises(TypeError, match=r"\*args"):
        pp.tool(star)
    with pytest.raises(pp.ProxyRequestError, match="tool name"):
        pp.tool(name="bad name")(star)
    def unresolvable(thing: "NoSuchType") -> None:  # noqa: F821
        """Its hint names nothing."""

    with pytest.raises(TypeError, match="cannot resolve its type hints"):
        pp.tool(unresolvable)
    def untyped(thing):  # type: ignore[no-untyped-def]
        """No hint at all."""

    assert pp.tool(untyped).input_schema["properties"] == {"thing": {}}  # any JSON value
    with pytest.raises(pp.ProxyRequestError, match="tool name"):
        pp.tool(lambda: None)  # '<lambda>' is no tool name: pass name=...


def test_outside_a_dispatch_the_function_runs_locally() -> None:
    assert refund_order("4521", amount=5.0) == {"local": True, "order_id": "4521", "amount": 5.0, "priority": "low"}
    assert asyncio.run(async_search("x", limit=2)) == ["local:x", "local:x"]


def test_inside_a_dispatch_calls_go_through_the_proxy(proxy: MockProxy, client: pp.ProxyClient,
                                                       request: pytest.FixtureRequest) -> None:
    previous = pp.set_default_client(client)
    request.addfinalizer(lambda: pp.set_default_client(previous))
    with pp.bind_envelope(envelope_for(proxy)):
        got = refund_order("4521", priority=Priority.HIGH, tags=["vip"])
        assert got == {"tool": "refund_order", "args": {"order_id": "4521", "priority": "high", "tags": ["vip"]}}
        assert asyncio.run(async_search("shoes")) == {"tool": "lookup", "args": {"query": "shoes"}}
    assert [c.name for c in proxy.calls()] == ["refund_order", "lookup"]


def test_invalid_arguments_list_every_violation_and_send_nothing(proxy: MockProxy) -> None:
    with pp.bind_envelope(envelope_for(proxy)):
        with pytest.raises(pp.ProxyRequestError) as info:
            refund_order(4521, amount="lots", reason="bored")
    message = str(info.value)
    for needle in ("args.order_id: expected string", "args.amount: expected number or null", "args.reason:"):
        assert needle in message
    assert proxy.requests == []


def test_export_in_every_shape() -> None:
    raw = {"name": "ping", "input_schema": {"type": "object"}}
    platform = pp.export_tools([refund_order, async_search, raw])
    assert [t["name"] for t in platform] == ["refund_order", "lookup", "ping"]
    chat = pp.export_tools([refund_order], "openai_chat")[0]
    assert chat["type"] == "function" and chat["function"]["parameters"] == refund_order.input_schema
    responses = pp.export_tools([refund_order], "openai_responses")[0]
    assert responses["name"] == "refund_order" and responses["parameters"]["required"] == ["order_id"]
    anthropic = pp.export_tools([async_search], "anthropic")[0]
    assert set(anthropic) == {"name", "description", "input_schema"}


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "kind": {"enum": ["a", "b"]},
        "fixed": {"const": 3},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2},
        "meta": {"type": "object", "additionalProperties": {"type": "integer"}},
        "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        "one": {"oneOf": [{"type": "number"}, {"type": "integer"}]},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("value,paths", [
    ({"name": "ann", "age": 30}, []),
    ({"name": "ann", "age": 30, "score": 0.5, "kind": "a", "fixed": 3, "tags": ["x"], "meta": {"k": 1},
      "either": "s", "one": 0.5}, []),
    ({}, ["args.name", "args.age"]),
    ({"name": "a", "age": -1}, ["args.name", "args.age"]),
    ({"name": "abcdef", "age": 151}, ["args.name", "args.age"]),
    ({"name": "ann", "age": 1.5}, ["args.age"]),
    ({"name": "ann", "age": True}, ["args.age"]),
    ({"name": "ann", "age": 1, "score": 0}, ["args.score"]),
    ({"name": "ann", "age": 1, "score": 1}, ["args.score"]),
    ({"name": "ann", "age": 1, "kind": "c"}, ["args.kind"]),
    ({"name": "ann", "age": 1, "fixed": 4}, ["args.fixed"]),
    ({"name": "ann", "age": 1, "tags": []}, ["args.tags"]),
    ({"name": "ann", "age": 1, "tags": ["a", "b", "c"]}, ["args.tags"]),
    ({"name": "ann", "age": 1, "tags": ["a", 2]}, ["args.tags[1]"]),
    ({"name": "ann", "age": 1, "meta": {"k": "v"}}, ["args.meta.k"]),
    ({"name": "ann", "age": 1, "either": 1.5}, ["args.either"]),
    ({"name": "ann", "age": 1, "one": 2}, ["args.one"]),
    ({"name": "ann", "age": 1, "extra": 1}, ["args.extra"]),
    ([1], ["args"]),
])
def test_validate_args_reports_every_violation_by_path(value: Any, paths: List[str]) -> None:
    problems = pp.validate_args(SCHEMA, value)
    assert sorted(p.split(":", 1)[0] for p in problems) == sorted(paths), problems
