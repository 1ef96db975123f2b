"""Checkpoints in and out: Hugging Face `Mamba2ForCausalLM`, `MambaForCausalLM`,
`FalconMambaForCausalLM` and `NemotronHForCausalLM`, and mamba_ssm `MambaLMHeadModel` (Mamba2
or Mamba-1, with attention and MLP layers or without), and our own layout for a model none
of them holds.

    model = from_pretrained("path/to/dir")                  # layout detected from config.json
    save_pretrained(model, "out", format="hf")              # or "mamba_ssm", "nemotron_h",
                                                            # "mamba_jax"
    python -m mamba_jax.convert SRC DST --to hf|mamba_ssm|nemotron_h|mamba_jax

A checkpoint dir holds config.json and model.safetensors (or a sharded
model.safetensors.index.json, or pytorch_model.bin, which needs torch to read). The layouts
share the Mamba layers' tensor names (the embedding is HF's `backbone.embeddings.weight`,
mamba_ssm's `backbone.embedding.weight`): the mixer's projections fused into
`in_proj.weight` [z | x | B | C | dt] and its conv into `conv1d.weight` [x | B | C, 1, d_conv],
which we split into per-role parameters shaped by head or group. Attention: mamba_ssm's
MHA fuses `in_proj` [q | k | v] (and its bias) and has `out_proj`; NemotronH has `q_proj`,
`k_proj`, `v_proj`, `o_proj`. MLP: mamba_ssm's Block holds `norm2` and `mlp.fc1` [up | gate],
`mlp.fc2` beside its mixer (our layers i and i+1); NemotronH's MLP layer has `mixer.up_proj`,
`mixer.down_proj`. NemotronH's own keys start `model.` in memory and `backbone.` on disk: both
are read. Our own layout ("mamba_jax") stores our parameters under their own names
(`layers.0.mixer.z_proj`, split as the model holds them) beside the whole Mamba2Config.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mamba_jax.chat import ADDITIONAL_TEMPLATES, ChatTemplate
from mamba_jax.cli import (HelpFormatter, MissingDependency, command, parse_overrides,
                           require_at_least)
from mamba_jax.config import Mamba2Config
from mamba_jax.files import (check_outside_checkpoints, check_writable, holds_checkpoints,
                             holds_model, model_file, replace_text)
from mamba_jax.formats import (OWN, config_dict, config_from, detect_format, layout_notes,
                               mamba_ssm_blocks, published_layouts, refusal, with_token_ids)
from mamba_jax.layers import checkpoint_keys
from mamba_jax.layers.registry import KINDS
from mamba_jax.megatron_files import TRACKER, is_megatron_checkpoint
from mamba_jax.model import Mamba2LM
from mamba_jax.parallel import global_array
from mamba_jax.sharding import logical_axes, param_name
from mamba_jax.tensors import index_shards, open_tensors
from mamba_jax.tokenizer import (TOKENIZER_FILES, find_tokenizer, load_tokenizer, save_tokenizer,
                                 special_token_ids)

FORMATS = ("hf", "mamba_ssm", "nemotron_h", OWN)
# Per layout: the embedding's, the final norm's and the (untied) head's keys (our own
# layout's: our parameters' names).
_TOP_KEYS = {"hf": ("backbone.embeddings.weight", "backbone.norm_f.weight", "lm_head.weight"),
             "mamba_ssm": ("backbone.embedding.weight", "backbone.norm_f.weight",
                           "lm_head.weight"),
             "nemotron_h": ("backbone.embeddings.weight", "backbone.norm_f.weight",
                            "lm_head.weight"),
             "megatron": ("embedding.word_embeddings.weight", "decoder.final_norm.weight",
                          "output_layer.weight"),
             OWN: ("embedding", "norm_f.weight", "lm_head")}
# Megatron-LM's layer norms, fused into each kind's first projection (its TE layer spec).
_MEGATRON_NORM_KEYS = {"M": "mixer.in_proj.layer_norm_weight",
                       "*": "self_attention.linear_qkv.layer_norm_weight",
                       "-": "mlp.linear_fc1.layer_norm_weight"}


def load_config(path) -> tuple[Mamba2Config, str]:
    """(Mamba2Config, its layout: one of FORMATS) from a checkpoint dir's config.json."""
    file = Path(path) / "config.json"
    if not file.is_file():
        hint = (" (it holds training checkpoints: python -m mamba_jax.convert exports one)"
                if is_training_checkpoint(path) else "")
        raise FileNotFoundError(f"{file} not found: a checkpoint dir needs config.json beside "
                                f"model.safetensors or pytorch_model.bin{hint}")
    try:
        d = json.loads(file.read_text())
        fmt = detect_format(d)
    except ValueError as error:
        raise ValueError(f"{file}: {error}") from None
    return config_from(d, fmt, str(file)), fmt


