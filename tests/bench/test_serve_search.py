"""``make bench-serve``'s rate search: rising rates, then a bisection between the last sustained rate and the next.
The phases are those of a server that keeps up below a known capacity (the search is under test, not a server)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from persia_core.bench import serve as B


def _fake_phases(monkeypatch, capacity: float) -> list[float]:
    rates: list[float] = []

    def phase(url, rows, rate, per_request, seconds, during=()):
        rates.append(rate)
        ok = rate <= capacity
        return {"rate": rate, "errors": 0, "unanswered": 0 if ok else 3, "p99_ms": 20.0 if ok else 900.0}

    monkeypatch.setattr(B, "phase", phase)
    monkeypatch.setattr(B, "settle", lambda port, timeout_s=30.0: None)
    return rates


@pytest.mark.parametrize(("capacity", "best"), [(170.0, 165.2), (200.0, 195.3), (90.0, 89.4), (50.0, None)])
def test_the_search_bisects_between_the_last_sustained_rate_and_the_next(monkeypatch, capacity, best):
    rates = _fake_phases(monkeypatch, capacity)
    args = SimpleNamespace(start_rate=80.0, phase_seconds=1.0, max_p99_ms=100.0, bisect=2)
    phases: list[dict] = []
    got, failed = B.search_rate("http://x", None, 0, args, phases)
    assert [p["rate"] for p in phases] == rates
    assert (got["rate"] if got else None) == (pytest.approx(best, abs=0.05) if best else None)
    assert failed is not None and failed["rate"] > capacity
    if best is None:  # nothing sustained: no bisection
        assert rates == [80.0]
        return
    ramp = [r for r in rates if r in (80.0, 100.0, 125.0, 156.25, 195.3125, 244.140625)]
    assert len(rates) == len(ramp) + 2  # two bisection phases
    low, high = ramp[-2], ramp[-1]
    mid = round((low * high) ** 0.5, 1)
    assert rates[len(ramp)] == mid
    assert low < mid < high
    assert all(p["rate"] <= capacity for p in phases if B.sustained(p, 100.0))
