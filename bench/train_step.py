"""The trainer's sharded step on one GPU: a baseline for the multi-GPU runs, and a check of
the GPU's float32 losses against the CPU's.

    python3 bench/train_step.py                   # both parts, prints two tables
    python3 bench/train_step.py --skip-tiny       # only the throughput baseline

1. tiny preset, float32: the first five losses of `python -m mamba_jax.train` on the GPU
   (default and "highest" matmul precision) and on the host CPU, same seed and batches.
2. mamba2-1.3b, bf16 compute, seqlen 4096, one-device mesh, through mamba_jax.parallel's
   loss and the trainer's jitted step: step time, tokens/s, MFU, peak memory.
MFU: mamba_jax.metrics.train_flops_per_token (the trainer's count: every matmul, the SSD's
chunked ones included, forward x3) over the H200's dense bf16 peak (989 TFLOP/s, NVIDIA's
datasheet).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PEAK_BF16_FLOPS = 989e12


def tiny_losses(platform: str, precision: str | None) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, JAX_PLATFORMS=platform)
        if precision:
            env["JAX_DEFAULT_MATMUL_PRECISION"] = precision
        run = subprocess.run([sys.executable, "-m", "mamba_jax.train", "--steps", "5",
                              "--out", "none", "--metrics-file", f"{tmp}/m.jsonl"], env=env,
                             capture_output=True, text=True)
        if run.returncode:
            print(run.stderr[-3000:])
            return [float("nan")] * 5
        with open(f"{tmp}/m.jsonl") as f:
            return [json.loads(line)["loss"] for line in f]


def baseline(preset: str, batch: int, seq_len: int, steps: int):
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mamba_jax import parallel
    from mamba_jax.config import Mamba2Config
    from mamba_jax.model import Mamba2LM
    from mamba_jax.metrics import train_flops_per_token
    from mamba_jax.optim import init_opt_state, make_optimizer, make_train_step
    from mamba_jax.parallel import global_array

    cfg = Mamba2Config.preset(preset)
    dtype = jax.numpy.bfloat16
    mesh = parallel.make_mesh("dp=1")
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0),
                                                                    dtype=dtype)))
    specs = parallel.param_specs(abstract, cfg, mesh)
    params = jax.jit(lambda: nnx.split(Mamba2LM(cfg, rngs=nnx.Rngs(0), dtype=dtype))[1],
                     out_shardings=parallel.shardings(mesh, specs))()
    n_params = sum(x.size for x in jax.tree.leaves(params))
    tx, _ = make_optimizer(params, 3e-4, 1000, 10, 0.1, 1.0)
    opt_state = init_opt_state(tx, params, parallel.shardings(mesh, specs),
                               NamedSharding(mesh, P()))
    step = make_train_step(parallel.make_loss_fn(graphdef, specs, mesh), tx)
    rows = NamedSharding(mesh, P(None, *parallel.TOKENS))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, batch, seq_len + 1),
                                            dtype=np.int32)
    batch_arrays = (global_array(ids[..., :-1], rows), global_array(ids[..., 1:], rows))
    start = time.perf_counter()
    params, opt_state, loss, _ = step(params, opt_state, batch_arrays)
    loss.block_until_ready()
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        params, opt_state, loss, _ = step(params, opt_state, batch_arrays)
        loss.block_until_ready()
        times.append(time.perf_counter() - start)
    step_s = float(np.median(times))
    tokens = batch * seq_len
    flops = train_flops_per_token(cfg, seq_len) * tokens
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30
    print(f"| {preset} | {batch}x{seq_len} | {n_params / 1e9:.3f}B | {first:.1f} | "
          f"{step_s * 1e3:.1f} | {tokens / step_s:,.0f} | "
          f"{100 * flops / step_s / PEAK_BF16_FLOPS:.1f}% | {peak:.1f} | {float(loss):.3f} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--skip-tiny", action="store_true")
    p.add_argument("--preset", default="mamba2-1.3b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    import jax
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    if not args.skip_tiny:
        gpu = tiny_losses("cuda", None)
        gpu_highest = tiny_losses("cuda", "highest")
        cpu = tiny_losses("cpu", None)
        print("| step | CPU | GPU (default precision) | GPU (highest) | max rel. diff, highest |")
        print("|---|---|---|---|---|")
        for i, (c, g, h) in enumerate(zip(cpu, gpu, gpu_highest), 1):
            print(f"| {i} | {c:.6f} | {g:.6f} | {h:.6f} | {abs(h - c) / abs(c):.1e} |",
                  flush=True)
    print("| model | batch x seqlen | params | first step (s, with compile) | step (ms) | "
          "tokens/s | MFU | peak memory (GiB) | loss |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    baseline(args.preset, args.batch, args.seq_len, args.steps)


if __name__ == "__main__":
    main()
