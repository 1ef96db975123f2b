"""Checkpoints in and out: Hugging Face `Mamba2ForCausalLM` and `NemotronHForCausalLM`, and
mamba_ssm `MambaLMHeadModel` (Mamba2, with attention and MLP layers or without).

    model = from_pretrained("path/to/dir")                  # layout detected from config.json
    save_pretrained(model, "out", format="hf")              # or "mamba_ssm", "nemotron_h"
    python -m mamba_jax.convert SRC DST --to hf|mamba_ssm|nemotron_h

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
are read.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path, PurePosixPath

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mamba_jax.cli import HelpFormatter, command
from mamba_jax.config import LAYER_KINDS, Mamba2Config
from mamba_jax.files import replace_text
from mamba_jax.formats import (config_dict, config_from, detect_format, export_format,
                               mamba_ssm_blocks, with_token_ids)
from mamba_jax.model import Mamba2LM, param_name
from mamba_jax.tokenizer import load_tokenizer, special_token_ids

FORMATS = ("hf", "mamba_ssm", "nemotron_h")
_EMBEDDING_KEY = {"hf": "backbone.embeddings.weight", "mamba_ssm": "backbone.embedding.weight",
                  "nemotron_h": "backbone.embeddings.weight"}



def load_config(path) -> tuple[Mamba2Config, str]:
    """(Mamba2Config, "hf" | "mamba_ssm" | "nemotron_h") from a checkpoint dir's config.json."""
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


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint dir as float32 numpy arrays, by name."""
    from safetensors import SafetensorError, safe_open

    def read_safetensors(files):
        out, source = {}, {}
        for f in files:
            try:
                # framework="flax" reads bfloat16, which numpy cannot represent on its own.
                with safe_open(f, framework="flax") as fh:
                    for key in fh.keys():
                        if key in out:
                            raise ValueError(f"{path}: tensor {key!r} is in two shards, "
                                             f"{source[key].name} and {f.name}; which one "
                                             "is meant cannot be known: remove one")
                        out[key] = np.asarray(fh.get_tensor(key).astype(jnp.float32))
                        source[key] = f
            except SafetensorError as error:
                raise ValueError(f"{f}: cannot be read ({error}); the file is truncated or "
                                 "corrupt: download or convert it again") from None
        return out

    if (path / "model.safetensors").is_file():
        return read_safetensors([path / "model.safetensors"])
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return read_safetensors([path / s for s in _index_shards(index)])
    if (path / "pytorch_model.bin").is_file():
        try:
            import torch
        except ImportError:
            raise ImportError(
                f"{path / 'pytorch_model.bin'} is a PyTorch pickle and reading it needs torch, "
                "which is not installed. Either `pip install torch` (CPU is enough), or convert "
                "it once where torch is installed: `python -c \"import torch, safetensors.torch;"
                " sd = torch.load('pytorch_model.bin', map_location='cpu', weights_only=True); "
                "safetensors.torch.save_file({k: v.contiguous() for k, v in sd.items()}, "
                "'model.safetensors')\"`") from None
        sd = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in sd.items()}
    raise FileNotFoundError(f"{path}: no model.safetensors, model.safetensors.index.json or "
                            "pytorch_model.bin")


def _in_proj_sizes(cfg: Mamba2Config):
    gn = cfg.ngroups * cfg.d_state
    return [cfg.d_inner, cfg.d_inner, gn, gn, cfg.nheads]  # z, x, B, C, dt


def _conv_sizes(cfg: Mamba2Config):
    gn = cfg.ngroups * cfg.d_state
    return [cfg.d_inner, gn, gn]  # x, B, C


def _layer_keys(cfg: Mamba2Config, fmt: str) -> list[tuple[str, str]]:
    """Per layer of ours: (its norm's key, the prefix of its mixer's keys) in fmt."""
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


def _mamba_from_torch(take, src, cfg: Mamba2Config) -> dict:
    h, p, g, n, d, k = (cfg.nheads, cfg.headdim, cfg.ngroups, cfg.d_state, cfg.d_model,
                        cfg.d_conv)
    w = take(src + "in_proj.weight", (sum(_in_proj_sizes(cfg)), d)).T
    z, x, B, C, dt = np.split(w, np.cumsum(_in_proj_sizes(cfg))[:-1], axis=1)
    out = {"z_proj": z.reshape(d, h, p), "x_proj": x.reshape(d, h, p),
           "B_proj": B.reshape(d, g, n), "C_proj": C.reshape(d, g, n), "dt_proj": dt.reshape(d, h)}
    if cfg.bias:
        bias = take(src + "in_proj.bias", (sum(_in_proj_sizes(cfg)),))
        z, x, B, C, dt = np.split(bias, np.cumsum(_in_proj_sizes(cfg))[:-1])
        out.update({"z_bias": z.reshape(h, p), "x_bias": x.reshape(h, p),
                    "B_bias": B.reshape(g, n), "C_bias": C.reshape(g, n), "dt_proj_bias": dt,
                    "out_bias": take(src + "out_proj.bias", (d,))})
    conv = take(src + "conv1d.weight", (cfg.conv_dim, 1, k))[:, 0].T  # [k, e]
    x, B, C = np.split(conv, np.cumsum(_conv_sizes(cfg))[:-1], axis=1)
    out.update({"x_conv": x.reshape(k, h, p), "B_conv": B.reshape(k, g, n),
                "C_conv": C.reshape(k, g, n)})
    if cfg.conv_bias:
        x, B, C = np.split(take(src + "conv1d.bias", (cfg.conv_dim,)),
                           np.cumsum(_conv_sizes(cfg))[:-1])
        out.update({"x_conv_bias": x.reshape(h, p), "B_conv_bias": B.reshape(g, n),
                    "C_conv_bias": C.reshape(g, n)})
    for name in ("dt_bias", "A_log", "D"):
        out[name] = take(src + name, (h,))
    out["norm"] = take(src + "norm.weight", (cfg.d_inner,)).reshape(h, p)
    out["out_proj"] = take(src + "out_proj.weight", (d, cfg.d_inner)).T.reshape(h, p, d)
    return out


def _mamba_to_torch(params, cfg: Mamba2Config) -> dict:
    d, k = cfg.d_model, cfg.d_conv
    flat = lambda name, lead: params[name].reshape(lead, -1)
    out = {"in_proj.weight": np.concatenate(
        [flat(r + "_proj", d) for r in ("z", "x", "B", "C", "dt")], axis=1).T}
    if cfg.bias:
        out["in_proj.bias"] = np.concatenate(
            [params[r].reshape(-1) for r in ("z_bias", "x_bias", "B_bias", "C_bias",
                                             "dt_proj_bias")])
        out["out_proj.bias"] = params["out_bias"]
    out["conv1d.weight"] = np.concatenate(
        [flat(r + "_conv", k) for r in ("x", "B", "C")], axis=1).T[:, None, :]
    if cfg.conv_bias:
        out["conv1d.bias"] = np.concatenate(
            [params[r + "_conv_bias"].reshape(-1) for r in ("x", "B", "C")])
    for name in ("dt_bias", "A_log", "D"):
        out[name] = params[name]
    out["norm.weight"] = params["norm"].reshape(-1)
    out["out_proj.weight"] = params["out_proj"].reshape(cfg.d_inner, d).T
    return out


def _attention_from_torch(take, src, cfg: Mamba2Config, fmt: str) -> dict:
    d, h, kv, e = cfg.d_model, cfg.attn_num_heads, cfg.attn_num_heads_kv, cfg.attn_head_dim
    sizes = [h * e, kv * e, kv * e]
    if fmt == "nemotron_h":
        q, k, v = (take(src + f"{r}_proj.weight", (size, d)).T
                   for r, size in zip("qkv", sizes))
        o = take(src + "o_proj.weight", (d, h * e))
    else:  # mamba_ssm's MHA: in_proj [q | k | v]
        q, k, v = np.split(take(src + "in_proj.weight", (sum(sizes), d)).T,
                           np.cumsum(sizes)[:-1], axis=1)
        o = take(src + "out_proj.weight", (d, h * e))
    out = {"q_proj": q.reshape(d, h, e), "k_proj": k.reshape(d, kv, e),
           "v_proj": v.reshape(d, kv, e), "o_proj": o.T.reshape(h, e, d)}
    if cfg.attn_qkv_bias:
        q, k, v = np.split(take(src + "in_proj.bias", (sum(sizes),)), np.cumsum(sizes)[:-1])
        out.update(q_bias=q.reshape(h, e), k_bias=k.reshape(kv, e), v_bias=v.reshape(kv, e))
    if cfg.attn_out_bias:
        out["out_bias"] = take(src + "out_proj.bias", (d,))
    return out


def _attention_to_torch(params, cfg: Mamba2Config, fmt: str) -> dict:
    d = cfg.d_model
    q, k, v = (params[r + "_proj"].reshape(d, -1).T for r in "qkv")
    o = params["o_proj"].reshape(-1, d).T
    if fmt == "nemotron_h":
        return {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v, "o_proj.weight": o}
    out = {"in_proj.weight": np.concatenate([q, k, v]), "out_proj.weight": o}
    if cfg.attn_qkv_bias:
        out["in_proj.bias"] = np.concatenate([params[r + "_bias"].reshape(-1) for r in "qkv"])
    if cfg.attn_out_bias:
        out["out_proj.bias"] = params["out_bias"]
    return out


def _mlp_from_torch(take, src, cfg: Mamba2Config, fmt: str) -> dict:
    d, f = cfg.d_model, cfg.d_intermediate
    if fmt == "nemotron_h":
        return {"up_proj": take(src + "up_proj.weight", (f, d)).T,
                "down_proj": take(src + "down_proj.weight", (d, f)).T}
    up, gate = np.split(take(src + "fc1.weight", (2 * f, d)).T, 2, axis=1)  # GatedMLP's chunk
    return {"up_proj": up, "gate_proj": gate, "down_proj": take(src + "fc2.weight", (d, f)).T}


def _mlp_to_torch(params, cfg: Mamba2Config, fmt: str) -> dict:
    if fmt == "nemotron_h":
        return {"up_proj.weight": params["up_proj"].T, "down_proj.weight": params["down_proj"].T}
    return {"fc1.weight": np.concatenate([params["up_proj"], params["gate_proj"]], axis=1).T,
            "fc2.weight": params["down_proj"].T}


def torch_to_params(tensors: dict, cfg: Mamba2Config, fmt: str) -> dict[str, np.ndarray]:
    """Checkpoint tensors (torch layout) -> our parameters by flat name ("layers.0.mixer.A_log").

    Raises ValueError naming the key, expected and found shape on any mismatch, and on
    missing or unexpected keys.
    """
    # NemotronH's keys are `model.` in memory (what a state_dict gives) and `backbone.` on disk.
    tensors = {("backbone." + key[6:] if fmt == "nemotron_h" and key.startswith("model.")
                else key): value for key, value in tensors.items()}
    d = cfg.d_model

    def take(key, shape):
        if key not in tensors:
            raise ValueError(f"checkpoint is missing {key!r} (expected shape {shape})")
        t = tensors.pop(key)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(t.shape)}, expected "
                             f"{tuple(shape)} for this config")
        return t

    v = cfg.padded_vocab_size
    out = {"embedding": take(_EMBEDDING_KEY[fmt], (v, d)),
           "norm_f.weight": take("backbone.norm_f.weight", (d,))}
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # mamba_ssm's state_dict lists the tied head too
    elif "lm_head.weight" not in tensors:
        raise ValueError("checkpoint is missing 'lm_head.weight' and the config says the "
                         "embeddings are not tied")
    else:
        out["lm_head"] = take("lm_head.weight", (v, d))
    for i, (symbol, (norm_key, src)) in enumerate(zip(cfg.layers, _layer_keys(cfg, fmt))):
        out[f"layers.{i}.norm.weight"] = take(norm_key, (d,))
        kind = LAYER_KINDS[symbol]
        if kind == "mamba":
            mixer = _mamba_from_torch(take, src, cfg)
        elif kind == "attention":
            mixer = _attention_from_torch(take, src, cfg, fmt)
        else:
            mixer = _mlp_from_torch(take, src, cfg, fmt)
        out.update({f"layers.{i}.mixer.{name}": value for name, value in mixer.items()})
    if tensors:
        raise ValueError(f"checkpoint has tensors this config does not use: {sorted(tensors)}")
    return out


def params_to_torch(params: dict, cfg: Mamba2Config, fmt: str) -> dict[str, np.ndarray]:
    """Our flat parameters -> tensors in the fmt layout (inverse of torch_to_params)."""
    out = {_EMBEDDING_KEY[fmt]: params["embedding"],
           "backbone.norm_f.weight": params["norm_f.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = params["lm_head"]
    elif fmt == "mamba_ssm":
        # mamba_ssm's state_dict lists the tied head too, and load_state_dict is strict.
        out["lm_head.weight"] = params["embedding"]
    for i, (symbol, (norm_key, dst)) in enumerate(zip(cfg.layers, _layer_keys(cfg, fmt))):
        out[norm_key] = params[f"layers.{i}.norm.weight"]
        src = f"layers.{i}.mixer."
        mine = {name[len(src):]: value for name, value in params.items()
                if name.startswith(src)}
        kind = LAYER_KINDS[symbol]
        if kind == "mamba":
            mixer = _mamba_to_torch(mine, cfg)
        elif kind == "attention":
            mixer = _attention_to_torch(mine, cfg, fmt)
        else:
            mixer = _mlp_to_torch(mine, cfg, fmt)
        out.update({dst + name: value for name, value in mixer.items()})
    return {key: np.ascontiguousarray(value, np.float32) for key, value in out.items()}


# ---------------------------------------------------------------- models


def flat_params(model: Mamba2LM) -> dict[str, np.ndarray]:
    """The model's parameters as numpy arrays by dotted name."""
    state = nnx.state(model, nnx.Param)
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))
    return {param_name(path): np.asarray(v) for path, v in leaves}


