"""The trainer's --init-from on a large model: how much host and device memory its load
takes as a bfloat16 checkpoint of a preset's shape goes onto a mesh, against the float32
copy of the whole model it must not make.

    python3 -m bench.init_from --dir /tmp/nano9b [--preset nemotron-nano-9b-v2]
                               [--mesh fsdp=1 --mesh fsdp=2]
                               [--lora-rank 16 --base-dtype bfloat16]

(each --mesh runs in a child that sees as many GPUs as the mesh has devices).

Writes DIR once, if it holds no model: the preset's config.json in the layout the trainer
exports it in (formats.export_format; NemotronH for the Nemotron presets) and random
bfloat16 weights (normal, std 0.02) in safetensors shards of at most 5 GB with their index,
as the hub publishes large models; the writer is a child process on the CPU. Then, for each
--mesh, a child process on the GPUs loads DIR as the trainer does (init_from.InitSource:
open, then load onto the mesh's shardings of the model's parameters) and reports: seconds,
its host RSS before the load and its peak after (ru_maxrss), and each device's peak bytes
in use. The table's baseline, from the same run, is the float32 copy of the whole model
that a loader reading the checkpoint at once would hold on the host (4 bytes a parameter);
ratio: the load's growth of the peak RSS over it (about one tensor's bytes over the
model's: near 0). The largest device's peak against the model's bytes as the run stores
them over the mesh's fsdp x tp says that no device held more than its shard. With
--lora-rank (and --base-dtype bfloat16), the load is a LoRA run's (init_from.placed_state:
the frozen base read straight into its dtype, the adapters drawn beside it), whose stored
bytes are the bfloat16 base's: a peak above them is a copy of the base in float32 on the
devices.

End to end, one step of training from DIR (the optimizer state included: three float32
copies of the model, so the 9B model needs fsdp=2 on H200s):

    python -m mamba_jax.train --init-from DIR --tokenizer bytes --mesh fsdp=2 --steps 1 \\
        --lr 0 --batch-size 2 --seq-len 512 --dtype bfloat16 --out none
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from pathlib import Path

from bench.harness import gpus, result, run_module, table_header, table_row

SHARD_BYTES = 5 << 30  # the hub's usual shard size


def write(directory: Path, preset: str) -> None:
    """DIR's config.json, bfloat16 shards and index (in this process: run on a CPU)."""
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np
    from safetensors.flax import save_file

    from mamba_jax.config import Mamba2Config
    from mamba_jax.convert import tensor_shapes
    from mamba_jax.formats import config_dict, export_format

    cfg = Mamba2Config.preset(preset)
    fmt = export_format(cfg, "hf")
    shapes = tensor_shapes(cfg, fmt)
    shards, current, size = [], {}, 0
    for key, shape in shapes.items():
        if current and size + 2 * math.prod(shape) > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[key] = shape
        size += 2 * math.prod(shape)
    shards.append(current)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file({key: jnp.asarray((0.02 * rng.standard_normal(shape, np.float32))
                                    .astype(ml_dtypes.bfloat16)) for key, shape in shard.items()},
                  directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        print(f"  wrote {name}", file=sys.stderr, flush=True)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (directory / "config.json").write_text(json.dumps(config_dict(cfg, fmt), indent=2))


def load(directory: Path, mesh_spec: str, lora_rank: int | None, base_dtype: str) -> None:
    """Load DIR onto the mesh as the trainer does (a LoRA run's state with lora_rank), and
    report (result) what it took."""
    import jax
    from flax import nnx

    from mamba_jax import adapters, parallel
    from mamba_jax.init_from import InitSource, placed_state
    from mamba_jax.model import Mamba2LM

    mesh = parallel.make_mesh(mesh_spec)
    source = InitSource.open(directory)
    build = lambda: Mamba2LM(source.config, rngs=nnx.Rngs(0))
    if lora_rank is not None:
        tuning = adapters.Tuning(rank=lora_rank, base_dtype=base_dtype).check(source.config)
        build = tuning.build(build, 0)
    graphdef, abstract = nnx.split(nnx.eval_shape(build))
    shardings = parallel.shardings(mesh, parallel.param_specs(abstract, mesh))
    size = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract))
    stored = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract))
    jax.block_until_ready(jax.device_put(0.0))  # the client started: its memory counted before
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    jax.block_until_ready(placed_state(build, abstract, shardings, source.load))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    devices = [(d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.devices()]
    result({"mesh": mesh_spec, "seconds": seconds, "rss_before": before, "rss_peak": peak,
            "float32_bytes": 4 * size, "stored_bytes": stored, "device_peak": max(devices),
            "split": mesh.shape["fsdp"] * mesh.shape["tp"],
            "device": jax.devices()[0].device_kind})


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m bench.init_from", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, type=Path,
                        help="the checkpoint folder (written if it holds no model)")
    parser.add_argument("--preset", default="nemotron-nano-9b-v2")
    parser.add_argument("--mesh", action="append", default=None,
                        help="a mesh to load onto (repeatable; default: fsdp=1 and fsdp=2)")
    parser.add_argument("--lora-rank", type=int, default=None,
                        help="load a LoRA run's state: adapters of this rank beside the base")
    parser.add_argument("--base-dtype", choices=("float32", "bfloat16"), default="bfloat16",
                        help="with --lora-rank: the dtype the frozen base is stored in")
    parser.add_argument("--part", choices=("write", "load"), default=None,
                        help=argparse.SUPPRESS)  # a child's part
    args = parser.parse_args(argv)
    meshes = args.mesh or ["fsdp=1", "fsdp=2"]
    if args.part == "write":
        return write(args.dir, args.preset)
    if args.part == "load":
        return load(args.dir, meshes[0], args.lora_rank, args.base_dtype)
    if not (args.dir / "config.json").is_file():
        run_module("init_from", ["--dir", str(args.dir), "--preset", args.preset,
                                 "--part", "write"], env={"JAX_PLATFORMS": "cpu"})
    gib = lambda n: f"{n / 2**30:.2f}"
    rows = []
    for mesh in meshes:  # each child sees as many GPUs as its mesh has devices
        from mamba_jax.parallel import parse_mesh_spec

        visible = gpus(math.prod(parse_mesh_spec(mesh).values()))
        lora = [] if args.lora_rank is None else ["--lora-rank", str(args.lora_rank),
                                                  "--base-dtype", args.base_dtype]
        reported = run_module("init_from", ["--dir", str(args.dir), "--mesh", mesh,
                                            "--part", "load", *lora], visible=visible)
        if not reported or "error" in reported[-1]:
            rows.append(table_row([mesh, *["error"] * 7, str(reported[-1:])[:200]]))
            continue
        r = reported[-1]
        growth = (r["rss_peak"] - r["rss_before"]) / r["float32_bytes"]
        rows.append(table_row([
            mesh, f"{r['seconds']:.1f}", gib(r["rss_before"]), gib(r["rss_peak"]),
            gib(r["float32_bytes"]), f"{growth:.3f}", gib(r["device_peak"]),
            gib(r["stored_bytes"] / r["split"]), r["device"]]))
    run = ("" if args.lora_rank is None else
           f"; a LoRA run's state: rank {args.lora_rank}, the base in {args.base_dtype}")
    print(f"{time.strftime('%Y-%m-%d')} --init-from {args.dir} ({args.preset}, bfloat16{run})")
    print(table_header(["mesh", "load s", "host RSS before GiB", "host RSS peak GiB",
                        "baseline: float32 model GiB", "ratio: RSS growth / baseline",
                        "largest device peak GiB", "stored model / (fsdp x tp) GiB",
                        "device"]))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