# ---------------------------------------------------------------- tensors


def _layer_keys(cfg: Mamba2Config, fmt: str) -> list[tuple[str, str]]:
    """Per layer of ours: (its norm's key, the prefix of its mixer's keys) in fmt."""
    if fmt == "megatron":  # the norm fused into the layer's first projection
        for symbol in cfg.layers:
            _key_table(symbol, fmt)  # a kind the layout lacks, named
        return [(f"decoder.layers.{i}.{_MEGATRON_NORM_KEYS[symbol]}", f"decoder.layers.{i}.")
                for i, symbol in enumerate(cfg.layers)]
    if fmt != "mamba_ssm":
        return [(f"backbone.layers.{i}.norm.weight", f"backbone.layers.{i}.mixer.")
                for i in range(len(cfg.layers))]
    mixers, mlp = mamba_ssm_blocks(cfg)
    keys = []
    for i in range(len(mixers)):
        keys.append((f"backbone.layers.{i}.norm.weight", f"backbone.layers.{i}.mixer."))
        if mlp:
            keys.append((f"backbone.layers.{i}.norm2.weight", f"backbone.layers.{i}.mlp."))
    return keys


def _key_table(symbol: str, fmt: str) -> dict:
    """The checkpoint keys of a layer kind in fmt (Mixer.checkpoint_keys)."""
    kind = KINDS[symbol]
    if fmt not in kind.checkpoint_keys:
        raise ValueError(f"format {fmt!r} has no {kind.name} layers; use one of "
                         f"{sorted(kind.checkpoint_keys)}")
    return kind.checkpoint_keys[fmt]


def _held_params(table: dict) -> set[str]:
    """The parameters a layer kind's checkpoint-key table (Mixer.checkpoint_keys) holds."""
    return {p for entry in table.values() for p in entry.params}


def _held_table(mine, symbol: str, fmt: str, i: int) -> dict:
    """Layer i's checkpoint keys in fmt, each entry over the parameters the layer has,
    refusing parameters of it (`mine`, by name) that the layout has no key for (e.g. a
    learnable initial state)."""
    table = _key_table(symbol, fmt)
    held = _held_params(table)
    if set(mine) - held:
        raise ValueError(f"format {fmt!r} cannot hold layer {i}'s parameters "
                         f"{sorted(set(mine) - held)}")
    return checkpoint_keys.held_table(table, mine)


def check_exportable(cfg: Mamba2Config, format: str = "hf") -> str:
    """The layout save_pretrained(format=format) writes a model of cfg in, or the
    ValueError it would raise there: a config field or a layer's parameter the layout
    cannot hold. "hf" is the first of formats.published_layouts that holds the model, else
    our own (OWN); any other format is itself. From the config alone (no model built): the
    trainer asks before training."""
    names = param_shapes(cfg)
    if format == "hf":
        return next((fmt for fmt in published_layouts(cfg)
                     if _refusal(cfg, fmt, names) is None), OWN)
    if why := _refusal(cfg, format, names):
        fits = [fmt for fmt in FORMATS
                if fmt not in (format, OWN) and _refusal(cfg, fmt, names) is None]
        hint = (f"use format={fits[0]!r}" if fits else f"no published layout holds it: "
                f"format={OWN!r} (ours, which transformers does not read) does")
        raise ValueError(f"{why}; {hint}")
    return format


def _held_tables(cfg: Mamba2Config, names: dict, fmt: str) -> list[dict]:
    """Each layer's checkpoint keys in fmt (_held_table), refusing a parameter that fmt
    holds no tensor for (our own layout holds them all, as they are)."""
    if fmt == OWN:
        return []
    return [_held_table(_layer_params(names, i), symbol, fmt, i)
            for i, symbol in enumerate(cfg.layers)]


def _refusal(cfg: Mamba2Config, fmt: str, names: dict) -> str | None:
    """Why the layout fmt cannot hold a model of cfg (its config.json or a parameter; names:
    param_shapes(cfg)), or None where it can."""
    if why := refusal(cfg, fmt):
        return why
    try:
        _held_tables(cfg, names, fmt)
    except ValueError as error:
        return str(error)
    return None


