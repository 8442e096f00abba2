"""The retry budget: unlimited while retries recover, bounded when they do not, fair."""

from __future__ import annotations

from gateway.config import RetryBudgetSettings
from gateway.guard.budget import Refusal, RetryBudget, RetryTicket


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def budget(**settings: float) -> tuple[RetryBudget, Clock]:
    clock = Clock()
    return RetryBudget(RetryBudgetSettings(**settings), clock), clock  # type: ignore[arg-type]


def test_a_burst_of_degenerate_answers_is_retried_whole_while_retries_recover() -> None:
    """77 degenerate answers at once (one poisoned prefix chain): every one retried."""
    b, _ = budget()
    for _ in range(77):
        b.record_request()
    tickets = [b.request_retry("vllm", f"client-{i % 3}") for i in range(77)]
    assert all(isinstance(t, RetryTicket) for t in tickets)
    for t in tickets:
        assert isinstance(t, RetryTicket)
        b.settle(t, recovered=True)
    # ...and heavy corruption that retries keep fixing never turns it off.
    for _ in range(2000):
        b.record_request()
        t = b.request_retry("vllm", "c")
        assert isinstance(t, RetryTicket)
        b.settle(t, recovered=True)


def test_when_retries_stop_recovering_useless_load_is_bounded() -> None:
    b, clock = budget(ratio=0.1, min_per_second=0.5, window_s=10, min_failed=3)
    granted = 0
    for second in range(120):  # a backend broken for everyone, 10 requests a second
        clock.now += 1
        for i in range(10):
            b.record_request()
            t = b.request_retry("vllm", f"client-{second}-{i}")
            if isinstance(t, RetryTicket):
                granted += 1
                b.settle(t, recovered=False)
    # Steady state: ratio x 10/s + 0.5/s = 1.5 useless retries a second, plus the
    # few the window needed to learn. Without the budget: 1,200.
    assert 1.5 * 120 * 0.8 <= granted <= 1.5 * 120 + 10


def test_reservations_bound_retries_in_flight_too() -> None:
    """Retries granted while restricted hold their unit until they settle."""
    b, _ = budget(ratio=0.0, min_per_second=0.5, window_s=10, min_failed=1)
    t = b.request_retry("vllm", "a")
    assert isinstance(t, RetryTicket)
    b.settle(t, recovered=False)  # now not recovering
    held = [b.request_retry("vllm", f"c{i}") for i in range(20)]
    in_flight = [t for t in held if isinstance(t, RetryTicket)]
    assert len(in_flight) == 4  # 0.5 x 10 = 5 units, one already failed
    assert Refusal.BUDGET in held
    for t in in_flight:
        b.settle(t, recovered=True)  # clean retries give their unit back
    assert isinstance(b.request_retry("vllm", "late"), RetryTicket)


def test_one_noisy_client_cannot_spend_the_share_of_others() -> None:
    """40 hopeless answers from one client in 0.1 s; another client's corrupt answer
    is still retried."""
    b, _ = budget()
    for _ in range(41):
        b.record_request()
    refused = 0
    for _ in range(40):
        t = b.request_retry("vllm", "noisy")
        if isinstance(t, RetryTicket):
            b.settle(t, recovered=False)
        else:
            assert t is Refusal.CLIENT_SHARE
            refused += 1
    assert refused > 30
    assert isinstance(b.request_retry("vllm", "quiet"), RetryTicket)


def test_a_client_whose_retries_never_recover_is_bounded_alone() -> None:
    b, _ = budget(min_failed=3)
    for _ in range(200):
        b.record_request()
    for _ in range(100):
        t = b.request_retry("vllm", "hopeless")
        if isinstance(t, RetryTicket):
            b.settle(t, recovered=False)
        good = b.request_retry("vllm", "other")
        assert isinstance(good, RetryTicket)
        b.settle(good, recovered=True)
    assert b.recovering("vllm")  # the backend still recovers for the others
    assert not isinstance(b.request_retry("vllm", "hopeless"), RetryTicket)


def test_recovery_is_judged_per_backend() -> None:
    b, _ = budget(ratio=0.0, min_per_second=0.1, min_failed=2)
    for _ in range(5):
        t = b.request_retry("broken", "c")
        if isinstance(t, RetryTicket):
            b.settle(t, recovered=False)
    assert not b.recovering("broken")
    assert b.recovering("healthy")
    assert isinstance(b.request_retry("healthy", "d"), RetryTicket)


def test_the_window_forgets() -> None:
    b, clock = budget(ratio=0.0, min_per_second=0.1, window_s=10, min_failed=2)
    for _ in range(3):
        t = b.request_retry("vllm", "c")
        if isinstance(t, RetryTicket):
            b.settle(t, recovered=False)
    assert not b.recovering("vllm")
    clock.now += 60  # six time constants: the failures have decayed away
    assert b.recovering("vllm")


def test_client_state_is_bounded() -> None:
    b, _ = budget(max_clients=10)
    for i in range(1000):
        t = b.request_retry("vllm", f"client-{i}")
        assert isinstance(t, RetryTicket)
        b.settle(t, recovered=True)
    assert len(b._clients) == 10


def test_unknown_outcome_returns_the_reservation_without_judging() -> None:
    b, _ = budget(ratio=0.0, min_per_second=0.1, window_s=10, min_failed=1)
    first = b.request_retry("vllm", "a")
    assert isinstance(first, RetryTicket)
    b.settle(first, recovered=False)
    t = b.request_retry("vllm", "b")
    assert t is Refusal.BUDGET  # 0.1 x 10 = 1 unit, taken by the failure
    b2, _ = budget(ratio=0.0, min_per_second=0.2, window_s=10, min_failed=1)
    first = b2.request_retry("vllm", "a")
    assert isinstance(first, RetryTicket)
    b2.settle(first, recovered=False)
    t = b2.request_retry("vllm", "b")
    assert isinstance(t, RetryTicket)
    assert t.reserved
    b2.settle(t, recovered=None)
    b2.settle(t, recovered=False)  # settling twice does nothing
    assert b2._reserved == 0
    assert isinstance(b2.request_retry("vllm", "c"), RetryTicket)
