"""The SSD scan and the decoding step's SSM kernel per headdim: whether a headdim that is no
power of two (80, Nemotron Nano 2's; 96; 192), which the kernels walk in power-of-two blocks
(pallas_kernels.ssd.triton._sub_blocks, pallas_kernels.ssd.step.filled_blocks), runs at the
speed of the power-of-two ones per FLOP and per byte.

    python3 -m bench.headdim [--headdims 64 80 96 128 192] [--width 8192] [--shape 8x4096]
                             [--step-batch 64] [--warmup 3] [--reps 20]
    python3 -m bench.headdim --tiny      # a CPU run (Pallas's interpreter), tiny shapes

Per headdim p, heads h = width / p rounded to a multiple of 8 groups (so h * p, the Mamba
width, stays about --width), d_state 128, bf16:
- the scan at --shape (batch x sequence): forward and forward+backward time of ssd(...,
  implementation="triton") and of "xla", and the kernels' TFLOP/s (bench.ssd's count of
  the chunked algorithm's matmuls at its chunk, backward twice forward): per FLOP, a
  headdim's row should read as its power-of-two neighbours';
- the step kernel (mamba_step, implementation "triton") at --step-batch rows: microseconds
  and the state's bytes read and written over the time against the copy bandwidth (a
  batch-64 step is bound by its state).
Checks first, failing loudly: the scan's y and final state against the XLA path, the step
against its reference (2**-7 of the largest value: bf16 operands summed in another order).
Timing: median of --reps jitted calls after --warmup, the host clock until ready.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import copy_bandwidth, median_time, table_header, table_row
from pallas_kernels.ssd import ssd
from pallas_kernels.ssd.step import mamba_step

CHUNK = 256


def scan_flops(b, l, h, p, g, n, chunk):
    """Forward matmul FLOPs of the chunked SSD (C B^T per group; per head the scores times
    x, the states B^T x and their read-out through C)."""
    c = -(-l // chunk)
    return b * c * (g * 2 * chunk * chunk * n + h * (2 * chunk * chunk * p + 4 * chunk * p * n))


def scan_inputs(rng, b, l, h, p, g, n):
    arr = lambda *s, dt=jnp.bfloat16: jnp.asarray(rng.standard_normal(s), dt)
    return dict(x=arr(b, l, h, p), dt=arr(b, l, h, dt=jnp.float32) - 2.0,
                A=-jnp.asarray(rng.uniform(1, 16, h), jnp.float32), B=arr(b, l, g, n),
                C=arr(b, l, g, n), D=arr(h, dt=jnp.float32),
                dt_bias=0.5 * arr(h, dt=jnp.float32))


def scan_fns(implementation, chunk):
    def run(a):
        return ssd(**a, chunk_size=chunk, dt_softplus=True, return_final_state=True,
                   implementation=implementation)

    def grad(a):
        def loss(x, B, C):
            y, s = run({**a, "x": x, "B": B, "C": C})
            return jnp.sum(y.astype(jnp.float32)) + jnp.sum(s)
        # The loss's value with the gradients: y is then computed (the gradients alone let
        # XLA drop the forward kernel, whose y nothing read).
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(a["x"], a["B"], a["C"])
    return jax.jit(run), jax.jit(grad)


def step_inputs(rng, b, h, p, g, n, k=4):
    e = h * p + 2 * g * n
    arr = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    zxbcdt = jnp.concatenate([arr(b, h * p), arr(b, e), arr(b, h) - 1.0], axis=1)
    return dict(conv_state=arr(b, e, k).astype(jnp.bfloat16),
                zxbcdt=zxbcdt.astype(jnp.bfloat16), conv_w=0.5 * arr(e, k),
                conv_b=0.1 * arr(e), A=-jnp.asarray(rng.uniform(1, 16, h), jnp.float32),
                D=arr(h), dt_bias=0.5 * arr(h), state=arr(b, h, p, n).astype(jnp.bfloat16))


def worst(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--headdims", type=int, nargs="+", default=[64, 80, 96, 128, 192])
    parser.add_argument("--width", type=int, default=8192, help="about h * p")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--state", type=int, default=128)
    parser.add_argument("--shape", default="8x4096", help="the scan's batch x sequence")
    parser.add_argument("--step-batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes, one rep: a CPU check that the script runs")
    args = parser.parse_args(argv)
    b, l = (int(v) for v in args.shape.split("x"))
    g, n, chunk, width = args.groups, args.state, CHUNK, args.width
    if args.tiny:
        b, l, g, n, chunk, width = 1, 32, 1, 16, 16, 192
        args.step_batch, args.warmup, args.reps = 2, 0, 1
    rng = np.random.default_rng(0)
    bandwidth = copy_bandwidth(1, 3) if not args.tiny else float("nan")
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; scan {b}x{l}, "
          f"d_state {n}, {g} groups, bf16; step at batch {args.step_batch}; copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s")
    print(table_header(("headdim", "heads", "fwd ms kernels", "fwd ms xla",
                        "fwd+bwd ms kernels", "fwd+bwd ms xla", "kernels fwd TFLOP/s",
                        "kernels fwd+bwd TFLOP/s", "step us", "step GB/s of state",
                        "step / copy bandwidth")))
    for p in args.headdims:
        h = max(g, round(width / p / g) * g)
        inputs = scan_inputs(rng, b, l, h, p, g, n)
        (fwd_k, grad_k), (fwd_x, grad_x) = scan_fns("triton", chunk), scan_fns("xla", chunk)
        errors = [worst(a, c) for a, c in zip(fwd_k(inputs), fwd_x(inputs))]
        if not max(errors) < 3e-2:  # bf16 operands; NaN fails too
            raise SystemExit(f"CHECK FAILED: scan at headdim {p}: {errors}")
        times = [median_time(lambda f=f: jax.block_until_ready(f(inputs)), args.warmup,
                             args.reps) for f in (fwd_k, fwd_x, grad_k, grad_x)]
        flop = scan_flops(b, l, h, p, g, n, chunk)
        step_args = step_inputs(rng, args.step_batch, h, p, g, n)
        kernel = jax.jit(lambda a: mamba_step(**a, implementation="triton"))
        got, want = kernel(step_args), mamba_step(**step_args, implementation="xla")
        if not max(worst(a, c) for a, c in zip(got, want)) < 2.0 ** -7:
            raise SystemExit(f"CHECK FAILED: step kernel at headdim {p}")
        t_step = median_time(lambda: jax.block_until_ready(kernel(step_args)), args.warmup,
                             args.reps)
        state_bytes = 2 * step_args["state"].nbytes  # read and written
        print(table_row((p, h, *(f"{t * 1e3:.3f}" for t in times),
                         f"{flop / times[0] / 1e12:.1f}", f"{3 * flop / times[2] / 1e12:.1f}",
                         f"{t_step * 1e6:.1f}", f"{state_bytes / t_step / 1e9:.0f}",
                         f"{state_bytes / t_step / bandwidth:.2f}")), flush=True)


if __name__ == "__main__":
    main()
