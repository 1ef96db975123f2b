"""SSD scan on a GPU: our Pallas kernels and our XLA path against mamba_ssm's Triton kernels.

    python3 -m bench.ssd [--baseline .baseline] [--warmup 5] [--reps 30]
                         [--float32-states] [--segments N [N ...]]
                         [--groups 1 8] [--shapes 8x2048 8x8192 1x65536]
    python3 -m bench.ssd --breakdown [CONFIG ...] [--shapes ...]

(Device run: PYTHONUNBUFFERED=1 python3 -m bench.ssd 2>&1 | tee $OUT/log, carrying .baseline;
a filter between python and tee must be line-buffered, or a timed-out run returns nothing.)

Checks first, failing loudly: on fresh random inputs our kernels' values and every gradient
against the naive recurrence in float64, and mamba_ssm's outputs against ours. Then one
table: per shape, forward and forward+backward time of each implementation, ours/theirs,
achieved TFLOP/s and the floor; then peak temporary memory of forward+backward. Our kernels'
column is `ssd()` with its defaults (so `segments="auto"`: 8 parts at batch 1 x 65536).
Variants of them get a column each (time and its ratio to theirs), checked against
mamba_ssm like the default: --float32-states (the per-chunk states in float32, the default before
BENCHMARKS.md's measurement) and --segments N (each row scanned in N parts at once,
`ssd(segments=N)`). --groups and --shapes take a part of the table (a whole run takes
over 10 minutes: a device call can hold only part of it).

--breakdown CONFIG...: instead of the table, for each of --shapes (g=1) and each kernel
config (`triton.Config` fields as 'backward_bc_heads=16,chunk=32'; '' is the default), each
pallas_call timed alone and the whole forward+backward, after checking every config against
the naive recurrence in bf16 (what it times). It needs no mamba_ssm.

Timing: each implementation is one call (a jitted function for JAX; the autograd function
for mamba_ssm), timed by the host clock from the call until its results are ready on the
device (`block_until_ready`, `torch.cuda.synchronize`): what a training step pays,
launches and host overhead included. Median of --reps calls after --warmup calls. Our
forward+backward returns y with the gradients (harness.forward_and_backward), as mamba_ssm's
computes y before its backward: returning the gradients alone let XLA drop our forward
kernel.

mamba_ssm is not a dependency: its pure-Python Triton ops are imported from the folder
--baseline (bench.baseline), with the package's __init__ bypassed so that none of its
compiled extensions is needed. mamba_chunk_scan_combined calls no causal_conv1d: it is the
SSD of both Mamba2 training paths, so the table's ratios stand with or without that
extension (the header names the path).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp
import numpy as np

from bench import baseline
from bench.harness import (copy_bandwidth, device_line, forward_and_backward, median_time,
                           table_header, table_row, to_torch)
from pallas_kernels.ssd import ssd
from pallas_kernels.ssd import reference, triton as kernels, vjp

SHAPES = [(8, 2048), (8, 8192), (1, 65536)]  # (batch, seqlen)
H, P, N, CHUNK = 64, 64, 128, 256


def make_inputs(rng, b, l, g, dtype, docs=False, state=False):
    arr = lambda *s, dt=jnp.float32: jnp.asarray(rng.standard_normal(s), dt)
    inputs = dict(x=arr(b, l, H, P, dt=dtype), dt=arr(b, l, H) - 2.0,
                  A=-jnp.asarray(rng.uniform(1, 16, H), jnp.float32),
                  B=arr(b, l, g, N, dt=dtype), C=arr(b, l, g, N, dt=dtype))
    options = dict(D=arr(H), dt_bias=0.5 * arr(H))
    if state:
        options["initial_state"] = arr(b, H, P, N)
    if docs:
        options["seq_idx"] = jnp.asarray(np.sort(rng.integers(0, 4, (b, l)), axis=1), jnp.int32)
    return inputs, options


def loss_and_grads(fn, inputs, options, wy, ws):
    """Values and gradients of <y, wy> + <final_state, ws> w.r.t. every float input."""
    names = ["x", "dt", "A", "B", "C", "D", "dt_bias"] + (
        ["initial_state"] if "initial_state" in options else [])
    args = {**inputs, **options}

    def loss(diff):
        y, s = fn(**{**args, **diff}, dt_softplus=True)
        return jnp.vdot(y.astype(wy.dtype), wy) + jnp.vdot(s.astype(ws.dtype), ws), (y, s)

    (_, (y, s)), grads = jax.value_and_grad(loss, has_aux=True)({k: args[k] for k in names})
    return y, s, grads


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_against_naive(rng, configs=(kernels.Config(),),
                        dtypes=(jnp.float32, jnp.bfloat16)):
    """Our kernels (each config) vs the float64 naive recurrence; raises on any miss."""
    # float32: IEEE float32 dots, sums over up to 1000 steps; bf16: bf16 matmul operands.
    tolerances = {jnp.float32: 3e-4, jnp.bfloat16: 3e-2}
    cases = [(2, 1000, 1, False, True), (2, 777, 8, True, True), (1, 300, 2, True, False)]
    for dtype in dtypes:
        tol = tolerances[dtype]
        for b, l, g, docs, state in cases:
            inputs, options = make_inputs(rng, b, l, g, dtype, docs, state)
            wy, ws = rng.standard_normal((b, l, H, P)), rng.standard_normal((b, H, P, N))
            with jax.enable_x64(True):
                up = lambda t: jax.tree.map(lambda a: a.astype(jnp.float64)
                                            if jnp.issubdtype(a.dtype, jnp.floating) else a, t)
                naive = loss_and_grads(reference.ssd_naive, up(inputs), up(options),
                                       jnp.asarray(wy), jnp.asarray(ws))
            weights = jnp.asarray(wy, jnp.float32), jnp.asarray(ws, jnp.float32)
            for config in configs:
                ours = jax.jit(lambda i, o: loss_and_grads(
                    lambda **a: vjp.ssd(backend=kernels, config=config, **a), i, o,
                    *weights))(inputs, options)
                errors = {"y": rel_err(ours[0], naive[0]),
                          "final_state": rel_err(ours[1], naive[1])}
                errors.update({f"d{k}": rel_err(ours[2][k], naive[2][k]) for k in naive[2]})
                worst = max(errors.values())
                print(f"check {jnp.dtype(dtype).name} b={b} l={l} g={g} docs={docs} "
                      f"state={state} {describe(config)}: worst rel err {worst:.2e} "
                      f"(tol {tol:.0e})", flush=True)
                if not worst < tol:  # NaN fails too
                    raise SystemExit(f"CHECK FAILED ({config}): {errors}")


def flops(b, l, g):
    """Matmul FLOPs of the chunked algorithm at chunk 256, forward (C B^T per group; per
    head scores x, states B^T x, read-out C state); backward counted as twice forward."""
    c = -(-l // CHUNK)
    return b * c * (g * 2 * CHUNK * CHUNK * N + H * (2 * CHUNK * CHUNK * P + 4 * CHUNK * P * N))


def io_bytes(b, l, g, backward):
    """Fewest bytes: read x, B, C, dt, write y; backward also reads dy, writes the grads."""
    xb, bcb, dtb = b * l * H * P * 2, b * l * g * N * 2, b * l * H * 4
    fwd = 2 * xb + 2 * bcb + dtb
    return fwd + (3 * xb + 4 * bcb + 2 * dtb if backward else 0)


def measure_ceilings():
    a = jnp.asarray(np.random.default_rng(0).standard_normal((8192, 8192)), jnp.bfloat16)
    mm = jax.jit(lambda a: a @ a)
    matmul = 2 * 8192 ** 3 / median_time(lambda: mm(a).block_until_ready(), 3, 10)
    return matmul, copy_bandwidth(3, 10)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    baseline.add_arguments(parser, "scan")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--breakdown", nargs="*", metavar="CONFIG",
                        help="time each kernel alone at --shapes (g=1) for each kernel "
                             "config ('' the default, 'backward_bc_heads=16,chunk=32' ...), "
                             "instead of the table")
    parser.add_argument("--float32-states", action="store_true",
                        help="a column for the kernels with float32 per-chunk states")
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--shapes", nargs="+", default=[f"{b}x{l}" for b, l in SHAPES],
                        help="batch x seqlen, e.g. 8x8192")
    parser.add_argument("--segments", type=int, nargs="*", default=[],
                        help="a column for each N: rows scanned in N segments at once")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(int(time.time()))
    start = time.perf_counter()
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes]
    if args.breakdown is not None:
        configs = [parse_config(text) for text in args.breakdown or [""]]
        check_against_naive(rng, configs, dtypes=(jnp.bfloat16,))  # what is timed
        return breakdown(rng, shapes, configs, args.warmup, args.reps)
    versus = baseline.comparison(args.baseline, "scan", allow_slow=False, in_child=False)
    print(versus.line, flush=True)
    import torch
    check_against_naive(rng)
    print(f"checks took {time.perf_counter() - start:.0f} s", flush=True)
    mamba_chunk_scan_combined = baseline.import_mamba_chunk_scan(args.baseline)
    matmul_rate, copy_rate = measure_ceilings()
    print(f"ceilings: bf16 matmul {matmul_rate / 1e12:.0f} TFLOP/s, copy "
          f"{copy_rate / 1e12:.2f} TB/s", flush=True)

    rows, memory = [], []
    for g in args.groups:
        for b, l in shapes:
            inputs, options = make_inputs(rng, b, l, g, jnp.bfloat16)
            dy = jnp.asarray(rng.standard_normal((b, l, H, P)), jnp.bfloat16)
            t_in = {k: to_torch(v) for k, v in {**inputs, **options}.items()}
            t_dy = to_torch(dy)

            def theirs(grad):
                leaves = {k: v.detach().requires_grad_(grad) for k, v in t_in.items()}
                y = mamba_chunk_scan_combined(
                    leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], CHUNK,
                    D=leaves["D"], dt_bias=leaves["dt_bias"], dt_softplus=True)
                if grad:
                    y.backward(t_dy)
                return y, leaves

            impls = {}
            for name, f in implementations(args):
                fwd = jax.jit(f)
                impls[name] = (fwd, forward_and_backward(f))
            # Same function: our kernel against our XLA path and against mamba_ssm.
            y_ours = impls["triton"][0](inputs, options)
            y_xla = impls["xla"][0](inputs, options)
            y_theirs, leaves = theirs(True)
            torch.cuda.synchronize()
            g_ours = impls["triton"][1](inputs, options, dy)[1][0]
            y_theirs_j = jnp.asarray(y_theirs.detach().float().cpu().numpy())
            errs = {"y vs xla": rel_err(y_ours, y_xla),
                    "y vs mamba_ssm": rel_err(y_ours, y_theirs_j)}
            for name in list(impls)[2:]:  # the variants
                g_variant = impls[name][1](inputs, options, dy)[1][0]
                errs[f"y ({name}) vs mamba_ssm"] = rel_err(impls[name][0](inputs, options),
                                                           y_theirs_j)
                for k in ("x", "B", "C", "dt"):
                    errs[f"d{k} ({name}) vs mamba_ssm"] = rel_err(
                        g_variant[k], leaves[k].grad.float().cpu().numpy())
            for k in ("x", "B", "C", "dt"):
                errs[f"d{k} vs mamba_ssm"] = rel_err(
                    g_ours[k], leaves[k].grad.float().cpu().numpy())
            print(f"check g={g} b={b} l={l}: " + ", ".join(f"{k} {v:.1e}"
                                                          for k, v in errs.items()), flush=True)
            if not max(errs.values()) < 3e-2:
                raise SystemExit(f"CHECK FAILED at g={g} b={b} l={l}: {errs}")
            del y_theirs, leaves

            times = {}
            for name, (fwd, fwdbwd) in impls.items():
                times[name] = (
                    median_time(lambda: fwd(inputs, options).block_until_ready(),
                                args.warmup, args.reps),
                    median_time(lambda: jax.block_until_ready(fwdbwd(inputs, options, dy)),
                                args.warmup, args.reps))
            with torch.no_grad():
                t_fwd = median_time(lambda: (theirs(False), torch.cuda.synchronize()),
                                    args.warmup, args.reps)
            t_fb = median_time(lambda: (theirs(True), torch.cuda.synchronize()),
                               args.warmup, args.reps)
            times["mamba_ssm"] = (t_fwd, t_fb)
            rows.append((g, b, l, times))
            print_row(g, b, l, times, matmul_rate, copy_rate, versus.ratio)
            print(f"elapsed {time.perf_counter() - start:.0f} s", flush=True)

            if (b, l) == (8, 8192):
                ours_mem = {name: fwdbwd.lower(inputs, options, dy).compile().memory_analysis()
                            .temp_size_in_bytes for name, (_, fwdbwd) in impls.items()}
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                _, leaves = theirs(True)
                torch.cuda.synchronize()
                outputs = sum(v.grad.numel() * v.grad.element_size() for v in leaves.values())
                outputs += b * l * H * P * 2  # y
                theirs_mem = torch.cuda.max_memory_allocated() - base - outputs
                memory.append((g, ours_mem, theirs_mem))
                del leaves

    print(f"\n{device_line()}, torch {torch.__version__}; heads {H}, headdim {P}, d_state {N}, "
          f"chunk {CHUNK}, bf16 x/B/C, D, dt_bias, softplus; median of {args.reps} after "
          f"{args.warmup}")
    print(f"ceilings measured: bf16 matmul {matmul_rate / 1e12:.0f} TFLOP/s, "
          f"copy {copy_rate / 1e12:.2f} TB/s")
    print(versus.line)
    for i, (g, b, l, times) in enumerate(rows):
        print_row(g, b, l, times, matmul_rate, copy_rate, versus.ratio, header=i == 0)
    for g, ours_mem, theirs_mem in memory:
        print(f"peak temporary memory, forward+backward, g={g}, (8, 8192): "
              + ", ".join(f"ours ({name}) {v / 2**30:.2f} GiB" for name, v in ours_mem.items())
              + f", mamba_ssm {theirs_mem / 2**30:.2f} GiB")


def implementations(args):
    """(name, f(inputs, options) -> y): ours ("triton", "xla"), then the asked variants."""
    def ours(name, **kw):
        return name, lambda i, o: ssd(**i, **o, chunk_size=CHUNK, dt_softplus=True, **kw)
    yield ours("triton", implementation="triton")
    yield ours("xla", implementation="xla")
    if args.float32_states:
        yield ("triton, float32 states",
               lambda i, o: vjp.ssd(**i, **o, dt_softplus=True, backend=kernels,
                                    config=kernels.Config(states_in_input_dtype=False))[0])
    for n in args.segments:
        yield ours(f"triton, {n} segments", implementation="triton", segments=n)


def print_row(g, b, l, times, matmul_rate, copy_rate, ratio, header=False):
    """A shape's two rows (and the header first); ratio(ours, theirs, spec, unit) formats a
    ratio to mamba_ssm's time (baseline.Comparison)."""
    variants = [k for k in times if k not in ("triton", "xla", "mamba_ssm")]
    if header:
        print(table_header(["g", "batch x seqlen", "pass", "ours triton ms", "ours xla ms",
                            "mamba_ssm ms", "ours/theirs", "ours TFLOP/s", "floor ms"]
                           + [c for k in variants for c in (f"ours {k} ms",
                                                            "its ratio to theirs")]))
    for i, pass_ in enumerate(("fwd", "fwd+bwd")):
        f = flops(b, l, g) * (1 if i == 0 else 3)
        floor = max(f / matmul_rate, io_bytes(b, l, g, i == 1) / copy_rate)
        ours, xla, theirs = (times[k][i] for k in ("triton", "xla", "mamba_ssm"))
        extra = [c for k in variants for c in (f"{times[k][i] * 1e3:.3f}",
                                               ratio(times[k][i], theirs, ".2f", ""))]
        print(table_row([g, f"{b} x {l}", pass_, f"{ours * 1e3:.3f}", f"{xla * 1e3:.3f}",
                         f"{theirs * 1e3:.3f}", ratio(ours, theirs, ".2f", ""),
                         f"{f / ours / 1e12:.0f}", f"{floor * 1e3:.3f}", *extra]), flush=True)


