"""How many requests a model server gets at once, and in what order (conformance/models/servers.py, issue 41).

The limit's rules on a clock of the test's own; then over sockets on 127.0.0.1 against stand-ins that shed load
(503 past a capacity) or answer one request at a time, slowly, as llama.cpp's server and Ollama do; then a whole
``simulate`` with every role on such a server.
"""

from __future__ import annotations

import html
import json
import pathlib
import threading
import time
from typing import Any, Dict, List

import pytest

from conformance.models import roles
from conformance.models.client import ChatClient, Endpoint, ModelServers
from conformance.models.servers import ANSWERED, CRITICAL, DEFERRED, OTHER, OVERLOADED, Server, queueing_bound
from conformance.simulator import report as report_text
from tests.fake_chat_server import FakeChatServer, Reply
from tests.test_model_client import ask_at_once
from tests.test_simulate import ROOT, simulate_cli, write_csv

GOOD = json.dumps({"task_completion": 5, "verdict": "PASS", "failure_mode": None, "instruction_adherence": None,
                   "explanation": "done"})
MESSAGES = [{"role": "system", "content": "grade"}, {"role": "user", "content": "{}"}]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def answer(server: Server, clock: Clock, ticket: Any, after_s: float, ended: str = ANSWERED) -> None:
    clock.now += after_s
    server.release(ticket, ended)


def test_the_limit_doubles_per_round_trip_then_halves_on_overload_then_grows_by_one() -> None:
    clock = Clock()
    server = Server("s", clock)
    lane = server.lane("judge", 16, 120.0)
    assert server.limit == 1
    def round_trip(count: int, ended: str = ANSWERED) -> None:  # ``count`` requests out, answered together
        tickets = [server.acquire(lane) for _ in range(count)]
        for i, t in enumerate(tickets):
            answer(server, clock, t, 1.0 if i == 0 else 0.0, ended)

    for expected in (2, 4, 8, 16):  # slow start: one more per answer to a request out while the limit was full
        round_trip(int(server.limit))
        assert server.limit == expected
    round_trip(16)
    assert server.limit == 16  # the bound (--judge-jobs): no further
    tickets = [server.acquire(lane) for _ in range(16)]
    answer(server, clock, tickets[0], 1.0, OVERLOADED)  # a 429, a 503, a timeout: halved ...
    assert server.limit == 8
    for t in tickets[1:4]:
        answer(server, clock, t, 0.0, OVERLOADED)  # ... once: these were sent before that cut
    assert server.limit == 8 and server.cuts == 1
    for t in tickets[4:]:
        answer(server, clock, t, 0.0)
    round_trip(8)
    assert server.limit == pytest.approx(9.0, abs=0.1)  # past the cut: one more per round trip
    round_trip(2)
    assert server.limit == pytest.approx(9.0, abs=0.1)  # a limit not reached does not grow


def test_answers_that_queue_at_the_server_cut_the_limit_by_one() -> None:
    """A server that answers one request at a time: latency grows with each request in flight."""
    clock = Clock()
    server = Server("llama", clock)
    lane = server.lane("judge", 16, 120.0)
    service = 10.0  # seconds a request takes alone
    limits = []
    for _ in range(40):
        tickets = [server.acquire(lane) for _ in range(int(server.limit))]
        for i, t in enumerate(tickets, 1):  # served one after another: the i-th waited for the ones before it
            answer(server, clock, t, service if i == 1 else 0.0)
            clock.now += 0 if i == len(tickets) else service
        limits.append(int(server.limit))
    # The second of two at once takes twice the service time, past 1.75 times it: requests queue, and the limit
    # stays at 1 or 2 after its first rounds.
    assert set(limits[5:]) <= {1, 2} and server.cuts >= 5, limits
    assert queueing_bound(10.0, 120.0) == 17.5 and queueing_bound(1.0, 120.0) == 6.0
    assert queueing_bound(50.0, 120.0) == 60.0  # a slow model is not cut before half the timeout


