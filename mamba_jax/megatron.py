"""Megatron-LM checkpoints in and out: its legacy layout (one file per tensor-parallel rank,
at any TP size, and per pipeline stage) and its torch_dist layout are read; the legacy
layout is written, at any TP size Megatron's layers allow.

    model = mamba_jax.from_pretrained("ckpts")       # Megatron's --save dir, or an iter_ folder
    save_megatron(model, "out", tp=2)                 # out/iter_0000000/mp_rank_0{0,1}/...
    python -m mamba_jax.convert SRC DST --to megatron --target-tp-size 2

The layouts (Megatron-LM's megatron/training/checkpointing.py and
megatron/core/dist_checkpointing; their files: mamba_jax.megatron_files):

    DIR/latest_checkpointed_iteration.txt           the newest iteration, or "release"
    DIR/iter_0000100/mp_rank_TT/model_optim_rng.pt  legacy, per tp rank (mp_rank_TT_PPP under
        pipeline parallelism): {"model": the rank's state dict, "args": the run's
        argparse.Namespace, "checkpoint_version": 3.0, "iteration": 100, ...}
    DIR/iter_0000100/{metadata.json, .metadata, __R_0.distcp, ...}   torch_dist: each tensor
        whole (its global shape) in torch.distributed.checkpoint's files, the arguments in
        its "common_state" object (or in common.pt, before Megatron-core 0.14)

Tensor names are the layer kinds' "megatron" key tables (mamba_jax.layers) under
`decoder.layers.N.`, with `embedding.word_embeddings.weight`, `decoder.final_norm.weight` and
`output_layer.weight`: the names of the TP=1 legacy layout. Rank r's file holds each
tensor's r-th piece of each part (checkpoint_keys.tp_parts, from where our parameters split
over tp: in_proj's z, x, B, C and dt each cut across the ranks; linear_qkv by rows, whole KV
groups where tp divides them; out_proj and linear_fc2 by columns; norms whole on every rank).
Read, each tensor is whole again (Tensors). TransformerEngine's fp8 metadata
(`_extra_state`), empty tensors and multi-token-prediction layers (`mtp.`) are dropped on
read and never written. KEY_LAYOUTS: the names of which Megatron-LM versions a written
checkpoint has. docs/megatron.md has the versions checked and what is refused.

Reading and writing the files needs torch, an optional extra
(`pip install mamba-jax[megatron]`), imported by mamba_jax.megatron_files alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from mamba_jax import megatron_files
from mamba_jax.config import LEGACY_NAMES, Mamba2Config
from mamba_jax.convert import flat_params, param_axes, param_shapes, params_to_torch, tensor_map
from mamba_jax.formats import config_from_megatron, megatron_args_dict
from mamba_jax.layers import checkpoint_keys, mamba2
from mamba_jax.megatron_files import LAYER
from mamba_jax.sharding import RULES

# The tensor names each era of Megatron-LM's Mamba layer saves in the legacy layout, as
# renames of ours (torch_dist's, which every version keeps): "0.19", Megatron-core 0.19 and
# later (the conv weights direct parameters of the mixer); "0.8", core_r0.8.0 to 0.18 (the
# layer norm fused into in_proj, the conv an nn.Conv1d); "2024", June 2024's first Mamba
# layer (a norm of its own), the one tools/checkpoint/hybrid_conversion.py knows (its
# checkpoints also hold an empty rng_state, which that tool copies).
KEY_LAYOUTS = {
    "0.19": {"mixer.conv1d.weight": "mixer.conv1d_weight",
             "mixer.conv1d.bias": "mixer.conv1d_bias"},
    "0.8": {},
    "2024": {"mixer.in_proj.layer_norm_weight": "norm.weight"},
}


class Tensors(Mapping):
    """A Megatron-LM checkpoint's tensors by our "megatron" names, each whole (its TP=1
    form) and read when looked up: its ranks' pieces joined by its key-table entry's
    parts (`parts`: name -> checkpoint_keys.tp_parts' value; a name without one, or None,
    is read from the first rank)."""

    def __init__(self, files, parts: dict):
        self._files, self._parts = files, parts

    def __getitem__(self, key):
        if key not in self._files.names():
            raise KeyError(key)
        parts = self._parts.get(key)
        return checkpoint_keys.merge_ranks(self._files.parts(key, whole=parts is None), parts)

    def __iter__(self):
        return iter(self._files.names())

    def __len__(self):
        return len(self._files.names())


# Our config fields a checkpoint without saved arguments must be given (--set), by the
# layers it has; d_model, the vocabulary and the head's tying come from its tensors.
_REQUIRED = {"M": ("mamba2.d_state", "mamba2.headdim", "mamba2.ngroups"),
             "*": ("attention.num_heads", "attention.num_heads_kv", "attention.head_dim"),
             "-": ("mlp.d_intermediate", "mlp.activation")}


def _config(saved, path, overrides: dict) -> Mamba2Config:
    """The model config of a checkpoint: its saved arguments', with `overrides` (our fields,
    as --set names them) applied; without saved arguments, the overrides' over what the
    tensors tell (d_model, the vocabulary, whether the head is tied) and Megatron's
    defaults, each field the layers need but the overrides lack named."""
    embedding = "embedding.word_embeddings.weight"
    if embedding not in saved.names():
        raise ValueError(f"{path}: holds no {embedding}: a checkpoint of a pipeline stage "
                         "other than the first, or not a language model's")
    rows = saved.rows(embedding)
    if saved.args is not None:
        cfg = config_from_megatron(saved.args, rows, f"{path}: its saved arguments")
        return cfg.replace(**overrides) if overrides else cfg
    pattern = next((overrides[name] for name in ("layer_pattern", "hybrid_layer_pattern",
                                                 "hybrid_override_pattern") if name in overrides),
                   None)
    if not pattern:
        raise ValueError(f"{path}: holds no saved arguments (Megatron's args) to build the "
                         "model from: give its layers, e.g. --set layer_pattern=M*M-, and "
                         "their sizes")
    named = {name for given in overrides for name in (given, _flat(given))}
    missing = [field for symbol in dict.fromkeys(pattern) if symbol in _REQUIRED
               for field in _REQUIRED[symbol] if field not in named]
    if missing:
        raise ValueError(f"{path}: holds no saved arguments, and --set lacks "
                         f"{', '.join(missing)} for the layers {pattern!r}: give each, "
                         f"e.g. --set {missing[0]}=...")
    return Mamba2Config.from_dict({
        "d_model": saved.shape(embedding)[1], "n_layer": len(pattern), "vocab_size": rows,
        "pad_vocab_size_multiple": 1, "residual_in_fp32": False, "mamba2.chunk_size": 128,
        "tie_embeddings": "output_layer.weight" not in saved.names(), **overrides})


def _flat(name: str) -> str:
    """A --set name as its section's field (the flat LEGACY_NAMES spelling resolved)."""
    section = LEGACY_NAMES.get(name)
    return f"{section[0]}.{section[1]}" if section else name


