"""Mamba-1's selective scan and its decoding update on a GPU, against mamba_ssm.

    python3 -m bench.selective_scan [--baseline .baseline] [--shapes 8x2048 1x16384]
                                    [--d-inner 4096] [--d-state 16] [--batches 1 64]
                                    [--warmup 3] [--reps 20]
                                    [--configs 'block_d=64,forward_warps=4' ...]
    python3 -m bench.selective_scan --tiny      # CPU smoke run: tiny shapes, no mamba_ssm

(Device run: PYTHONUNBUFFERED=1 python3 -m bench.selective_scan 2>&1 | tee $OUT/log,
carrying .baseline.) --d-inner 4096 and --d-state 16 are mamba-1.4b's layer.

Checks first, failing loudly: our Pallas kernels' y, final state and every gradient against
the recurrence in float64 (reference.selective_scan_naive) on fresh random inputs with
packed documents and an initial state, in float32 and bfloat16.

The scan table: per shape (batch x seqlen, bf16 x, B, C; float32 dt, A, D), forward and
forward+backward time of our kernels ("triton"), of our XLA form
(xla.py, implementation="xla") and of the baseline, and ours/baseline. The baseline,
named in the table's header (--configs: our kernels with other tiles, a column each):
- mamba_ssm's selective_scan_fn on its compiled CUDA extension (selective_scan_cuda),
  where that imports on this machine;
- otherwise our own XLA form: the header then says that mamba_ssm's extension is not built
  here, and the ratio is our kernels against our XLA form, not against mamba_ssm.

The decode table: per batch, one token's SSM update with the gate (state [b, d, n] float32,
x, dt, z [b, d], B, C [b, n]): ours as the decoding step runs it (an XLA fusion of
reference.selective_state_update and y * silu(z)) against mamba_ssm's Triton
selective_state_update (ops/triton/selective_state_update.py, which needs no compiled
extension), both updating the state in place of the old one.

Timing: the host clock from the call until the results are ready on the device
(block_until_ready, torch.cuda.synchronize); median of --reps after --warmup. mamba_ssm's
Python comes from --baseline (bench.baseline), its __init__ bypassed.
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp
import numpy as np

from bench import baseline
from bench.harness import device_line, median_time, table_header, table_row
from pallas_kernels.selective_scan import kernel_scan, reference, selective_scan, triton
from pallas_kernels.ssd.reference import process_dt

SHAPES = [(8, 2048), (1, 16384)]


def make_inputs(rng, b, l, d, n, dtype, docs=False):
    """(x, dt (before dt_bias and softplus), A, B, C, D, dt_bias, initial_state, seq_idx)."""
    arr = lambda *s: rng.standard_normal(s).astype(np.float32)
    seq_idx = (np.sort(rng.integers(0, 3, (b, l)), axis=1).astype(np.int32) if docs
               else None)
    return dict(x=jnp.asarray(arr(b, l, d), dtype), dt=jnp.asarray(arr(b, l, d) - 1.0),
                A=-jnp.asarray(np.exp(arr(d, n))), B=jnp.asarray(arr(b, l, n), dtype),
                C=jnp.asarray(arr(b, l, n), dtype), D=jnp.asarray(arr(d)),
                dt_bias=jnp.asarray(0.5 * arr(d)), initial_state=jnp.asarray(arr(b, d, n)),
                seq_idx=None if seq_idx is None else jnp.asarray(seq_idx))


def scan_loss(scan, diff, fixed, wy, ws):
    """<y, wy> + <final_state, ws>, a function of the float inputs `diff`."""
    y, s = scan(**diff, **fixed, dt_softplus=True, return_final_state=True)
    return jnp.vdot(y.astype(jnp.float32), wy) + jnp.vdot(s, ws), (y, s)


def values_and_grads(scan, inputs, wy, ws):
    fixed = {"seq_idx": inputs["seq_idx"]}
    diff = {k: v for k, v in inputs.items() if k != "seq_idx"}
    (_, out), grads = jax.value_and_grad(
        lambda d: scan_loss(scan, d, fixed, wy, ws), has_aux=True)(diff)
    return out, grads


def check(rng, interpret, configs=()):
    """Our kernels (the default tiles and each of configs) against the float64 recurrence;
    SystemExit on a miss."""
    tolerances = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}  # bf16: x, B, C rounded
    b, l, d, n = (2, 37, 32, 8) if interpret else (2, 1000, 256, 16)
    for dtype, tol in tolerances.items():
        inputs = make_inputs(rng, b, l, d, n, dtype, docs=True)
        wy, ws = rng.standard_normal((b, l, d)), rng.standard_normal((b, d, n))
        with jax.enable_x64(True):
            up = jax.tree.map(lambda a: a.astype(jnp.float64)
                              if jnp.issubdtype(a.dtype, jnp.floating) else a, inputs)
            naive = values_and_grads(
                lambda dt_softplus, return_final_state, **a: _naive(**a), up,
                jnp.asarray(wy), jnp.asarray(ws))
        for config in (triton.Config(), *configs):
            ours = jax.jit(lambda i: values_and_grads(
                lambda **a: _kernels(**a, config=config), i,
                jnp.asarray(wy, jnp.float32), jnp.asarray(ws, jnp.float32)))(inputs)
            worst = max(_rel_err(o, r) for o, r in zip(jax.tree.leaves(ours),
                                                         jax.tree.leaves(naive)))
            print(f"check {jnp.dtype(dtype).name} b={b} l={l} d={d} n={n} docs, initial "
                  f"state, {config}: worst rel err of y, final state and every gradient "
                  f"{worst:.2e} (tol {tol:.0e})", flush=True)
            if not worst <= tol:
                raise SystemExit(f"CHECK FAILED: {jnp.dtype(dtype).name} {config}: "
                                 f"{worst:.2e}")


def _kernels(x, dt, A, B, C, D, dt_bias, initial_state=None, seq_idx=None, *, config,
             dt_softplus=True, return_final_state=True):
    """selective_scan's arithmetic on the kernels with `config`: (y, final_state)."""
    return kernel_scan(x, process_dt(dt, dt_bias, dt_softplus), A, B, C, D=D,
                       initial_state=initial_state, seq_idx=seq_idx, config=config)


