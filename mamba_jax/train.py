"""The trainer: `python -m mamba_jax.train` (tiny preset on the bundled corpus by default).

    python -m mamba_jax.train --preset tiny --steps 300 --metrics-file m.jsonl
    python -m mamba_jax.train --set ngroups=2 --set d_state=64

optax AdamW with linear warmup and cosine decay, global-norm clipping, and no weight decay
on A_log, D, dt_bias, norms and biases (as mamba_ssm's recipes). The training step is a
pure function of (params, opt_state, batch), jitted with donated buffers, so it takes a
mesh and shardings without change.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

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


def loss_fn(params, graphdef, inputs, targets):
    """Mean next-token cross-entropy (nats) of inputs [b, l] against targets [b, l]."""
    model = nnx.merge(graphdef, params)
    logits = model(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


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
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    for name in ("steps", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    cfg = Mamba2Config.preset(args.preset, **parse_overrides(args.set))
    tokenizer = load_tokenizer(args.tokenizer)
    tokens = tokenize_file(args.data, tokenizer, cfg.vocab_size)
    train_tokens, eval_tokens = split_tokens(tokens, args.seq_len)
    dtype = jnp.dtype(args.dtype)

    model = Mamba2LM(cfg, rngs=nnx.Rngs(args.seed), dtype=dtype)
    graphdef, params = nnx.split(model)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    print(f"mamba_jax.train: preset {args.preset}, {n_params / 1e6:.2f}M parameters, "
          f"{len(train_tokens)} training tokens, {jax.devices()[0].platform} x "
          f"{jax.device_count()}, compute {args.dtype}", file=sys.stderr)
    tx, schedule = make_optimizer(params, args.lr, args.steps, args.warmup, args.weight_decay,
                                  args.clip)
    opt_state = tx.init(params)

    @jax.jit
    def eval_loss(params, inputs, targets):
        return loss_fn(params, graphdef, inputs, targets)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, graphdef, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    def evaluate(params):
        losses = [eval_loss(params, x, y) for x, y in
                  eval_windows(eval_tokens, args.batch_size, args.seq_len)]
        return float(np.mean(losses))

    metrics = open(args.metrics_file, "a") if args.metrics_file else None
    batches = random_windows(train_tokens, args.batch_size, args.seq_len, args.seed)
    progress = Progress(args.steps)
    start = time.perf_counter()
    try:
        for step in range(1, args.steps + 1):
            inputs, targets = next(batches)
            params, opt_state, loss, grad_norm = train_step(params, opt_state, inputs, targets)
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
            progress.update(step, f"loss {record['loss']:.3f}"
                            + (f" eval {record['eval_loss']:.3f}" if "eval_loss" in record
                               else "") + f" {record['tokens_per_s']:.0f} tok/s")
    finally:
        if metrics:
            metrics.close()

    out = args.out.format(preset=args.preset)
    if out.lower() != "none":
        nnx.update(model, params)
        save_pretrained(model, out, format="hf")
        tokenizer.save(str(Path(out) / "tokenizer.json"))
        print(f"saved {out} ({len(flat_params(model))} tensors); try: python -m "
              f"mamba_jax.generate --checkpoint {out} --prompt 'This License'", file=sys.stderr)


if __name__ == "__main__":
    main()
