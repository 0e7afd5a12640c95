"""The simulated backend (conformance/simulator/engine.py): failure rules rule by rule, the ledger, fixtures, templates."""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Optional, Tuple

import pytest

from conformance.simulator import engine
from conformance.simulator.engine import Backend, load_fixtures, render

ORDERS = {"order": {"4521": {"status": "shipped", "amount": 79.5}, "7730": {"status": "refunded", "amount": 10}}}
E502 = {"code": 502, "message": "Payment processor unavailable"}


def fail(tool: str, trigger: str = "after_n_calls", **fields: Any) -> Dict[str, Any]:
    rule = {"trigger": trigger, "tool": tool, "error": fields.pop("error", E502)}
    rule.update(fields)
    return rule


def pattern(backend: Backend, calls: List[str]) -> List[Optional[int]]:
    """The matched_rule_index of each call in turn (None when no rule fired)."""
    return [backend.call(name, {"order_id": "4521"}).matched_rule_index for name in calls]


# ---------------------------------------------------------------------------
# after_n_calls
# ---------------------------------------------------------------------------


def test_after_n_calls_fires_on_the_nth_call_for_duration_calls_counting_the_nth() -> None:
    backend = Backend(ORDERS, [fail("get_order", n=3, duration=2)])
    assert pattern(backend, ["get_order"] * 6) == [None, None, 0, 0, None, None]


def test_after_n_calls_one_one_fails_exactly_the_first_call_so_a_retry_succeeds() -> None:
    backend = Backend(ORDERS, [fail("refund_order", n=1, duration=1)])
    first = backend.call("refund_order", {"order_id": "4521"})
    assert (first.source, first.matched_rule_index) == ("injected", 0)
    assert first.response == {"error": "Payment processor unavailable", "status_code": 502}
    assert backend.call("refund_order", {"order_id": "4521"}).source != "injected"


def test_after_n_calls_counts_only_calls_to_its_own_tool() -> None:
    backend = Backend(ORDERS, [fail("get_order", n=2, duration=1)])
    assert pattern(backend, ["list_orders", "get_order", "list_orders", "list_orders", "get_order", "get_order"]) == \
        [None, None, None, None, 0, None]


def test_star_matches_and_counts_every_tool() -> None:
    backend = Backend(ORDERS, [fail("*", n=2, duration=2)])
    assert pattern(backend, ["get_order", "list_orders", "refund_order", "get_order"]) == [None, 0, 0, None]


# ---------------------------------------------------------------------------
# Ordering: first match wins, every rule counts every call
# ---------------------------------------------------------------------------


def test_first_matching_rule_wins_in_array_order() -> None:
    specific = fail("get_order", n=1, duration=1, error={"code": 404, "message": "specific"})
    catch_all = fail("*", n=1, duration=3, error={"code": 503, "message": "catch-all"})
    backend = Backend(ORDERS, [specific, catch_all])
    first = backend.call("get_order", {"order_id": "4521"})
    assert (first.matched_rule_index, first.response["error"]) == (0, "specific")
    assert pattern(backend, ["get_order", "get_order", "get_order"]) == [1, 1, None]
    # the same rules the other way round: the catch-all shadows the specific rule
    assert pattern(Backend(ORDERS, [catch_all, specific]), ["get_order"] * 4) == [0, 0, 0, None]


def test_a_rule_window_counts_calls_answered_by_an_earlier_rule() -> None:
    backend = Backend(ORDERS, [fail("get_order", n=1, duration=2), fail("get_order", n=2, duration=2)])
    assert pattern(backend, ["get_order"] * 4) == [0, 0, 1, None]


# ---------------------------------------------------------------------------
# random
# ---------------------------------------------------------------------------


def test_random_draw_is_the_documented_sha256_formula() -> None:
    seed = engine.task_seed(3, "Can I return opened electronics?")
    assert seed == hashlib.sha256(b"3\nCan I return opened electronics?").hexdigest()
    digest = hashlib.sha256(f"{seed}:0:1".encode()).digest()
    assert engine.draw(seed, 0, 1) == int.from_bytes(digest[:8], "big") / 2 ** 64


def test_random_replays_identically_for_the_same_task() -> None:
    rules = [fail("*", "random", probability=0.5)]
    calls = ["get_order", "list_orders"] * 20
    seed = engine.task_seed(2, "Refund order 4521")
    first = pattern(Backend(ORDERS, rules, seed=seed), calls)
    second = pattern(Backend(ORDERS, rules, seed=seed), calls)
    other = pattern(Backend(ORDERS, rules, seed=engine.task_seed(3, "Refund order 4521")), calls)
    assert first == second
    assert first != other
    assert 0 in first and None in first