def tp_parts(cfg: Mamba2Config) -> dict:
    """Each "megatron" tensor's tensor-parallel parts (checkpoint_keys.tp_parts) for a model
    of cfg: where its parameters split over our tp axis (sharding.RULES), Megatron's ranks
    split it."""
    shapes, axes = param_shapes(cfg), param_axes(cfg)
    dims = {name: next((i for i, a in enumerate(axes[name]) if RULES[a] == "tp"), None)
            for name in axes}
    return {key: entry.tp_parts([shapes[p] for p in entry.params],
                                [dims[p] for p in entry.params])
            for key, entry in tensor_map(cfg, "megatron", shapes).items()}


def read_megatron(path, overrides: dict | None = None) -> tuple[Mamba2Config, Tensors]:
    """(the model config, its tensors by our "megatron" names, each read whole when looked
    up) of a Megatron-LM --save dir or iteration folder, legacy at any TP size (and
    pipeline stages) or torch_dist: checkpoint_tensors of its files."""
    return checkpoint_tensors(megatron_files.open_iteration(path), overrides, path)


def checkpoint_tensors(files, overrides: dict | None = None,
                       path="the checkpoint") -> tuple[Mamba2Config, Tensors]:
    """(the model config, the tensors) of a checkpoint's files (megatron_files.Legacy or
    TorchDist). The config comes from the checkpoint's saved arguments and `overrides`
    (our config fields, as --set names them); without saved arguments, the overrides give
    the layer pattern and sizes."""
    cfg = _config(files, path, dict(overrides or {}))
    return cfg, Tensors(files, tp_parts(cfg))


# ---------------------------------------------------------------- writing


