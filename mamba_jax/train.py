"""The trainer: `python -m mamba_jax.train` (tiny preset on the bundled corpus by default).

    python -m mamba_jax.train --preset tiny --steps 300 --metrics-file m.jsonl
    python -m mamba_jax.train --config train/mamba2-130m.toml --data data/corpus \
        --mesh dp=2,tp=4 --checkpoint-dir runs/130m/ckpt --save-every 500 --resume
    python -m mamba_jax.train --set ngroups=2 --set d_state=64

Every run, one device or many, goes through the same sharded code (mamba_jax.parallel) over
a mesh (`--mesh`, default: every device on dp); the step is a pure jitted function of
(params, opt_state, batch) with the shardings in the arrays (mamba_jax.optim). Batch `s` is
a pure function of (s, seed) (mamba_jax.data), so a checkpoint needs only the step to
restore the data position. Checkpoints (mamba_jax.checkpoint) restore onto any mesh.
SIGTERM / SIGINT save a checkpoint at the current step and exit cleanly.
Several processes (multi-host): pass --coordinator-address, --num-processes and
--process-id (or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) to each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import time
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from mamba_jax import parallel
from mamba_jax.checkpoint import Checkpointer, abstract_like
from mamba_jax.config import PRESETS, Mamba2Config
from mamba_jax.convert import save_pretrained
from mamba_jax.data import DEFAULT_CORPUS, TokenDataset
from mamba_jax.formats import config_dict, export_format
from mamba_jax.metrics import (MetricsWriter, Progress, peak_flops, peak_memory_gib,
                               train_flops_per_token)
from mamba_jax.model import REMAT, Mamba2LM
from mamba_jax.optim import SCHEDULES, init_opt_state, make_optimizer, make_train_step
from mamba_jax.tokenizer import load_tokenizer


def parse_overrides(pairs: list[str]) -> dict:
    """["mamba2.ngroups=2", "mamba2.dt_limit=0.001,0.1"] -> {"mamba2.ngroups": 2,
    "mamba2.dt_limit": (0.001, 0.1)}: names as Mamba2Config.replace takes them (a section's
    field as SECTION.FIELD, or its flat name: ngroups=2), values parsed to the field's type."""
    out = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set {pair!r}: expected FIELD=VALUE, e.g. mamba2.ngroups=2")
        try:
            default = Mamba2Config.field_default(name)
        except ValueError as error:
            raise SystemExit(f"--set {pair!r}: {error}") from None
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


def build_parser():
    p = argparse.ArgumentParser(prog="python -m mamba_jax.train",
                                description="Train a Mamba2 language model.")
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="a recipe (train/*.toml): flag values at the top level, Mamba2Config "
                        "overrides under [model]; flags on the command line win")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a Mamba2Config field (repeatable): a shared one, e.g. "
                        "--set d_model=512, or a layer kind's as SECTION.FIELD, e.g. --set "
                        "mamba2.ngroups=2 --set attention.num_heads=16")
    p.add_argument("--data", default=str(DEFAULT_CORPUS),
                   help="a dataset dir made by `python -m mamba_jax.data prepare`, or a UTF-8 "
                        "text file (byte-level; default: the bundled corpus)")
    p.add_argument("--no-cross-document-state", dest="cross_document_state",
                   action="store_false",
                   help="restart the conv and the SSM state at every document boundary of the "
                        "packed sequences (passes seq_idx to the scan)")
    p.add_argument("--tokenizer", default="bytes",
                   help="tokenizer.json path or 'bytes': saved with the exported model")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype (parameters and optimizer state stay float32)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--schedule", choices=SCHEDULES, default="cosine")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--remat", choices=REMAT, default="none",
                   help="activation checkpointing per block: block keeps matmul outputs, "
                        "full keeps only each block's input")
    p.add_argument("--loss-chunk", type=int, default=None, metavar="TOKENS",
                   help="compute the logits and the loss TOKENS positions at a time, "
                        "recomputed in the backward pass (long sequences: the full logits "
                        "are seq-len x vocab floats per row)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--metrics-file", default=None,
                   help="append one JSON line per step (step, loss, lr, grad_norm, ...)")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write TensorBoard event files there (needs tensorboardX)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="Orbax checkpoints of params, optimizer state and step go here")
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept (the newest)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir")
    p.add_argument("--out", "--export-hf", dest="out", default="runs/{preset}",
                   help="where the final weights go (HF layout + tokenizer.json); 'none' to "
                        "skip")
    p.add_argument("--mesh", default=None, metavar="SPEC",
                   help="device mesh, e.g. 'tp=4', 'dp=2,fsdp=2,tp=2' or 'cp=2,tp=4' (axes dp, "
                        "fsdp, cp, tp; omitted axes are 1; default: every device on dp)")
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