def test_waiters_go_critical_first_then_in_order_and_each_role_keeps_its_bound() -> None:
    clock = Clock()
    server = Server("s", clock)
    judge, tools = server.lane("judge", 1, 120.0), server.lane("simulator", 8, 120.0)
    first = server.acquire(tools)
    order: List[str] = []
    threads = []
    for name, lane, priority in (("judge-1", judge, DEFERRED), ("judge-2", judge, DEFERRED),
                                 ("tool-1", tools, CRITICAL), ("tool-2", tools, CRITICAL)):
        def go(name: str = name, lane: Any = lane, priority: int = priority) -> None:
            ticket = server.acquire(lane, priority)
            order.append(name)
            server.release(ticket, OTHER)
        threads.append(threading.Thread(target=go))
        threads[-1].start()
        deadline = time.monotonic() + 10
        while len(server._waiting) < len(threads) and time.monotonic() < deadline:
            time.sleep(0.005)
    server.release(first, OTHER)  # the limit is 1: the waiters go one at a time, best first
    for t in threads:
        t.join(10)
    assert order == ["tool-1", "tool-2", "judge-1", "judge-2"]
    figures = server.figures()
    assert figures["requests"] == 5 and figures["max_at_once"] == 1 and figures["roles"] == ["judge", "simulator"]
    assert figures["bound"] == 8


def test_a_judge_request_waits_while_an_agents_is_out_at_a_server_that_takes_one_at_a_time() -> None:
    """At a limit of 2 or less a deferred request is not sent beside a critical one (it would be served before
    the agent's next request); at a larger limit it is, unless answers have shown requests queueing at the
    server (a limit grown back to 3 there put two judge requests before an agent's tool answer)."""
    for limit, queued, goes_beside in ((2, False, False), (8, False, True), (8, True, False)):
        clock = Clock()
        server = Server("s", clock)
        tools, judge = server.lane("simulator", 16, 120.0), server.lane("judge", 16, 120.0)
        if queued:  # one alone in 10 s, then two at once: the second answered after 30 s, past 17.5
            answer(server, clock, server.acquire(judge, DEFERRED), 10.0)
            server.limit = 2.0
            pair = [server.acquire(judge, DEFERRED) for _ in range(2)]
            answer(server, clock, pair[0], 10.0)
            answer(server, clock, pair[1], 20.0)
            assert server.cuts == 1 and server.queues
        server.limit = float(limit)
        critical = server.acquire(tools, CRITICAL)
        sent = threading.Event()
        def judge_asks(server: Server = server, judge: Any = judge, sent: threading.Event = sent) -> None:
            server.acquire(judge, DEFERRED)
            sent.set()

        waiter = threading.Thread(target=judge_asks)
        waiter.start()
        assert sent.wait(0.5) is goes_beside, limit
        server.release(critical, OTHER)
        assert sent.wait(10)  # the agent's request answered: the judge's goes
        waiter.join(10)


def test_a_server_that_sheds_load_gets_what_it_sustains() -> None:
    """30 requests at once, a bound of 16, a server that takes 2 and answers 503 past them: every request is
    answered, after a handful of 503s, not a storm of them (16 at once would draw 14 on the first round)."""
    with FakeChatServer([Reply(GOOD, delay=0.05)], capacity=2) as server:
        c = ChatClient(Endpoint(server.base_url, "m", None, concurrency=16), sleep=lambda s: None,
                       servers=ModelServers())
        answers = ask_at_once(c, 30, roles.judge_schema(False))
    assert all(not isinstance(a, Exception) and a.value["verdict"] == "PASS" for a in answers), answers
    assert server.shed <= 8, server.shed
    figures = c.server.figures()
    assert figures["slowed_down"] >= 1 and figures["typical_at_once"] <= 3


def test_a_slow_server_that_answers_one_at_a_time_is_not_queued_into_timeouts() -> None:
    """12 requests at once to a server that answers one in 0.2 s: with 16 sent at once the last would wait 2.4 s,
    past the 2 s timeout, and be sent again into the same queue; the limit keeps the queue short instead."""
    with FakeChatServer([Reply(GOOD, delay=0.2)], serial=True) as server:
        c = ChatClient(Endpoint(server.base_url, "m", None, timeout_s=2.0, concurrency=16), sleep=time.sleep,
                       servers=ModelServers())
        answers = ask_at_once(c, 12, roles.judge_schema(False))
    assert all(not isinstance(a, Exception) for a in answers), answers
    assert c.usage.retries == 0 and len(server.requests) == 12  # no timeout, no retry
    assert server.max_active <= 6


