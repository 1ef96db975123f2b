"""The trainer: `python -m mamba_jax.train` (tiny preset on the bundled corpus by default).

    python -m mamba_jax.train --preset tiny --steps 300 --metrics-file m.jsonl
    python -m mamba_jax.train --set ngroups=2 --set d_state=64

    python -m mamba_jax.train --mesh dp=2,tp=4 --grad-accum 2

optax AdamW with linear warmup and cosine decay, global-norm clipping, and no weight decay
on A_log, D, dt_bias, norms and biases (as mamba_ssm's recipes). Every run, one device or
many, goes through the same sharded code (mamba_jax.parallel) over a mesh (`--mesh`,
default: every device on dp). The training step is a pure jitted function of
(params, opt_state, batch) with the shardings in the arrays, buffers donated.
Several processes (multi-host): pass --coordinator-address, --num-processes and
--process-id (or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) to each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from mamba_jax import parallel
from mamba_jax.config import PRESETS, Mamba2Config
from mamba_jax.convert import flat_params, save_pretrained
from mamba_jax.data import (DEFAULT_CORPUS, eval_windows, load_tokenizer, random_windows,
                            split_tokens, tokenize_file)
from mamba_jax.model import Mamba2LM, param_name

_NO_DECAY_NAMES = ("A_log", "D", "dt_bias", "norm")


def no_weight_decay(name: str) -> bool:
    """True for parameters mamba_ssm trains without weight decay: A_log, D, dt_bias, every
    norm weight and every bias. `name` is a dotted parameter name ("layers.0.mixer.D")."""
    parts = name.split(".")
    return (parts[-1] in _NO_DECAY_NAMES or parts[-1].endswith("bias")
            or any(p.startswith("norm") for p in parts))


def weight_decay_mask(params):
    """A pytree like params: True where weight decay applies."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not no_weight_decay(param_name(path)), params)


def make_optimizer(params, lr, steps, warmup, weight_decay, clip):
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=min(warmup, max(steps - 1, 1)),
        decay_steps=max(steps, 2), end_value=lr * 0.1)
    tx = optax.chain(
        optax.clip_by_global_norm(clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay,
                    mask=weight_decay_mask(params)))
    return tx, schedule


def make_train_step(loss_fn, tx):
    """step(params, opt_state, batch) -> (params, opt_state, loss, grad_norm), jitted.

    batch = (inputs, targets), each [micro-batches, b, l]: the gradient is the mean over the
    micro-batches, accumulated in a scan (--grad-accum). Shardings ride on the arrays;
    params and opt_state are donated.
    """
    def step(params, opt_state, batch):
        n = batch[0].shape[0]
        if n == 1:  # no loop: a scan costs a little even over one micro-batch
            loss, grads = jax.value_and_grad(loss_fn)(params, batch[0][0], batch[1][0])
        else:
            def accumulate(total, micro_batch):
                loss, grads = jax.value_and_grad(loss_fn)(params, *micro_batch)
                return jax.tree.map(jnp.add, total, (loss, grads)), None
            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(accumulate, zeros, batch)
            loss, grads = loss / n, jax.tree.map(lambda g: g / n, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)
    return jax.jit(step, donate_argnums=(0, 1))