def export_notes(cfg: Mamba2Config, fmt: str) -> list[str]:
    """What an export in the layout fmt (check_exportable's) says, a line each: for our own
    layout, why no published one holds the model and who reads it; what the layout
    computes otherwise than cfg (formats.layout_notes)."""
    if fmt != OWN:
        return layout_notes(cfg, fmt)
    why = _refusal(cfg, published_layouts(cfg)[0], param_shapes(cfg))
    return [f"in mamba_jax's own layout, which from_pretrained, generate, serve and convert "
            f"read and transformers does not: no published layout holds the model ({why})"]


def _layer_params(flat: dict, i: int) -> dict:
    """Of {flat parameter name: value}, layer i's mixer's, by their names in the mixer."""
    prefix = f"layers.{i}.mixer."
    return {name[len(prefix):]: value for name, value in flat.items() if name.startswith(prefix)}


def tensor_map(cfg: Mamba2Config, fmt: str, shapes: dict | None = None) -> dict:
    """Every tensor of the fmt layout that a model of cfg has: its key -> its key-table
    entry (mamba_jax.layers.checkpoint_keys) over our parameters' flat names. The head
    only where it is untied. shapes: param_shapes(cfg), where the caller has them. A
    parameter the layout has no tensor for is a ValueError naming it."""
    shapes = param_shapes(cfg) if shapes is None else shapes
    if fmt == OWN:  # our parameters, by their own names and shapes
        return {name: checkpoint_keys.AsIs(name) for name in shapes}
    embedding, norm_f, head = _TOP_KEYS[fmt]
    out = {embedding: checkpoint_keys.AsIs("embedding"),
           norm_f: checkpoint_keys.Flat("norm_f.weight")}
    if not cfg.tie_embeddings:
        out[head] = checkpoint_keys.AsIs("lm_head")
    for i, (symbol, (norm_key, prefix)) in enumerate(zip(cfg.layers, _layer_keys(cfg, fmt))):
        out[norm_key] = checkpoint_keys.Flat(f"layers.{i}.norm.weight")
        for key, entry in _held_table(_layer_params(shapes, i), symbol, fmt, i).items():
            entry.params = tuple(f"layers.{i}.mixer.{name}" for name in entry.params)
            out[prefix + key] = entry
    return out


def tensor_shapes(cfg: Mamba2Config, fmt: str) -> dict:
    """{key: torch shape} of every tensor of the fmt layout that a model of cfg has
    (tensor_map's), without building one."""
    shapes = param_shapes(cfg)
    return {key: entry.torch_shape([shapes[p] for p in entry.params])
            for key, entry in tensor_map(cfg, fmt, shapes).items()}


def param_tensors(tensors: Mapping, cfg: Mamba2Config, fmt: str, source=None):
    """A checkpoint's tensors -> our parameters: (flat name, e.g. "layers.0.mixer.A_log",
    array in the tensor's stored dtype) pairs, one tensor read at a time (a fused tensor's
    parameters one after the other, views of it), so that a caller placing each pair as it
    comes holds about one tensor.

    tensors: a Mapping from the fmt layout's names to arrays, read as they are looked up
    (mamba_jax.tensors.open_tensors, mamba_jax.megatron.Tensors). Every name is checked
    before any tensor is read: a tensor missing or one the config does not use is a
    ValueError naming it (after `source`, e.g. the folder, where given); a tensor of
    another shape, as it is read.
    """
    at = "" if source is None else f"{source}: "
    # NemotronH's keys are `model.` in memory (what a state_dict gives) and `backbone.` on disk.
    names = {("backbone." + key[6:] if fmt == "nemotron_h" and key.startswith("model.")
              else key): key for key in tensors}
    if fmt == "nemotron_h":  # multi-token-prediction layers, which transformers skips too
        names = {key: name for key, name in names.items() if not key.startswith("mtp.")}
    shapes = param_shapes(cfg)
    head = _TOP_KEYS[fmt][2]
    if cfg.tie_embeddings:
        names.pop(head, None)  # mamba_ssm's state_dict lists the tied head too
    elif head not in names:
        raise ValueError(f"{at}checkpoint is missing {head!r}, and its embeddings are "
                         + {"nemotron_h": "never tied in NemotronH (its tie_word_embeddings "
                                          "is not read)",
                            "megatron": "untied by its arguments "
                                        "(untie_embeddings_and_output_weights)"}.get(
                             fmt, "untied by its config (a transformers Mamba2 config "
                                  "without tie_word_embeddings unties them, as transformers "
                                  "does)"))
    table = tensor_map(cfg, fmt, shapes)
    for key, entry in table.items():
        if key not in names:
            raise ValueError(f"{at}checkpoint is missing {key!r} (expected shape "
                             f"{entry.torch_shape([shapes[p] for p in entry.params])})")
    if unused := sorted(set(names) - set(table)):
        raise ValueError(f"{at}checkpoint has tensors this config does not use: "
                         f"{unused}")

    def take(key, shape):
        tensor = tensors[names[key]]
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{at}checkpoint tensor {key!r} has shape "
                             f"{tuple(tensor.shape)}, expected {tuple(shape)} for this config")
        if not jnp.issubdtype(tensor.dtype, jnp.floating):  # (an int64 D was cast silently)
            raise ValueError(f"{at}checkpoint tensor {key!r} is of dtype {tensor.dtype}; the "
                             "model's weights are floating-point tensors (float32, bfloat16 or "
                             "float16): the file holds something else there")
        return tensor

    for key, entry in table.items():
        wanted = [shapes[p] for p in entry.params]
        # no name here holds the tensor: it goes once its parts have been placed
        yield from zip(entry.params, entry.from_torch(take(key, entry.torch_shape(wanted)),
                                                      wanted))


