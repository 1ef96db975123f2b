"""What every benchmark script shares: timing, the copy-bandwidth floor, checking a kernel
against its reference, running a script's part in a child process pinned to GPUs, and the
markdown table that each script prints.

A child process reports to its parent by printing `RESULT {json}` lines (result), which
run_module parses; it is started as `python -m bench.<module>` with the repository on
PYTHONPATH, so it imports what its parent imports from any working directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ssd.step import INT8_LEVELS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


# ---- timing ----

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


def forward_and_backward(f):
    """jit of (*args, dy) -> (f(*args), the gradients of <f(*args), dy> for every arg): a
    forward and backward as a training step runs them. The output is returned, so its
    forward is computed (XLA drops the work of an output nobody reads: with only the
    gradients returned, the SSD's forward kernel was not run at all), and dy is an argument,
    not a constant the compiler could fold into the backward."""
    def run(*args):
        *args, dy = args
        y, pullback = jax.vjp(f, *args)
        return y, pullback(dy)
    return jax.jit(run)


def copy_bandwidth(warmup, reps):
    """Bytes/s of a jitted read-and-write of 4 GiB: the measured memory ceiling."""
    big = jnp.ones((1 << 30,), jnp.float32)
    scale = jax.jit(lambda v: v * 2)
    return 2 * big.nbytes / median_time(lambda: scale(big).block_until_ready(), warmup, reps)


# ---- our kernels against their references ----

# check_kernel's tolerances: one bf16 ulp, where float32 sums in another order round to the
# neighbour; where an int8 state is compared, a value may also round to its neighbour, one
# step of 1/127 of its row's largest.
BF16_TOLERANCE = 2.0 ** -8
INT8_TOLERANCE = 1 / INT8_LEVELS + BF16_TOLERANCE


def check_kernel(label, f, kwargs, tolerance=BF16_TOLERANCE):
    """f(**kwargs, implementation="triton") on the default device against
    f(**kwargs, implementation="xla") on the CPU: prints the worst difference over the
    largest value of any output, exits on one over `tolerance` (default one bf16 ulp, where
    float32 sums in another order round to the neighbour), and returns it. kwargs: arrays,
    pytrees of them (an Int8State) and None are the jitted arguments, the rest static. The
    reference runs on the CPU because XLA's GPU fusions may skip the model's bf16 roundings
    (xla_allow_excess_precision), which alone moves the SSM update by about 2e-3 relative."""
    cpu = jax.devices("cpu")[0]
    args = {k: v for k, v in kwargs.items() if v is None or jax.tree.leaves(v) and all(
        isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(v))}
    static = {k: v for k, v in kwargs.items() if k not in args}
    ours = jax.jit(lambda a: f(**a, **static, implementation="triton"))(args)
    with jax.default_device(cpu):
        ref = jax.jit(lambda a: f(**a, **static, implementation="xla"))(
            jax.device_put(args, cpu))
    err = max(float(np.abs(np.asarray(o, np.float64) - np.asarray(r, np.float64)).max()
                    / np.abs(np.asarray(r, np.float64)).max())
              for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)))
    print(f"check {label}: worst error relative to the largest value {err:.1e}", flush=True)
    if not err <= tolerance:  # NaN fails too
        raise SystemExit(f"CHECK FAILED: {label}: {err:.2e}")
    return err


def to_torch(a):
    """A JAX array on the GPU as torch's, bfloat16 staying bfloat16, other floats float32."""
    import torch
    dtype = torch.bfloat16 if a.dtype == jnp.bfloat16 else torch.float32
    return torch.from_numpy(np.array(a, np.float32)).to(device="cuda", dtype=dtype)


def time_passes(forward, both, inputs, dy, theirs, warmup, reps):
    """Seconds of a forward pass and of a forward+backward pass (median_time), each as a list
    [ours "triton", ours "xla", theirs]: forward[impl](*inputs), both[impl](*inputs, dy)
    (forward_and_backward's), theirs(grad) a torch call (without grad under no_grad),
    synchronised."""
    import torch

    def run(fn):
        return median_time(fn, warmup, reps)
    sync = lambda fn: lambda: (fn(), torch.cuda.synchronize())
    with torch.no_grad():
        theirs_forward = run(sync(lambda: theirs(False)))
    ours = ("triton", "xla")
    return {"fwd": [run(lambda f=forward[i]: jax.block_until_ready(f(*inputs))) for i in ours]
            + [theirs_forward],
            "fwd+bwd": [run(lambda f=both[i]: jax.block_until_ready(f(*inputs, dy)))
                        for i in ours] + [run(sync(lambda: theirs(True)))]}


def print_versus_table(labels, theirs_name, rows, versus, copy_rate):
    """The table of a layer operation's passes: rows of (the `labels` columns' cells, the
    pass, ours, our XLA path's and theirs seconds, the floor's seconds), after the device
    line and versus.line (bench.baseline.Comparison)."""
    import torch
    print(f"\n{device_line()}, torch {torch.__version__}; copy bandwidth "
          f"{copy_rate / 1e12:.2f} TB/s")
    print(versus.line)
    print(table_header([*labels, "pass", "ours ms", "ours xla ms", f"{theirs_name} ms",
                        "ours/theirs", "floor ms", "ours/floor"]))
    for *cells, pass_, ours, xla, theirs, floor in rows:
        print(table_row([*cells, pass_, f"{ours * 1e3:.3f}", f"{xla * 1e3:.3f}",
                         f"{theirs * 1e3:.3f}", versus.ratio(ours, theirs),
                         f"{floor * 1e3:.3f}", f"{ours / floor:.2f}x"]))


def layer_op_arguments(doc, use):
    """The arguments of a script that times one of a Mamba layer's operations (bench.conv,
    bench.norm) against mamba_ssm's (`use`, a key of bench.baseline.USES): the presets whose
    shapes it takes, batch x seqlen shapes, warm-up and timed calls."""
    from bench import baseline
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    baseline.add_arguments(parser, use)
    parser.add_argument("--presets", nargs="+", default=["mamba2-370m", "mamba2-1.3b"])
    parser.add_argument("--shapes", nargs="+", default=["20x2048"], help="batch x seqlen")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    return parser


def check_outputs(label, ours, reference, tolerance: dict):
    """ours and reference: lists of arrays in the order of tolerance's names. Prints each
    one's largest difference over the reference's largest value; exits on one over its
    tolerance (NaN too)."""
    errors = {name: float(np.abs(np.asarray(o, np.float32) - np.asarray(r, np.float32)).max()
                          / np.abs(np.asarray(r, np.float32)).max())
              for name, o, r in zip(tolerance, ours, reference)}
    print(f"check {label}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()),
          flush=True)
    missed = {k: v for k, v in errors.items() if not v <= tolerance[k]}
    if missed:
        raise SystemExit(f"CHECK FAILED: {label}: {missed} over {tolerance}")


# ---- sweeping a kernel's tiles (bench.norm_matmul, bench.step) ----

def sweep_parser(doc, blocks, batch):
    """The options of a benchmark (its docstring `doc`) that sweeps a kernel's tiles
    (`blocks`, the kernel module's Blocks dataclass) over presets at --batch (default
    `batch`), timing each in a loop over a decode step's layers compiled as one CUDA
    graph."""
    fields = ",".join(field.name for field in dataclasses.fields(blocks))
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--presets", default="mamba2-370m,mamba2-1.3b")
    parser.add_argument("--blocks", nargs="*", default=[""],
                        help=f"{blocks.__module__}.Blocks as '{fields}'; '' the default")
    parser.add_argument("--layers", type=int, default=48,
                        help="layers a pass, each with its own weights or state")
    parser.add_argument("--repeats", type=int, default=10, help="passes a timed call")
    parser.add_argument("--reps", type=int, default=10, help="timed calls (the median)")
    return parser


def parse_blocks(blocks, text):
    """One --blocks value: `blocks` (the dataclass) from its comma-separated ints; '' or
    'auto' its defaults."""
    if text in ("", "auto"):
        return blocks()
    return blocks(*(int(v) for v in text.split(",")))


def sweep_blocks(blocks, texts, label, kernel, inputs, time_kernel, xla_seconds,
                 tolerance=BF16_TOLERANCE):
    """For each --blocks text: `kernel` with those tiles (`blocks`, the kernel module's Blocks
    dataclass) checked on `inputs` against its reference (check_kernel, within tolerance),
    then timed by time_kernel(blocks) -> seconds; prints each against xla_seconds and returns
    [(text or 'auto', seconds)]."""
    timed = []
    for text in texts:
        tiles = parse_blocks(blocks, text)
        name = f"{label} blocks {text or 'auto'}"
        check_kernel(name, functools.partial(kernel, blocks=tiles), inputs, tolerance)
        seconds = time_kernel(tiles)
        print(f"{name}: {seconds * 1e6:.1f} us, xla {xla_seconds * 1e6:.1f} us", flush=True)
        timed.append((text or "auto", seconds))
    return timed


def print_sweep(setting, labels, moved, rows, copy_rate):
    """A sweep's table, after a line of the device and `setting`: per row its `labels`
    columns, then microseconds of the kernel (ours) and of our XLA path, their ratio, the
    kernel's rate in GB/s (column `moved`) of the bytes each call must move, and that rate
    over the measured copy bandwidth for both: the floor. rows: (*labels, ours s, xla s,
    bytes)."""
    print(f"\n{device_line()}, {setting}; copy bandwidth {copy_rate / 1e12:.2f} TB/s")
    print(table_header((*labels, "ours us", "xla us", "ours/xla", moved, "ours/copy",
                        "xla/copy")))
    for *label, ours, xla, moved_bytes in rows:
        print(table_row((*label, f"{ours * 1e6:.1f}", f"{xla * 1e6:.1f}", f"{ours / xla:.2f}x",
                         f"{moved_bytes / ours / 1e9:.0f}",
                         f"{moved_bytes / ours / copy_rate:.0%}",
                         f"{moved_bytes / xla / copy_rate:.0%}")))


# ---- child processes ----

def gpu_count() -> int:
    """How many GPUs this process may use: its CUDA_VISIBLE_DEVICES, else nvidia-smi's list
    (0 where there is none)."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if seen:
        return len(seen.split(","))
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return 0
    return sum(line.startswith("GPU ") for line in listed.splitlines())


def gpus(count: int, skip: int = 0) -> str:
    """CUDA_VISIBLE_DEVICES for a child: GPUs skip..skip+count-1 of those this process sees
    (its own CUDA_VISIBLE_DEVICES, if set), so that two runs of a script can share a host."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = seen.split(",") if seen else [str(i) for i in range(skip + count)]
    if len(seen) < skip + count:
        raise SystemExit(f"needs {skip + count} GPUs; CUDA_VISIBLE_DEVICES={seen} has "
                         f"{len(seen)}")
    return ",".join(seen[skip:skip + count])


def result(value: dict):
    """Report value to the parent process (run_module reads it back)."""
    print("RESULT " + json.dumps(value), flush=True)


def child_environment(env: dict | None = None) -> dict:
    """The environment of a `python -m bench.<module>` child: ours, with env's variables and
    the repository first on PYTHONPATH, less JAX_COMPILATION_CACHE_DIR: a child compiles
    cold, so the compile and first-step times it reports are what a first run pays."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    environ = dict(os.environ, **(env or {}), PYTHONPATH=path)
    environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    return environ


def with_cublas_gemms(flags: str) -> str:
    """XLA flags with `--xla_gpu_enable_triton_gemm=false` added unless they name that flag:
    for a script's XLA programs, cuBLAS's GEMMs as the train step compiles with
    (mamba_jax.optim.TRAIN_COMPILER_OPTIONS; the autotuning of XLA's Triton GEMMs dominated
    compile times)."""
    if "xla_gpu_enable_triton_gemm" in flags:
        return flags
    return (flags + " --xla_gpu_enable_triton_gemm=false").strip()


def use_cublas_gemms():
    """with_cublas_gemms for this process: call it before jax starts its backends (its first
    device or computation), which read XLA_FLAGS then."""
    os.environ["XLA_FLAGS"] = with_cublas_gemms(os.environ.get("XLA_FLAGS", ""))


def run_module(module: str, argv: list[str], *, visible: str | None = None,
               env: dict | None = None, timeout: float | None = None) -> list[dict]:
    """Run `python -m bench.<module> *argv` in a child process and return what it reported
    (result), with {"error": ...} appended where it exited non-zero, reported nothing or ran
    past timeout seconds. visible: the child's CUDA_VISIBLE_DEVICES (gpus()); env: more
    variables for it. Its stderr lines that start with two spaces (progress, and a
    traceback's frames) pass on to ours."""
    environ = child_environment(env)
    if visible is not None:
        environ["CUDA_VISIBLE_DEVICES"] = visible
    cmd = [sys.executable, "-m", f"bench.{module}", *argv]
    try:
        run = subprocess.run(cmd, env=environ, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        err = expired.stderr or b""
        sys.stderr.write(err.decode() if isinstance(err, bytes) else err)
        return [{"error": f"timed out after {timeout:.0f} s"}]
    sys.stderr.write("".join(line + "\n" for line in run.stderr.splitlines()
                             if line.startswith("  ")))
    results = [json.loads(line[7:]) for line in run.stdout.splitlines()
               if line.startswith("RESULT ")]
    if run.returncode or not results:
        tail = run.stderr.strip().splitlines()[-3:]
        results.append({"error": f"exit {run.returncode}: " + " | ".join(tail)[-600:]})
    return results


# ---- the table ----

def device_line() -> str:
    """'<date> <device>, jax <version>': the first words of a table's header."""
    return f"{datetime.date.today()} {jax.devices()[0].device_kind}, jax {jax.__version__}"


def table_header(columns) -> str:
    """A markdown table's header line and its rule."""
    return "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)


def table_row(cells) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(cell) for cell in cells) + " |"
