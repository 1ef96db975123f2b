"""Timing helpers shared by the benchmark scripts (imported as `timing`: each script runs
with bench/ first on sys.path)."""

import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp

from checks import check_kernel


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


def add_sweep_arguments(parser, blocks):
    """The options of a benchmark that sweeps a kernel's tiles (`blocks`, the kernel module's
    Blocks dataclass) over presets, timing each in a loop over a decode step's layers
    compiled as one CUDA graph (bench/norm_matmul.py, bench/step.py)."""
    fields = ",".join(field.name for field in dataclasses.fields(blocks))
    parser.add_argument("--presets", default="mamba2-370m,mamba2-1.3b")
    parser.add_argument("--blocks", nargs="*", default=[""],
                        help=f"{blocks.__module__}.Blocks as '{fields}'; '' the default")
    parser.add_argument("--layers", type=int, default=48,
                        help="layers a pass, each with its own weights or state")
    parser.add_argument("--repeats", type=int, default=10, help="passes a timed call")
    parser.add_argument("--reps", type=int, default=10, help="timed calls (the median)")


def parse_blocks(blocks, text):
    """One --blocks value: `blocks` (the dataclass) from its comma-separated ints; '' or
    'auto' its defaults."""
    if text in ("", "auto"):
        return blocks()
    return blocks(*(int(v) for v in text.split(",")))


def sweep_blocks(blocks, texts, label, kernel, inputs, time_kernel, xla_seconds):
    """For each --blocks text: `kernel` with those tiles (`blocks`, the kernel module's Blocks
    dataclass) checked on `inputs` against its reference (checks.check_kernel), then timed by
    time_kernel(blocks) -> seconds; prints each against xla_seconds and returns
    [(text or 'auto', seconds)]."""
    timed = []
    for text in texts:
        tiles = parse_blocks(blocks, text)
        name = f"{label} blocks {text or 'auto'}"
        check_kernel(name, functools.partial(kernel, blocks=tiles), inputs)
        seconds = time_kernel(tiles)
        print(f"{name}: {seconds * 1e6:.1f} us, xla {xla_seconds * 1e6:.1f} us", flush=True)
        timed.append((text or "auto", seconds))
    return timed
