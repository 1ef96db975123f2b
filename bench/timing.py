"""Timing helpers shared by the benchmark scripts (imported as `timing`: each script runs
with bench/ first on sys.path)."""

import statistics
import time

import jax
import jax.numpy as jnp


def median_time(fn, warmup, reps):
    """Median seconds of fn() over reps calls after warmup calls; fn blocks until done."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(warmup, reps):
    """Bytes/s of a jitted read-and-write of 4 GiB: the measured memory ceiling."""
    big = jnp.ones((1 << 30,), jnp.float32)
    scale = jax.jit(lambda v: v * 2)
    return 2 * big.nbytes / median_time(lambda: scale(big).block_until_ready(), warmup, reps)


def add_loop_arguments(parser):
    """The options of a benchmark that times a kernel in a loop over a decode step's layers,
    compiled as one CUDA graph (bench/norm_matmul.py, bench/step.py)."""
    parser.add_argument("--layers", type=int, default=48,
                        help="layers a pass, each with its own weights or state")
    parser.add_argument("--repeats", type=int, default=10, help="passes a timed call")
    parser.add_argument("--reps", type=int, default=10, help="timed calls (the median)")
