"""The trainer: `python -m mamba_jax.train` (tiny preset on the bundled corpus by default).

    python -m mamba_jax.train --preset tiny --steps 300 --metrics-file m.jsonl
    python -m mamba_jax.train --config train/mamba2-130m.toml --data data/corpus \
        --mesh dp=2,tp=4 --checkpoint-dir runs/130m/ckpt --save-every 500 --resume
    python -m mamba_jax.train --set ngroups=2 --set d_state=64
    python -m mamba_jax.train --init-from models/mamba2-130m --data data/corpus --lr 1e-4

Every run, one device or many, goes through the same sharded code (mamba_jax.parallel) over
a mesh (`--mesh`, default: every device on dp); the step is a pure jitted function of
(params, opt_state, batch) with the shardings in the arrays (mamba_jax.optim). Batch `s` is
a pure function of (s, seed) (mamba_jax.data), so a checkpoint needs only the step to
restore the data position. Checkpoints (mamba_jax.checkpoint) restore onto any mesh.
--init-from starts from a published model or a trainer's checkpoint (mamba_jax.init_from).
SIGTERM / SIGINT save a checkpoint at the current step and exit cleanly. A --checkpoint-dir
is locked while a run uses it; --resume refuses one without a checkpoint (--resume-if-exists
starts fresh there), and a resumed run supersedes what the interrupted one logged after its
checkpoint. A save that fails (a full disk) stops the run with one line, the checkpoint
before it intact. Mistakes in the input are one line and exit status 2 (mamba_jax.cli).
Several processes (multi-host): pass --coordinator-address, --num-processes and
--process-id (or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) to each.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import math
import os
import shlex
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

from mamba_jax import adapters, compilation_cache, parallel
from mamba_jax.chat import ChatTemplate
from mamba_jax.checkpoint import Checkpointer, abstract_like
from mamba_jax.cli import HelpFormatter, command, parse_overrides, require_at_least
from mamba_jax.config import PRESETS, Mamba2Config, check_field
from mamba_jax.convert import check_exportable, export, export_notes
from mamba_jax.data import (DEFAULT_CORPUS, data_chat_template, dataset_meta, dataset_tokenizer,
                            fingerprint, is_indexed, load_data, parse_blend)
from mamba_jax.files import (check_outside_checkpoints, check_writable, checkpoints_above,
                             holds_model, holds_steps, locked, model_file, replace_text)
from mamba_jax.init_from import InitSource, check_resumed_source, placed_state
from mamba_jax.metrics import (MetricsWriter, Progress, check_metrics_file, peak_flops,
                               peak_memory_gib, train_flops_per_token)
from mamba_jax.model import REMAT, Fp8, Mamba2LM, check_causal
from mamba_jax.optim import (SCHEDULES, WSD_DECAY_FRACTION, init_opt_state, make_optimizer,
                             make_train_step, train_compiler_options, warmup_steps)
from mamba_jax.tokenizer import find_tokenizer, load_tokenizer, save_tokenizer


SAVE_EVERY = 500  # --save-every's default

# The train flags of Megatron-LM's layer settings (Mamba2Config.MEGATRON_NAMES' and the
# ratios), passed to the config under their own names.
MEGATRON_FLAGS = ("num_layers", "hybrid_attention_ratio", "hybrid_mlp_ratio",
                  "hybrid_override_pattern")


def build_parser():
    p = argparse.ArgumentParser(prog="python -m mamba_jax.train",
                                description="Train a Mamba2 language model.",
                                formatter_class=HelpFormatter)
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="a recipe (train/*.toml): flag values at the top level (paths "
                        "relative to the recipe's folder), Mamba2Config overrides under "
                        "[model]; flags on the command line win")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="the model (default: tiny); not with --init-from")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from the model in DIR: a folder from_pretrained reads (HF "
                        "Mamba2, Mamba, FalconMamba, NemotronH; mamba_ssm) or a trainer's "
                        "--checkpoint-dir or one step folder of it. Its config, weights and "
                        "tokenizer; --set may change only what keeps every parameter's "
                        "shape; the optimizer starts fresh; --out writes its layout")
    megatron = p.add_argument_group(
        "Megatron-LM's layer flags", "the model's layers as Megatron-LM's flags give them "
        "(the same as --set n_layer=, hybrid_attention_ratio=, hybrid_mlp_ratio=, "
        "layer_pattern=; in a recipe's [model] too)")
    megatron.add_argument("--num-layers", type=int, default=None, help="n_layer")
    megatron.add_argument("--hybrid-attention-ratio", type=float, default=None, metavar="R",
                          help="the share of attention layers, placed as Megatron does")
    megatron.add_argument("--hybrid-mlp-ratio", type=float, default=None, metavar="R",
                          help="the share of MLP layers, placed as Megatron does")
    megatron.add_argument("--hybrid-override-pattern", "--hybrid-layer-pattern",
                          dest="hybrid_override_pattern", default=None, metavar="PATTERN",
                          help="layer_pattern: one of M * - per layer")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a Mamba2Config field (repeatable): a shared one, e.g. "
                        "--set d_model=512, or a layer kind's as SECTION.FIELD, e.g. --set "
                        "mamba2.ngroups=2 --set attention.num_heads=16")
    p.add_argument("--data", nargs="+", default=[str(DEFAULT_CORPUS)], metavar="[WEIGHT] PATH",
                   help="a dataset dir made by `python -m mamba_jax.data prepare`, a Megatron "
                        "indexed dataset's prefix (PREFIX.bin + PREFIX.idx), or a UTF-8 text "
                        "file (tokenized with --tokenizer; the bundled corpus by default); or "
                        "a blend of them with weights: --data 0.3 data/a 0.7 data/b")
    p.add_argument("--no-cross-document-state", dest="cross_document_state",
                   action="store_false",
                   help="restart the conv and the SSM state at every document boundary of the "
                        "packed sequences (passes seq_idx to the scan); instruction data "
                        "(prepare --format chat or prompt-completion) always does")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json or SentencePiece tokenizer.model path, or 'bytes', "
                        "saved with the exported model (default: the one --data was prepared "
                        "with; bytes for a text file; a Megatron dataset needs it given)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype (parameters and optimizer state stay float32)")
    p.add_argument("--fp8", action="store_true",
                   help="train the layers' projections (Mamba in- and out-projections, "
                        "attention's, the MLP's) as FP8 matmuls: E4M3 weights and "
                        "activations, E5M2 gradients, each tensor scaled by its own largest "
                        "value, on Hopper's FP8 tensor cores; the embedding, the LM head and "
                        "the first and last --fp8-skip-layers layers stay in --dtype (use "
                        "with --dtype bfloat16). Evaluation and the export run in --dtype")
    p.add_argument("--fp8-skip-layers", type=int, default=1, metavar="N",
                   help="with --fp8, the layers kept in --dtype at each end of the model "
                        "(Megatron-LM's --num-layers-at-start/end-in-bf16)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--schedule", choices=SCHEDULES, default="cosine")
    p.add_argument("--warmup", type=int, default=30,
                   help="steps of linear warmup (shortened to --steps - 1 where longer, "
                        "and with --schedule wsd to leave its decay over the last fifth)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true",
                   help="bitwise-reproducible steps on GPUs (XLA's deterministic scatter-adds "
                        "and reductions): two runs of one command give the same losses to the "
                        "bit, for more time a step (docs/performance.md); CPU steps are "
                        "reproducible without it")
    p.add_argument("--remat", choices=REMAT, default="none",
                   help="activation checkpointing per block: block keeps matmul outputs, "
                        "full keeps only each block's input")
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=False,
                   help="run each run of a layer kind as one scan over its stacked layers: "
                        "a compile that does not grow with the number of layers and less "
                        "memory a row, for a longer step (the stacked weights, their "
                        "gradients and the saved activations are copied each step); by "
                        "default the layers run one after the other")
    p.add_argument("--loss-chunk", type=int, default=None, metavar="TOKENS",
                   help="compute the logits and the loss TOKENS positions at a time, "
                        "recomputed in the backward pass (long sequences: the full logits "
                        "are seq-len x vocab floats per row)")
    p.add_argument("--eval-every", type=int, default=100, metavar="N",
                   help="evaluate on the held-out split every N steps and after the last; "
                        "0: never")
    p.add_argument("--metrics-file", default=None,
                   help="append one JSON line per step (step, loss, lr, grad_norm, ...)")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write TensorBoard event files there (needs tensorboardX)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="Orbax checkpoints of params, optimizer state and step go here")
    p.add_argument("--save-every", type=int, default=None, metavar="N",
                   help=f"checkpoint every N steps into --checkpoint-dir (default "
                        f"{SAVE_EVERY})")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept (the newest)")
    resume = p.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in "
                             "--checkpoint-dir (refused if it holds none)")
    resume.add_argument("--resume-if-exists", action="store_true",
                        help="as --resume, but start fresh when --checkpoint-dir holds no "
                             "checkpoint (for jobs that a scheduler restarts)")
    p.add_argument("--out", "--export-hf", dest="out", default="runs/{preset}",
                   help="where the final weights go (HF layout, or mamba_ssm's for a model "
                        "transformers cannot hold; + tokenizer.json); 'none' to "
                        "skip. A directory that holds a model is refused, unless "
                        "--overwrite-out or the run resumes the checkpoints that wrote it; "
                        "one that comes to hold a model while the run trains is kept, the "
                        "run's model going to OUT-1 (or the next free OUT-N) beside it")
    p.add_argument("--overwrite-out", action="store_true",
                   help="let the final export replace the model in --out")
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
    tuning = p.add_argument_group(
        "LoRA and partial training", "train a part of the model; the rest, the base, stays "
        "frozen (mamba_jax.adapters). --out merges what trained into the base's layout")
    tuning.add_argument("--lora-rank", type=int, default=None, metavar="R",
                        help="LoRA adapters of rank R on --lora-targets; only they train")
    tuning.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                        help="the adapters' scale is A / R (default A = R: a scale of 1)")
    tuning.add_argument("--lora-targets", nargs="+", default=None, metavar="NAME",
                        help="the projections adapted, named as the model's checkpoint layout "
                             "names them (in_proj out_proj; q_proj k_proj v_proj o_proj; "
                             "up_proj down_proj; x_proj dt_proj; ...); default: every "
                             "projection of every layer")
    tuning.add_argument("--train-only", default=None, metavar="PATTERN",
                        help="train the parameters whose dotted names the regular expression "
                             "matches whole, e.g. 'layers\\.\\d+\\.mixer\\.(A_log|D)' or "
                             "'.*norm.*' (with --lora-rank: beside the adapters)")
    tuning.add_argument("--base-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="store the frozen base's weights in this dtype (A_log, D, "
                             "dt_bias, norms and biases stay float32); what trains and its "
                             "optimizer state are float32")
    tuning.add_argument("--export-adapter", default=None, metavar="DIR",
                        help="also write the LoRA adapters alone in PEFT's layout "
                             "(adapter_config.json, adapter_model.safetensors)")
    compilation_cache.add_argument(p)
    return p


def parse_command_line(argv=None) -> tuple[argparse.Namespace, dict]:
    """The command line over the --config recipe over the defaults -> (args, the
    Mamba2Config fields that override the preset's)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    model_overrides, tokenizer_source = {}, "--tokenizer"
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise SystemExit(f"--config {path}: no such file (recipes are in train/)")
        try:
            recipe = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            raise SystemExit(f"--config {path}: not a TOML recipe ({error}); recipes are in "
                             "train/") from None
        model_overrides = recipe.pop("model", {})
        try:  # named here, as the recipe's: --set's are named as they are given
            for key, value in model_overrides.items():
                for name in ([f"{key}.{field}" for field in value] if isinstance(value, dict)
                             else [key]):
                    check_field(name)
        except ValueError as error:
            raise SystemExit(f"--config {path} [model]: {error}") from None
        actions = {a.dest: a for a in parser._actions}
        known = set(actions) - {"help", "config", "set"}
        unknown = sorted(set(recipe) - known)
        if unknown:
            raise SystemExit(f"--config {path}: unknown keys {unknown}; keys are flag names "
                             f"with underscores: {sorted(known)}")
        for key, value in recipe.items():
            _check_recipe_value(path, key, value, actions[key])
        if "tokenizer" in recipe and args.tokenizer is None:  # named so in what it says
            tokenizer_source = f"the tokenizer of --config {path}"
        parser.set_defaults(**_recipe_paths(path, recipe))
        args = parser.parse_args(argv)
    args.tokenizer_source = tokenizer_source
    if isinstance(args.data, str):  # a recipe's data = "PATH"
        args.data = [args.data]
    try:
        args.data = [str(v) for v in args.data]
        parse_blend(args.data)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    layer_flags = {name: getattr(args, name) for name in MEGATRON_FLAGS
                   if getattr(args, name) is not None}
    require_at_least(args, ("steps", "batch_size", "seq_len", "grad_accum"))
    require_at_least(args, ("eval_every",), least=0)  # 0: no evaluation
    if args.save_every is not None:  # None: not given, SAVE_EVERY in _train
        require_at_least(args, ("save_every",))
    if args.loss_chunk is not None and args.loss_chunk < 1:
        raise SystemExit(f"--loss-chunk={args.loss_chunk} must be >= 1 (positions a piece), "
                         "or left out for the whole sequence at once")
    if not (math.isfinite(args.lr) and args.lr >= 0):
        raise SystemExit(f"--lr={args.lr} must be a number >= 0 (the peak learning rate; 0 "
                         "changes no weight)")
    if args.init_from and args.preset:
        raise SystemExit(f"--preset {args.preset} with --init-from {args.init_from}: the model "
                         "is the one in that folder; leave --preset out (of the recipe too)")
    if not args.init_from:
        args.preset = args.preset or "tiny"
    # Each of these below zero would train without an error, wrongly: a negative clip
    # turns every gradient around, a negative weight decay grows the weights.
    require_at_least(args, ("warmup", "fp8_skip_layers"), least=0)
    if not (math.isfinite(args.clip) and args.clip > 0):
        raise SystemExit(f"--clip={args.clip} must be a positive number (the largest global "
                         "gradient norm)")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise SystemExit(f"--weight-decay={args.weight_decay} must be a number >= 0 (0: none)")
    return args, {**model_overrides, **layer_flags, **parse_overrides(args.set)}


# A recipe's values that are paths (the words these flags take instead of one kept as they
# are): read relative to the recipe's folder, as the command line's are to the current one.
RECIPE_PATHS = {"data": (), "tokenizer": ("bytes",), "init_from": (), "checkpoint_dir": (),
                "out": ("none",), "export_adapter": (), "metrics_file": (), "tensorboard": (),
                "compilation_cache": ("off",)}


def _recipe_paths(path: Path, recipe: dict) -> dict:
    """The recipe at `path` with its RECIPE_PATHS values relative to its folder (an absolute
    one, or ~, as it is; data's weights as they are)."""
    def resolve(value, words=()):
        if value.lower() in words or Path(value).expanduser().is_absolute():
            return value
        return os.path.normpath(path.parent / value)
    out = dict(recipe)
    for key, words in RECIPE_PATHS.items():
        if key == "data" and key in out:
            items = [str(v) for v in ([out[key]] if isinstance(out[key], str) else out[key])]
            # one path, or [WEIGHT, PATH, ...] (another length: refused as --data's)
            first = 0 if len(items) == 1 else 1
            out[key] = [resolve(v) if i >= first and (i - first) % 2 == 0 else v
                        for i, v in enumerate(items)]
        elif key in out:
            out[key] = resolve(out[key], words)
    return out


def _check_recipe_value(path, key: str, value, action: argparse.Action) -> None:
    """Refuse a recipe's value that its flag would not take: a recipe's values become the
    parser's defaults, which argparse neither converts nor checks."""
    number = lambda v, kinds: isinstance(v, kinds) and not isinstance(v, bool)
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        ok, want = isinstance(value, bool), "true or false"
    elif action.nargs in ("+", "*"):  # --data: [WEIGHT] PATH ..., as strings or numbers
        ok = isinstance(value, str) or isinstance(value, list) and bool(value) and all(
            isinstance(v, str) or number(v, (int, float)) for v in value)
        want = "a string or a list of strings (and weights)"
    elif action.type is int:
        ok, want = number(value, int), "an integer"
    elif action.type is float:
        ok, want = number(value, (int, float)), "a number"
    else:
        ok, want = isinstance(value, str), "a string"
    if ok and action.choices is not None and value not in action.choices:
        ok, want = False, f"one of {sorted(action.choices)}"
    if not ok:
        raise SystemExit(f"--config {path}: {key} = {value!r} must be {want}, as "
                         f"{action.option_strings[0]} takes")


def fp8_recipe(args, cfg: Mamba2Config) -> Fp8 | None:
    """The training loss's FP8 recipe (None without --fp8); refused where
    --fp8-skip-layers leaves no layer to it."""
    if not args.fp8:
        return None
    recipe, n = Fp8(args.fp8_skip_layers), len(cfg.layers)
    if not any(recipe.in_fp8(n)):
        raise SystemExit(f"--fp8-skip-layers {args.fp8_skip_layers} keeps all {n} layers of "
                         "the model in --dtype, so nothing would train in FP8: use at most "
                         f"{(n - 1) // 2}, or leave out --fp8")
    return recipe


def model_config(preset: str, overrides: dict) -> Mamba2Config:
    """The preset with overrides, refused in one line where it is no causal LM's config."""
    try:
        cfg = Mamba2Config.preset(preset, **overrides)
        check_causal(cfg)
        return cfg
    except (TypeError, ValueError) as error:
        raise SystemExit(str(error)) from None


def parse_args(argv=None) -> tuple[argparse.Namespace, Mamba2Config]:
    """The command line over the --config recipe over the defaults -> (args, config)."""
    args, overrides = parse_command_line(argv)
    if args.init_from:
        return args, _init_source(args, overrides).config_for(overrides)
    return args, model_config(args.preset, overrides)


def _init_source(args, overrides: dict) -> InitSource:
    """--init-from's source (overrides: the model fields given, which a Megatron-LM
    checkpoint's config takes), a folder that cannot give one refused in one line."""
    try:
        return InitSource.open(args.init_from, overrides)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--init-from {error}") from None


def _load_named(tokenizer: str, source: str, data: str | None = None):
    """load_tokenizer(tokenizer), one that a recipe names and is not there refused naming
    the recipe (its path is the recipe's, not the command line's) and, where --data was
    prepared with one (`data`), that one."""
    try:
        return load_tokenizer(tokenizer)
    except FileNotFoundError as error:
        if source == "--tokenizer":
            raise
        raise SystemExit(f"{source}: {error}" + (
            "" if data is None else f"; or leave it out of the recipe to train with the "
            f"tokenizer --data {data} was prepared with")) from None


def resolve_tokenizer(args) -> str:
    """--tokenizer, else the tokenizer the --data datasets were prepared with (their
    meta.json), else bytes (text files). A --tokenizer other than a dataset's, or datasets
    of different tokenizers, are refused, naming both; a Megatron dataset, which does not
    record its tokenizer, needs --tokenizer."""
    paths = [path for _, path in parse_blend(args.data)]
    prepared = {path: dataset_tokenizer(path, meta) for path in paths
                if (meta := dataset_meta(path)) is not None}
    chosen, source = args.tokenizer, args.tokenizer_source
    for path, prepared_with in prepared.items():
        if chosen is None:
            chosen, source = prepared_with, f"the tokenizer --data {path} was prepared with"
        elif _load_named(chosen, source, path).to_str() != \
                load_tokenizer(prepared_with).to_str():
            raise SystemExit(f"--data {path} was prepared with {prepared_with}, not {source} "
                             f"({chosen}); prepare every dataset with one tokenizer, and give "
                             "it as --tokenizer or leave --tokenizer out"
                             + (" (and out of the recipe)" if source != "--tokenizer" else ""))
    indexed = [path for path in paths if is_indexed(path)]
    if chosen is None and indexed:
        raise SystemExit(f"--data {indexed[0]} is a Megatron indexed dataset, which does not "
                         "record its tokenizer: pass the one it was made with, e.g. "
                         "--tokenizer tokenizer.model")
    return chosen or "bytes"


class _StopRequest:
    """While active, records SIGTERM / SIGINT (`signal`, a signal.Signals) so the loop can
    checkpoint and leave between steps; the previous handlers come back on exit."""

    _SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __enter__(self):
        self.signal = None
        self.previous = [signal.signal(sig, self._handle) for sig in self._SIGNALS]
        return self

    def __exit__(self, *_):
        for sig, handler in zip(self._SIGNALS, self.previous):
            signal.signal(sig, handler)

    def _handle(self, signum, _frame):
        self.signal = signal.Signals(signum)


def _token_fields(args, dataset) -> tuple[str, ...]:
    """The batch arrays the loss takes: seq_idx only when documents must not share state
    (always for instruction data, whose rows are documents packed whole), loss_mask for
    instruction data."""
    masked = dataset.masked
    return ("inputs", "targets") + (("seq_idx",) if masked or not args.cross_document_state
                                    else ()) + (("loss_mask",) if masked else ())


def _batch_arrays(batch: dict, args, dataset, sharding) -> tuple:
    """This process's rows [b_local, l] -> global arrays [grad_accum, b / grad_accum, l]."""
    global_shape = (args.grad_accum, args.batch_size // args.grad_accum, args.seq_len)
    return tuple(jax.make_array_from_process_local_data(
        sharding, batch[n].reshape(args.grad_accum, -1, args.seq_len), global_shape)
        for n in _token_fields(args, dataset))


def _open_checkpoints(args, tokenizer, held: contextlib.ExitStack, lead: bool):
    """The Checkpointer of --checkpoint-dir, with the directory's lock held on `held` (by
    process 0), once the directory fits the resume flags: --resume needs a checkpoint
    there, a fresh run needs none, and resumed checkpoints need this tokenizer."""
    directory = Path(args.checkpoint_dir)
    fresh_hint = ("start a new run without --resume, or pass --resume-if-exists to start "
                  "fresh when there is no checkpoint")
    if args.resume and not directory.is_dir():
        raise SystemExit(f"--resume: --checkpoint-dir {directory} does not exist; check the "
                         f"path, or {fresh_hint}")
    if lead:
        held.enter_context(locked(directory, "training run"))
    ckpt = Checkpointer(directory, keep=args.keep)
    held.callback(ckpt.close)  # on a refusal; the training loop closes it first otherwise
    steps = ckpt.steps()
    if args.resume and not steps:
        raise SystemExit(f"--resume: --checkpoint-dir {directory} holds no checkpoint; check "
                         f"the path, or {fresh_hint}")
    if steps and not (args.resume or args.resume_if_exists):
        raise SystemExit(f"--checkpoint-dir {directory} already holds checkpoints (steps "
                         f"{steps}): pass --resume to continue, or choose another directory")
    copy = find_tokenizer(directory)
    if steps and copy and load_tokenizer(copy).to_str() != tokenizer.to_str():
        raise SystemExit(f"the checkpoints in {directory} were trained with another tokenizer "
                         f"({copy}) than {args.tokenizer}; pass that one with --tokenizer")
    if lead:
        save_tokenizer(tokenizer, directory)
    return ckpt


def _out_dir(args) -> str | None:
    """Where the final export goes: --out with {preset} filled in (any other brace is the
    path's own), or None for --out none."""
    name = args.preset or Path(args.init_from).absolute().name
    return None if args.out.lower() == "none" else args.out.replace("{preset}", name)


def _replaceable(args, out: str, resumed: bool, held=model_file) -> bool:
    """Whether the export may write --out: it holds no model (files.model_file; for
    --export-adapter, `held` is adapters.adapter_file), or --overwrite-out, or the run
    `resumed` from checkpoints of the --checkpoint-dir that the folder's own
    train_config.json names (a restarted job exports where it did; a run that started afresh
    there, with --resume-if-exists, is another run)."""
    out = Path(out)
    if args.overwrite_out or held(out) is None:
        return True
    if resumed:
        try:
            earlier = json.loads((out / "train_config.json").read_text())["train"]
            if Path(earlier["checkpoint_dir"]).resolve() == Path(args.checkpoint_dir).resolve():
                return True
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no record of the run that wrote it: someone else's model
    return False


def _check_out(args, out: str, resumed: bool, flag="--out", held=model_file) -> None:
    """Refuses, before training, an --out (or `flag`'s folder) whose model the export at the
    end would replace."""
    if not _replaceable(args, out, resumed, held):
        what = "a model" if held is model_file else "an adapter"
        raise SystemExit(f"{flag} {out} already holds {what} (its {held(out)}), which "
                         f"this run's final export would replace: give another {flag}, "
                         + ("--out none, " if flag == "--out" else "")
                         + "or --overwrite-out to replace it")


def _export_dir(args, out: str, resumed: bool, flag="--out", held=model_file) -> str:
    """Where the export goes: --out (or `flag`'s folder), or, where a model the run may not
    replace came into it while the run trained (another run's export), the first free
    `OUT-N` beside it, said."""
    if _replaceable(args, out, resumed, held):
        return out
    free = next(f"{out}-{i}" for i in itertools.count(1) if not Path(f"{out}-{i}").exists())
    what = "model" if held is model_file else "adapter"
    print(f"{flag} {out} came to hold a {what} while this run trained (another run's "
          f"export?), which this run may not replace: its {what} goes to {free} instead",
          file=sys.stderr)
    return free


@command("python -m mamba_jax.train")
def main(argv=None):
    # The trainer is its GPUs' one process: it may take 95% of their memory rather than
    # jax's default 75%, so that the batches in BENCHMARKS.md fit (mamba2-1.3b's 20 rows of
    # 2048 tokens plan more than 75% of an H200's 141 GB). Read when jax first uses a GPU,
    # so set before; an XLA_PYTHON_CLIENT_MEM_FRACTION the user gives is kept.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    with contextlib.ExitStack() as held:  # the --checkpoint-dir lock, to the end
        _train(argv, held)


def _train(argv, held: contextlib.ExitStack):
    """main's run; `held` keeps the --checkpoint-dir lock until main returns."""
    args, overrides = parse_command_line(argv)
    cache_dir = compilation_cache.use(args.compilation_cache)
    parallel.initialize_distributed(args.coordinator_address, args.num_processes,
                                    args.process_id)
    lead = jax.process_index() == 0  # the process that prints, logs and exports
    n_proc = jax.process_count()
    if args.batch_size % (n_proc * args.grad_accum):
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by processes x "
                         f"--grad-accum = {n_proc} x {args.grad_accum}: use a multiple of "
                         f"{n_proc * args.grad_accum}, or another --grad-accum")
    if (args.resume or args.resume_if_exists) and not args.checkpoint_dir:
        raise SystemExit("--resume needs --checkpoint-dir")
    # A --save-every (a recipe's included) without --checkpoint-dir saves nothing: said at
    # the start, since a long run that crashes would otherwise find no checkpoint.
    saves_nothing = args.save_every is not None and not args.checkpoint_dir
    args.save_every = args.save_every or SAVE_EVERY
    # What this process will write, refused now rather than when the work comes to it.
    out = _out_dir(args)
    if out and args.checkpoint_dir and Path(args.checkpoint_dir).resolve() in (
            Path(out).resolve(), *Path(out).resolve().parents):
        # Orbax takes its folders for steps: a numbered --out would be a corrupt checkpoint
        raise SystemExit(f"--out {out} is inside --checkpoint-dir {args.checkpoint_dir}, "
                         "whose folders are the checkpoints: give an --out outside it")
    if args.checkpoint_dir and (above := checkpoints_above(args.checkpoint_dir)):
        # a step of another run's (or of its own) checkpoints: a run there would write
        # steps into that checkpoint, and a --resume-if-exists start afresh inside it
        raise SystemExit(f"--checkpoint-dir {args.checkpoint_dir} is inside the training "
                         f"checkpoints folder {above}: give that folder to resume its run, "
                         "or a folder of its own")
    writes = [("--checkpoint-dir", args.checkpoint_dir)]
    if lead:  # the lead alone logs and exports
        writes += [("--metrics-file", args.metrics_file), ("--tensorboard", args.tensorboard),
                   ("--out", out), ("--export-adapter", args.export_adapter)]
    for flag, path in writes:
        if path:
            check_writable(flag, path, folder=flag != "--metrics-file")
    if lead and args.metrics_file:
        check_metrics_file(args.metrics_file)
    for flag, path in (("--out", out), ("--export-adapter", args.export_adapter)):
        if path:  # another run's checkpoints (its own are refused above, made or not)
            check_outside_checkpoints(flag, path)
    if args.checkpoint_dir and holds_model(args.checkpoint_dir):
        raise SystemExit(f"--checkpoint-dir {args.checkpoint_dir} holds a model (its "
                         f"{model_file(args.checkpoint_dir)}), which the commands that read "
                         "the folder would take for its checkpoints: give the checkpoints a "
                         "folder of their own")
    source = _init_source(args, overrides) if args.init_from else None
    if source:
        args.tokenizer, args.tokenizer_source = source.tokenizer_for(
            args.tokenizer, args.tokenizer_source, args.data)
    args.tokenizer = resolve_tokenizer(args)
    tokenizer = _load_named(args.tokenizer, args.tokenizer_source)
    cfg = source.config_for(overrides, tokenizer) if source else model_config(args.preset,
                                                                              overrides)
    layout = source.export_layout(cfg) if source else "hf"  # the export's
    if not source and tokenizer.get_vocab_size() > cfg.vocab_size and \
            "vocab_size" not in overrides:
        if lead:
            print(f"vocab_size {tokenizer.get_vocab_size()}: the tokenizer's ({args.tokenizer}); "
                  f"the preset's {cfg.vocab_size} is too small", file=sys.stderr)
        cfg = model_config(args.preset, {**overrides, "vocab_size": tokenizer.get_vocab_size()})
    try:
        tuning = adapters.Tuning.of(vars(args))
        if tuning:  # its targets and alpha spelt out, so recorded for a resume or a loader
            tuning = tuning.check(cfg)
            args.lora_targets, args.lora_alpha = tuning.targets, tuning.alpha
        if args.export_adapter:
            adapters.check_peft(cfg, tuning or adapters.Tuning())
    except ValueError as error:
        raise SystemExit(str(error)) from None
    # a run that will restore checkpoints may replace its own export there
    restores = (args.resume or args.resume_if_exists) and holds_steps(args.checkpoint_dir)
    if args.export_adapter:
        _check_out(args, args.export_adapter, restores, "--export-adapter",
                   adapters.adapter_file)
    if out:
        _check_out(args, out, restores)
    # Refuses bad data before any compute.
    dataset = load_data(args.data, cfg.vocab_size, tokenizer)
    chat_template, mixed = data_chat_template(args.data)  # what the model answers chats with
    if mixed and lead:
        print(mixed, file=sys.stderr)
    elif chat_template is None and source:  # else the one of the model it starts from
        chat_template = ChatTemplate.from_model_dir(source.checkpoints or source.path)
    dtype = jnp.dtype(args.dtype)
    fp8 = fp8_recipe(args, cfg)
    try:
        mesh = parallel.make_mesh(args.mesh)
        n_shards = mesh.shape["dp"] * mesh.shape["fsdp"]
        if args.batch_size // args.grad_accum % n_shards:  # named by the flags that set it
            micro = (f" / --grad-accum {args.grad_accum} = micro-batches of "
                     f"{args.batch_size // args.grad_accum}" if args.grad_accum > 1 else "")
            raise SystemExit(f"--batch-size {args.batch_size}{micro} rows do not split over "
                             f"the mesh's dp x fsdp = {n_shards} data shards: use a "
                             f"--batch-size that is a multiple of {args.grad_accum * n_shards}"
                             + (" (--grad-accum x dp x fsdp)" if args.grad_accum > 1 else ""))
        parallel.check_layout(cfg, mesh, batch_size=args.batch_size // args.grad_accum,
                              seq_len=args.seq_len, sequence_parallel=args.sequence_parallel,
                              loss_chunk=args.loss_chunk)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    # Without a held-out window, say so now and train without evaluating rather than fail
    # at the first evaluation.
    evaluating = args.eval_every > 0 and dataset.evaluates(args.seq_len)
    if args.eval_every and not evaluating and lead:
        print(f"--data {dataset.name}: {dataset.no_evaluation(args.seq_len)}, so this run does "
              "not evaluate (prepare more documents or a larger --eval-fraction to evaluate)",
              file=sys.stderr)
    ckpt = _open_checkpoints(args, tokenizer, held, lead) if args.checkpoint_dir else None
    if ckpt and lead and chat_template:  # beside its tokenizer, where serve and convert look
        chat_template.save(args.checkpoint_dir, tokenizer)

    build = lambda: Mamba2LM(cfg, rngs=nnx.Rngs(args.seed), dtype=dtype)
    # With adapters or --train-only, `params` is what trains (the optimizer sees only it)
    # and `frozen` holds the base: [state], passed to the loss beside them; else [].
    split = tuning.split if tuning else lambda state: (state,)
    if tuning:
        build = tuning.build(build, args.seed)
    graphdef, whole = nnx.split(nnx.eval_shape(build))
    specs = parallel.param_specs(whole, mesh)
    param_shardings = parallel.shardings(mesh, specs)
    abstract_params, shardings_trained = split(whole)[0], split(param_shardings)[0]
    tx, lr_at = make_optimizer(abstract_params, args.lr, args.steps, args.warmup,
                               args.weight_decay, args.clip, args.schedule)
    effective = {"model": cfg.to_dict(), "train": {
        k: v for k, v in vars(args).items()
        if k not in ("set", "resume", "resume_if_exists", "tokenizer_source")}}
    if source:
        effective["train"].update(source.record())
    if args.checkpoint_dir:
        # Absolute: a resume from another folder finds its export's. And what the data and
        # the tokenizer are, wherever they are found (a resume's same_model, _note_changes):
        # read only by a resume, so hashed only for a run that keeps checkpoints.
        effective["train"].update(
            checkpoint_dir=str(Path(args.checkpoint_dir).resolve()),
            data_identity=[[weight, fingerprint(path)] for weight, path in parse_blend(args.data)],
            tokenizer_sha256=hashlib.sha256(tokenizer.to_str().encode()).hexdigest())
        if tuning:  # what a resume and the loaders read the base from again
            effective["train"]["base"] = (source.base() if source
                                          else adapters.identity(cfg, args.seed))

    def same_model(step, meta):
        """Refuse to resume checkpoint `step` (its meta) of another run than this one."""
        # One model however its layers are spelt (ratios, mamba_ssm's blocks, a pattern)
        saved = Mamba2Config.from_dict(meta["config"]["model"]).spelt_out()
        trained = meta["config"]["train"]
        check_resumed_source(step, args.checkpoint_dir, trained, effective["train"])
        if trained.get("tokenizer_sha256", effective["train"]["tokenizer_sha256"]) != \
                effective["train"]["tokenizer_sha256"]:  # recorded since, beside the copy
            raise SystemExit(f"checkpoint {step} in {args.checkpoint_dir} was trained with "
                             f"another tokenizer ({trained['tokenizer']}) than "
                             f"{args.tokenizer}; pass that one with --tokenizer")
        if saved != cfg.spelt_out():
            raise SystemExit(f"checkpoint {step} in {args.checkpoint_dir} is of another "
                             f"model: {_config_difference(saved, cfg.spelt_out())}; use "
                             "its --preset/--set or another --checkpoint-dir")
        try:
            adapters.check_same_part(trained, effective["train"])
        except ValueError as error:
            raise SystemExit(f"checkpoint {step} in {args.checkpoint_dir}: {error}; use "
                             "its flags or another --checkpoint-dir") from None

    resuming = bool(ckpt and ckpt.steps())
    if resuming:  # refused before the source is read (restore_latest checks its step again)
        newest = ckpt.steps()[-1]
        try:
            meta = ckpt.read_meta(newest)
        except Exception:  # noqa: BLE001 - a damaged step: restore_latest says so, goes on
            meta = None
        if meta is not None:
            same_model(newest, meta)
    try:
        # A resumed run's checkpoint replaces what trains: the source is read for the frozen
        # base of a run that trains a part of the model alone (its checkpoints hold the rest)
        if source and (tuning or not resuming):
            state = placed_state(build, whole, param_shardings, source.load)
        else:
            state = parallel.init_params(build, param_shardings)
        params, *frozen = split(state)
        opt_state = init_opt_state(tx, params, shardings_trained, NamedSharding(mesh, P()))
    except jax.errors.JaxRuntimeError as error:  # before any step: the model alone
        if not _out_of_memory(error):
            raise
        size = sum(x.size for x in jax.tree.leaves(whole))
        raise SystemExit(f"the model ({size / 1e6:.1f}M parameters, {3 * 4 * size / 2**30:.1f} "
                         "GiB with AdamW's two float32 moments) does not fit in the devices' "
                         f"memory ({str(error).splitlines()[0][:160]}): shard it over more "
                         "devices (--mesh fsdp=N), or a smaller model (--preset, --set)"
                         ) from None

    start, resumed = 0, False
    if ckpt:
        try:
            restored = ckpt.restore_latest(
                abstract_like({"params": params, "opt_state": opt_state}), same_model)
        except RuntimeError as error:
            raise SystemExit(str(error)) from None
        if restored is not None:
            (start, state, meta), resumed = restored, True
            params, opt_state = state["params"], state["opt_state"]
            if lead:
                _note_changes(meta["config"]["train"], effective["train"])
        if lead:
            replace_text(Path(args.checkpoint_dir, "train_config.json"),
                         json.dumps(effective, indent=2) + "\n")

    loss_options = dict(remat=args.remat, sequence_parallel=args.sequence_parallel,
                        loss_chunk=args.loss_chunk, scan_layers=args.scan_layers)
    join = adapters.joined if tuning else lambda fn: fn
    loss_fn = join(parallel.make_loss_fn(graphdef, specs, mesh, **loss_options, fp8=fp8))
    # Held-out losses in --dtype under --fp8 too: the model as generate and the export run it
    eval_loss = jax.jit(join(parallel.make_loss_fn(graphdef, specs, mesh, **loss_options,
                                                   per_row=True)),
                        compiler_options=train_compiler_options(args.deterministic))
    train_step = make_train_step(loss_fn, tx, deterministic=args.deterministic)
    micro_rows = NamedSharding(mesh, P(None, *parallel.TOKENS))
    rows = NamedSharding(mesh, parallel.TOKENS)

    def evaluate(params):
        """The mean loss of the held-out rows' counted tokens (every token of a window of
        text): the same on every mesh and --grad-accum (a batch that the data shards do not
        divide is filled with copies of its first rows, whose losses are not counted)."""
        # in the step's micro-batches (as many rows in all): --grad-accum is what makes
        # the step fit, and a forward over --batch-size rows at once need not
        losses, counts, micro = [], [], args.batch_size // args.grad_accum
        for batch in dataset.eval_batches(micro, args.seq_len, 4 * args.grad_accum):
            n = len(batch["inputs"])
            filled = np.arange(-n % n_shards + n) % n  # rows 0..n-1, then 0, 1, ... again
            per_row = eval_loss(params, *frozen, *(
                parallel.global_array(batch[name][filled], rows)
                for name in _token_fields(args, dataset)))
            losses.append(np.asarray(multihost_utils.process_allgather(per_row, tiled=True)
                                     if n_proc > 1 else per_row)[:n])
            counts.append(batch["loss_mask"].sum(-1) if dataset.masked else None)
        return float(np.average(np.concatenate(losses), weights=np.concatenate(counts)
                                if dataset.masked else None))

    if lead:
        n_params = sum(x.size for x in jax.tree_util.tree_leaves(whole))
        trained = sum(x.size for x in jax.tree_util.tree_leaves(params))
        model = f"init from {args.init_from}" if source else f"preset {args.preset}"
        print(f"mamba_jax.train: {model}, {n_params / 1e6:.2f}M parameters"
              + (f" ({trained / 1e6:.3f}M of them trained)" if tuning else "") + ", "
              f"data {dataset.name}, {jax.devices()[0].platform} x {jax.device_count()} "
              f"({n_proc} processes), mesh {dict(mesh.shape)}, sequence parallel "
              f"{args.sequence_parallel and mesh.shape['tp'] > 1}, compute {args.dtype}"
              + (f" (FP8 projections in layers {args.fp8_skip_layers}.."
                 f"{len(cfg.layers) - 1 - args.fp8_skip_layers})" if fp8 else "") + ", "
              f"remat {args.remat}, layers {'scanned' if args.scan_layers else 'unrolled'}, "
              f"compilation cache {cache_dir or 'off'}"
              + (f", resumed at step {start}" if start else ""), file=sys.stderr)
        if (warmup := warmup_steps(args.steps, args.warmup, args.schedule)) < args.warmup:
            instead = (f"warms up over {warmup} step{'s' * (warmup > 1)}" if warmup else
                       "starts at its peak")
            why = (f"is not below --steps {args.steps}" if args.warmup >= args.steps else
                   f"leaves --schedule wsd no room for its decay over the last "
                   f"{WSD_DECAY_FRACTION:.0%} of --steps {args.steps}")
            print(f"--warmup {args.warmup} {why}: the learning rate {instead} instead",
                  file=sys.stderr)
        if note := dataset.packing_note(args.seq_len, args.seed):
            print(note, file=sys.stderr)
        if saves_nothing:
            print(f"--save-every {args.save_every} without --checkpoint-dir: this run saves "
                  "no checkpoints (add --checkpoint-dir DIR to save them)", file=sys.stderr)
        if start >= args.steps:
            print(f"the checkpoint's step {start} is at --steps {args.steps} or past it: "
                  "nothing to train (raise --steps to train on)", file=sys.stderr)
    flops = train_flops_per_token(cfg, args.seq_len)
    peak = peak_flops(args.dtype)
    # A resumed run supersedes what a killed one logged after its checkpoint; a run that
    # restored nothing (--resume-if-exists finding none) appends, as any fresh run does.
    resumed_from = start if resumed else None
    metrics = (MetricsWriter(args.metrics_file, args.tensorboard, resumed_from) if lead
               else MetricsWriter())
    progress = Progress(args.steps, first=start)
    # Each step's learning rate for its record, computed once: the schedule's jnp, run on
    # the device at each step, would wait there behind the step dispatched after it.
    lrs = np.asarray(lr_at(np.arange(args.steps)))

    def finished(step, loss, grad_norm, began) -> dict:
        """The metrics record of a dispatched step whose time began at `began`; reading its
        loss waits for it."""
        loss = float(loss)
        if not math.isfinite(loss):
            raise SystemExit(f"step {step}: the loss is {loss}; stopping without saving "
                             "(the last checkpoint is the last good state). Lower --lr, "
                             "raise --warmup" + (" or use --dtype float32"
                                                 if args.dtype != "float32" else ""))
        elapsed = time.perf_counter() - began
        tokens_per_s = args.batch_size * args.seq_len / elapsed
        return {"step": step, "loss": loss, "lr": float(lrs[step - 1]),
                "grad_norm": float(grad_norm), "step_time_s": elapsed,
                "tokens_per_s": tokens_per_s,
                "mfu": None if peak is None else flops * tokens_per_s / peak,
                "peak_memory_gib": peak_memory_gib()}

    def log(record):
        metrics.write(record)
        if lead:
            progress.update(record["step"], record)

    # Each step is dispatched before the loss of the step before it is read, so that the
    # device does not wait between steps while the host dispatches (docs/performance.md).
    # A step that saves or evaluates,
    # the last step and a step after a stop request are read at once: a state is checked
    # before it is kept.
    step = start
    pending = None  # (step, loss, grad_norm, when its time began): dispatched, not yet read
    stopping = False  # a stop request seen after a step, which then saves and ends the run
    with _StopRequest() as stop, contextlib.ExitStack() as cleanup, _fits_in_memory(args):
        cleanup.callback(metrics.close)
        if ckpt:
            cleanup.callback(ckpt.close)  # saves in flight are committed before we go on
        while step < args.steps and not stopping:
            tic = time.perf_counter()
            batch = dataset.train_batch(step, args.batch_size, args.seq_len, args.seed,
                                        jax.process_index(), n_proc)
            params, opt_state, loss, grad_norm = train_step(
                params, opt_state, _batch_arrays(batch, args, dataset, micro_rows), *frozen)
            step += 1
            if pending is not None:
                log(finished(*pending))
                tic = time.perf_counter()  # this step has the device from here on
            if ckpt:
                ckpt.check()  # a save that failed in the background stops the run now
            stopping = stop.signal is not None
            saving = ckpt and (step % args.save_every == 0 or step == args.steps or stopping)
            scoring = evaluating and (step % args.eval_every == 0 or step == args.steps)
            pending = (step, loss, grad_norm, tic)
            if not (saving or scoring or step == args.steps or stopping):
                continue
            record, pending = finished(*pending), None
            if saving:  # before evaluating: the checkpoint never waits on an evaluation
                ckpt.save(step, {"params": params, "opt_state": opt_state},
                          {"step": step, "config": effective})
            if scoring:
                record["eval_loss"] = evaluate(params)
                record["eval_ppl"] = math.exp(min(record["eval_loss"], 50.0))
            log(record)
    if stop.signal and step < args.steps:
        if lead:
            print(f"{stop.signal.name}: stopped after step {step}; " + (
                f"checkpoint saved in {args.checkpoint_dir}" if ckpt else
                "nothing saved (--out is written when the run ends; --checkpoint-dir DIR keeps "
                "a run's progress, to continue with --resume)"), file=sys.stderr)
        # A run that did not finish is no success: `train && generate` stops, and a
        # scheduler sees a job to run again. 128 + the signal, as a shell reports it.
        raise SystemExit(128 + stop.signal)
    if stop.signal and lead:  # during the last step or its save: nothing was cut short
        print(f"{stop.signal.name} after the last step: the run is complete", file=sys.stderr)

    if out or args.export_adapter:
        state = adapters.join(params, *frozen) if tuning else params
        if n_proc > 1:
            state = multihost_utils.process_allgather(state, tiled=True)  # all processes join
        model = nnx.merge(graphdef, state)
    if args.export_adapter and lead:
        where = _export_dir(args, args.export_adapter, resumed, "--export-adapter",
                            adapters.adapter_file)
        adapters.save_peft_adapter(model, where, source.name() if source else None)
        replace_text(Path(where, "train_config.json"), json.dumps(effective, indent=2) + "\n")
        print(f"saved {where} (LoRA adapters in PEFT's layout)", file=sys.stderr)
    if out:
        if lead:
            out = _export_dir(args, out, resumed)
            removed = export(adapters.merge(model) if tuning else model, out, tokenizer,
                             format=layout, chat_template=chat_template)
            replace_text(Path(out, "train_config.json"), json.dumps(effective, indent=2) + "\n")
            if removed := [name for name in removed if name != "train_config.json"]:
                print(f"removed the replaced model's {', '.join(removed)} from {out}",
                      file=sys.stderr)
            written = check_exportable(cfg, layout)
            named = "" if written == "hf" else f" ({written}'s layout)"
            for note in export_notes(cfg, written):
                print(f"note: {note}", file=sys.stderr)
            print(f"saved {out}{named}; try: python -m mamba_jax.generate --checkpoint "
                  f"{shlex.quote(out)} --prompt {shlex.quote(dataset.prompt(tokenizer))}",
                  file=sys.stderr)


# The flags that, with the step, fix the batch a step trains on (Dataset.train_batch), and
# those that fix its learning rate (optim.make_optimizer's schedule).
_DATA_ORDER = ("data", "tokenizer", "batch_size", "seq_len", "seed")
_SCHEDULE = ("lr", "steps", "warmup", "schedule")
# Flags compared by what they name where the run recorded it: the same data or tokenizer at
# another path is no change, and other data at the same path is one.
_IDENTITY = {"data": "data_identity", "tokenizer": "tokenizer_sha256"}


def _config_difference(saved: Mamba2Config, given: Mamba2Config, most: int = 6) -> str:
    """The fields where a checkpoint's model config and this run's differ, as `FIELD SAVED in
    the checkpoint, GIVEN here` (a layer kind's as SECTION.FIELD, as --set spells them),
    shared fields first, at most `most` of them."""
    def flat(d, prefix=""):
        for key, value in d.items():
            if isinstance(value, dict):
                yield from flat(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value
    before, now = dict(flat(saved.to_dict())), dict(flat(given.to_dict()))
    fields = sorted((k for k in before if before[k] != now.get(k)), key=lambda k: ("." in k, k))
    shown = [f"{k} {before[k]!r} in the checkpoint, {now.get(k)!r} here" for k in fields[:most]]
    more = f" and {len(fields) - most} more" if len(fields) > most else ""
    return "; ".join(shown) + more if fields else f"its config {saved.to_dict()}"


def _note_changes(before: dict, now: dict) -> None:
    """A line on stderr where a resumed run changed a flag the data order depends on, and
    one where it changed the learning rate's schedule (from the checkpoint's own run flags
    `before`): allowed (a longer run is a resume with more --steps), but the resumed steps
    then differ from what the interrupted run's would have been."""
    differs = lambda k: (before[_IDENTITY[k]] != now[_IDENTITY[k]]
                         if _IDENTITY.get(k) in before else before.get(k) != now[k])
    for flags, effect in ((_DATA_ORDER, "the steps from here train on other batches than "
                                        "that run would have"),
                          (_SCHEDULE, "the learning rate from here follows this run's "
                                      "schedule, not that run's")):
        changed = [f"--{k.replace('_', '-')} " + (
            f"{before.get(k)} -> {now[k]}" if before.get(k) != now[k] else
            f"{now[k]} (its contents changed)") for k in flags if differs(k)]
        if changed:
            print(f"resumed with {', '.join(changed)} (from the checkpoint's run): {effect}",
                  file=sys.stderr)


def _out_of_memory(error: Exception) -> bool:
    """Whether a JaxRuntimeError is a device out of memory: XLA's RESOURCE_EXHAUSTED, or the
    CPU client's INTERNAL "Out of memory allocating" of a dispatch over several devices."""
    return "RESOURCE_EXHAUSTED" in str(error) or "Out of memory allocating" in str(error)


@contextlib.contextmanager
def _fits_in_memory(args):
    """A device out of memory in the steps (XLA's RESOURCE_EXHAUSTED, at the first step's
    allocation or later) -> a message naming the batch and what to change, not a traceback.
    Entered inside the run's cleanup stack, which then commits the checkpoints in flight."""
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        if not _out_of_memory(error):
            raise
        # float32 compute first: the trainer's default, it keeps twice the activations of
        # the bfloat16 that mamba_ssm's users train under (autocast)
        fixes = (["compute in bfloat16 (--dtype bfloat16: about half the activations; the "
                  "parameters, optimizer state and SSM states stay float32)"]
                 if args.dtype == "float32" else [])
        fixes += [f"split the step's rows into more micro-batches (--grad-accum "
                  f"{2 * args.grad_accum}: the same tokens a step, fewer activations at once) "
                  "or lower --batch-size"]
        if args.remat != "full":
            fixes.append("recompute more in the backward pass (--remat "
                         + ("block or full)" if args.remat == "none" else "full)"))
        if not args.scan_layers:
            fixes.append("run the layers as one scan (--scan-layers: less memory a row, a "
                         "longer step)")
        fixes.append("or shard the model over more devices (--mesh fsdp=N)")
        at_once = (f" ({args.batch_size // args.grad_accum} rows at once with --grad-accum "
                   f"{args.grad_accum})" if args.grad_accum > 1 else "")
        raise SystemExit(f"--batch-size {args.batch_size} x --seq-len {args.seq_len}{at_once} "
                         f"does not fit in the device's memory "
                         f"({str(error).splitlines()[0][:160]}): {'; '.join(fixes)}") from None


if __name__ == "__main__":
    main()
