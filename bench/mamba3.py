"""Mamba-3 scans on a GPU: ours against mamba_ssm's SISO Triton kernels (mamba3_siso_combined)
and, where TileLang imports, its MIMO TileLang kernels (mamba3_mimo); our MIMO scan checked
against mamba_ssm's MIMO torch reference.

    python3 -m bench.mamba3 [--baseline .baseline/e9594ce] [--warmup 5] [--reps 30]
                            [--shapes 8x2048 8x8192 1x65536] [--implementations triton [xla]]
                            [--mimo-rank [R]] [--heads 64] [--headdim 64] [--d-state 128]
                            [--chunk 64] [--check-len 256] [--seed N]
    python3 -m bench.mamba3 --only-ours --shapes 1x64 --heads 2 --headdim 16 --d-state 16 \\
                            --chunk 16 --check-len 32        # a CPU smoke run, no torch

(Device run: PYTHONUNBUFFERED=1 python3 -m bench.mamba3 --baseline .baseline/e9594ce, with
that folder holding mamba_ssm's Python package with ops/triton/mamba3 and, for --mimo-rank,
its ops/tilelang/mamba3 and tests/ops/tilelang/test_mamba3_mimo.py: a `git archive` of the
commit compared against.)

What is compared. The head layout is mamba2-1.3b's (64 heads of 64, d_state 128, one B/C
group), rope_fraction 0.5 (32 angles), bf16 C, B and x with float32 decays, gates and
angles, as the mixer makes them. SISO (the default): ours (`pallas_kernels.mamba3.
mamba3_scan`, "triton": the SSD's Pallas kernels with the work around them; "xla": the
chunked pure-JAX form) against mamba_ssm's mamba3_siso_combined, its Triton kernels, at its
Mamba3 default chunk 64, on the same inputs (its angles per head: the module's expansion of
the shared ones). MIMO (--mimo-rank R; without a value mamba_ssm's Mamba3 default rank, 4):
ours checked, values and every gradient, against mamba_ssm's float32 torch reference of its
kernels (mamba3_MIMO_chunk_ref in its tests/ops/tilelang/test_mamba3_mimo.py, imported from
--baseline) at the check shape, then timed against its TileLang kernels (mamba3_mimo without
the gate and the out-projection over ranks, so that its y is our scan's, at its recommended
chunk of 64 / R tokens) where TileLang imports, else alone. TileLang is not on the GPU
machine, and the wheel of the version mamba_ssm pins (tilelang 0.1.8, 43.5 MB; 0.1.15 fails
to compile its backward kernels) with its dependencies (z3-solver 4.15.4.0, 29 MB;
apache-tvm-ffi 0.1.8.post2, the release current when tilelang 0.1.8 was built: 0.1.12 stops
its import with an AttributeError in tvm_ffi's registry; torch-c-dlpack-ext; cloudpickle)
is more than a call carries: installed here for CPython 3.12 (`pip install --no-deps
--only-binary=:all: --python-version 3.12 --target DIR`), without z3's executable and its
second copy of libz3, and packed as one xz tarball (32 MB), it travels in one call,
unpacked there onto PYTHONPATH.

Checks, each the worst difference over the largest value, 3e-2 at most (1e-1 for the
gradients summed over the whole row: the angles', the biases', D's; see TOLERANCES). First,
exiting on a miss: ours against the token-by-token recurrence in float64 at a tiny shape; at
two small shapes of the timed layout (8 and 1 x --check-len tokens, the backward's kernels
turning B and C at 8 rows and reading per-head copies at 1) our kernels against our XLA
form, values and every gradient (checked there only: the XLA form is the slower to compile
and run at long rows), and for MIMO ours against mamba_ssm's reference. Then for SISO, at
every timed shape, mamba_ssm's output and every gradient (C, B, x, adt, dt, trap, angles,
the biases, D) against ours on the same bf16 inputs; a miss there is printed and marks its
row (the last column: the worst difference), the other shapes are still timed, and the
script exits non-zero at the end (mamba_ssm's tests note that its kernels' angle sums drift
from its reference over long rows).

Timing as bench/ssd.py: one jitted call (or the autograd function) from call to results
ready, median of --reps after --warmup; our forward+backward returns y with the gradients
and takes the output's cotangent as an argument (harness.forward_and_backward: the forward
kernel runs, as mamba_ssm's does before its backward, and nothing folds into the program).
On a fresh machine mamba_ssm's first calls autotune its kernels (27 configurations of the
forward for each of its keys, the forward without gradients one of them): of a run of the
three default shapes most of the time was its autotuning; TRITON_CACHE_AUTOTUNING=1
keeps the choices in Triton's cache for later processes. --implementations: the columns of
ours, default the kernels alone; "xla" adds the chunked form's. XLA_FLAGS gets
`--xla_gpu_enable_triton_gemm=false` unless it names that flag (harness.use_cublas_gemms, as
the train step compiles: the autotuning of XLA's Triton GEMMs dominated compile times).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import baseline  # noqa: E402
from bench.harness import (device_line, forward_and_backward, median_time,  # noqa: E402
                           table_header, table_row, to_torch, use_cublas_gemms)
from mamba_jax.layers.mamba3 import Mamba3Section  # noqa: E402
from pallas_kernels.mamba3 import IMPLEMENTATIONS, mamba3_scan  # noqa: E402
from pallas_kernels.mamba3.reference import mamba3_naive  # noqa: E402

use_cublas_gemms()

SHAPES = [(8, 2048), (8, 8192), (1, 65536)]  # (batch, seqlen)
GRADS = ("C", "B", "x", "adt", "dt", "trap", "angles", "C_bias", "B_bias", "D")
TOLERANCE = 3e-2
# Gradients that sum over the whole row (the biases' and D's over every token, the angles' a
# reverse cumulative sum) add bf16 roundings over every token: against the float64
# recurrence at 1 x 1024 with 64 heads (a CPU, 2026-12-01) both our kernels and our XLA form
# missed d(angles) by 3.3e-2 and 4.2e-2 and d(C_bias) by up to 1.8e-2, and a longer row
# misses by more. A layout or sign error misses by O(1).
TOLERANCES = {"dangles": 1e-1, "dC_bias": 1e-1, "dB_bias": 1e-1, "dD": 1e-1}


# mamba2-1.3b's head layout, the benchmark's default (heads, headdim, d_state).
LAYOUT = (64, 64, 128)


def make_inputs(rng, b, l, h, p, n, r, dtype):
    """The scan's inputs as the mixer makes them, rank r (1: SISO): C, B [b, l, r, 1, n]
    normed-sized and x [b, l, h, p] in dtype; dt after softplus, adt = A dt with A from the
    heavy-tail range, trap (values of dtype, as the in-projection makes them: mamba_ssm's
    MIMO kernels take it in dtype) and angles [b, l, n/4] float32; biases [h, r, n], D [h];
    for MIMO mimo_x [h, r, p] near mamba_ssm's init 1/r."""
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    dt = jax.nn.softplus(arr(b, l, h) - 3.0)
    inputs = dict(C=arr(b, l, r, 1, n).astype(dtype), B=arr(b, l, r, 1, n).astype(dtype),
                  x=arr(b, l, h, p).astype(dtype),
                  adt=-dt * jnp.asarray(rng.uniform(0.5, 2, (b, l, h)), jnp.float32), dt=dt,
                  trap=arr(b, l, h).astype(dtype).astype(jnp.float32),
                  angles=arr(b, l, n // 4), C_bias=1 + arr(h, r, n) / 4,
                  B_bias=1 + arr(h, r, n) / 4, D=arr(h))
    if r > 1:
        inputs["mimo_x"] = (1 + arr(h, r, p) / 4) / r
    return inputs


def inputs_and_cotangent(rng, b, l, r, h=LAYOUT[0], p=LAYOUT[1], n=LAYOUT[2]):
    """make_inputs in bf16, then a cotangent of the scan's y, dy [b, l, r, h, p] bf16, drawn
    from rng after them."""
    inputs = make_inputs(rng, b, l, h, p, n, r, jnp.bfloat16)
    return inputs, jnp.asarray(rng.standard_normal((b, l, r, h, p)), jnp.bfloat16)


def ours(chunk, implementation, rotary):
    """Our scan of the inputs -> y [b, l, r, h, p] (before the gate)."""
    def scan(inputs):
        return mamba3_scan(**inputs, chunk_size=chunk, implementation=implementation,
                           rotary=rotary)[0]
    return scan


def jitted(scan):
    """(forward(inputs), forward+backward(inputs, dy) -> (y, (the inputs' gradients,))),
    jitted (harness.forward_and_backward)."""
    return jax.jit(scan), forward_and_backward(scan)


def rel_err(a, b):
    """max |a - b| over max |b|, b reshaped to a's shape; NaN where either has one."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64).reshape(a.shape)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan")
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def report(label, errs, tolerance=TOLERANCE) -> str:
    """Print the errors (name -> relative error); '' where each is under its tolerance
    (TOLERANCES, else `tolerance`), else the failure's line (NaN fails too)."""
    print(f"check {label}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()),
          flush=True)
    bad = {k: v for k, v in errs.items() if not v < TOLERANCES.get(k, tolerance)}
    return f"CHECK FAILED: {label}: {bad}" if bad else ""


def require(label, errs, tolerance=TOLERANCE):
    """report(), exiting on a failure."""
    failed = report(label, errs, tolerance)
    if failed:
        raise SystemExit(failed)


def check_against_naive(rng, chunk, r, rotary):
    with jax.enable_x64(True):
        inputs = make_inputs(rng, 2, 3 * chunk + 5, 4, 8, 16, r, jnp.float64)
        y = ours(chunk, "xla", rotary)(inputs)
        y_ref = mamba3_naive(**inputs, rotary=rotary)[0]
        require("ours (XLA form) against the recurrence, float64", {"y": rel_err(y, y_ref)},
                1e-9)


def check_kernels_against_xla(inputs, dy, chunk, rotary, label):
    """Our kernels' values and gradients against our XLA form's on the same inputs."""
    kernels, xla = (jitted(ours(chunk, impl, rotary)) for impl in ("triton", "xla"))
    errs = {"y": rel_err(kernels[0](inputs), xla[0](inputs))}
    got, want = kernels[1](inputs, dy)[1][0], xla[1](inputs, dy)[1][0]
    errs.update({f"d{k}": rel_err(got[k], want[k]) for k in want})
    require(f"{label}: kernels against the XLA form", errs)


def theirs_fn(kernels, t_in, chunk):
    """mamba_ssm's scan on torch copies of our inputs, returning (y, the leaves for
    gradients). kernels: its SISO Triton kernels (mamba3_siso_combined: C, B [b, l, g, n]
    without the rank axis, biases [h, n]; y [b, l, h, p]) or, a (mamba3_mimo, its rotary
    divisor) pair, its MIMO TileLang kernels without the gate and the out-projection over
    ranks (Z, MIMO_Z and MIMO_Out None, so its y is ours, [b, l, r, h, p]; C, B, the biases
    and mimo_x as ours). Both take decays and gates [b, h, l] and angles per head."""
    import torch

    if isinstance(kernels, tuple):  # its MIMO kernels take trap in bf16: exact for
        t_in = {**t_in, "trap": t_in["trap"].to(torch.bfloat16)}  # make_inputs' values

    def run(grad, dy=None):
        leaves = {k: v.detach().requires_grad_(grad) for k, v in t_in.items()}
        heads = leaves["x"].shape[2]
        bhl = lambda t: t.transpose(1, 2)
        shared = dict(V=leaves["x"], ADT=bhl(leaves["adt"]), DT=bhl(leaves["dt"]),
                      Trap=bhl(leaves["trap"]), D=leaves["D"], Z=None, chunk_size=chunk,
                      Angles=leaves["angles"][:, :, None].expand(-1, -1, heads, -1))
        if isinstance(kernels, tuple):
            mamba3_mimo, rotary_dim_divisor = kernels
            y = mamba3_mimo(Q=leaves["C"], K=leaves["B"], Q_bias=leaves["C_bias"],
                            K_bias=leaves["B_bias"], MIMO_V=leaves["mimo_x"], MIMO_Z=None,
                            MIMO_Out=None, rotary_dim_divisor=rotary_dim_divisor,
                            dtype=torch.bfloat16, **shared)
        else:
            y = kernels(Q=leaves["C"][:, :, 0], K=leaves["B"][:, :, 0],
                        Q_bias=leaves["C_bias"][:, 0], K_bias=leaves["B_bias"][:, 0], **shared)
        if grad:
            y.backward(dy)
        return y, leaves
    return run


def theirs_mimo_reference(reference, t_in, t_dy, chunk, rotary_dim_divisor):
    """mamba_ssm's MIMO reference (`reference`: its test module) in float32 on torch copies
    of our inputs, as its tests feed it: the angles through its apply_angle_dt_reference
    (per head, summed over the sequence), the decays as chunk cumulative sums dA_cs and
    dA_cs_rev [b, h, l], dt and trap [b, h, l], the kernels' rotation (rotate_pairwise=False),
    no gate and no out-projection over ranks (our scan's y). Returns (y [b, l, r, h, p], the
    leaves, their .grad set by y's backward against t_dy [b, l, r, h, p])."""
    import torch
    import torch.nn.functional as F

    leaves = {k: v.detach().float().requires_grad_(True) for k, v in t_in.items()}
    b, l, h, _ = leaves["x"].shape
    bhl = lambda t: t.transpose(1, 2)
    adt = F.pad(bhl(leaves["adt"]), (0, -l % chunk))  # whole chunks, as its tests
    dA_cs = torch.cumsum(adt.reshape(b, h, -1, chunk), dim=-1)
    dA_cs_rev = dA_cs[..., -1:] - dA_cs
    flat = lambda t: t.reshape(b, h, -1)[..., :l]
    angles = reference.apply_angle_dt_reference(
        leaves["angles"][:, :, None].expand(-1, -1, h, -1), leaves["dt"])
    y, _, _ = reference.mamba3_MIMO_chunk_ref(
        leaves["C"], leaves["B"], leaves["x"], leaves["C_bias"], leaves["B_bias"],
        leaves["mimo_x"], None, None, None, angles, flat(dA_cs), flat(dA_cs_rev),
        bhl(leaves["dt"]), bhl(leaves["trap"]), leaves["D"], chunk_size=chunk,
        rotary_dim_divisor=rotary_dim_divisor, dtype=torch.float32, rotate_pairwise=False,
        contract_mimo_out=False)
    y.backward(t_dy.float())
    return y, leaves


def against_theirs(y_ours, grads, y_theirs, leaves):
    """The relative errors of our y and gradients against theirs (torch tensors, their
    layouts reshaped to ours)."""
    numpy = lambda t: t.detach().float().cpu().numpy()
    errs = {"y": rel_err(y_ours, numpy(y_theirs))}
    errs.update({f"d{k}": rel_err(grads[k], numpy(leaves[k].grad)) for k in grads})
    return errs


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    baseline.add_arguments(parser, "mamba3")
    parser.add_argument("--only-ours", action="store_true",
                        help="time ours alone (no mamba_ssm, no torch): a smoke run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--shapes", nargs="+", default=[f"{b}x{l}" for b, l in SHAPES],
                        help="batch x seqlen, e.g. 8x8192")
    parser.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS,
                        default=["triton"],
                        help="our columns: triton (the kernels), xla (the chunked form, slow "
                             "to compile at long sequences)")
    parser.add_argument("--mimo-rank", type=int, nargs="?", default=None,
                        const=Mamba3Section.mimo_rank,
                        help="MIMO of this rank (alone: mamba_ssm's default, "
                             f"{Mamba3Section.mimo_rank}); ours only, checked against "
                             "mamba_ssm's torch reference")
    parser.add_argument("--heads", type=int, default=LAYOUT[0])
    parser.add_argument("--headdim", type=int, default=LAYOUT[1])
    parser.add_argument("--d-state", type=int, default=LAYOUT[2])
    parser.add_argument("--chunk", type=int, default=64,
                        help="the XLA form's chunk and mamba_ssm's SISO chunk (for MIMO its "
                             "reference takes chunk / rank, its recommendation)")
    parser.add_argument("--seed", type=int, default=None,
                        help="the inputs' random seed (default: the clock's seconds)")
    parser.add_argument("--check-len", type=int, default=256,
                        help="the tokens of the one-row shape the kernels are checked at "
                             "against the XLA form (and MIMO against mamba_ssm's reference)")
    args = parser.parse_args(argv)
    if args.mimo_rank is not None and args.mimo_rank < 2:
        parser.error(f"--mimo-rank {args.mimo_rank}: MIMO needs a rank of at least 2 (SISO "
                     "is the default, without --mimo-rank)")
    return args