def test_random_fires_at_about_its_probability_and_never_or_always_at_the_ends() -> None:
    seed = engine.task_seed(1, "x")
    fired = pattern(Backend(ORDERS, [fail("get_order", "random", probability=0.25)], seed=seed), ["get_order"] * 400)
    assert 70 <= fired.count(0) <= 130
    assert set(pattern(Backend(ORDERS, [fail("*", "random", probability=0)], seed=seed), ["get_order"] * 50)) == {None}
    assert set(pattern(Backend(ORDERS, [fail("*", "random", probability=1)], seed=seed), ["get_order"] * 50)) == {0}


def test_random_draws_do_not_depend_on_other_rules() -> None:
    seed = engine.task_seed(5, "y")
    alone = pattern(Backend(ORDERS, [fail("*", "random", probability=0),
                                     fail("get_order", "random", probability=0.5)], seed=seed), ["get_order"] * 30)
    shadowed = pattern(Backend(ORDERS, [fail("*", n=1, duration=10),
                                        fail("get_order", "random", probability=0.5)], seed=seed), ["get_order"] * 30)
    assert alone[10:] == shadowed[10:]


# ---------------------------------------------------------------------------
# after_state_change
# ---------------------------------------------------------------------------

REFUND_FIXTURES = load_fixtures({"tools": {"refund_order": {
    "effects": [{"update": "order.<args.order_id>", "set": {"status": "refunded"}}, {"set_flag": "refund_issued"}],
    "response": {"status": "{{order.<args.order_id>.status}}"},
}}})


def test_after_state_change_fires_for_duration_calls_after_the_flag_is_set() -> None:
    stale = {"code": 200, "response": {"status": "shipped", "stale": True}}
    rule = fail("get_order", "after_state_change", condition="refund_issued", duration=2, error=stale)
    backend = Backend(ORDERS, [rule], fixtures=REFUND_FIXTURES)
    assert pattern(backend, ["get_order", "get_order"]) == [None, None]  # flag not set yet
    refund = backend.call("refund_order", {"order_id": "4521"})
    assert refund.source == "odyssey" and refund.response == {"status": "refunded"}
    assert backend.ledger.flags == {"refund_issued": True}
    calls = [backend.call("get_order", {"order_id": "4521"}) for _ in range(3)]
    assert [c.matched_rule_index for c in calls] == [0, 0, None]
    assert calls[0].response == {"status": "shipped", "stale": True}
    assert calls[2].response["status"] == "refunded"


def test_after_state_change_does_not_count_the_call_that_set_the_flag_nor_other_tools() -> None:
    backend = Backend(ORDERS, [fail("*", "after_state_change", condition="refund_issued", duration=1)],
                      fixtures=REFUND_FIXTURES)
    assert backend.call("refund_order", {"order_id": "4521"}).source == "odyssey"
    assert pattern(backend, ["list_orders", "get_order"]) == [0, None]
    only_get = Backend(ORDERS, [fail("get_order", "after_state_change", condition="refund_issued", duration=1)],
                       fixtures=REFUND_FIXTURES)
    only_get.call("refund_order", {"order_id": "4521"})
    assert pattern(only_get, ["list_orders", "get_order", "get_order"]) == [None, 0, None]


def test_after_state_change_never_fires_without_its_flag() -> None:
    backend = Backend(ORDERS, [fail("*", "after_state_change", condition="other_flag", duration=5)],
                      fixtures=REFUND_FIXTURES)
    assert pattern(backend, ["refund_order", "get_order", "get_order"]) == [None, None, None]
    assert engine.flags_set_by(REFUND_FIXTURES) == {"refund_issued"}


# ---------------------------------------------------------------------------
# The error envelope and what an injected call does not do
# ---------------------------------------------------------------------------


def test_code_200_is_a_forced_success_copied_per_call() -> None:
    backend = Backend(ORDERS, [fail("get_order", n=1, duration=2, error={"code": 200, "response": {"items": []}})])
    first = backend.call("get_order", {"order_id": "4521"})
    assert (first.response, first.source, first.matched_rule_index) == ({"items": []}, "injected", 0)
    first.response["items"].append("mutated by the caller")
    assert backend.call("get_order", {"order_id": "4521"}).response == {"items": []}


def test_an_injected_call_changes_no_state() -> None:
    backend = Backend(ORDERS, [fail("refund_order", n=1, duration=1)], fixtures=REFUND_FIXTURES)
    injected = backend.call("refund_order", {"order_id": "4521"})
    assert injected.changes == [] and backend.ledger.flags == {} and backend.ledger.changes == []
    assert backend.ledger.entities["order"]["4521"]["status"] == "shipped"


