"""The model servers a run asks: for each, how many requests at once, in what order, and what it took.

One :class:`ModelServers` per run (``simulate`` makes one for its roles; a client made without one shares the
module's :data:`SHARED`), one :class:`Server` per base URL in it, whichever roles and models ask there.  A
server's limit on requests at once adapts to what the server sustains, as TCP's congestion window does (AIMD):

- it starts at 1 and grows by one with each answer to a request that was out while the limit was full (so it
  doubles per round trip) until the server first pushes back, then by one per round trip; a limit never
  reached does not grow;
- it halves on a timeout, a 429, a 503 or any other failure worth a retry (the server is overloaded, or gone);
  it shrinks by one when an answer took far longer than its role's service time (``queueing_bound``; the
  service time is the fastest answer to a request that found no other in flight, else the fastest answer):
  requests are waiting at the server, as they do at a local server that answers one at a time (llama.cpp's,
  Ollama's by default), and a longer queue there only delays the agents' tool answers and ends in timeouts.
  Either cut happens at most once per round trip: an answer to a request sent before the last cut cuts (or
  grows) nothing;
- it never passes the largest bound of the roles asking there (``--judge-jobs`` and the like), and each role
  keeps to its own bound.

Requests wait for a slot in priority order: :data:`CRITICAL` (on an agent's critical path: the simulated
backend's tool answers, the simulated user's turns) before :data:`DEFERRED` (the judge's, which can wait), first
come first served within each.  At a server that takes about one request at a time (its limit is 2 or less, or
an answer has shown requests queueing there, whatever the limit has grown to since) a deferred request also
waits while a critical one is out: it would be served before the agent's next request, which then waits a whole
judge request at the server.  A slow server thus still gets every row run and judged,
the judge later.
:meth:`ModelServers.report` says, per server, how many requests it took at once.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, TypeVar

__all__ = ["CRITICAL", "DEFERRED", "ANSWERED", "OVERLOADED", "OTHER", "queueing_bound", "Lane", "Ticket", "Server",
           "ModelServers", "SHARED"]

CRITICAL = 0
DEFERRED = 1
# How a request ended, for the limit: an answer (its latency counts), a failure that says the server is
# overloaded (a timeout, 429, 503 or another status worth a retry), or anything else (a 400: no signal).
ANSWERED = "answered"
OVERLOADED = "overloaded"
OTHER = "other"

T = TypeVar("T")


def queueing_bound(service_s: float, timeout_s: float) -> float:
    """The latency past which an answer says requests queue at the server: 1.75 times its role's service time
    (a server that answers one at a time takes twice it with one request ahead) and 5 s more than it (a hosted
    API's answers vary that much unqueued), but never past half the timeout."""
    return min(max(1.75 * service_s, service_s + 5.0), timeout_s / 2)


class Lane:
    """One role's requests at a server (one client): its bound, its requests in flight, its service time."""

    __slots__ = ("label", "bound", "timeout_s", "in_flight", "fastest_s", "fastest_alone_s", "requests")

    def __init__(self, label: str, bound: int, timeout_s: float) -> None:
        self.label = label
        self.bound = max(1, bound)
        self.timeout_s = timeout_s
        self.in_flight = 0
        self.fastest_s: Optional[float] = None  # of every answer ...
        self.fastest_alone_s: Optional[float] = None  # ... and of the answers to requests sent with none in flight
        self.requests = 0

    @property
    def service_s(self) -> Optional[float]:
        """How long this role's request takes with nothing ahead of it, as far as is known."""
        return self.fastest_alone_s if self.fastest_alone_s is not None else self.fastest_s

    def answered(self, latency_s: float, alone: bool) -> None:
        self.fastest_s = latency_s if self.fastest_s is None else min(self.fastest_s, latency_s)
        if alone:
            self.fastest_alone_s = latency_s if self.fastest_alone_s is None else min(self.fastest_alone_s, latency_s)



class Ticket(NamedTuple):
    """A granted slot: whose, how urgent, when, in which round of cuts, how many times the limit was full before
    it, and whether it found no other request in flight."""

    lane: Lane
    priority: int
    sent_at: float
    epoch: int
    fills: int
    alone: bool


class _Waiter:
    __slots__ = ("key", "lane", "ticket")

    def __init__(self, key: Any, lane: Lane) -> None:
        self.key = key
        self.lane = lane
        self.ticket: Optional[Ticket] = None


class Server:
    """One server's adaptive limit, its queue of waiting requests, and its figures (see the module docstring)."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.limit = 1.0
        self._threshold = float("inf")  # TCP's ssthresh: below it the limit doubles per round trip
        self._epoch = 0  # counts the cuts
        self._fills = 0  # counts the grants that took the last slot
        self._in_flight = 0
        self._critical = 0  # CRITICAL requests in flight
        self.queues = False  # an answer has shown requests queueing here (a cut by one): a server of one at a time
        self._waiting: List[_Waiter] = []
        self._order = itertools.count()
        self._lanes: List[Lane] = []
        self._ceiling = 1  # the largest bound of the lanes: the limit never passes it
        self._condition = threading.Condition()
        self._clock = clock
        self._since = clock()
        self.max_at_once = 0
        self.cuts = 0
        self._busy_s = 0.0  # time with a request in flight ...
        self._load_s = 0.0  # ... and the integral of requests in flight over it
        self._shared: Dict[Any, Any] = {}

    def lane(self, label: str, bound: int, timeout_s: float) -> Lane:
        """A new lane for one client asking here (``bound``: its role's requests at once)."""
        lane = Lane(label, bound, timeout_s)
        with self._condition:
            self._lanes.append(lane)
            self._ceiling = max(self._ceiling, lane.bound)
        return lane

    def shared(self, key: Any, make: Callable[[], T]) -> T:
        """What the clients asking here share under ``key`` (a model's dialect), made once."""
        with self._condition:
            if key not in self._shared:
                self._shared[key] = make()
            return self._shared[key]  # type: ignore[no-any-return]

    def acquire(self, lane: Lane, priority: int = CRITICAL) -> Ticket:
        """Wait for a slot, in priority order; the slot is the caller's until :meth:`release`."""
        with self._condition:
            waiter = _Waiter((priority, next(self._order)), lane)
            self._waiting.append(waiter)
            self._waiting.sort(key=lambda w: w.key)
            self._grant()
            while waiter.ticket is None:
                self._condition.wait()
            return waiter.ticket

    def release(self, ticket: Ticket, ended: str) -> None:
        """Give the slot back; ``ended`` (``ANSWERED``, ``OVERLOADED``, ``OTHER``) moves the limit."""
        with self._condition:
            now = self._clock()
            self._account(now)
            self._in_flight -= 1
            if ticket.priority == CRITICAL:
                self._critical -= 1
            ticket.lane.in_flight -= 1
            if ended == OVERLOADED:
                self._cut(ticket, halve=True)
            elif ended == ANSWERED:
                latency = now - ticket.sent_at
                service = ticket.lane.service_s
                ticket.lane.answered(latency, ticket.alone)
                if service is not None and latency > queueing_bound(service, ticket.lane.timeout_s):
                    self._cut(ticket, halve=False)
                elif self._fills > ticket.fills and ticket.epoch == self._epoch:  # out while the limit was full
                    self._grow()
            self._grant()

    # -- the parts -----------------------------------------------------------------------------------------------

    def _slots(self) -> int:
        return max(1, min(int(self.limit), self._ceiling))

    def _grant(self) -> None:
        """Slots to waiters, best first; a waiter whose role is at its own bound lets the next one by, and so does
        a deferred one while a critical request is out at a server that takes about one at a time (a limit of 2 or
        less, or requests seen queueing there)."""
        granted = False
        for waiter in list(self._waiting):
            if self._in_flight >= self._slots():
                break
            priority = waiter.key[0]
            if waiter.lane.in_flight >= waiter.lane.bound or (
                    priority != CRITICAL and self._critical and (self._slots() <= 2 or self.queues)):
                continue
            now = self._clock()
            self._account(now)
            self._waiting.remove(waiter)
            self._in_flight += 1
            if priority == CRITICAL:
                self._critical += 1
            waiter.lane.in_flight += 1
            waiter.lane.requests += 1
            self.max_at_once = max(self.max_at_once, self._in_flight)
            waiter.ticket = Ticket(waiter.lane, priority, now, self._epoch, self._fills, self._in_flight == 1)
            if self._in_flight >= self._slots():
                self._fills += 1
            granted = True
        if granted:
            self._condition.notify_all()

    def _grow(self) -> None:
        step = 1.0 if self.limit < self._threshold else 1.0 / self.limit
        self.limit = min(float(self._ceiling), self.limit + step)

    def _cut(self, ticket: Ticket, *, halve: bool) -> None:
        if ticket.epoch != self._epoch:  # sent before the last cut: that cut already answered this round trip
            return
        self._epoch += 1
        self.cuts += 1
        self.queues = self.queues or not halve
        self.limit = max(1.0, float(int(self.limit / 2)) if halve else self.limit - 1.0)
        self._threshold = self.limit

    def _account(self, now: float) -> None:
        """Time with requests in flight, weighted by how many, up to ``now``."""
        if self._in_flight:
            self._busy_s += now - self._since
            self._load_s += (now - self._since) * self._in_flight
        self._since = now

    def figures(self) -> Dict[str, Any]:
        """How many requests this server took, at most and typically at once, and how often it was slowed."""
        with self._condition:
            self._account(self._clock())
            lanes = [lane for lane in self._lanes if lane.requests]
            return {"server": self.name, "roles": sorted({lane.label for lane in lanes}),
                    "requests": sum(lane.requests for lane in lanes), "max_at_once": self.max_at_once,
                    "typical_at_once": round(self._load_s / self._busy_s, 2) if self._busy_s else 0.0,
                    "bound": self._ceiling, "slowed_down": self.cuts}


class ModelServers:
    """The servers of one run, by base URL."""

    def __init__(self) -> None:
        self._servers: Dict[str, Server] = {}
        self._lock = threading.Lock()

    def server(self, base_url: str, name: str) -> Server:
        """The server at ``base_url`` (``name``: how reports show it, no credentials)."""
        key = base_url.rstrip("/")
        with self._lock:
            if key not in self._servers:
                self._servers[key] = Server(name)
            return self._servers[key]

    def report(self) -> List[Dict[str, Any]]:
        """Each server that took a request: :meth:`Server.figures`."""
        with self._lock:
            servers = list(self._servers.values())
        return [figures for figures in (s.figures() for s in servers) if figures["requests"]]


SHARED = ModelServers()