def main(argv=None):
    args = parse_args(argv)
    mimo = args.mimo_rank is not None
    r = args.mimo_rank or 1
    rotary = "halves" if mimo else "pairwise"  # mamba_ssm's pairing in each (reference.py)
    seed = int(time.time()) if args.seed is None else args.seed
    rng = np.random.default_rng(seed)
    h, p, n = args.heads, args.headdim, args.d_state
    print(f"{device_line()}; {'MIMO rank ' + str(r) if mimo else 'SISO'}, {h} heads of {p}, "
          f"d_state {n}, one B/C group, {n // 4} angles; seed {seed}", flush=True)
    check_against_naive(rng, args.chunk, r, rotary)

    # Everything of mamba_ssm's imported before any timing: a missing piece costs none.
    if not args.only_ours:
        import torch
        if mimo:
            reference = baseline.import_mamba3_mimo_reference(args.baseline)
            mamba3_mimo, why = baseline.import_mamba3_mimo(args.baseline)
            print(f"mamba_ssm {baseline.version(args.baseline)} MIMO: ours is checked "
                  "against its float32 torch reference mamba3_MIMO_chunk_ref "
                  "(tests/ops/tilelang/test_mamba3_mimo.py), then " + (
                      "timed against its TileLang kernels (mamba3_mimo)" if mamba3_mimo else
                      f"timed alone: its TileLang kernels (mamba3_mimo) do not import ({why})"),
                  flush=True)
        else:
            mamba3_siso_combined = baseline.import_mamba3_siso(args.baseline)
            print(baseline.mamba3_siso_path(args.baseline), flush=True)

    # The small shapes: kernels against the XLA form at 1 and 8 rows (at 64 heads the
    # backward reads per-head copies of B and C at 1 row and turns them in its kernels at 8:
    # triton.Config.backward_turns), MIMO against mamba_ssm's reference at 1 row.
    for rows in (8, 1):
        small, small_dy = inputs_and_cotangent(rng, rows, args.check_len, r, h, p, n)
        label = f"b={rows} l={args.check_len}"
        check_kernels_against_xla(small, small_dy, args.chunk, rotary, label)
    if mimo and not args.only_ours:
        chunk = max(args.chunk // r, 1)
        y_theirs, leaves = theirs_mimo_reference(
            reference, {k: to_torch(v) for k, v in small.items()}, to_torch(small_dy), chunk,
            4)  # rotary_dim_divisor = 2 / rope_fraction
        fwd, fwdbwd = jitted(ours(args.chunk, "triton", rotary))
        require(f"{label} against mamba_ssm's MIMO reference (float32)",
                against_theirs(fwd(small), fwdbwd(small, small_dy)[1][0], y_theirs, leaves))

    theirs_timed = not args.only_ours and (not mimo or mamba3_mimo is not None)
    columns = ["b x l"] + [f"{impl} {what} ms" for impl in args.implementations
                           for what in ("fwd", "fwd+bwd")]
    if theirs_timed:
        columns += ["theirs fwd ms", "theirs fwd+bwd ms"] + [
            f"{impl} {what} ours/theirs" for impl in args.implementations
            for what in ("fwd", "fwd+bwd")] + [f"{args.implementations[0]} vs theirs"]
    print(table_header(columns), flush=True)
    failures = []
    for shape in args.shapes:
        b, l = (int(v) for v in shape.split("x"))
        inputs, dy = inputs_and_cotangent(rng, b, l, r, h, p, n)
        impls = {impl: jitted(ours(args.chunk, impl, rotary)) for impl in args.implementations}
        times = []
        for f, fb in impls.values():
            times += [median_time(lambda: f(inputs).block_until_ready(), args.warmup,
                                  args.reps),
                      median_time(lambda: jax.block_until_ready(fb(inputs, dy)), args.warmup,
                                  args.reps)]
        if theirs_timed:
            fwd, fwdbwd = next(iter(impls.values()))
            t_in = {k: to_torch(v) for k, v in inputs.items()}
            if mimo:  # its MIMO chunk: the recommended 64 / rank positions' worth of tokens
                run = theirs_fn((mamba3_mimo, 4), t_in, max(args.chunk // r, 8))
                t_dy = to_torch(dy)
            else:
                run = theirs_fn(mamba3_siso_combined, t_in, args.chunk)
                t_dy = to_torch(dy[:, :, 0])
            y_theirs, leaves = run(True, t_dy)
            torch.cuda.synchronize()
            errs = against_theirs(fwd(inputs), fwdbwd(inputs, dy)[1][0], y_theirs, leaves)
            # A miss is reported, its row marked and the run's exit status set, but the
            # timing goes on: the other shapes' rows still come.
            failed = report(f"b={b} l={l} {args.implementations[0]} against mamba_ssm", errs)
            failures += [failed] if failed else []
            worst = max(errs.values(), key=lambda e: e if e == e else float("inf"))
            agreement = f"{worst:.1e}" + (" CHECK FAILED" if failed else "")
            with torch.no_grad():
                t_fwd = median_time(lambda: (run(False), torch.cuda.synchronize()),
                                    args.warmup, args.reps)
            t_fb = median_time(lambda: (run(True, t_dy), torch.cuda.synchronize()),
                               args.warmup, args.reps)
            times += [t_fwd, t_fb] + [t / theirs for t, theirs in
                                      zip(times, [t_fwd, t_fb] * len(impls))]
        timed = 2 * len(impls) + (2 if theirs_timed else 0)
        cells = [f"{b}x{l}"] + [f"{t * 1e3:.2f}" for t in times[:timed]] + [
            f"{q:.2f}x" for q in times[timed:]] + ([agreement] if theirs_timed else [])
        print(table_row(cells), flush=True)
    if failures:
        raise SystemExit("\n".join(failures))


if __name__ == "__main__":
    main()
