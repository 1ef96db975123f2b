"""The norm-then-projection kernel (pallas_kernels.norm_matmul) on a GPU, against our XLA
path for the same arithmetic (a norm fusion and a cuBLAS matrix-vector product).

    python3 -m bench.norm_matmul [--presets mamba2-370m,mamba2-1.3b] [--batch 1]
                                 [--blocks 'BN,BK,WARPS' ...] [--layers 48] [--repeats 10]
                                 [--reps 10]

For each preset's two decoding projections as the fused step calls them (in_proj: the
block's RMSNorm, then [d] -> [2*h*p + 2*g*n + h]; out_proj: the grouped norm of y already
gated, float32 from the step kernel, then [h*p] -> [d] plus the residual)
and each of --blocks (norm_matmul.Blocks; '' is the default, 'auto'), one row: microseconds
per call of the kernel and of the XLA path, their ratio, and w's bytes over the time against
the copy bandwidth measured in the same run.

Timing: one jitted call loops --repeats times over --layers projections, each on its own
weight as a decode step does (48 of them exceed the H200's 50 MB L2, so w comes from HBM),
compiled as one CUDA graph as generate's decode loop is; the host clock from the call until
its result is ready, median of --reps after 3 warm-up calls, divided by layers x repeats.
Checks first, failing loudly: every blocks setting on the GPU against the reference on the
CPU (harness.check_kernel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import copy_bandwidth, median_time, print_sweep, sweep_blocks, sweep_parser
from mamba_jax import Mamba2Config
from mamba_jax.generate import DECODE_COMPILER_OPTIONS
from mamba_jax.layers import mamba2
from pallas_kernels.decode.norm_matmul import Blocks, rms_norm_matmul


def projections(cfg, batch, layers, rng):
    """{name: keyword arguments, with `w` a list of --layers weights}."""
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    dims = mamba2.dims(cfg)
    hp, d = dims.d_inner, cfg.d_model
    n_in = hp + dims.e + dims.h  # z, xBC, dt
    weights = lambda n, k: [(arr(n, k) / k ** 0.5).astype(jnp.bfloat16) for _ in range(layers)]
    return {
        "in_proj": dict(x=arr(batch, d), weight=arr(d), w=weights(n_in, d), eps=cfg.norm_eps,
                        w_transposed=True),
        "out_proj": dict(x=arr(batch, hp), weight=arr(hp), w=weights(d, hp), eps=cfg.norm_eps,
                         ngroups=cfg.mamba2.ngroups, residual=arr(batch, d),
                         w_transposed=True)}


def per_call(kwargs, layers, repeats, reps, **kw):
    """Seconds per projection: --repeats passes over --layers weights, each pass one iteration
    of a loop compiled as one CUDA graph (generate's DECODE_COMPILER_OPTIONS), so that the
    GPU's time is measured rather than the host's launches. Each call's output feeds the
    next one's input (in_proj: its first d columns; out_proj: the residual), so that XLA can
    neither reorder the calls nor hoist them out of the loop."""
    args = {k: v for k, v in kwargs.items() if isinstance(v, (jax.Array, list))}
    static = {k: v for k, v in kwargs.items() if k not in args}
    chained = "residual" if "residual" in args else "x"

    def one_pass(_, a):
        for w in a["w"]:
            out = rms_norm_matmul(**{**a, "w": w}, **static, **kw)
            a = {**a, chained: out[:, :a[chained].shape[1]].astype(a[chained].dtype)}
        return a

    run = jax.jit(lambda a: jax.lax.fori_loop(0, repeats, one_pass, a)[chained],
                  compiler_options=DECODE_COMPILER_OPTIONS)
    return median_time(lambda: run(args).block_until_ready(), 3, reps) / (layers * repeats)


def main(argv=None):
    args = sweep_parser(__doc__, Blocks, batch=1).parse_args(argv)
    rng = np.random.default_rng(0)
    copy_rate = copy_bandwidth(3, 10)
    rows = []
    for preset in args.presets.split(","):
        cfg = Mamba2Config.preset(preset)
        for name, kwargs in projections(cfg, args.batch, args.layers, rng).items():
            w_bytes = kwargs["w"][0].nbytes
            xla = per_call(kwargs, args.layers, args.repeats, args.reps, implementation="xla")
            timed = sweep_blocks(Blocks, args.blocks, f"{preset} {name}", rms_norm_matmul,
                                 {**kwargs, "w": kwargs["w"][0]}, lambda blocks: per_call(
                                     kwargs, args.layers, args.repeats, args.reps,
                                     implementation="triton", blocks=blocks), xla)
            rows += [(preset, name, text, ours, xla, w_bytes) for text, ours in timed]
    print_sweep(f"batch {args.batch}, {args.layers} layers a call",
                ("preset", "projection", "blocks (bn,bk,warps)"), "ours GB/s", rows, copy_rate)


if __name__ == "__main__":
    main()