def _naive(x, dt, A, B, C, D, dt_bias, initial_state, seq_idx):
    return reference.selective_scan_naive(x, process_dt(dt, dt_bias, True), A, B, C, D=D,
                                          initial_state=initial_state, seq_idx=seq_idx)


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def ours_times(inputs, implementation, warmup, reps, config=None):
    """(forward s, forward+backward s) of selective_scan(implementation), or with a
    triton.Config `config` of the kernels (kernel_scan, dt processed the same way)."""
    if config is None:
        scan = lambda **a: selective_scan(**a, dt_softplus=True, return_final_state=True,
                                          implementation=implementation)
    else:
        scan = functools.partial(_kernels, config=config)
    args = {k: v for k, v in inputs.items() if k not in ("seq_idx", "initial_state")}
    forward = jax.jit(lambda a: scan(**a))
    # The loss's value with the gradients: y is then computed, as mamba_ssm's backward needs
    # its forward (the gradients alone let XLA drop the forward kernel, whose y nothing read).
    grad = jax.jit(jax.value_and_grad(lambda a: jnp.sum(scan(**a)[0].astype(jnp.float32))))
    return (median_time(lambda: jax.block_until_ready(forward(args)), warmup, reps),
            median_time(lambda: jax.block_until_ready(grad(args)), warmup, reps))


def parse_config(text):
    """'block_d=64,stages=2' -> triton.Config(block_d=64, stages=2); '' the default."""
    fields = dict(item.split("=") for item in text.split(",") if item)
    return triton.Config(**{k: int(v) for k, v in fields.items()})


def mamba_ssm_scan(copy):
    """(mamba_ssm's selective_scan_fn, '') where its compiled selective_scan_cuda imports,
    else (None, why not)."""
    try:
        import torch  # noqa: F401 (the extension links against its libraries)
        import selective_scan_cuda
    except (ImportError, OSError) as error:
        return None, f"{type(error).__name__}: {error}"
    if not hasattr(selective_scan_cuda, "fwd"):
        return None, "selective_scan_cuda is a stand-in without fwd"
    baseline._use_copy(copy)
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    return selective_scan_fn, ""


def theirs_times(selective_scan_fn, inputs, warmup, reps):
    """(forward s, forward+backward s) of mamba_ssm's selective_scan_fn on the same values,
    in its layout (x, dt [b, d, l], B, C [b, n, l])."""
    import torch

    def t(name, dtype, transpose=False):
        a = np.asarray(inputs[name], np.float32)
        a = np.ascontiguousarray(np.swapaxes(a, 1, 2)) if transpose else a
        return torch.from_numpy(a).cuda().to(dtype).requires_grad_()

    # Its kernel takes dt in x's dtype (bf16 here); ours takes it in float32.
    u, delta, B, C = (t(k, torch.bfloat16, transpose=True) for k in ("x", "dt", "B", "C"))
    A, D, bias = (t(k, torch.float32) for k in ("A", "D", "dt_bias"))

    def forward():
        out = selective_scan_fn(u, delta, A, B, C, D=D, delta_bias=bias, delta_softplus=True,
                                return_last_state=True)
        torch.cuda.synchronize()
        return out

    def both():
        forward()[0].float().sum().backward()
        torch.cuda.synchronize()
    return median_time(forward, warmup, reps), median_time(both, warmup, reps)


