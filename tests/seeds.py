"""Fresh random inputs for the kernel tests, each one reproducible: fresh_rng() draws a new
seed a call, tests/conftest.py names the seeds of a failed test in its report, and
MAMBA_JAX_TEST_SEEDS=A,B,... (that list) gives its draws those seeds again, in order."""

import os

import numpy as np

drawn: list[int] = []  # the running test's seeds, in the order it drew them
_replay: list[int] = []


def start() -> None:
    """A test begins: no seed drawn yet, MAMBA_JAX_TEST_SEEDS's to replay."""
    drawn.clear()
    given = os.environ.get("MAMBA_JAX_TEST_SEEDS", "")
    _replay[:] = [int(s) for s in given.split(",") if s.strip()]


def fresh_rng() -> np.random.Generator:
    """A Generator of a seed drawn now (or the next one to replay)."""
    seed = _replay.pop(0) if _replay else int(np.random.SeedSequence().entropy % 2**63)
    drawn.append(seed)
    return np.random.default_rng(seed)