def parse_args(argv=None) -> tuple[argparse.Namespace, Mamba2Config]:
    """The command line over the --config recipe over the defaults -> (args, config)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    model_overrides = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise SystemExit(f"--config {path}: no such file (recipes are in train/)")
        recipe = tomllib.loads(path.read_text())
        model_overrides = recipe.pop("model", {})
        known = {a.dest for a in parser._actions} - {"help", "config", "set"}
        unknown = sorted(set(recipe) - known)
        if unknown:
            raise SystemExit(f"--config {path}: unknown keys {unknown}; keys are flag names "
                             f"with underscores: {sorted(known)}")
        parser.set_defaults(**recipe)
        args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "grad_accum", "save_every", "eval_every"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    model_overrides = {**model_overrides, **parse_overrides(args.set)}
    try:
        cfg = Mamba2Config.preset(args.preset, **model_overrides)
    except (TypeError, ValueError) as error:
        raise SystemExit(str(error)) from None
    return args, cfg


class _StopRequest:
    """While active, records SIGTERM / SIGINT so the loop can checkpoint and leave between
    steps; the previous handlers come back on exit."""

    _SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __enter__(self):
        self.signal = None
        self.previous = [signal.signal(sig, self._handle) for sig in self._SIGNALS]
        return self

    def __exit__(self, *_):
        for sig, handler in zip(self._SIGNALS, self.previous):
            signal.signal(sig, handler)

    def _handle(self, signum, _frame):
        self.signal = signal.Signals(signum).name


def _token_fields(args) -> tuple[str, ...]:
    """The batch arrays the loss takes: seq_idx only when documents must not share state."""
    return ("inputs", "targets") + (() if args.cross_document_state else ("seq_idx",))


def _batch_arrays(batch: dict, args, sharding) -> tuple:
    """This process's rows [b_local, l] -> global arrays [grad_accum, b / grad_accum, l]."""
    global_shape = (args.grad_accum, args.batch_size // args.grad_accum, args.seq_len)
    return tuple(jax.make_array_from_process_local_data(
        sharding, batch[n].reshape(args.grad_accum, -1, args.seq_len), global_shape)
        for n in _token_fields(args))


def main(argv=None):
    args, cfg = parse_args(argv)
    parallel.initialize_distributed(args.coordinator_address, args.num_processes,
                                    args.process_id)
    lead = jax.process_index() == 0  # the process that prints, logs and exports
    n_proc = jax.process_count()
    if args.batch_size % (n_proc * args.grad_accum):
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by processes x "
                         f"--grad-accum = {n_proc} x {args.grad_accum}")
    if args.resume and not args.checkpoint_dir:
        raise SystemExit("--resume needs --checkpoint-dir")
    if args.out.lower() != "none":
        try:  # the export's layout must fit the model: say so now, not after training
            config_dict(cfg, export_format(cfg, "hf"))
        except ValueError as error:
            raise SystemExit(f"--out {args.out}: {error}; or --out none") from None
    tokenizer = load_tokenizer(args.tokenizer)
    # Refuses bad data before any compute.
    dataset = TokenDataset.load(args.data, cfg.vocab_size, tokenizer)
    dtype = jnp.dtype(args.dtype)
    try:
        mesh = parallel.make_mesh(args.mesh)
        parallel.check_layout(cfg, mesh, batch_size=args.batch_size // args.grad_accum,
                              seq_len=args.seq_len, sequence_parallel=args.sequence_parallel,
                              loss_chunk=args.loss_chunk)
    except ValueError as e:
        raise SystemExit(str(e)) from None

    # Parameters are created in place, already sharded: no device holds the whole model
    # first, and every process builds the same values from the seed.
    build = lambda: Mamba2LM(cfg, rngs=nnx.Rngs(args.seed), dtype=dtype)
    graphdef, abstract_params = nnx.split(nnx.eval_shape(build))
    specs = parallel.param_specs(abstract_params, mesh)
    param_shardings = parallel.shardings(mesh, specs)
    params = jax.jit(lambda: nnx.split(build())[1], out_shardings=param_shardings)()
    tx, lr_at = make_optimizer(params, args.lr, args.steps, args.warmup, args.weight_decay,
                               args.clip, args.schedule)
    opt_state = init_opt_state(tx, params, param_shardings, NamedSharding(mesh, P()))
    effective = {"model": cfg.to_dict(), "train": {k: v for k, v in vars(args).items()
                                                   if k not in ("set", "resume")}}

    start, ckpt = 0, None
    if args.checkpoint_dir:
        ckpt = Checkpointer(args.checkpoint_dir, keep=args.keep)
        if ckpt.steps() and not args.resume:
            raise SystemExit(f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints "
                             f"(steps {ckpt.steps()}): pass --resume to continue, or choose "
                             "another directory")

        def same_model(step, meta):
            if Mamba2Config.from_dict(meta["config"]["model"]) != cfg:
                raise SystemExit(f"checkpoint {step} in {args.checkpoint_dir} is of another "
                                 f"model ({meta['config']['model']}); use its --preset/--set "
                                 "or another --checkpoint-dir")

        try:
            restored = ckpt.restore_latest(
                abstract_like({"params": params, "opt_state": opt_state}), same_model)
        except RuntimeError as error:
            raise SystemExit(str(error)) from None
        if restored is not None:
            start, state, _ = restored
            params, opt_state = state["params"], state["opt_state"]
        if lead:
            Path(args.checkpoint_dir, "train_config.json").write_text(
                json.dumps(effective, indent=2) + "\n")

    loss_fn = parallel.make_loss_fn(graphdef, specs, mesh, remat=args.remat,
                                    sequence_parallel=args.sequence_parallel,
                                    loss_chunk=args.loss_chunk)
    eval_loss = jax.jit(loss_fn)
    train_step = make_train_step(loss_fn, tx)
    micro_rows = NamedSharding(mesh, P(None, *parallel.TOKENS))
    rows = NamedSharding(mesh, parallel.TOKENS)
    n_shards = mesh.shape["dp"] * mesh.shape["fsdp"]

    def evaluate(params):
        losses = []
        for batch in dataset.eval_batches(args.batch_size, args.seq_len):
            keep = len(batch["inputs"]) - len(batch["inputs"]) % n_shards  # whole shards
            if keep:
                losses.append(eval_loss(params, *(parallel.global_array(batch[n][:keep], rows)
                                                  for n in _token_fields(args))))
        return float(np.mean(losses))

    if lead:
        n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
        print(f"mamba_jax.train: preset {args.preset}, {n_params / 1e6:.2f}M parameters, "
              f"data {dataset.name}, {jax.devices()[0].platform} x {jax.device_count()} "
              f"({n_proc} processes), mesh {dict(mesh.shape)}, sequence parallel "
              f"{args.sequence_parallel and mesh.shape['tp'] > 1}, compute {args.dtype}, "
              f"remat {args.remat}" + (f", resumed at step {start}" if start else ""),
              file=sys.stderr)
    flops = train_flops_per_token(cfg, args.seq_len)
    peak = peak_flops(args.dtype)
    metrics = MetricsWriter(args.metrics_file, args.tensorboard) if lead else MetricsWriter()
    progress = Progress(args.steps, first=start)
    step = start
    with _StopRequest() as stop, contextlib.ExitStack() as cleanup:
        cleanup.callback(metrics.close)
        if ckpt:
            cleanup.callback(ckpt.close)  # saves in flight are committed before we go on
        while step < args.steps and stop.signal is None:
            tic = time.perf_counter()
            batch = dataset.train_batch(step, args.batch_size, args.seq_len, args.seed,
                                        jax.process_index(), n_proc)
            params, opt_state, loss, grad_norm = train_step(
                params, opt_state, _batch_arrays(batch, args, micro_rows))
            step += 1
            loss = float(loss)  # waits for the step
            if not math.isfinite(loss):
                raise SystemExit(f"step {step}: the loss is {loss}; stopping without saving "
                                 "(the last checkpoint is the last good state). Lower --lr, "
                                 "raise --warmup or use --dtype float32")
            elapsed = time.perf_counter() - tic
            tokens_per_s = args.batch_size * args.seq_len / elapsed
            record = {"step": step, "loss": loss, "lr": float(lr_at(step - 1)),
                      "grad_norm": float(grad_norm), "step_time_s": elapsed,
                      "tokens_per_s": tokens_per_s,
                      "mfu": None if peak is None else flops * tokens_per_s / peak,
                      "peak_memory_gib": peak_memory_gib()}
            if step % args.eval_every == 0 or step == args.steps:
                record["eval_loss"] = evaluate(params)
                record["eval_ppl"] = math.exp(min(record["eval_loss"], 50.0))
            metrics.write(record)
            if lead:
                progress.update(step, record)
            if ckpt and (step % args.save_every == 0 or step == args.steps or stop.signal):
                ckpt.save(step, {"params": params, "opt_state": opt_state},
                          {"step": step, "config": effective})
    if stop.signal:
        if lead:
            print(f"{stop.signal}: stopped after step {step}"
                  + (f"; checkpoint saved in {args.checkpoint_dir}" if ckpt else ""),
                  file=sys.stderr)
        return

    out = args.out.format(preset=args.preset)
    if out.lower() != "none":
        if n_proc > 1:
            params = multihost_utils.process_allgather(params, tiled=True)  # all processes join
        if lead:
            save_pretrained(nnx.merge(graphdef, params), out, format="hf")
            tokenizer.save(str(Path(out) / "tokenizer.json"))
            Path(out, "train_config.json").write_text(json.dumps(effective, indent=2) + "\n")
            print(f"saved {out}; try: python -m mamba_jax.generate --checkpoint {out} "
                  "--prompt 'This License'", file=sys.stderr)


if __name__ == "__main__":
    main()