def torch_to_params(tensors: Mapping, cfg: Mamba2Config, fmt: str) -> dict[str, np.ndarray]:
    """Checkpoint tensors -> our parameters by flat name, all at once (param_tensors' pairs
    as a dict)."""
    return dict(param_tensors(tensors, cfg, fmt))


def params_to_torch(params: dict, cfg: Mamba2Config, fmt: str) -> dict[str, np.ndarray]:
    """Our flat parameters -> tensors in the fmt layout (inverse of torch_to_params)."""
    out = {key: entry.to_torch([params[p] for p in entry.params])
           for key, entry in tensor_map(cfg, fmt, {k: v.shape for k, v in params.items()})
           .items()}
    if cfg.tie_embeddings and fmt in ("mamba_ssm", "nemotron_h"):
        # mamba_ssm's state_dict lists the tied head too, and load_state_dict is strict;
        # NemotronHForCausalLM never ties its head, so it reads it from the file.
        out[_TOP_KEYS[fmt][2]] = params["embedding"]
    return {key: np.ascontiguousarray(value, np.float32) for key, value in out.items()}


# ---------------------------------------------------------------- models


def _abstract_params(cfg: Mamba2Config) -> dict:
    """A model of cfg's parameters (abstract: nothing allocated) by flat name."""
    model = nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0)))
    return {param_name(path): variable for path, variable in jax.tree_util.tree_leaves_with_path(
        nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))}


def param_shapes(cfg: Mamba2Config) -> dict[str, tuple]:
    """The shapes of a model of cfg's parameters by flat name, without building one."""
    return {name: tuple(v.shape) for name, v in _abstract_params(cfg).items()}


def param_axes(cfg: Mamba2Config) -> dict[str, tuple]:
    """The logical axes (sharding.RULES' names) of a model of cfg's parameters by flat
    name, without building one."""
    return {name: logical_axes(v, name) for name, v in _abstract_params(cfg).items()}


def flat_params(model: Mamba2LM) -> dict[str, np.ndarray]:
    """The model's parameters as numpy arrays by dotted name."""
    state = nnx.state(model, nnx.Param)
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))
    return {param_name(path): np.asarray(v) for path, v in leaves}


def place_params(named, abstract, shardings):
    """The state `abstract` describes (an nnx.State of leaves with a shape and a dtype, as
    nnx.eval_shape gives), its arrays from `named`: (flat parameter name, host array) pairs,
    each placed on its sharding as it comes (`shardings`: a pytree like abstract, or one
    Sharding for every array), cast to the leaf's dtype a device's shard at a time. So the
    host holds one pair's array and its shards' casts, never the whole model, and no device
    receives more than its shard. A name abstract lacks or never given, or an array of
    another shape, is a ValueError naming it."""
    leaves = {param_name(path): leaf
              for path, leaf in jax.tree_util.tree_leaves_with_path(abstract)}
    where = (dict.fromkeys(leaves, shardings) if isinstance(shardings, jax.sharding.Sharding)
             else {param_name(path): sharding for path, sharding
                   in jax.tree_util.tree_leaves_with_path(shardings)})
    placed = {}
    for name, array in named:
        if name not in leaves:
            raise ValueError(f"parameter {name} is not one of the model's")
        if tuple(array.shape) != tuple(leaves[name].shape):
            raise ValueError(f"parameter {name} has shape {tuple(array.shape)}, the config "
                             f"needs {tuple(leaves[name].shape)}")
        placed[name] = global_array(array, where[name], leaves[name].dtype)
        del array  # the next pair is read without this one held
    if missing := sorted(set(leaves) - set(placed)):
        raise ValueError(f"no array for the parameters {missing}")
    return jax.tree_util.tree_map_with_path(lambda path, _: placed[param_name(path)],
                                            abstract)


