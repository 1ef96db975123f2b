"""Mamba-3 SISO scan on a GPU: ours against mamba_ssm's Triton kernels (mamba3_siso_combined).

    python3 -m bench.mamba3 [--baseline .baseline] [--warmup 5] [--reps 30]
                            [--shapes 8x2048 8x8192 1x65536] [--heads 64] [--headdim 64]
                            [--d-state 128] [--chunk 64]
    python3 -m bench.mamba3 --only-ours --shapes 1x64 --heads 2 --headdim 16 --d-state 16 \\
                            --chunk 16                      # a CPU smoke run, no torch

(Device run: PYTHONUNBUFFERED=1 python3 -m bench.mamba3 2>&1 | tee $OUT/log, carrying a
--baseline folder that holds mamba_ssm's Python package with ops/triton/mamba3, e.g. a
`git archive` of the commit compared against.)

Checks first, failing loudly: our scan against the token-by-token recurrence in float64 at a
small shape; then at every timed shape mamba_ssm's output and every gradient (C, B, x, adt,
dt, trap, angles, the biases, D) against ours on the same bf16 inputs (3e-2 of the largest
value). Then per shape the forward and forward+backward time of each, and ours/theirs. The
head layout is mamba2-1.3b's (64 heads of 64, d_state 128, one B/C group), chunk 64
(mamba_ssm's Mamba3 default), rope_fraction 0.5 (32 angles), SISO.

Ours is `pallas_kernels.mamba3.mamba3_scan`, a column for each implementation: "xla" (the
chunked form) and "triton" (the SSD's Pallas kernels with the work around them); the kernels
are checked against the XLA form and mamba_ssm at every shape. Theirs gets the angles per
head, the module's expansion of the shared ones.
Timing as bench/ssd.py: one jitted call (or the autograd function) from call to results
ready, median of --reps after --warmup.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp
import numpy as np

from bench import baseline
from bench.harness import device_line, median_time, table_header, table_row
from bench.ssd import to_torch
from pallas_kernels.mamba3 import mamba3_scan
from pallas_kernels.mamba3.reference import mamba3_naive

SHAPES = [(8, 2048), (8, 8192), (1, 65536)]  # (batch, seqlen)
GRADS = ("C", "B", "x", "adt", "dt", "trap", "angles", "C_bias", "B_bias", "D")


def make_inputs(rng, b, l, h, p, n, dtype):
    """The scan's inputs as the mixer makes them: C, B normed-sized and x in dtype; dt after
    softplus, adt = A dt with A from the heavy-tail range, trap and angles float32."""
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    dt = jax.nn.softplus(arr(b, l, h) - 3.0)
    return dict(C=arr(b, l, 1, 1, n).astype(dtype), B=arr(b, l, 1, 1, n).astype(dtype),
                x=arr(b, l, h, p).astype(dtype),
                adt=-dt * jnp.asarray(rng.uniform(0.5, 2, (b, l, h)), jnp.float32), dt=dt,
                trap=arr(b, l, h), angles=arr(b, l, n // 4), C_bias=1 + arr(h, 1, n) / 4,
                B_bias=1 + arr(h, 1, n) / 4, D=arr(h))


IMPLEMENTATIONS = ("xla", "triton")


def ours(chunk, implementation="xla"):
    def scan(inputs):
        y, _ = mamba3_scan(**inputs, chunk_size=chunk, implementation=implementation)
        return y[:, :, 0]  # [b, l, h, p]
    return scan


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def check_against_naive(rng, chunk):
    with jax.enable_x64(True):
        inputs = make_inputs(rng, 2, 3 * chunk + 5, 4, 8, 16, jnp.float64)
        y = ours(chunk)(inputs)
        y_ref = mamba3_naive(**inputs)[0][:, :, 0]
        err = rel_err(y, y_ref)
    print(f"check against the recurrence (float64): {err:.1e}", flush=True)
    if not err < 1e-9:
        raise SystemExit(f"CHECK FAILED: ours against the recurrence {err}")


def theirs_fn(mamba3_siso_combined, t_in, chunk):
    """mamba_ssm's SISO scan on torch copies of our inputs (its layouts: decays and gates
    [b, h, l], angles per head), returning (y [b, l, h, p], the leaves for gradients)."""
    def run(grad, dy=None):
        leaves = {k: v.detach().requires_grad_(grad) for k, v in t_in.items()}
        heads = leaves["x"].shape[2]
        bhl = lambda t: t.transpose(1, 2)
        y = mamba3_siso_combined(
            Q=leaves["C"][:, :, 0], K=leaves["B"][:, :, 0], V=leaves["x"],
            ADT=bhl(leaves["adt"]), DT=bhl(leaves["dt"]), Trap=bhl(leaves["trap"]),
            Q_bias=leaves["C_bias"][:, 0], K_bias=leaves["B_bias"][:, 0],
            Angles=leaves["angles"][:, :, None].expand(-1, -1, heads, -1), D=leaves["D"],
            Z=None, chunk_size=chunk)
        if grad:
            y.backward(dy)
        return y, leaves
    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    baseline.add_arguments(parser, "mamba3")
    parser.add_argument("--only-ours", action="store_true",
                        help="time ours alone (no mamba_ssm, no torch): a smoke run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--shapes", nargs="+", default=[f"{b}x{l}" for b, l in SHAPES],
                        help="batch x seqlen, e.g. 8x8192")
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--headdim", type=int, default=64)
    parser.add_argument("--d-state", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=64)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(int(time.time()))
    print(device_line(), flush=True)
    check_against_naive(rng, args.chunk)
    if not args.only_ours:
        import torch
        mamba3_siso_combined = baseline.import_mamba3_siso(args.baseline)
        # Its one path (the kernels call no causal_conv1d), named in the table's header.
        install = baseline.Install(baseline.version(args.baseline),
                                   *baseline.causal_conv1d_version(), bound={})
        print(baseline.guard(install, "mamba3", allow_slow=False).line, flush=True)
    h, p, n = args.heads, args.headdim, args.d_state
    columns = ["b x l"] + [f"{impl} {what} ms" for impl in IMPLEMENTATIONS
                           for what in ("fwd", "fwd+bwd")]
    if not args.only_ours:
        columns += ["theirs fwd ms", "theirs fwd+bwd ms"] + [
            f"{impl} {what} ours/theirs" for impl in IMPLEMENTATIONS
            for what in ("fwd", "fwd+bwd")]
    print(table_header(columns), flush=True)
    for shape in args.shapes:
        b, l = (int(v) for v in shape.split("x"))
        inputs = make_inputs(rng, b, l, h, p, n, jnp.bfloat16)
        dy = jnp.asarray(rng.standard_normal((b, l, h, p)), jnp.bfloat16)
        impls = {}
        for impl in IMPLEMENTATIONS:
            scan = ours(args.chunk, impl)
            impls[impl] = (jax.jit(scan),
                           jax.jit(lambda i, scan=scan: jax.vjp(scan, i)[1](dy)[0]))
        fwd, fwdbwd = impls["triton"]
        err = rel_err(fwd(inputs), impls["xla"][0](inputs))
        print(f"check b={b} l={l}: kernels against XLA {err:.1e}", flush=True)
        if not err < 3e-2:
            raise SystemExit(f"CHECK FAILED at b={b} l={l}: kernels against XLA {err}")
        times = []
        for f, fb in impls.values():
            times += [median_time(lambda: f(inputs).block_until_ready(), args.warmup,
                                  args.reps),
                      median_time(lambda: jax.block_until_ready(fb(inputs)), args.warmup,
                                  args.reps)]
        if not args.only_ours:
            run = theirs_fn(mamba3_siso_combined, {k: to_torch(v) for k, v in inputs.items()},
                            args.chunk)
            t_dy = to_torch(dy)
            y_theirs, leaves = run(True, t_dy)
            torch.cuda.synchronize()
            grads = fwdbwd(inputs)
            errs = {"y": rel_err(fwd(inputs), y_theirs.detach().float().cpu().numpy())}
            for k in GRADS:
                theirs_grad = leaves[k].grad.float().cpu().numpy()
                errs[f"d{k}"] = rel_err(grads[k], theirs_grad.reshape(grads[k].shape))
            print(f"check b={b} l={l} against mamba_ssm: "
                  + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
            if not max(errs.values()) < 3e-2:
                raise SystemExit(f"CHECK FAILED at b={b} l={l}: {errs}")
            with torch.no_grad():
                t_fwd = median_time(lambda: (run(False), torch.cuda.synchronize()),
                                    args.warmup, args.reps)
            t_fb = median_time(lambda: (run(True, t_dy), torch.cuda.synchronize()),
                               args.warmup, args.reps)
            times += [t_fwd, t_fb] + [t / theirs for t, theirs in
                                      zip(times, [t_fwd, t_fb] * len(IMPLEMENTATIONS))]
        timed = 2 * len(IMPLEMENTATIONS) + (0 if args.only_ours else 2)
        cells = [f"{b}x{l}"] + [f"{t * 1e3:.2f}" for t in times[:timed]] + [
            f"{r:.2f}x" for r in times[timed:]]
        print(table_row(cells), flush=True)


if __name__ == "__main__":
    main()