def decode_times(batch, d, n, copy, warmup, reps):
    """(ours s, theirs s or None, why theirs did not run) for one token's SSM update and gate."""
    rng = np.random.default_rng(batch)
    arr = lambda *s: rng.standard_normal(s).astype(np.float32)
    state, x, dt, z = arr(batch, d, n), arr(batch, d), arr(batch, d) - 1.0, arr(batch, d)
    A, B, C, D, bias = -np.exp(arr(d, n)), arr(batch, n), arr(batch, n), arr(d), arr(d)

    @jax.jit
    def update(state, x, dt, z, A, B, C, D, bias):
        dt = jax.nn.softplus(dt + bias)
        y, state = reference.selective_state_update(state, x, dt, A, B, C, D)
        return (y * jax.nn.silu(z)).astype(jnp.bfloat16), state
    args = [jnp.asarray(a) for a in (state, x.astype(jnp.bfloat16), dt,
                                     z.astype(jnp.bfloat16), A, B, C, D, bias)]
    ours = median_time(lambda: jax.block_until_ready(update(*args)), warmup, reps)
    try:
        import torch
        baseline._use_copy(copy)
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    except (ImportError, OSError) as error:
        return ours, None, f"{type(error).__name__}: {error}"
    if not torch.cuda.is_available():
        return ours, None, "no CUDA device for torch"
    cuda = lambda a, dtype=torch.float32: torch.from_numpy(a).cuda().to(dtype)
    s_t, A_t, B_t, C_t, D_t, b_t, dt_t = map(cuda, (state, A, B, C, D, bias, dt))
    x_t, z_t = cuda(x, torch.bfloat16), cuda(z, torch.bfloat16)

    def theirs():
        selective_state_update(s_t, x_t, dt_t, A_t, B_t, C_t, D=D_t, z=z_t, dt_bias=b_t,
                               dt_softplus=True)
        torch.cuda.synchronize()
    return ours, median_time(theirs, warmup, reps), ""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default=".baseline",
                        help="the folder holding mamba_ssm's Python package (mamba_ssm/)")
    parser.add_argument("--shapes", nargs="+", default=[f"{b}x{l}" for b, l in SHAPES])
    parser.add_argument("--d-inner", type=int, default=4096)
    parser.add_argument("--d-state", type=int, default=16)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--configs", nargs="*", default=[],
                        help="kernel tiles to time beside the defaults, each a column: "
                             "triton.Config fields as 'block_d=64,forward_warps=4,stages=2'")
    parser.add_argument("--tiny", action="store_true",
                        help="a CPU smoke run: tiny shapes, Pallas's interpreter, 1 rep")
    args = parser.parse_args(argv)
    if args.tiny:
        args.shapes, args.d_inner, args.d_state, args.batches = ["1x24"], 32, 8, [2]
        args.warmup, args.reps = 0, 1
    print(device_line())
    rng = np.random.default_rng(0)
    configs = {text: parse_config(text) for text in args.configs}
    check(rng, jax.default_backend() != "gpu", configs.values())

    theirs_fn, why = mamba_ssm_scan(args.baseline)
    if theirs_fn is not None:
        print("scan baseline: mamba_ssm selective_scan_fn on its compiled selective_scan_cuda "
              "(dt in bf16, as its kernel takes it)")
    else:
        print(f"scan baseline: OUR OWN XLA FORM (selective_scan/xla.py), not "
              f"mamba_ssm: its selective_scan_cuda extension is not built here ({why}); "
              f"'ours/baseline' is our kernels against our XLA form")
    d, n = args.d_inner, args.d_state
    print(f"d_inner {d}, d_state {n}, bf16 x/B/C, float32 dt/A/D; median of {args.reps}")
    print(table_header(("batch x seqlen", "fwd ours ms", "fwd xla ms", "fwd baseline ms",
                        "fwd ours/baseline", "fwd+bwd ours ms", "fwd+bwd xla ms",
                        "fwd+bwd baseline ms", "fwd+bwd ours/baseline")
                       + tuple(f"fwd / fwd+bwd ms [{text}]" for text in configs)))
    for shape in args.shapes:
        b, l = map(int, shape.split("x"))
        inputs = make_inputs(rng, b, l, d, n, jnp.bfloat16)
        ours = ours_times(inputs, "triton", args.warmup, args.reps)
        xla = ours_times(inputs, "xla", args.warmup, args.reps)
        base = xla if theirs_fn is None else theirs_times(theirs_fn, inputs, args.warmup,
                                                          args.reps)
        ms = lambda s: f"{1e3 * s:.3f}"
        variants = tuple("{} / {}".format(*map(ms, ours_times(inputs, "triton", args.warmup,
                                                              args.reps, config)))
                         for config in configs.values())
        print(table_row((shape, ms(ours[0]), ms(xla[0]), ms(base[0]), f"{ours[0] / base[0]:.2f}x",
                         ms(ours[1]), ms(xla[1]), ms(base[1]), f"{ours[1] / base[1]:.2f}x")
                        + variants), flush=True)

    print(f"\ndecode: one token's SSM update and gate, d_inner {d}, d_state {n}, float32 state; "
          "theirs: mamba_ssm's Triton selective_state_update")
    print(table_header(("batch", "ours us", "theirs us", "ours/theirs")))
    for batch in args.batches:
        ours, theirs, why = decode_times(batch, d, n, args.baseline, args.warmup, args.reps)
        if theirs is None:
            print(table_row((batch, f"{1e6 * ours:.1f}", f"not run ({why})", "")))
        else:
            print(table_row((batch, f"{1e6 * ours:.1f}", f"{1e6 * theirs:.1f}",
                             f"{ours / theirs:.2f}x")), flush=True)


if __name__ == "__main__":
    main()
