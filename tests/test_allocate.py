"""Bit allocator vs exhaustive search on small random problems."""
import itertools
import random

import pytest

from exl_core.errors import InputError
from exl_core.quantize.allocate import allocate, allocate_bpw, bpw_range


def _brute(costs, errors, budget):
    best, arg = float("inf"), None
    for combo in itertools.product(*[range(len(c)) for c in costs]):
        if sum(costs[i][c] for i, c in enumerate(combo)) <= budget:
            e = sum(errors[i][c] for i, c in enumerate(combo))
            if e < best:
                best, arg = e, combo
    return best, arg


@pytest.mark.parametrize("trial", range(30))
def test_allocate_matches_exhaustive_integer_costs(trial):
    rng = random.Random()
    n = rng.randint(1, 5)
    costs = [[rng.randint(1, 40) for _ in range(rng.randint(1, 4))] for _ in range(n)]
    errors = [[rng.random() for _ in c] for c in costs]
    budget = rng.randint(sum(min(c) for c in costs), sum(max(c) for c in costs))
    best, _ = _brute(costs, errors, budget)
    got = allocate(costs, errors, budget)
    assert sum(costs[i][c] for i, c in enumerate(got)) <= budget
    assert sum(errors[i][c] for i, c in enumerate(got)) == pytest.approx(best)


@pytest.mark.parametrize("trial", range(10))
def test_allocate_real_valued_costs_near_optimal(trial):
    # large real costs go through a rounded-up unit: always feasible, at most a hair worse
    rng = random.Random()
    n = 5
    costs = [[rng.uniform(1e5, 9e5) for _ in range(3)] for _ in range(n)]
    errors = [[rng.random() for _ in c] for c in costs]
    budget = rng.uniform(sum(min(c) for c in costs), sum(max(c) for c in costs))
    got = allocate(costs, errors, budget)
    assert sum(costs[i][c] for i, c in enumerate(got)) <= budget
    best, arg = _brute(costs, errors, budget)
    slack = sum(costs[i][c] for i, c in enumerate(arg))
    if slack <= budget * (1 - 5 * n / 50000):   # optimum not on the rounding edge
        assert sum(errors[i][c] for i, c in enumerate(got)) == pytest.approx(best)


def test_allocate_bpw_limits():
    numel = [100, 300]
    costs = [[200, 400, 800], [600, 1200, 2400]]        # 2, 4, 8 bits per weight
    errors = [[0.3, 0.1, 0.01], [0.2, 0.05, 0.001]]
    assert bpw_range(costs, numel) == (2.0, 8.0)
    assert allocate_bpw(costs, errors, numel, 8.0) == [2, 2]
    assert allocate_bpw(costs, errors, numel, 2.0) == [0, 0]
    with pytest.raises(InputError, match="outside"):
        allocate_bpw(costs, errors, numel, 1.5)
    with pytest.raises(InputError, match="outside"):
        allocate_bpw(costs, errors, numel, 9.0)
    with pytest.raises(InputError):
        allocate([[5]], [[0.1]], 4)
