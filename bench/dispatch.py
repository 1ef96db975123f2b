"""generate()'s cost a call on the host: the work to start its two programs, which the GPU
waits for before the prefill begins.

    python3 -m bench.dispatch [--presets mamba2-1.3b,megatron-hybrid-800m] [--reps 20]

For each preset, a model of the preset's layers (so its number of arrays) at small widths,
so that the programs themselves take little time: the arrays in the model, and the median
ms of generate(max_new_tokens=1) (a prefill of 8 tokens and an empty decode loop, on
whatever device JAX has) after two warm-up calls that compile them. On the CPU the figure
is mostly the host's; the widths make the programs' own work a small part of it.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from bench.harness import median_time, table_header, table_row
from mamba_jax import Mamba2Config, Mamba2LM, generate

# Small widths that every preset's layer pattern accepts (attention and MLP layers too).
SMALL = dict(d_model=64, d_state=16, headdim=16, chunk_size=16, vocab_size=256)


def small(preset: str) -> Mamba2Config:
    """The preset's layers at SMALL's widths."""
    cfg = Mamba2Config.preset(preset, **SMALL)
    if "*" in cfg.layers:
        cfg = cfg.replace(attn_num_heads=4, attn_num_heads_kv=4, attn_head_dim=16,
                          d_intermediate=128)
    return cfg


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="mamba2-1.3b,megatron-hybrid-800m")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(table_header(("preset (small widths)", "layers", "arrays",
                        "ms per generate(max_new_tokens=1)")))
    for preset in args.presets.split(","):
        cfg = small(preset)
        model = Mamba2LM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
        ids = jnp.zeros((1, 8), jnp.int32)
        t = median_time(lambda: generate(model, ids, 1).block_until_ready(), 2, args.reps)
        arrays = len(jax.tree_util.tree_leaves(nnx.state(model)))
        print(table_row((preset, cfg.n_layer, arrays, f"{1e3 * t:.2f}")), flush=True)


if __name__ == "__main__":
    main()
