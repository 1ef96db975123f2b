"""The decoding step's SSM kernel (pallas_kernels.ssd.step.mamba_step) on a GPU, against our
XLA path for the same arithmetic, per tile setting.

    python3 -m bench.step [--presets mamba2-370m,mamba2-1.3b] [--batch 64]
                          [--ssm-state-dtype bfloat16|float32|int8]
                          [--blocks 'BP,WARPS' ...]
                          [--layers 48] [--repeats 10] [--reps 10]

For each preset and each of --blocks (step.Blocks as 'block_p,num_warps'; '' is the
default, 'auto'), one row: microseconds per layer of the kernel and of the XLA path (the
window's shift, the conv, dt and the state update with its read-out, reading xBC and dt
from the in-projection's output, as `Mamba2Mixer.step` calls them), their ratio, and the
state's bytes read and written over the time against the copy bandwidth measured in the
same run (an int8 state's values and its float32 scales). At batch 64 the step is bound by
its state: 33.5 MB a layer for mamba2-370m in bf16, read and written.

Timing: one jitted call loops --repeats times over --layers layers, each with its own conv
window and state carried through the loop (so no call can be hoisted, and the state is
updated in place as in generate's decode loop), compiled as one CUDA graph
(generate's DECODE_COMPILER_OPTIONS); the host clock from the call until its result is
ready, median of --reps after 3 warm-up calls, divided by layers x repeats. Checks first,
failing loudly: every blocks setting on the GPU against the reference on the CPU
(harness.check_kernel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import (BF16_TOLERANCE, INT8_TOLERANCE, copy_bandwidth, median_time,
                           print_sweep, sweep_blocks, sweep_parser)
from mamba_jax import Mamba2Config
from mamba_jax.generate import DECODE_COMPILER_OPTIONS, SSM_STATE_DTYPES
from mamba_jax.layers import mamba2
from pallas_kernels.ssd.step import Blocks, mamba_step, state_in


def step_inputs(cfg, batch, state_dtype: str, layers, rng):
    """mamba_step's keyword arguments with conv_state and state lists of --layers each, the
    states stored in state_dtype (generate's ssm_state_dtype: "int8" an Int8State)."""
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    _, _, h, p, _, n, k, e = mamba2.dims(cfg)
    return dict(
        conv_state=[arr(batch, e, k).astype(jnp.bfloat16) for _ in range(layers)],
        zxbcdt=arr(batch, h * p + e + h).astype(jnp.bfloat16),  # in_proj: z, xBC, dt
        conv_w=0.5 * arr(e, k), conv_b=0.1 * arr(e),
        A=-jnp.asarray(rng.uniform(1.0, 16.0, h), jnp.float32), D=arr(h),
        dt_bias=0.5 * arr(h),
        state=[state_in(arr(batch, h, p, n), state_dtype) for _ in range(layers)],
        dt_limit=cfg.mamba2.dt_limit, y_dtype=jnp.bfloat16)


def per_layer(kwargs, layers, repeats, reps, **kw):
    """Seconds per layer's step: --repeats passes over --layers layers in one loop compiled
    as one CUDA graph; each layer's window and state are the loop's carry."""
    carried = {k: kwargs[k] for k in ("conv_state", "state")}
    fixed = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kwargs.items() if k not in carried and k not in fixed}

    def one_pass(_, c):
        windows, states = [], []
        for window, state in zip(c["conv_state"], c["state"]):
            _, window, state = mamba_step(window, state=state, **fixed, **static, **kw)
            windows.append(window)
            states.append(state)
        return {"conv_state": windows, "state": states}

    run = jax.jit(lambda c: jax.lax.fori_loop(0, repeats, one_pass, c), donate_argnums=0,
                  compiler_options=DECODE_COMPILER_OPTIONS)
    state = [carried]

    def call():  # each call donates the carry and keeps the next one
        state[0] = run(state[0])
        jax.block_until_ready(state[0])
    return median_time(call, 3, reps) / (layers * repeats)


def main(argv=None):
    parser = sweep_parser(__doc__, Blocks, batch=64)
    parser.add_argument("--ssm-state-dtype", default="bfloat16", choices=SSM_STATE_DTYPES)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    copy_rate = copy_bandwidth(3, 10)
    rows = []
    for preset in args.presets.split(","):
        cfg = Mamba2Config.preset(preset)
        kwargs = step_inputs(cfg, args.batch, args.ssm_state_dtype, args.layers, rng)
        state_bytes = 2 * sum(a.nbytes for a in jax.tree.leaves(kwargs["state"][0]))  # r + w
        first = {k: v[0] if isinstance(v, list) else v for k, v in kwargs.items()}
        fresh = lambda: {k: jax.tree.map(jnp.copy, v) if isinstance(v, list) else v
                        for k, v in kwargs.items()}  # each timing donates its own
        xla = per_layer(fresh(), args.layers, args.repeats, args.reps, implementation="xla")
        timed = sweep_blocks(Blocks, args.blocks, f"{preset} batch {args.batch}", mamba_step,
                             first, lambda blocks: per_layer(
                                 fresh(), args.layers, args.repeats, args.reps,
                                 implementation="triton", blocks=blocks), xla,
                             INT8_TOLERANCE if args.ssm_state_dtype == "int8" else BF16_TOLERANCE)
        rows += [(preset, text, ours, xla, state_bytes) for text, ours in timed]
    print_sweep(f"batch {args.batch}, {args.ssm_state_dtype} states, {args.layers} layers a "
                "call", ("preset", "blocks (bp,warps)"), "ours state GB/s", rows, copy_rate)


if __name__ == "__main__":
    main()