def test_invalid_rules_or_state_are_refused_up_front() -> None:
    with pytest.raises(ValueError, match=r"invalid failure_rules: \[0\]\.n: must be a positive integer"):
        Backend(ORDERS, [fail("x", n=0, duration=1)])
    with pytest.raises(ValueError, match="invalid state"):
        Backend({"order": [1]}, [])


def test_describe_rule_is_one_readable_line() -> None:
    assert engine.describe_rule(fail("refund_order", n=1, duration=1)) == \
        "after_n_calls: call 1 to refund_order -> HTTP-style error 502 Payment processor unavailable"
    assert engine.describe_rule(fail("*", n=2, duration=3)).startswith("after_n_calls: calls 2 to 4 to *")


# ---------------------------------------------------------------------------
# The ledger's own answers
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("args", [{"order_id": "4521"}, {"order_id": 4521}, {"id": "4521"}, {"number": "4521"}])
def test_get_type_returns_the_entity_with_its_id(args: Dict[str, Any]) -> None:
    result = Backend(ORDERS).call("get_order", args)
    assert (result.response, result.source) == ({"id": "4521", "status": "shipped", "amount": 79.5}, "odyssey")


def test_get_type_not_found_and_unanswerable_calls() -> None:
    backend = Backend({"orders": {"1": {"status": "paid"}}})
    assert backend.call("get_order", {"order_id": "1"}).response["status"] == "paid"  # plural type name
    missing = backend.call("get_order", {"order_id": "9"})
    assert (missing.response, missing.source) == ({"error": "orders '9' not found"}, "odyssey")
    no_id = backend.call("get_order", {"a": 1, "b": 2})
    assert no_id.source == "error" and "needs an id argument" in no_id.response["error"]
    unknown = backend.call("get_customer", {"id": "1"})
    assert unknown.source == "error" and "no `customer` entities" in unknown.response["error"]
    other = backend.call("refund_order", {"order_id": "1"})
    assert other.source == "error" and "no answer for refund_order" in other.response["error"]


def test_list_types_filters_on_attribute_arguments() -> None:
    backend = Backend(ORDERS)
    assert [o["id"] for o in backend.call("list_orders", {}).response] == ["4521", "7730"]
    assert [o["id"] for o in backend.call("list_orders", {"status": "refunded", "limit": 5}).response] == ["7730"]
    assert backend.call("list_orders", {"amount": "10"}).response[0]["id"] == "7730"


# ---------------------------------------------------------------------------
# Fixtures: matching, effects, templates
# ---------------------------------------------------------------------------


def test_fixture_match_and_when_pick_the_first_fitting_fixture() -> None:
    fixtures = load_fixtures({"tools": {
        "refund_order": [
            {"when": {"order.<args.order_id>.status": "refunded"}, "response": {"error": "already refunded"}},
            {"match": {"order_id": 4521}, "response": "special {{args.order_id}}"},
            {"response": {"ok": True}},
        ],
        "*": {"response": {"fallback": "{{args}}"}},
    }})
    backend = Backend(ORDERS, fixtures=fixtures)
    assert backend.call("refund_order", {"order_id": "7730"}).response == {"error": "already refunded"}
    assert backend.call("refund_order", {"order_id": "4521"}).response == "special 4521"  # 4521 matches "4521"
    # a `when` path that names nothing never matches
    assert backend.call("refund_order", {"order_id": "1"}).response == {"ok": True}
    assert backend.call("ping", {"x": 1}).response == {"fallback": {"x": 1}}


def test_fixture_effects_are_recorded_as_ledger_changes() -> None:
    fixtures = load_fixtures({"tools": {
        "create_ticket": {"effects": [{"add": "ticket", "set": {"order": "{{args.order_id}}"}}],
                          "response": {"ticket_id": "{{new_id}}"}},
        "close_order": {"effects": [{"update": "order.<args.order_id>", "set": {"status": "closed"}},
                                    {"remove": "order.7730"}, {"set_flag": "closed_one"}],
                        "response": "{{order.<args.order_id>}}"},
    }})
    backend = Backend(ORDERS, fixtures=fixtures)
    first = backend.call("create_ticket", {"order_id": "4521"})
    second = backend.call("create_ticket", {"order_id": "7730"})
    assert (first.response, second.response) == ({"ticket_id": "ticket-1"}, {"ticket_id": "ticket-2"})
    assert first.changes == [
        {"op": "add", "entity_type": "ticket", "entity_id": "ticket-1", "after": {"order": "4521"}}]
    closed = backend.call("close_order", {"order_id": "4521"})
    assert closed.response == {"status": "closed", "amount": 79.5}
    assert [c["op"] for c in closed.changes] == ["update", "remove", "set_flag"]
    assert closed.changes[0]["before"]["status"] == "shipped" and closed.changes[0]["after"]["status"] == "closed"
    assert "7730" not in backend.ledger.entities["order"]
    assert [c["op"] for c in backend.ledger.changes] == ["add", "add", "update", "remove", "set_flag"]