def _model(cfg: Mamba2Config, named, dtype) -> Mamba2LM:
    """A Mamba2LM of cfg (compute dtype `dtype`, None: float32) holding the float32
    parameters `named` gives (place_params' pairs) on the first local device."""
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32 if dtype is None else dtype)))
    return nnx.merge(graphdef, place_params(named, abstract, first_device()))


def first_device() -> NamedSharding:
    """The first local device, as a sharding (jax 0.12 deprecates SingleDeviceSharding)."""
    return NamedSharding(Mesh(np.array(jax.local_devices()[:1]), ("device",)), P())


def model_from_params(cfg: Mamba2Config, params: dict, dtype=jnp.float32) -> Mamba2LM:
    """A Mamba2LM holding exactly `params` (flat names, as flat_params returns)."""
    return _model(cfg, params.items(), dtype)


def from_pretrained(path, dtype=None, overrides: dict | None = None) -> Mamba2LM:
    """Load a Hugging Face Mamba2ForCausalLM, MambaForCausalLM, FalconMambaForCausalLM or
    NemotronHForCausalLM, or a mamba_ssm MambaLMHeadModel checkpoint dir, or a Megatron-LM
    checkpoint (its --save dir or one iteration's folder; legacy at any tensor-parallel
    size, or torch_dist: mamba_jax.megatron, which needs torch), or one in our own layout
    (save_pretrained's for a model none of those holds).

    Parameters become float32; `dtype` is the compute dtype (default float32). overrides:
    for a Megatron-LM checkpoint, config fields (as --set names them) over its saved
    arguments, or in place of them where it saved none; a config.json gives the others'.
    """
    from mamba_jax import megatron

    path = Path(path)
    if is_megatron_checkpoint(path):
        (cfg, tensors), fmt = megatron.read_megatron(path, overrides), "megatron"
    elif overrides:
        raise ValueError(f"{path}: its config.json gives the model's config; config fields "
                         f"({', '.join(overrides)}) are taken for a Megatron-LM checkpoint "
                         "only")
    else:
        cfg, fmt = load_config(path)
        tensors = open_tensors(path)  # (its errors name their file)
    return _model(cfg, param_tensors(tensors, cfg, fmt, source=path), dtype)


def save_pretrained(model: Mamba2LM, path, format: str = "hf") -> list[str]:
    """Write config.json and model.safetensors (float32) in the HF, mamba_ssm or NemotronH
    layout, or our own. "hf" is Mamba2ForCausalLM for a Mamba2-only model, MambaForCausalLM
    (or FalconMambaForCausalLM, with mamba1.bc_dt_rms) for a Mamba-1-only one and
    NemotronHForCausalLM ("nemotron_h") for a hybrid, or mamba_ssm's layout where only it
    holds the hybrid or the model has Mamba-3 layers (formats.published_layouts), and our
    own ("mamba_jax") where no published layout holds the model (export_notes says why);
    another format that cannot express the model is a ValueError naming what does not fit
    and the layout that can.

    HF: `Mamba2ForCausalLM.from_pretrained(path)` (or NemotronHForCausalLM) loads it.
    mamba_ssm (whose from_pretrained reads only pytorch_model.bin):
    `MambaLMHeadModel(MambaConfig(**json.load(...)))` then
    `load_state_dict(safetensors.torch.load_file(path + "/model.safetensors"))`. Our own:
    from_pretrained here (and generate, serve, convert); transformers does not read it.

    A model already in `path` is replaced: its weight files and the trainer's
    train_config.json that the new ones do not replace are removed (their names returned).
    Its tokenizer stays (a user's file); where the replaced model was another one (of other
    parameter shapes), a KeptTokenizer warning says so: generate and serve would read that
    tokenizer with this model.
    """
    path = Path(path)
    replaced = _shapes_in(path)
    removed = _write(model, path, format)
    kept = find_tokenizer(path)
    if kept and replaced is not None and replaced != param_shapes(model.config):
        warnings.warn(f"{kept} is the replaced model's (of other shapes), kept beside this "
                      "one: generate and serve would read it with this model; remove it, or "
                      "write this model's there (mamba_jax.tokenizer.save_tokenizer)",
                      KeptTokenizer, stacklevel=2)
    return removed