def model_from_params(cfg: Mamba2Config, params: dict, dtype=jnp.float32) -> Mamba2LM:
    """A Mamba2LM holding exactly `params` (flat names, as flat_params returns)."""
    model = nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)

    def fill(path, abstract):
        value = params[param_name(path)]
        if value.shape != abstract.shape:
            raise ValueError(f"parameter {param_name(path)} has shape {value.shape}, the "
                             f"config needs {abstract.shape}")
        return jnp.asarray(value, jnp.float32)

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(fill, pure))
    nnx.update(model, state)
    return model


def from_pretrained(path, dtype=None) -> Mamba2LM:
    """Load a Hugging Face Mamba2ForCausalLM or NemotronHForCausalLM, or a mamba_ssm
    MambaLMHeadModel checkpoint dir.

    Parameters become float32; `dtype` is the compute dtype (default float32).
    """
    path = Path(path)
    cfg, fmt = load_config(path)
    params = torch_to_params(_read_tensors(path), cfg, fmt)
    return model_from_params(cfg, params, jnp.float32 if dtype is None else dtype)


def save_pretrained(model: Mamba2LM, path, format: str = "hf") -> None:
    """Write config.json and model.safetensors (float32) in the HF, mamba_ssm or NemotronH
    layout. "hf" is Mamba2ForCausalLM for a Mamba-only model and NemotronHForCausalLM
    ("nemotron_h") for a hybrid; a layout that cannot express the model is a ValueError
    naming what does not fit.

    HF: `Mamba2ForCausalLM.from_pretrained(path)` (or NemotronHForCausalLM) loads it.
    mamba_ssm (whose from_pretrained reads only pytorch_model.bin):
    `MambaLMHeadModel(MambaConfig(**json.load(...)))` then
    `load_state_dict(safetensors.torch.load_file(path + "/model.safetensors"))`.
    """
    from safetensors.numpy import save_file

    if format not in FORMATS:
        raise ValueError(f"save_pretrained: format={format!r}; use one of {FORMATS}")
    cfg = model.config
    format = export_format(cfg, format)
    config = config_dict(cfg, format)  # first: it refuses what the layout cannot express
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = params_to_torch(flat_params(model), cfg, format)
    # Write to temporary names and rename, so an interrupted save never leaves a torn pair.
    save_file(tensors, path / "model.safetensors.tmp", metadata={"format": "pt"})
    (path / "config.json.tmp").write_text(json.dumps(config, indent=2) + "\n")
    os.replace(path / "model.safetensors.tmp", path / "model.safetensors")
    os.replace(path / "config.json.tmp", path / "config.json")


