"""The trainer's step on a CPU: a Mamba-1 preset against a Mamba2 preset of the same size,
measured in one process, taking turns; and the Mamba-1 layer's selective scan alone.

    python3 -m bench.cpu_step [--presets tiny-mamba1 tiny] [--batch 16] [--seq-len 128]
                              [--rounds 5] [--steps 5]

The step is `python -m mamba_jax.train`'s at its defaults (float32, batch 16 x 128 tokens,
one device, the layers unrolled, the trainer's compiler options: bench.train_step.Steps).
Each round runs every preset's step in turn (two warm-up steps, then --steps steps
dispatched as the trainer dispatches them, the median); a row's step time is the median of
its rounds, and the ratio the median of the rounds' ratios to the last preset (the
baseline): on a shared machine a ratio within a round is steadier than either time. Also
each preset's compile (lowering and XLA's compile, no compilation cache) and first step.

The scan table: the first preset's Mamba-1 layer's scan (x, dt [batch, seq-len, d_inner],
d_state) alone, forward and forward+backward (harness.forward_and_backward), of the
dispatcher's implementation="xla" (ours) and of the recurrence token by token
(reference.selective_scan_naive, differentiated by JAX: the oracle as a plain lax.scan),
after checking ours against it (values and every gradient, float32, within 1e-4 of the
largest). Medians of --reps calls, the two taking turns.

Progress goes to stderr; the tables to stdout.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import (check_outputs, device_line, forward_and_backward, median_time,
                           table_header, table_row)
from bench.train_step import Steps, log
from mamba_jax.config import Mamba2Config
from mamba_jax.layers.mamba1 import dims
from pallas_kernels.selective_scan import reference, selective_scan

CHECK_TOLERANCE = 1e-4  # float32 sums over seq-len tokens in other orders


def steps_table(args):
    """[(preset, compile s, first step s, [step s per round])] and the rounds' ratios."""
    runs = {name: Steps(name, "dp=1", "none", None, dtype="float32") for name in args.presets}
    first = {}
    for name, run in runs.items():
        measured = run.measure(args.batch, args.seq_len, args.steps)
        first[name] = (measured["compile_s"], measured["first_step_s"])
    per_round = {name: [] for name in runs}
    for r in range(args.rounds):
        for name, run in runs.items():
            step = run.measure(args.batch, args.seq_len, args.steps)["step_s"]
            per_round[name].append(step)
            log(f"  round {r + 1}: {name} {step * 1e3:.1f} ms")
    baseline = args.presets[-1]
    print(f"\n{device_line()}, {jax.local_device_count()} CPU device(s); the trainer's step "
          f"(float32, batch {args.batch} x {args.seq_len}), {args.rounds} rounds of "
          f"{args.steps} steps")
    print(table_header(("preset", "step ms (median of rounds)", "rounds ms",
                        f"ratio to {baseline}", "compile s", "first step s")))
    for name in runs:
        ratios = [a / b for a, b in zip(per_round[name], per_round[baseline])]
        print(table_row((name, f"{statistics.median(per_round[name]) * 1e3:.1f}",
                         " ".join(f"{t * 1e3:.0f}" for t in per_round[name]),
                         f"{statistics.median(ratios):.2f}x", f"{first[name][0]:.1f}",
                         f"{first[name][1]:.2f}")))


def scan_table(args):
    cfg = Mamba2Config.preset(args.presets[0])
    _, d, _, n, _ = dims(cfg)
    b, l = args.batch, args.seq_len
    rng = np.random.default_rng(0)
    arr = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    inputs = (arr(b, l, d), arr(b, l, d) - 2.0, -jnp.exp(arr(d, n)), arr(b, l, n),
              arr(b, l, n), arr(d), arr(d))
    dy = (arr(b, l, d), arr(b, d, n))
    xla = lambda x, dt, A, B, C, D, dt_bias: selective_scan(
        x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True, return_final_state=True,
        implementation="xla", chunk_size=cfg.mamba1.chunk_size)

    def oracle(x, dt, A, B, C, D, dt_bias):
        dt = jax.nn.softplus(dt + dt_bias)
        return reference.selective_scan_naive(x, dt, A, B, C, D=D)

    forms = {"ours (xla)": xla, "oracle (lax.scan per token)": oracle}
    both = {k: forward_and_backward(f) for k, f in forms.items()}
    names = ["y", "final_state", "dx", "ddt", "dA", "dB", "dC", "dD", "ddt_bias"]
    got, want = (jax.tree.leaves(both[k](*inputs, dy)) for k in forms)
    check_outputs(f"xla scan against the oracle at {b}x{l}, d_inner {d}, d_state {n}", got,
                  want, dict.fromkeys(names, CHECK_TOLERANCE))
    calls = {}
    for k, f in forms.items():
        forward = jax.jit(f)
        calls[k, "fwd"] = lambda forward=forward: jax.block_until_ready(forward(*inputs))
        calls[k, "fwd+bwd"] = lambda k=k: jax.block_until_ready(both[k](*inputs, dy))
        calls[k, "fwd"]()  # compiles it
    times = {key: [] for key in calls}
    for _ in range(args.reps):  # one call of each in turn
        for key, call in calls.items():
            times[key].append(median_time(call, 0, 1))
    ours, oracle_name = forms
    print(f"\nthe scan alone: {args.presets[0]}'s layer, batch {b} x {l}, d_inner {d}, "
          f"d_state {n}, float32; median of {args.reps} calls")
    print(table_header(("pass", "ours ms", "oracle ms", "ours/oracle")))
    for p in ("fwd", "fwd+bwd"):
        a, o = (statistics.median(times[k, p]) for k in (ours, oracle_name))
        print(table_row((p, f"{a * 1e3:.1f}", f"{o * 1e3:.1f}", f"{a / o:.2f}x")))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=["tiny-mamba1", "tiny"],
                   help="the first a Mamba-1 preset (its layer gives the scan table's "
                        "shape); the last the baseline of the ratios")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    if jax.default_backend() != "cpu":
        raise SystemExit(f"bench.cpu_step times the CPU; this process's backend is "
                         f"{jax.default_backend()} (run with JAX_PLATFORMS=cpu)")
    scan_table(args)
    steps_table(args)


if __name__ == "__main__":
    main()
