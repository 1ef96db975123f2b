"""tests/seeds.py: a fresh seed a draw, recorded in order, and replayed from
MAMBA_JAX_TEST_SEEDS (which a failed test's report names)."""

import numpy as np

import seeds
from seeds import fresh_rng


def test_fresh_draws_are_recorded_and_replayed_in_order(monkeypatch):
    monkeypatch.delenv("MAMBA_JAX_TEST_SEEDS", raising=False)
    seeds.start()
    a, b = (fresh_rng().integers(0, 2**62, 4) for _ in range(2))
    first = list(seeds.drawn)
    assert len(first) == 2 and first[0] != first[1] and not np.array_equal(a, b)
    monkeypatch.setenv("MAMBA_JAX_TEST_SEEDS", ",".join(map(str, first)))
    seeds.start()
    assert seeds.drawn == []
    np.testing.assert_array_equal(fresh_rng().integers(0, 2**62, 4), a)
    np.testing.assert_array_equal(fresh_rng().integers(0, 2**62, 4), b)
    assert seeds.drawn == first