@command("python -m mamba_jax.convert")
def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m mamba_jax.convert", formatter_class=HelpFormatter,
        description="Convert a Mamba2 or hybrid checkpoint dir between the HF (Mamba2, "
                    "NemotronH) and mamba_ssm layouts (reads any; also turns "
                    "pytorch_model.bin into model.safetensors), or export a step of a "
                    "trainer's --checkpoint-dir (Orbax) to one of them.")
    parser.add_argument("src", help="checkpoint dir (config.json + weights), or a trainer's "
                                    "--checkpoint-dir")
    parser.add_argument("dst", help="output dir")
    parser.add_argument("--to", choices=FORMATS, required=True)
    parser.add_argument("--step", type=int, default=None,
                        help="with a trainer's --checkpoint-dir: the step to export (default: "
                             "the newest)")
    args = parser.parse_args(argv)
    tokenizer = None
    if is_training_checkpoint(args.src):
        model, meta = load_training_checkpoint(args.src, args.step)
        tokenizer = load_tokenizer(training_tokenizer(args.src, meta))
        source = f"step {meta['step']} of {args.src}"
    else:
        if args.step is not None:
            parser.error(f"--step picks a step of a trainer's --checkpoint-dir; {args.src} is "
                         "not one")
        model, source = from_pretrained(args.src), args.src
        if (Path(args.src) / "tokenizer.json").is_file():
            tokenizer = load_tokenizer(Path(args.src) / "tokenizer.json")
    export(model, args.dst, tokenizer, format=args.to)
    print(f"wrote {args.dst} ({args.to}) from {source}")