def check_tp(cfg: Mamba2Config, tp: int) -> None:
    """Refuse a tensor-parallel size Megatron-LM cannot run the model at (its layers divide
    heads, groups, the MLP width and the vocabulary over the ranks), naming the sizes that
    work."""
    m, a, layers = cfg.mamba2, cfg.attention, cfg.layers
    sizes = {"the padded vocabulary": cfg.padded_vocab_size}
    if "M" in layers:
        sizes |= {"mamba2 heads": mamba2.dims(cfg).h, "mamba2.ngroups": m.ngroups}
    if "*" in layers:
        sizes["attention.num_heads"] = a.num_heads
    if "-" in layers:
        sizes["mlp.d_intermediate"] = cfg.mlp.d_intermediate

    def uneven(t: int) -> list[str]:
        found = [f"{name}={size}" for name, size in sizes.items() if size % t]
        if "*" not in layers:
            return found
        # Megatron splits KV groups over the ranks, or (fewer groups than ranks) linear_qkv's
        # rows evenly over them, each rank then taking its group's part of the whole
        kv, rows = a.num_heads_kv, (a.num_heads + 2 * a.num_heads_kv) * a.head_dim
        if kv % t and t % kv:
            found.append(f"attention.num_heads_kv={kv} (nor does it divide {t})")
        elif kv < t and rows % t:
            found.append(f"linear_qkv's {rows} rows ((num_heads + 2 * num_heads_kv) * "
                         f"head_dim, split evenly where there are fewer KV heads than ranks)")
        return found

    if problems := uneven(tp):
        fits = [t for t in range(1, 65) if not uneven(t)]
        raise ValueError(f"--target-tp-size {tp} does not divide {', '.join(problems)}, which "
                         f"Megatron-LM splits over its tensor-parallel ranks; sizes that "
                         f"work: {fits}")


def _divisible_by(rows: int, vocab: int, tp: int) -> int:
    """Megatron's --make-vocab-size-divisible-by to save: it pads the tokenizer's vocabulary
    up to a multiple of this times tp, which must give the embedding's rows. The largest
    power of two up to its default 128 that does, else rows / tp."""
    return next((m for m in (128, 64, 32, 16, 8, 4, 2, 1)
                 if rows % (m * tp) == 0 and rows - vocab < m * tp), rows // tp)


def megatron_args(cfg: Mamba2Config, tp: int, iteration: int) -> dict:
    """The arguments a legacy checkpoint of a model of cfg saves: the fields Megatron-LM's
    loader (load_args_from_checkpoint, check_checkpoint_args) and
    tools/checkpoint/hybrid_conversion.py read."""
    return dict(
        **megatron_args_dict(cfg), tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1,
        make_vocab_size_divisible_by=_divisible_by(cfg.padded_vocab_size, cfg.vocab_size, tp),
        ckpt_format="torch", iteration=iteration, consumed_train_samples=0,
        consumed_valid_samples=0)


def rank_state_dicts(params: dict, cfg: Mamba2Config, tp: int, keys: str = "0.19") -> list:
    """Our flat parameters -> each tensor-parallel rank's state dict of numpy arrays, its
    tensors named as the Megatron-LM versions of KEY_LAYOUTS[keys] save them."""
    check_tp(cfg, tp)
    renames = KEY_LAYOUTS[keys]
    parts = tp_parts(cfg)
    ranks = [{} for _ in range(tp)]
    for key, tensor in params_to_torch(params, cfg, "megatron").items():
        layer = LAYER.match(key)
        name = layer.group(0) + renames.get(key[layer.end():], key[layer.end():]) \
            if layer else key
        for rank, part in zip(ranks, checkpoint_keys.split_ranks(tensor, parts[key], tp)):
            rank[name] = part
    return ranks


def save_megatron(model, path, tp: int = 1, keys: str = "0.19", iteration: int = 0) -> Path:
    """Write the model as a Megatron-LM legacy checkpoint at tensor-parallel size tp
    (megatron_files.write_legacy), float32, its tensors named as the Megatron-LM versions of
    KEY_LAYOUTS[keys] save them. No optimizer or RNG state: Megatron loads it with
    --finetune (or --no-load-optim --no-load-rng). Returns the iteration folder."""
    if keys not in KEY_LAYOUTS:
        raise ValueError(f"keys={keys!r}; use one of {sorted(KEY_LAYOUTS)}")
    megatron_files.torch_module("writing a Megatron-LM checkpoint")  # before any work
    cfg = model.config
    args = megatron_args(cfg, tp, iteration)  # first: it refuses what Megatron cannot hold
    ranks = rank_state_dicts(flat_params(model), cfg, tp, keys)
    # hybrid_conversion.py copies the RNG state into what it writes (and reads it first):
    # none saved. Megatron's loader reads it only without --finetune and --no-load-rng.
    extra = {"rng_state": []} if keys == "2024" else None
    return megatron_files.write_legacy(path, ranks, args, iteration, extra)