class KeptTokenizer(UserWarning):
    """save_pretrained replaced another model whose tokenizer stays in its folder."""


def _shapes_in(path: Path) -> dict | None:
    """The parameter shapes of the model in `path` (param_shapes), {} for one whose config
    cannot be read, or None where it holds none."""
    if not holds_model(path):
        return None
    try:
        return param_shapes(load_config(path)[0])
    except (OSError, ValueError):
        return {}


def _write(model: Mamba2LM, path: Path, format: str) -> list[str]:
    """save_pretrained's writing: config.json and model.safetensors, and the replaced
    model's files removed (their names)."""
    from safetensors.numpy import save_file

    if format not in FORMATS:
        raise ValueError(f"save_pretrained: format={format!r}; use one of {FORMATS}")
    if not isinstance(model, Mamba2LM):
        raise ValueError(f"save_pretrained writes a Mamba2LM's checkpoint, not a "
                         f"{type(model).__name__}'s (no layout holds an encoder): keep its "
                         "parameters with Orbax (nnx.state(model)), as the trainer does")
    cfg = model.config
    format = check_exportable(cfg, format)  # first: it refuses what the layout cannot hold
    config = config_dict(cfg, format)
    params = flat_params(model)
    # Parameters of another config (nnx.update with another model's) would be written
    # beside this config.json: a checkpoint no loader takes
    wrong = [f"{name} {params[name].shape}, not {shape}"
             for name, shape in param_shapes(cfg).items() if params[name].shape != shape]
    if wrong:
        raise ValueError(f"save_pretrained: the model's parameters do not fit its config: "
                         f"{'; '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}")
    path.mkdir(parents=True, exist_ok=True)
    tensors = params_to_torch(params, cfg, format)
    # Write to temporary names and rename, so an interrupted save never leaves a torn pair.
    save_file(tensors, path / "model.safetensors.tmp", metadata={"format": "pt"})
    (path / "config.json.tmp").write_text(json.dumps(config, indent=2) + "\n")
    # safetensors writes its file for its owner alone (0600): given config.json's mode (the
    # umask's), so that a shared or served model folder is whole to its readers
    os.chmod(path / "model.safetensors.tmp", (path / "config.json.tmp").stat().st_mode & 0o777)
    os.replace(path / "model.safetensors.tmp", path / "model.safetensors")
    os.replace(path / "config.json.tmp", path / "config.json")
    return _remove_replaced(path)


def _remove_replaced(path: Path) -> list[str]:
    """Remove what a model replaced in `path` leaves beside the new config.json and
    model.safetensors: its other weight files (an index and its shards, pytorch_model.bin:
    read by tools that look for them, mamba_ssm's loader among them) and the trainer's
    train_config.json (which says that the trainer's run exported the folder). Returns
    their names."""
    removed = []
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = index_shards(index)
        except ValueError:
            shards = []  # not an index we could read: its files are not known
        for shard in shards:  # (an index of one shard may name the file just written)
            if shard not in ("model.safetensors", "config.json") and (path / shard).is_file():
                (path / shard).unlink()
                removed.append(shard)
    for name in ("model.safetensors.index.json", "pytorch_model.bin", "train_config.json"):
        if (path / name).is_file():
            (path / name).unlink()
            removed.append(name)
    return removed


def _remove_model(path: Path) -> list[str]:
    """Remove a model from `path` (its config.json, weights and generation_config.json, and
    what _remove_replaced removes): what would be read as the model before the Megatron-LM
    checkpoint written beside it. Returns their names."""
    removed = [name for name in ("config.json", "model.safetensors", _GENERATION_CONFIG)
               if (path / name).is_file()]
    for name in removed:
        (path / name).unlink()
    return removed + _remove_replaced(path)