def parse_config(text):
    """'backward_bc_heads=16,chunk=32' -> kernels.Config(backward_bc_heads=16, chunk=32)."""
    values = {"None": None, "True": True, "False": False}
    fields = dict(item.split("=") for item in text.split(",") if item)
    return kernels.Config(**{k: values[v] if v in values else int(v)
                             for k, v in fields.items()})


def describe(config):
    """The fields of a kernels.Config that differ from the default, or 'default'."""
    default = kernels.Config()
    changed = {k: v for k, v in vars(config).items() if getattr(default, k) != v}
    return ",".join(f"{k}={v}" for k, v in changed.items()) or "default"


@contextlib.contextmanager
def default_config(text):
    """Within it, the kernels' default config, the one `ssd()` and the model's Mamba2 layers
    run when given none, is parse_config(text): to trace a whole model under a variant
    (bench.train_step's --ssd-variants). Mamba-3's scan keeps the config it binds at import."""
    fields = vars(parse_config(text))
    original = kernels.Config
    kernels.Config = functools.partial(original, **fields)
    try:
        yield
    finally:
        kernels.Config = original


def breakdown(rng, shapes, configs, warmup, reps):
    """Where the kernels' time goes, g=1: per shape and config, each pallas_call timed alone
    (a jitted function whose other outputs are dead, so XLA drops the other calls), and the
    whole ssd forward+backward with that config."""
    g = 1
    for b, l in shapes:
        inputs, options = make_inputs(rng, b, l, g, jnp.bfloat16)
        dy = jnp.asarray(rng.standard_normal((b, l, H, P)), jnp.bfloat16)
        x, B, C = inputs["x"], inputs["B"], inputs["C"]
        dt = jax.nn.softplus(inputs["dt"]).transpose(0, 2, 1)
        s0 = jnp.zeros((b, H, P, N), jnp.float32)
        for config in configs:
            t = config.chunk  # the cumsum restarts at every kernel chunk
            cs = jnp.cumsum((dt * inputs["A"][:, None]).reshape(b, H, -1, t), -1).reshape(
                b, H, l)
            forward = jax.jit(lambda *a: kernels.forward(*a, None, config=config)[0])
            chunk_states = jax.jit(lambda x, dt, cs, B, s0: kernels.chunk_states(
                x, dt, cs, B, s0, None, config=config))
            states = chunk_states(x, dt, cs, B, s0)
            bwd = lambda i: jax.jit(lambda *a: kernels.backward(*a, config=config)[i])
            args = (x, dt, cs, B, C, None, states, dy, s0)
            whole = lambda i, o: vjp.ssd(**i, **o, dt_softplus=True, backend=kernels,
                                         config=config)[0]
            parts = {"forward": (forward, (x, dt, cs, B, C, s0)),
                     "chunk states": (chunk_states, (x, dt, cs, B, s0)),
                     "backward state kernel": (bwd(0), args),
                     "both backward kernels": (bwd(3), args),
                     "ssd fwd+bwd": (forward_and_backward(whole), (inputs, options, dy))}
            times = {name: median_time(lambda: jax.block_until_ready(f(*a)), warmup, reps)
                     for name, (f, a) in parts.items()}
            print(f"breakdown {b}x{l} {describe(config)}: " + ", ".join(
                f"{name} {v * 1e3:.3f} ms" for name, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