def test_effects_are_all_or_nothing() -> None:
    fixtures = load_fixtures({"tools": {"refund_both": {
        "effects": [{"update": "order.4521", "set": {"status": "refunded"}}, {"set_flag": "f"},
                    {"update": "order.<args.other>", "set": {"status": "refunded"}}],
        "response": {"ok": True}}}})
    backend = Backend(ORDERS, fixtures=fixtures)
    result = backend.call("refund_both", {"other": "9999"})
    assert (result.response, result.source, result.changes) == ({"error": "order '9999' not found"}, "odyssey", [])
    assert backend.ledger.entities["order"]["4521"]["status"] == "shipped"
    assert backend.ledger.flags == {} and backend.ledger.changes == []


@pytest.mark.parametrize("template, expected", [
    ("{{order.4521.amount}}", 79.5),
    ("{{ order.<args.id>.status }}", "shipped"),
    ("{{state.order.4521}}", {"status": "shipped", "amount": 79.5}),
    ("paid {{order.4521.amount}} for {{args.id}}", "paid 79.5 for 4521"),
    ("{{args.items.1}}", "b"),
    ("{{flags.on}}", True),
    ({"nested": ["{{args.id}}", 3]}, {"nested": [4521, 3]}),  # a whole template keeps the type
    ("no template", "no template"),
])
def test_template_syntax(template: Any, expected: Any) -> None:
    scope = {"args": {"id": 4521, "items": ["a", "b"]}, "state": ORDERS, "flags": {"on": True}, "new_id": None}
    assert render(template, scope) == expected


@pytest.mark.parametrize("template, message", [
    ("{{order.9.status}}", "order '9' not found"),
    ("{{order.4521.colour}}", "order '4521' has no field 'colour'"),
    ("{{customer.1}}", "no customer records"),
    ("{{order.<args.missing>}}", "missing argument 'missing'"),
])
def test_missing_paths_say_what_is_missing(template: str, message: str) -> None:
    with pytest.raises(engine.Missing) as caught:
        render(template, {"args": {}, "state": ORDERS, "flags": {}, "new_id": None})
    assert caught.value.described == message


def test_render_does_not_change_its_input() -> None:
    value = {"a": ["{{order.4521}}"]}
    scope = {"args": {}, "state": ORDERS, "flags": {}, "new_id": None}
    out = render(value, scope)
    out["a"][0]["status"] = "changed"
    assert value == {"a": ["{{order.4521}}"]} and ORDERS["order"]["4521"]["status"] == "shipped"


def fixture_errors(doc: Any) -> List[Tuple[str, str]]:
    return [(f.where, f.message) for f in engine.fixture_findings(doc) if f.severity == "error"]


def test_fixture_documents_are_checked() -> None:
    assert fixture_errors([]) == [("", "must be a JSON object {\"tools\": {...}}, got an array")]
    assert fixture_errors({"tools": {"t": {}}}) == [("tools.t[0]", "needs `response`, the value the agent receives")]
    assert fixture_errors({"tools": {"t": {"response": "{{order.<args.id}}"}}}) == \
        [("tools.t[0].response", "unclosed '<' in path 'order.<args.id'")]
    assert fixture_errors({"tools": {"t": {"response": 1, "effects": [{"update": "order"}]}}}) == \
        [("tools.t[0].effects[0].update", 'must be "type.id", got "order"')]
    assert fixture_errors({"tools": {"t": {"response": 1, "effects": [{"update": "a.b", "remove": "a.b"}]}}}) == \
        [("tools.t[0].effects[0]", "an effect needs exactly one of `update`, `add`, `remove`, `set_flag`")]
    assert fixture_errors({"tools": {"t": {"response": "{{a}} }}"}}}) == \
        [("tools.t[0].response", "unbalanced '{{' or '}}' in \"{{a}} }}\"")]
    with pytest.raises(ValueError, match="invalid fixtures"):
        load_fixtures({"tools": {"t": {}}})