@command("python -m mamba_jax.convert")
def main(argv=None):
    from mamba_jax import megatron  # (they import this module)
    from mamba_jax.init_from import load_training_checkpoint

    parser = argparse.ArgumentParser(
        prog="python -m mamba_jax.convert", formatter_class=HelpFormatter,
        description="Convert a Mamba2, Mamba-1 or hybrid checkpoint dir between the HF "
                    "(Mamba2, Mamba, FalconMamba, NemotronH), mamba_ssm and Megatron-LM "
                    "layouts and our own (reads any, Megatron's legacy and torch_dist at any "
                    "tensor-parallel size; also turns pytorch_model.bin into "
                    "model.safetensors), or export a step of a trainer's --checkpoint-dir "
                    "(Orbax) to one of them.")
    parser.add_argument("src", help="checkpoint dir (config.json + weights), a Megatron-LM "
                                    "--save dir or iteration folder, or a trainer's "
                                    "--checkpoint-dir")
    parser.add_argument("dst", help="output dir (refused if it holds a model, unless "
                                    "--overwrite)")
    parser.add_argument("--to", choices=(*FORMATS, "megatron"), required=True,
                        help="the layout: hf is transformers' Mamba2ForCausalLM (or Mamba's, "
                             "or NemotronH's for a hybrid), mamba_ssm's for a model with "
                             "Mamba-3 layers, which transformers lacks, and our own "
                             "(mamba_jax) for a model no published layout holds; megatron is "
                             "Megatron-LM's legacy layout (needs torch)")
    parser.add_argument("--target-tp-size", type=int, default=1,
                        help="with --to megatron: its tensor-parallel size (one "
                             "mp_rank_TT folder a rank)")
    parser.add_argument("--megatron-keys", choices=sorted(megatron.KEY_LAYOUTS),
                        default="0.19",
                        help="with --to megatron: the Megatron-LM versions whose tensor names "
                             "to write: 0.19 (core 0.19 and later), 0.8 (core_r0.8.0 to "
                             "0.18), 2024 (its first Mamba layer, which "
                             "tools/checkpoint/hybrid_conversion.py reads)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a Megatron-LM src's config field (repeatable), over its saved "
                             "arguments or where it saved none, e.g. layer_pattern=M*M- "
                             "mamba2.ngroups=8")
    parser.add_argument("--step", type=int, default=None,
                        help="with a trainer's --checkpoint-dir: the step to export (default: "
                             "the newest)")
    parser.add_argument("--overwrite", action="store_true",
                        help="let the output replace the model in dst")
    args = parser.parse_args(argv)
    if args.to != "megatron" and (args.target_tp_size != 1 or args.megatron_keys != "0.19"):
        parser.error("--target-tp-size and --megatron-keys go with --to megatron")
    require_at_least(args, ["target_tp_size"])
    check_writable("dst", args.dst, folder=True)
    check_outside_checkpoints("dst", args.dst)
    held = model_file(args.dst) or (TRACKER if is_megatron_checkpoint(args.dst) else None)
    if held and not args.overwrite:
        raise SystemExit(f"{args.dst} already holds a model (its {held}): give another output "
                         "dir, or --overwrite to replace it")
    tokenizer = None
    training = is_training_checkpoint(args.src)
    if args.set and training:
        parser.error("--set gives a Megatron-LM src's config; a trainer's checkpoints hold "
                     "theirs")
    if training:
        model, meta = load_training_checkpoint(args.src, args.step)
        tokenizer = load_tokenizer(training_tokenizer(args.src, meta))
        source = f"step {meta['step']} of {args.src}"
    else:
        if args.step is not None:
            parser.error(f"--step picks a step of a trainer's --checkpoint-dir; {args.src} is "
                         "not one")
        model = from_pretrained(args.src, overrides=parse_overrides(args.set))
        source = args.src
        if found := find_tokenizer(args.src):
            tokenizer = load_tokenizer(found)
    # beside its tokenizer, the chat template it answers chats with (a trainer's too)
    chat_template = None if tokenizer is None else ChatTemplate.from_model_dir(args.src)
    if args.to == "megatron":
        folder = megatron.save_megatron(model, args.dst, args.target_tp_size,
                                        args.megatron_keys)
        if tokenizer is not None:
            save_tokenizer(tokenizer, args.dst)
        print(f"wrote {folder} (Megatron-LM legacy, tensor-parallel size "
              f"{args.target_tp_size}, the tensor names of Megatron-LM "
              f"{args.megatron_keys}) from {source}; load it in Megatron-LM with --finetune")
        for note in layout_notes(model.config, "megatron"):
            print(f"note: {note}")
        # A model replaced in dst would be read before the checkpoint (from_pretrained reads
        # a folder's config.json first): its files go, unless dst is src, which holds it
        if not (Path(args.src).is_dir() and os.path.samefile(args.src, args.dst)) and \
                (removed := _remove_model(Path(args.dst))):
            print(f"removed the replaced model's {', '.join(removed)}")
        return
    removed = export(model, args.dst, tokenizer, format=args.to,
                     source=None if training else args.src, chat_template=chat_template)
    written = check_exportable(model.config, args.to)
    layout = written if written == args.to else f"{written}, the layout --to {args.to} writes " \
        "for this model"
    print(f"wrote {args.dst} ({layout}) from {source}")
    for note in export_notes(model.config, written):
        print(f"note: {note}")
    if removed:
        print(f"removed the replaced model's {', '.join(removed)}")
    kept = find_tokenizer(args.dst) if tokenizer is None else None
    if kept:  # src has none: dst is another folder, and this is the replaced model's
        print(f"{kept} is the replaced model's, kept: {args.src} has no tokenizer; remove it "
              "if it is not this model's (generate reads it)")


