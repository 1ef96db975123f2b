"""Checkpoints in and out: Hugging Face `Mamba2ForCausalLM` and mamba_ssm `MambaLMHeadModel`.

    model = from_pretrained("path/to/dir")                  # layout detected from config.json
    save_pretrained(model, "out", format="hf")              # or format="mamba_ssm"
    python -m mamba_jax.convert SRC DST --to hf|mamba_ssm

A checkpoint dir holds config.json and model.safetensors (or a sharded
model.safetensors.index.json, or pytorch_model.bin, which needs torch to read). The two
layouts share tensor names except the embedding (HF `backbone.embeddings.weight`, mamba_ssm
`backbone.embedding.weight`); both fuse the mixer's projections into `in_proj.weight`
[z | x | B | C | dt] and its conv into `conv1d.weight` [x | B | C, 1, d_conv], which we split
into per-role parameters shaped by head or group.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mamba_jax.config import Mamba2Config
from mamba_jax.model import Mamba2LM, param_name

FORMATS = ("hf", "mamba_ssm")
_EMBEDDING_KEY = {"hf": "backbone.embeddings.weight", "mamba_ssm": "backbone.embedding.weight"}


# ---------------------------------------------------------------- configs


def _decode_float(value):
    """HF writes inf as bare `Infinity` (json reads it) or as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def _require(condition, path, message):
    if not condition:
        raise ValueError(f"{path}: {message}")