def global_array(array: np.ndarray, sharding):
    """A host array (the same on every process) -> a jax.Array placed as sharding; each
    process supplies only its own devices' pieces."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def parse_overrides(pairs: list[str]) -> dict:
    """["ngroups=2", "dt_limit=0.001,0.1"] -> {"ngroups": 2, "dt_limit": (0.001, 0.1)}."""
    fields = {f.name: f for f in dataclasses.fields(Mamba2Config)}
    out = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in fields:
            raise SystemExit(f"--set {pair!r}: expected FIELD=VALUE with FIELD one of "
                             f"{sorted(fields)}")
        default = getattr(Mamba2Config(), name)
        try:
            if isinstance(default, bool):
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(text)
                value = text.lower() in ("true", "1")
            elif isinstance(default, tuple):
                value = tuple(float(v) for v in text.strip("()[]").split(","))
            else:
                value = type(default)(text)
        except ValueError:
            raise SystemExit(f"--set {pair!r}: {text!r} is not a valid "
                             f"{type(default).__name__} for {name}") from None
        out[name] = value
    return out


class Progress:
    """One status line, redrawn in place on a terminal, printed every 10% otherwise."""

    def __init__(self, total: int):
        self.total, self.tty, self.last = total, sys.stderr.isatty(), -1

    def update(self, step: int, text: str):
        frac = step / self.total
        if self.tty:
            bar = "#" * int(30 * frac)
            print(f"\r{step:>6}/{self.total} [{bar:<30}] {text}", end="", file=sys.stderr,
                  flush=True)
            if step == self.total:
                print(file=sys.stderr)
        elif int(10 * frac) > self.last or step == self.total:
            self.last = int(10 * frac)
            print(f"{step:>6}/{self.total} {text}", file=sys.stderr, flush=True)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m mamba_jax.train",
                                description="Train a Mamba2 language model.")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a Mamba2Config field (repeatable), e.g. --set ngroups=2")
    p.add_argument("--data", default=str(DEFAULT_CORPUS),
                   help="a UTF-8 text file (default: the bundled corpus)")
    p.add_argument("--tokenizer", default="bytes", help="tokenizer.json path or 'bytes'")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype (parameters and optimizer state stay float32)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--metrics-file", default=None,
                   help="append one JSON line per step (step, loss, lr, grad_norm, ...)")
    p.add_argument("--out", default="runs/{preset}",
                   help="where the final checkpoint goes (HF layout + tokenizer.json); "
                        "'none' to skip")
    p.add_argument("--mesh", default=None, metavar="SPEC",
                   help="device mesh, e.g. 'tp=4' or 'dp=2,fsdp=2,tp=2' (axes dp, fsdp, tp; "
                        "omitted axes are 1; default: every device on dp)")
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   help="keep the residual stream whole on every tp rank (all-reduce after "
                        "each mixer) instead of split on the sequence")
    p.add_argument("--grad-accum", type=int, default=1, metavar="N",
                   help="split each batch into N micro-batches and average their gradients")
    p.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="multi-process runs: process 0's address (all processes)")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "grad_accum"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    parallel.initialize_distributed(args.coordinator_address, args.num_processes,
                                    args.process_id)
    lead = jax.process_index() == 0  # the process that prints, logs and saves
    cfg = Mamba2Config.preset(args.preset, **parse_overrides(args.set))
    tokenizer = load_tokenizer(args.tokenizer)
    tokens = tokenize_file(args.data, tokenizer, cfg.vocab_size)
    train_tokens, eval_tokens = split_tokens(tokens, args.seq_len)
    dtype = jnp.dtype(args.dtype)
    try:
        mesh = parallel.make_mesh(args.mesh)
        if args.batch_size % args.grad_accum:
            raise ValueError(f"--batch-size {args.batch_size} is not divisible by "
                             f"--grad-accum {args.grad_accum}")
        parallel.check_layout(cfg, mesh, batch_size=args.batch_size // args.grad_accum,
                              seq_len=args.seq_len, sequence_parallel=args.sequence_parallel)
    except ValueError as e:
        raise SystemExit(str(e)) from None

    # Parameters are created in place, already sharded: no device holds the whole model
    # first, and every process builds the same values from the seed.
    make_params = lambda: nnx.split(Mamba2LM(cfg, rngs=nnx.Rngs(args.seed), dtype=dtype))[1]
    graphdef, abstract_params = nnx.split(
        nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(args.seed), dtype=dtype)))
    specs = parallel.param_specs(abstract_params, cfg, mesh)
    params = jax.jit(make_params, out_shardings=parallel.shardings(mesh, specs))()
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    if lead:
        print(f"mamba_jax.train: preset {args.preset}, {n_params / 1e6:.2f}M parameters, "
              f"{len(train_tokens)} training tokens, {jax.devices()[0].platform} x "
              f"{jax.device_count()} ({jax.process_count()} processes), mesh "
              f"{dict(mesh.shape)}, sequence parallel "
              f"{args.sequence_parallel and mesh.shape['tp'] > 1}, compute {args.dtype}",
              file=sys.stderr)
    tx, schedule = make_optimizer(params, args.lr, args.steps, args.warmup, args.weight_decay,
                                  args.clip)
    opt_state = jax.jit(tx.init)(params)
    loss_fn = parallel.make_loss_fn(graphdef, specs, mesh,
                                    sequence_parallel=args.sequence_parallel)
    eval_loss = jax.jit(loss_fn)
    train_step = make_train_step(loss_fn, tx)
    rows = NamedSharding(mesh, P(parallel.BATCH_AXES, None))
    micro_rows = NamedSharding(mesh, P(None, parallel.BATCH_AXES, None))
    n_shards = mesh.shape["dp"] * mesh.shape["fsdp"]

    def evaluate(params):
        losses = []
        for x, y in eval_windows(eval_tokens, args.batch_size, args.seq_len):
            keep = len(x) - len(x) % n_shards  # whole rows per batch shard
            if keep:
                losses.append(eval_loss(params, global_array(x[:keep], rows),
                                        global_array(y[:keep], rows)))
        return float(np.mean(losses))

    metrics = open(args.metrics_file, "a") if args.metrics_file and lead else None
    batches = random_windows(train_tokens, args.batch_size, args.seq_len, args.seed)
    progress = Progress(args.steps)
    start = time.perf_counter()
    try:
        for step in range(1, args.steps + 1):
            batch = tuple(global_array(a.reshape(args.grad_accum, -1, args.seq_len), micro_rows)
                          for a in next(batches))
            params, opt_state, loss, grad_norm = train_step(params, opt_state, batch)
            record = {"step": step, "loss": float(loss), "lr": float(schedule(step - 1)),
                      "grad_norm": float(grad_norm)}
            if not np.isfinite(record["loss"]):
                raise SystemExit(f"step {step}: loss is {record['loss']}; lower --lr or use "
                                 "--dtype float32")
            if step % args.eval_every == 0 or step == args.steps:
                record["eval_loss"] = evaluate(params)
            record["tokens_per_s"] = step * args.batch_size * args.seq_len / (
                time.perf_counter() - start)
            if metrics:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            if lead:
                progress.update(step, f"loss {record['loss']:.3f}"
                                + (f" eval {record['eval_loss']:.3f}" if "eval_loss" in record
                                   else "") + f" {record['tokens_per_s']:.0f} tok/s")
    finally:
        if metrics:
            metrics.close()

    out = args.out.format(preset=args.preset)
    if out.lower() != "none":
        if jax.process_count() > 1:
            params = multihost_utils.process_allgather(params, tiled=True)  # all processes join
        if lead:
            model = nnx.merge(graphdef, params)
            save_pretrained(model, out, format="hf")
            tokenizer.save(str(Path(out) / "tokenizer.json"))
            print(f"saved {out} ({len(flat_params(model))} tensors); try: python -m "
                  f"mamba_jax.generate --checkpoint {out} --prompt 'This License'",
                  file=sys.stderr)


if __name__ == "__main__":
    main()
