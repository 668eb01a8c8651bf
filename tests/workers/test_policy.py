"""The adaptive batching policy: the cost fit and the size worth waiting for."""

from __future__ import annotations

import pytest

from workers.policy import ArrivalRate, BatchPolicy, CostModel


def test_cost_model_recovers_fixed_and_per_item_cost() -> None:
    model = CostModel()
    for n in (1, 4, 8, 16, 32, 8, 2):
        model.observe(n, 0.020 + 0.003 * n)
    a, b = model.coefficients()
    assert a == pytest.approx(0.020, rel=1e-6)
    assert b == pytest.approx(0.003, rel=1e-6)


def test_cost_model_follows_drift() -> None:
    model = CostModel(decay=0.5)
    for n in (1, 8) * 5:
        model.observe(n, 0.010 + 0.001 * n)
    for n in (1, 8) * 10:
        model.observe(n, 0.050 + 0.004 * n)  # the model got slower (e.g. a busier GPU)
    a, b = model.coefficients()
    assert a == pytest.approx(0.050, rel=0.05)
    assert b == pytest.approx(0.004, rel=0.05)


def test_one_batch_size_seen_counts_all_cost_as_fixed() -> None:
    model = CostModel()
    model.observe(1, 0.010)
    model.observe(1, 0.012)
    a, b = model.coefficients()
    assert a == pytest.approx(0.011, rel=0.01)
    assert b == 0.0


def policy_with(a: float, b: float, rate: float, max_batch: int = 32) -> BatchPolicy:
    policy = BatchPolicy(max_batch)
    for n in (1, 2, 4, 8, 16):
        policy.cost.observe(n, a + b * n)
    for i in range(int(rate * 2)):  # `rate` arrivals per second over the 2 s horizon
        policy.arrivals.observe(100.0 - i / rate)
    return policy


def test_light_load_goes_with_one_item() -> None:
    policy = policy_with(a=0.020, b=0.002, rate=10)  # 10/s; one item per 22 ms keeps up
    assert policy.target(100.0) == 1
    assert policy.go_now(1, 100.0)


def test_heavy_load_fills_to_the_size_that_keeps_up() -> None:
    policy = policy_with(a=0.020, b=0.002, rate=200)
    # keeps up at n = 200*0.02 / (1 - 200*0.002) = 6.7, with 25 % headroom -> 9
    assert policy.target(100.0) == 9
    assert not policy.go_now(4, 100.0)
    assert policy.go_now(9, 100.0)


def test_overload_fills_whole_batches() -> None:
    policy = policy_with(a=0.020, b=0.002, rate=600)  # 600 * 0.002 >= 1
    assert policy.target(100.0) == 32
    assert policy.go_now(32, 100.0)


def test_unknown_cost_or_no_arrivals_never_waits() -> None:
    assert BatchPolicy(32).target(0.0) == 1
    assert policy_with(a=0.02, b=0.002, rate=200).target(1000.0) == 1  # arrivals long gone


def test_arrival_rate_forgets_old_arrivals() -> None:
    rate = ArrivalRate(horizon_s=1.0)
    for i in range(10):
        rate.observe(5.0 + i * 0.1)
    assert rate.rate(5.95) == pytest.approx(10.0)
    assert rate.rate(7.0) == 0.0
