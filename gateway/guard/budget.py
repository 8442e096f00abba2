"""The retry budget: retries run freely while they recover answers; useless load is bounded.

A retry that comes back clean is the product working: it is never what a budget
should stop. A retry that comes back degenerate (or fails) again is extra load on
vLLM that helped nobody: that is what the budget bounds. So:

* **Recovering** (per backend, and per client): over the recent window, at least
  ``min_recovery_ratio`` of finished retries came back clean, or fewer than
  ``min_failed`` failed. Every degenerate answer is then retried up to
  ``max_attempts``, however many arrive at once.
* **Not recovering** (a backend broken for everyone, or one client whose answers
  no retry fixes): each retry *reserves* one unit of useless load, and gets it back
  if it comes back clean. Reservations in flight plus failed retries in the window
  stay within ``ratio`` x requests in the window + ``min_per_second`` x window.
* **Fair share**: while restricted, one client may hold at most ``client_share`` of
  that allowance, so a noisy client cannot spend the retries of others.

"In the window" is an exponentially decaying count with time constant
``window_s``: O(1) time and memory per key, no buckets, and in a steady state it
equals rate x window. State is bounded: backends are configured, clients are an
LRU of ``max_clients`` entries (a client that falls out starts fresh, i.e.
presumed recovering).

The maths (docs/guard.md, "Retry budget"): with request rate R, a backend broken for
everyone, and allowance A = ratio x R x W + min_per_second x W, useless retries in
flight or failed in the window never exceed A, so the extra upstream request rate
converges to at most ratio x R + min_per_second, plus ``min_failed`` retries per
key while the window learns that retries stopped recovering.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from gateway.config import RetryBudgetSettings


class Refusal(StrEnum):
    """Why a retry was refused (a metric label: a fixed set)."""

    MAX_ATTEMPTS = "max_attempts"
    BUDGET = "budget"
    CLIENT_SHARE = "client_share"


class Decaying:
    """A count that decays with time constant ``tau`` seconds."""

    __slots__ = ("_stamp", "_value", "tau")

    def __init__(self, tau: float) -> None:
        self.tau = tau
        self._value = 0.0
        self._stamp = 0.0

    def value(self, now: float) -> float:
        if self._value and now > self._stamp:
            self._value *= math.exp((self._stamp - now) / self.tau)
            self._stamp = now
        return self._value

    def add(self, amount: float, now: float) -> None:
        self._value = self.value(now) + amount
        self._stamp = now


@dataclass(slots=True)
class Outcomes:
    """Recent retry outcomes of one backend or one client, and its reservations."""

    recovered: Decaying
    failed: Decaying
    #: Restricted retries of this key still waiting for their verdict.
    reserved: int = 0

    @classmethod
    def new(cls, tau: float) -> Outcomes:
        return cls(Decaying(tau), Decaying(tau))

    def recovering(self, settings: RetryBudgetSettings, now: float) -> bool:
        failed = self.failed.value(now)
        if failed < settings.min_failed:
            return True
        recovered = self.recovered.value(now)
        return recovered >= settings.min_recovery_ratio * (recovered + failed)


@dataclass(slots=True)
class RetryTicket:
    """A granted retry; give it back to ``RetryBudget.settle`` with its outcome."""

    backend: str
    client: str
    reserved: bool
    settled: bool = False


class RetryBudget:
    def __init__(
        self,
        settings: RetryBudgetSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.clock = clock
        tau = settings.window_s
        self._requests = Decaying(tau)
        self._useless = Decaying(tau)
        self._reserved = 0
        self._backends: dict[str, Outcomes] = {}
        self._clients: OrderedDict[str, Outcomes] = OrderedDict()

    # -- bookkeeping ----------------------------------------------------------------

    def record_request(self) -> None:
        self._requests.add(1.0, self.clock())

    def _backend(self, name: str) -> Outcomes:
        outcomes = self._backends.get(name)
        if outcomes is None:
            outcomes = self._backends[name] = Outcomes.new(self.settings.window_s)
        return outcomes

    def _client(self, client: str) -> Outcomes:
        outcomes = self._clients.get(client)
        if outcomes is None:
            outcomes = self._clients[client] = Outcomes.new(self.settings.window_s)
            while len(self._clients) > self.settings.max_clients:
                _, evicted = self._clients.popitem(last=False)
                self._reserved -= evicted.reserved  # its tickets settle as unknown
        else:
            self._clients.move_to_end(client)
        return outcomes

    @property
    def reserved(self) -> int:
        """Retries granted against the allowance whose outcome is not in yet."""
        return self._reserved

    def allowance(self) -> float:
        """Useless retries the window may hold while retries are not recovering."""
        s = self.settings
        return s.ratio * self._requests.value(self.clock()) + s.min_per_second * s.window_s

    def recovering(self, backend: str) -> bool:
        return self._backend(backend).recovering(self.settings, self.clock())

    # -- the decision ---------------------------------------------------------------

    def request_retry(self, backend: str, client: str) -> RetryTicket | Refusal:
        """May a degenerate answer from ``backend`` to ``client`` be retried?"""
        now = self.clock()
        by_backend = self._backend(backend)
        by_client = self._client(client)
        if by_backend.recovering(self.settings, now) and by_client.recovering(self.settings, now):
            return RetryTicket(backend, client, reserved=False)
        allowance = self.allowance()
        if self._useless.value(now) + self._reserved + 1 > allowance:
            return Refusal.BUDGET
        client_used = by_client.failed.value(now) + by_client.reserved
        if client_used + 1 > max(1.0, self.settings.client_share * allowance):
            return Refusal.CLIENT_SHARE
        self._reserved += 1
        by_client.reserved += 1
        return RetryTicket(backend, client, reserved=True)

    def settle(self, ticket: RetryTicket, *, recovered: bool | None) -> None:
        """The retry's verdict: clean (``recovered``), degenerate or failed again, or
        unknown (``None``: the client left first; the reservation is returned)."""
        if ticket.settled:
            return
        ticket.settled = True
        now = self.clock()
        by_client = self._clients.get(ticket.client)
        if ticket.reserved and by_client is not None and by_client.reserved > 0:
            by_client.reserved -= 1
            self._reserved -= 1
        if recovered is None:
            return
        for outcomes in (self._backend(ticket.backend), by_client):
            if outcomes is not None:
                (outcomes.recovered if recovered else outcomes.failed).add(1.0, now)
        if not recovered:
            self._useless.add(1.0, now)