# ---------------------------------------------------------------- training checkpoints


def _index_shards(index: Path) -> list[str]:
    """The shard files model.safetensors.index.json names, each inside its directory: a
    path that is absolute or climbs out (..) is refused, so that an index never has us read
    files elsewhere. (A shard may be a symlink, as in the Hugging Face cache.)"""
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{index}: expected a JSON object whose 'weight_map' maps tensor "
                         "names to shard files") from None
    for shard in shards:
        if not isinstance(shard, str) or PurePosixPath(shard).is_absolute() \
                or ".." in PurePosixPath(shard).parts:
            raise ValueError(f"{index}: shard {shard!r} is not a file inside {index.parent}; "
                             "an index names its shards relative to its own directory")
    return shards


def export(model: Mamba2LM, path, tokenizer=None, format: str = "hf") -> None:
    """save_pretrained, then the tokenizer (if given) beside the weights as tokenizer.json,
    its bos / eos / pad ids in config.json where the layout has them
    (formats.with_token_ids; null for a tokenizer without them)."""
    save_pretrained(model, path, format=format)
    if tokenizer is None:
        return
    path = Path(path)
    tokenizer.save(str(path / "tokenizer.json"))
    config = json.loads((path / "config.json").read_text())
    replace_text(path / "config.json", json.dumps(
        with_token_ids(config, special_token_ids(tokenizer)), indent=2) + "\n")