# ---------------------------------------------------------------- training checkpoints


# Beside a Hugging Face model, files that belong to its tokenizer (its chat template among
# them) or its generation settings, which transformers reads before what config.json says
# (bos / eos / pad ids).
_TOKENIZER_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json",
                         "added_tokens.json", "chat_template.jinja", ADDITIONAL_TEMPLATES)
_GENERATION_CONFIG = "generation_config.json"


def export(model: Mamba2LM, path, tokenizer=None, format: str = "hf",
           source=None, chat_template=None) -> list[str]:
    """save_pretrained, then the tokenizer (if given) beside the weights (tokenizer.json, or
    a SentencePiece model's tokenizer.model), its bos / eos / pad ids in config.json where
    the layout has them (formats.with_token_ids; null for a tokenizer without them), and
    with it the chat_template the model answers chats with (a chat.ChatTemplate: what
    its instruction data was rendered with), as transformers saves one (ChatTemplate.save),
    its special tokens' ids in config.json over the tokenizer's.

    A model replaced in `path` (other than `source`, the folder the model was read from,
    whose files are its own) leaves nothing that would be read as this one's: its
    generation_config.json, and where a tokenizer is written its tokenizer of the other
    kind (found before this one's) and its tokenizer's companions (tokenizer_config.json
    ...) are removed. Returns the names of the replaced model's files removed (with
    save_pretrained's)."""
    path = Path(path)
    removed = _write(model, path, format)  # (a kept tokenizer: the caller says so)
    in_place = source is not None and os.path.samefile(source, path)
    stale = [] if in_place else [_GENERATION_CONFIG]
    if tokenizer is not None:
        written = save_tokenizer(tokenizer, path)
        if not in_place:
            stale += sorted(set(TOKENIZER_FILES) - {written.name}) + list(_TOKENIZER_COMPANIONS)
    for name in stale:
        if (path / name).is_file():
            (path / name).unlink()
            removed.append(name)
        elif (path / name).is_dir():  # a folder of named chat templates
            shutil.rmtree(path / name)
            removed.append(name)
    if tokenizer is not None:
        ids = special_token_ids(tokenizer)
        if chat_template is not None and not in_place:  # in place, the folder holds it
            chat_template.save(path, tokenizer)
            ids |= {f"{name}_id": i for name in ("bos_token", "eos_token", "pad_token")
                    if (token := chat_template.special_tokens.get(name)) is not None
                    and (i := tokenizer.token_to_id(token)) is not None}
        config = json.loads((path / "config.json").read_text())
        replace_text(path / "config.json", json.dumps(
            with_token_ids(config, ids), indent=2) + "\n")
    return removed


def is_training_checkpoint(path) -> bool:
    """Whether `path` is a trainer's --checkpoint-dir (files.holds_checkpoints), not a
    model's folder: a run that has not saved yet is one, which holds no checkpoint."""
    return holds_checkpoints(path) and not holds_model(path)


def training_tokenizer(path, meta: dict) -> str:
    """The tokenizer of a trainer's --checkpoint-dir, as load_tokenizer takes it: the copy
    the trainer keeps there (tokenizer.json or tokenizer.model), else what the run's flags
    name, else bytes."""
    copy = find_tokenizer(path)
    return str(copy) if copy else meta["config"]["train"].get("tokenizer") or "bytes"


if __name__ == "__main__":
    main()