def config_from_hf(d: dict, path="config.json") -> Mamba2Config:
    """A transformers Mamba2Config dict -> Mamba2Config. HF does not pad the vocabulary."""
    d_model, expand, headdim = d["hidden_size"], d.get("expand", 2), d.get("head_dim", 64)
    nheads = d.get("num_heads", d_model * expand // headdim)
    _require(nheads * headdim == d_model * expand, path,
             f"num_heads={nheads} * head_dim={headdim} != hidden_size*expand = "
             f"{d_model * expand}; only d_ssm = d_inner checkpoints are supported")
    _require(not d.get("norm_before_gate", False), path,
             "norm_before_gate=True is not supported (Mamba2 checkpoints use False)")
    _require(d.get("rms_norm", True), path, "rms_norm=False is not supported")
    limit = d.get("time_step_limit", (0.0, math.inf))
    return Mamba2Config(
        d_model=d_model, n_layer=d["num_hidden_layers"], vocab_size=d["vocab_size"],
        pad_vocab_size_multiple=1, d_state=d.get("state_size", 128),
        d_conv=d.get("conv_kernel", 4), expand=expand, headdim=headdim,
        ngroups=d.get("n_groups", 1), chunk_size=d.get("chunk_size", 256),
        dt_min=d.get("time_step_min", 0.001), dt_max=d.get("time_step_max", 0.1),
        dt_init_floor=d.get("time_step_floor", 1e-4),
        dt_limit=tuple(_decode_float(v) for v in limit),
        conv_bias=d.get("use_conv_bias", True), bias=d.get("use_bias", False),
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        residual_in_fp32=d.get("residual_in_fp32", True),
        tie_embeddings=d.get("tie_word_embeddings", True))


def config_from_mamba_ssm(d: dict, path="config.json") -> Mamba2Config:
    """A mamba_ssm MambaConfig dict (ssm_cfg nested) -> Mamba2Config."""
    ssm = dict(d.get("ssm_cfg", {}))
    _require(ssm.pop("layer", "Mamba1") == "Mamba2", path,
             "ssm_cfg.layer must be 'Mamba2' (Mamba1 checkpoints are not supported)")
    _require(not d.get("attn_layer_idx") and not d.get("d_intermediate", 0), path,
             "hybrid checkpoints (attn_layer_idx / d_intermediate) are not supported yet")
    _require(d.get("rms_norm", True), path, "rms_norm=False is not supported")
    for flag, ok in (("D_has_hdim", False), ("norm_before_gate", False), ("rmsnorm", True)):
        _require(ssm.pop(flag, ok) == ok, path, f"ssm_cfg.{flag} must be {ok}")
    _require(ssm.pop("d_ssm", None) is None, path, "ssm_cfg.d_ssm is not supported")
    if "dt_limit" in ssm:
        ssm["dt_limit"] = tuple(_decode_float(v) for v in ssm["dt_limit"])
    return Mamba2Config(
        d_model=d["d_model"], n_layer=d["n_layer"], vocab_size=d["vocab_size"],
        pad_vocab_size_multiple=d.get("pad_vocab_size_multiple", 8),
        residual_in_fp32=d.get("residual_in_fp32", True),
        tie_embeddings=d.get("tie_embeddings", True), **ssm)


def detect_format(d: dict) -> str:
    if "ssm_cfg" in d or "d_model" in d:
        return "mamba_ssm"
    if d.get("model_type") == "mamba2" or "hidden_size" in d:
        return "hf"
    raise ValueError("config.json is neither a Hugging Face Mamba2 config (model_type "
                     "'mamba2') nor a mamba_ssm config (d_model, ssm_cfg)")


def hf_config_dict(cfg: Mamba2Config) -> dict:
    v = cfg.padded_vocab_size
    return {
        "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2",
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer, "vocab_size": v,
        "state_size": cfg.d_state, "conv_kernel": cfg.d_conv, "expand": cfg.expand,
        "head_dim": cfg.headdim, "num_heads": cfg.nheads, "n_groups": cfg.ngroups,
        "chunk_size": cfg.chunk_size, "time_step_min": cfg.dt_min,
        "time_step_max": cfg.dt_max, "time_step_floor": cfg.dt_init_floor,
        "time_step_limit": [cfg.dt_limit[0], _encode_float(cfg.dt_limit[1])],
        "use_conv_bias": cfg.conv_bias, "use_bias": cfg.bias,
        "layer_norm_epsilon": cfg.norm_eps, "residual_in_fp32": cfg.residual_in_fp32,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "rescale_prenorm_residual": False, "dtype": "float32",
    }


def mamba_ssm_config_dict(cfg: Mamba2Config) -> dict:
    ssm = {"layer": "Mamba2", "d_state": cfg.d_state, "d_conv": cfg.d_conv,
           "expand": cfg.expand, "headdim": cfg.headdim, "ngroups": cfg.ngroups,
           "chunk_size": cfg.chunk_size, "dt_min": cfg.dt_min, "dt_max": cfg.dt_max,
           "dt_init_floor": cfg.dt_init_floor,
           "dt_limit": [cfg.dt_limit[0], _encode_float(cfg.dt_limit[1])],
           "A_init_range": list(cfg.A_init_range), "conv_bias": cfg.conv_bias,
           "bias": cfg.bias}
    return {"d_model": cfg.d_model, "d_intermediate": 0, "n_layer": cfg.n_layer,
            "vocab_size": cfg.vocab_size, "ssm_cfg": ssm, "attn_layer_idx": [],
            "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": cfg.residual_in_fp32,
            "fused_add_norm": True, "pad_vocab_size_multiple": cfg.pad_vocab_size_multiple,
            "tie_embeddings": cfg.tie_embeddings}


def _encode_float(value):
    # json.dumps would write bare `Infinity`, which strict JSON readers reject.
    return {"__float__": "Infinity"} if math.isinf(value) else value


def load_config(path) -> tuple[Mamba2Config, str]:
    """(Mamba2Config, "hf" | "mamba_ssm") from a checkpoint dir's config.json."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: a checkpoint dir needs config.json beside "
                                "model.safetensors or pytorch_model.bin")
    d = json.loads(file.read_text())
    fmt = detect_format(d)
    parse = config_from_hf if fmt == "hf" else config_from_mamba_ssm
    return parse(d, str(file)), fmt


# ---------------------------------------------------------------- tensors


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint dir as float32 numpy arrays, by name."""
    from safetensors import safe_open

    def read_safetensors(files):
        out = {}
        for f in files:
            # framework="flax" reads bfloat16, which numpy cannot represent on its own.
            with safe_open(f, framework="flax") as fh:
                for key in fh.keys():
                    out[key] = np.asarray(fh.get_tensor(key).astype(jnp.float32))
        return out

    if (path / "model.safetensors").is_file():
        return read_safetensors([path / "model.safetensors"])
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return read_safetensors([path / s for s in shards])
    if (path / "pytorch_model.bin").is_file():
        try:
            import torch
        except ImportError:
            raise ImportError(
                f"{path / 'pytorch_model.bin'} is a PyTorch pickle and reading it needs torch, "
                "which is not installed. Either `pip install torch` (CPU is enough), or convert "
                "it once where torch is installed: `python -c \"import torch, safetensors.torch;"
                " sd = torch.load('pytorch_model.bin', map_location='cpu'); "
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


def torch_to_params(tensors: dict, cfg: Mamba2Config, fmt: str) -> dict[str, np.ndarray]:
    """Checkpoint tensors (torch layout) -> our parameters by flat name ("layers.0.mixer.A_log").

    Raises ValueError naming the key, expected and found shape on any mismatch, and on
    missing or unexpected keys.
    """
    tensors = dict(tensors)
    h, p, g, n, d, k = (cfg.nheads, cfg.headdim, cfg.ngroups, cfg.d_state, cfg.d_model,
                        cfg.d_conv)

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
    head = tensors.pop("lm_head.weight", None)
    if not cfg.tie_embeddings:
        if head is None:
            raise ValueError("checkpoint is missing 'lm_head.weight' and the config says the "
                             "embeddings are not tied")
        tensors["lm_head.weight"] = head
        out["lm_head"] = take("lm_head.weight", (v, d))
    for i in range(cfg.n_layer):
        src, dst = f"backbone.layers.{i}.", f"layers.{i}."
        out[dst + "norm.weight"] = take(src + "norm.weight", (d,))
        src, dst = src + "mixer.", dst + "mixer."
        w = take(src + "in_proj.weight", (sum(_in_proj_sizes(cfg)), d)).T
        z, x, B, C, dt = np.split(w, np.cumsum(_in_proj_sizes(cfg))[:-1], axis=1)
        out.update({dst + "z_proj": z.reshape(d, h, p), dst + "x_proj": x.reshape(d, h, p),
                    dst + "B_proj": B.reshape(d, g, n), dst + "C_proj": C.reshape(d, g, n),
                    dst + "dt_proj": dt.reshape(d, h)})
        if cfg.bias:
            bias = take(src + "in_proj.bias", (sum(_in_proj_sizes(cfg)),))
            z, x, B, C, dt = np.split(bias, np.cumsum(_in_proj_sizes(cfg))[:-1])
            out.update({dst + "z_bias": z.reshape(h, p), dst + "x_bias": x.reshape(h, p),
                        dst + "B_bias": B.reshape(g, n), dst + "C_bias": C.reshape(g, n),
                        dst + "dt_proj_bias": dt, dst + "out_bias": take(src + "out_proj.bias",
                                                                         (d,))})
        conv = take(src + "conv1d.weight", (cfg.conv_dim, 1, k))[:, 0].T  # [k, e]
        x, B, C = np.split(conv, np.cumsum(_conv_sizes(cfg))[:-1], axis=1)
        out.update({dst + "x_conv": x.reshape(k, h, p), dst + "B_conv": B.reshape(k, g, n),
                    dst + "C_conv": C.reshape(k, g, n)})
        if cfg.conv_bias:
            x, B, C = np.split(take(src + "conv1d.bias", (cfg.conv_dim,)),
                               np.cumsum(_conv_sizes(cfg))[:-1])
            out.update({dst + "x_conv_bias": x.reshape(h, p), dst + "B_conv_bias": B.reshape(g, n),
                        dst + "C_conv_bias": C.reshape(g, n)})
        for name in ("dt_bias", "A_log", "D"):
            out[dst + name] = take(src + name, (h,))
        out[dst + "norm"] = take(src + "norm.weight", (cfg.d_inner,)).reshape(h, p)
        out[dst + "out_proj"] = take(src + "out_proj.weight", (d, cfg.d_inner)).T.reshape(h, p, d)
    if tensors:
        raise ValueError(f"checkpoint has tensors this config does not use: {sorted(tensors)}")
    return out


def params_to_torch(params: dict, cfg: Mamba2Config, fmt: str) -> dict[str, np.ndarray]:
    """Our flat parameters -> tensors in the HF or mamba_ssm layout (inverse of above)."""
    d = cfg.d_model
    out = {_EMBEDDING_KEY[fmt]: params["embedding"],
           "backbone.norm_f.weight": params["norm_f.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = params["lm_head"]
    elif fmt == "mamba_ssm":
        # mamba_ssm's state_dict lists the tied head too, and load_state_dict is strict.
        out["lm_head.weight"] = params["embedding"]
    for i in range(cfg.n_layer):
        src, dst = f"layers.{i}.", f"backbone.layers.{i}."
        out[dst + "norm.weight"] = params[src + "norm.weight"]
        src, dst = src + "mixer.", dst + "mixer."
        flat = lambda name, lead: params[src + name].reshape(lead, -1)
        out[dst + "in_proj.weight"] = np.concatenate(
            [flat(r + "_proj", d) for r in ("z", "x", "B", "C", "dt")], axis=1).T
        if cfg.bias:
            out[dst + "in_proj.bias"] = np.concatenate(
                [params[src + r].reshape(-1)
                 for r in ("z_bias", "x_bias", "B_bias", "C_bias", "dt_proj_bias")])
            out[dst + "out_proj.bias"] = params[src + "out_bias"]
        k = cfg.d_conv
        out[dst + "conv1d.weight"] = np.concatenate(
            [flat(r + "_conv", k) for r in ("x", "B", "C")], axis=1).T[:, None, :]
        if cfg.conv_bias:
            out[dst + "conv1d.bias"] = np.concatenate(
                [params[src + r + "_conv_bias"].reshape(-1) for r in ("x", "B", "C")])
        for name in ("dt_bias", "A_log", "D"):
            out[dst + name] = params[src + name]
        out[dst + "norm.weight"] = params[src + "norm"].reshape(-1)
        out[dst + "out_proj.weight"] = params[src + "out_proj"].reshape(cfg.d_inner, d).T
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
    """Load a Hugging Face Mamba2ForCausalLM or mamba_ssm MambaLMHeadModel checkpoint dir.

    Parameters become float32; `dtype` is the compute dtype (default float32).
    """
    path = Path(path)
    cfg, fmt = load_config(path)
    params = torch_to_params(_read_tensors(path), cfg, fmt)
    return model_from_params(cfg, params, jnp.float32 if dtype is None else dtype)


def save_pretrained(model: Mamba2LM, path, format: str = "hf") -> None:
    """Write config.json and model.safetensors (float32) in the HF or mamba_ssm layout.

    HF: `Mamba2ForCausalLM.from_pretrained(path)` loads it. mamba_ssm (whose from_pretrained
    reads only pytorch_model.bin): `MambaLMHeadModel(MambaConfig(**json.load(...)))` then
    `load_state_dict(safetensors.torch.load_file(path + "/model.safetensors"))`.
    """
    from safetensors.numpy import save_file

    if format not in FORMATS:
        raise ValueError(f"save_pretrained: format={format!r}; use one of {FORMATS}")
    cfg = model.config
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = params_to_torch(flat_params(model), cfg, format)
    config = hf_config_dict(cfg) if format == "hf" else mamba_ssm_config_dict(cfg)
    # Write to temporary names and rename, so an interrupted save never leaves a torn pair.
    save_file(tensors, path / "model.safetensors.tmp", metadata={"format": "pt"})
    (path / "config.json.tmp").write_text(json.dumps(config, indent=2) + "\n")
    os.replace(path / "model.safetensors.tmp", path / "model.safetensors")
    os.replace(path / "config.json.tmp", path / "config.json")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m mamba_jax.convert",
        description="Convert a Mamba2 checkpoint dir between the HF and mamba_ssm layouts "
                    "(reads either; also turns pytorch_model.bin into model.safetensors).")
    parser.add_argument("src", help="checkpoint dir (config.json + weights)")
    parser.add_argument("dst", help="output dir")
    parser.add_argument("--to", choices=FORMATS, required=True)
    args = parser.parse_args(argv)
    model = from_pretrained(args.src)
    save_pretrained(model, args.dst, format=args.to)
    tokenizer = Path(args.src) / "tokenizer.json"
    if tokenizer.is_file():
        (Path(args.dst) / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    print(f"wrote {args.dst} ({args.to})")


if __name__ == "__main__":
    main()