def is_training_checkpoint(path) -> bool:
    """Whether `path` is a trainer's --checkpoint-dir: Orbax step directories, no
    config.json."""
    path = Path(path)
    return (path.is_dir() and not (path / "config.json").exists()
            and any(child.name.isdigit() and child.is_dir() for child in path.iterdir()))


def load_training_checkpoint(path, step: int | None = None, dtype=None):
    """(model, meta) of checkpoint `step` (default: the newest) in a trainer's
    --checkpoint-dir. Only the parameters are read (not the optimizer state), onto one
    device; `dtype` is the compute dtype (default float32). meta["config"] is the run's
    effective config: {"model": Mamba2Config fields, "train": its flags}."""
    from mamba_jax.checkpoint import Checkpointer

    ckpt = Checkpointer(path, read_only=True)
    try:
        steps = ckpt.steps()
        if not steps:
            raise FileNotFoundError(f"{path}: holds no complete training checkpoint")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise ValueError(f"{path}: no checkpoint of step {step}; it holds steps {steps}")
        meta = ckpt.read_meta(step)
        cfg = Mamba2Config.from_dict(meta["config"]["model"])
        graphdef, abstract = nnx.split(nnx.eval_shape(
            lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32 if dtype is None
                             else dtype)))
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract)
        params = ckpt.restore_part(step, {"params": target})["params"]
    finally:
        ckpt.close()
    return nnx.merge(graphdef, params), meta


def training_tokenizer(path, meta: dict) -> str:
    """The tokenizer of a trainer's --checkpoint-dir, as load_tokenizer takes it: the copy
    the trainer keeps there (tokenizer.json), else what the run's flags name, else bytes."""
    copy = Path(path) / "tokenizer.json"
    return str(copy) if copy.is_file() else meta["config"]["train"].get("tokenizer") or "bytes"


if __name__ == "__main__":
    main()