def test_the_critical_request_goes_before_the_judges_that_queued_first() -> None:
    """Over sockets, one request at a time: three judge requests wait, then a tool answer is asked; when the
    server is free, the tool answer goes first, then the judge's in their order."""
    servers = ModelServers()
    hold = threading.Event()
    with FakeChatServer([Reply(GOOD), Reply(GOOD, hold=hold), Reply(GOOD)], serial=True) as server:
        judge = ChatClient(Endpoint(server.base_url, "m", None, concurrency=1), servers=servers, role="judge")
        tools = ChatClient(Endpoint(server.base_url, "m", None, concurrency=1), servers=servers, role="simulator")
        judge.ask_json(MESSAGES, roles.judge_schema(False), name=roles.JUDGE)  # the form is found: nobody waits for it
        asks = [(judge, DEFERRED, "first")] + [(judge, DEFERRED, f"judge-{i}") for i in (1, 2, 3)] + [
            (tools, CRITICAL, "tool")]
        threads = []
        for c, priority, label in asks:
            messages = [MESSAGES[0], {"role": "user", "content": json.dumps({"label": label})}]
            threads.append(threading.Thread(target=c.ask_json, args=(messages, roles.judge_schema(False)),
                                            kwargs={"name": roles.JUDGE, "priority": priority}))
            threads[-1].start()
            deadline = time.monotonic() + 10
            while len(server.requests) + len(judge.server._waiting) < len(threads) and time.monotonic() < deadline:
                time.sleep(0.005)
        hold.set()
        for t in threads:
            t.join(30)
    served = [json.loads(server.requests[i].json["messages"][1]["content"]).get("label") for i in server.served[1:]]
    assert served == ["first", "tool", "judge-1", "judge-2", "judge-3"]


STATE = json.dumps({"order": {"4521": {"status": "paid", "user_id": "u-1"}, "4522": {"status": "paid"}}})


def rows(count: int) -> List[Dict[str, str]]:
    """Rows whose agent calls a tool no fixture covers (the simulated backend answers), every third a
    conversation (the simulated user answers), some with behavior (instruction_adherence)."""
    out = []
    for i in range(count):
        row = {"user": f"Please change the shipping address of order 452{1 + i % 2} to {i} Main St.", "state": STATE}
        if i % 3 == 2:
            row["turn_mode"] = "model_as_user"
        if i % 2:
            row["behavior"] = "change_shipping_address only succeeds while the order is paid."
        out.append(row)
    return out


def test_every_role_on_one_slow_server_that_answers_one_at_a_time(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    """The issue's case, offline: the judge, the simulated backend and the simulated user all on one server that
    answers one request at a time; 9 rows, 3 at once, 16 judge requests allowed: every row runs and is judged
    (the judge later), the agents' requests go before the judge's, and the report says what the server took."""
    dataset = write_csv(tmp_path / "rows.csv", rows(9))
    with FakeChatServer([Reply(delay=0.05)], serial=True) as server:
        model = ["--judge", "m", "--judge-url", server.base_url, "--judge-key-env", "", "--simulator", "m",
                 "--simulator-url", server.base_url, "--simulator-key-env", "", "--user-model", "m",
                 "--user-url", server.base_url, "--user-key-env", "", "--max-turns", "2"]
        code, text, err = simulate_cli(capsys, "--csv", dataset, "--code", ROOT / "templates" / "openai_chat.py",
                                       "--model", "scripted", "--tools", ROOT / "templates" / "tools_schema.json",
                                       "--no-model-cache", "--jobs", "3", "--judge-jobs", "16", *model,
                                       "--json", tmp_path / "r.json", "--html", tmp_path / "r.html")
        names = [((r.json.get("response_format") or {}).get("json_schema") or {}).get("name")
                 for r in server.requests]
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    runs = report["runs"]
    assert len(runs) == 9 and all(r["status"] == "ok" for r in runs), [r["errors"] for r in runs]
    assert all(r["judge"]["verdict"] in ("PASS", "FAIL") for r in runs), [r["judge"] for r in runs]
    assert [r["judge"]["instruction_adherence"] is not None for r in runs] == [i % 2 == 1 for i in range(9)]
    assert any(c.get("answered_by") == "model" for r in runs for c in r["tool_calls"])
    assert sum(1 for r in runs if r.get("session")) == 3
    assert names.count(roles.JUDGE) == 9 and names.count(roles.TOOL) >= 9 and names.count(roles.USER) >= 3
    (figures,) = report["model_servers"]
    assert figures["roles"] == ["judge", "simulator", "user-model"] and figures["requests"] == len(names)
    assert server.max_active <= figures["max_at_once"] <= 6  # never 16 judge requests queued at the server
    line = report_text.server_text(figures)
    assert f"at most {figures['max_at_once']} at once, typically {figures['typical_at_once']}" in line
    assert line in text and html.escape(line, quote=False) in (tmp_path / "r.html").read_text(encoding="utf-8")
