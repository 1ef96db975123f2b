"""config.json of each checkpoint layout <-> Mamba2Config.

Layouts: Hugging Face `Mamba2ForCausalLM`, `MambaForCausalLM` and `FalconMambaForCausalLM`
("hf", told apart by model_type), mamba_ssm `MambaLMHeadModel` ("mamba_ssm", Mamba2,
Mamba-1 or Mamba-3 layers with optional attention blocks and MLPs), Hugging Face
`NemotronHForCausalLM` ("nemotron_h", Megatron's hybrid layers), the arguments a Megatron-LM
checkpoint saves ("megatron"; its folders: mamba_jax.megatron), and our own ("mamba_jax",
for a model no published layout holds: the whole Mamba2Config under config.json's
"mamba_jax", beside a few of HF's fields for tools that look). Every field a layout has and
we cannot represent is refused by name rather than silently dropped.
"""

from __future__ import annotations

import json
import math
import re

from mamba_jax.config import Mamba2Config, hybrid_pattern
from mamba_jax.layers import mamba1, mamba2
from mamba_jax.layers.mlp import GATED_MLP_MULTIPLE
# NemotronH's layer type names (and older spellings) -> our symbols.
_NEMOTRON_TYPES = {"linear_attention": "M", "mamba": "M", "full_attention": "*",
                   "attention": "*", "mlp": "-"}
_NEMOTRON_NAMES = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}


def _decode_limit(limit):
    """A JSON dt_limit -> (low, high) floats. HF writes inf as bare `Infinity` (json reads
    it) or as {"__float__": "Infinity"}."""
    return tuple(float(v["__float__"]) if isinstance(v, dict) and "__float__" in v
                 else float(v) for v in limit)


def _require(condition, path, message):
    if not condition:
        raise ValueError(f"{path}: {message}")


# ---------------------------------------------------------------- field checks
# Each reader first checks the types of the fields it reads, and bounds every size: far
# above any published model (the largest have ~120 layers, d_model 8192, a 262144-token
# vocabulary), so that a mistyped or hostile value is refused by name before anything is
# built from it (num_hidden_layers: 1e9 would spell out a billion-layer pattern).
MAX_LAYERS = 1024
MAX_WIDTH = 1 << 16  # d_model, heads, head and state dims, groups, conv taps, chunk
MAX_VOCAB = 1 << 22
MAX_MLP = 1 << 20  # an MLP's hidden width


def _integer(high, low=1):
    def check(value):
        if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
            return f"an integer in [{low}, {high}]"
    return check


def _number(value):
    try:
        finite = not isinstance(value, bool) and math.isfinite(value)
    except (TypeError, OverflowError):
        finite = False
    if not finite:
        return "a finite number"


def _flag(value):
    if not isinstance(value, bool):
        return "true or false"


def _text(value):
    if not isinstance(value, str) or len(value) > MAX_LAYERS:
        return f"a string of at most {MAX_LAYERS} characters"


def _optional(check):
    return lambda value: None if value is None else check(value)


def _list(check, what: str, low=0, high=MAX_LAYERS):
    def each(value):
        if not (isinstance(value, list) and low <= len(value) <= high
                and all(check(v) is None for v in value)):
            return f"a list of {low} to {high} {what}"
    return each


def _limit(value):
    try:
        low, high = _decode_limit(value)
        if not (math.isfinite(low) and not math.isnan(high)):
            raise ValueError(value)
    except (TypeError, ValueError, KeyError, OverflowError):
        return "a pair [low, high] of numbers (high may be Infinity)"


_WIDTH, _LAYERS, _VOCAB = _integer(MAX_WIDTH), _integer(MAX_LAYERS), _integer(MAX_VOCAB)


def _rank(value):
    if value != "auto" and _WIDTH(value) is not None:
        return f"\"auto\" or {_WIDTH(value)}"


def _check_fields(d, path, schema: dict, required=(), where=""):
    """Refuse, naming the file, the field and its value, a field of config.json (the dict
    `d`, or a nested one `where`) that is missing, of the wrong type or out of bounds.
    schema: field -> a check returning what the value must be, or None if it is fine (a
    dict: a nested object with its own schema, whose other fields are refused)."""
    if not isinstance(d, dict):
        raise ValueError(f"{path}: {where.rstrip('.') or 'the config'} must be a JSON object")
    for key in required:
        _require(key in d, path, f"{where}{key} is required")
    for key, check in schema.items():
        if key not in d:
            continue
        if isinstance(check, dict):
            _check_fields(d[key], path, check, where=f"{where}{key}.")
            unknown = sorted(set(d[key]) - set(check))
            _require(not unknown, path, f"{where}{key} has fields we do not support: {unknown}")
            continue
        must = check(d[key])
        if must is not None:
            shown = json.dumps(d[key])
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise ValueError(f"{path}: {where}{key}={shown} must be {must}")


# The fields transformers' Mamba2Config, MambaConfig and FalconMambaConfig share.
_HF_COMMON_FIELDS = {
    "hidden_size": _WIDTH, "num_hidden_layers": _LAYERS, "vocab_size": _VOCAB,
    "expand": _WIDTH, "state_size": _WIDTH, "conv_kernel": _WIDTH, "time_step_min": _number,
    "time_step_max": _number, "time_step_floor": _number, "use_conv_bias": _flag,
    "use_bias": _flag, "layer_norm_epsilon": _number, "residual_in_fp32": _flag,
    "tie_word_embeddings": _flag}
_HF_FIELDS = {
    **_HF_COMMON_FIELDS, "head_dim": _WIDTH, "num_heads": _WIDTH, "n_groups": _WIDTH,
    "chunk_size": _WIDTH, "time_step_limit": _limit, "norm_before_gate": _flag,
    "rms_norm": _flag}
_HF_MAMBA1_FIELDS = {
    **_HF_COMMON_FIELDS, "hidden_act": _text, "time_step_rank": _rank,
    "time_step_scale": _number, "time_step_init_scheme": _text, "mixer_rms_eps": _number,
    "intermediate_size": _integer(MAX_MLP)}
_MAMBA_SSM_FIELDS = {
    "d_model": _WIDTH, "n_layer": _LAYERS, "vocab_size": _VOCAB,
    "pad_vocab_size_multiple": _WIDTH, "residual_in_fp32": _flag, "tie_embeddings": _flag,
    "rms_norm": _flag, "d_intermediate": _integer(MAX_MLP, low=0),
    "attn_layer_idx": _list(_integer(MAX_LAYERS - 1, low=0), "layer indices"),
    "ssm_cfg": {"layer": _text, "d_state": _WIDTH, "d_conv": _WIDTH, "expand": _WIDTH,
                "headdim": _WIDTH, "ngroups": _WIDTH, "chunk_size": _WIDTH, "dt_min": _number,
                "dt_max": _number, "dt_init_floor": _number, "dt_limit": _limit,
                "A_init_range": _list(_number, "numbers", 2, 2), "conv_bias": _flag,
                "bias": _flag,
                "D_has_hdim": _flag, "norm_before_gate": _flag, "rmsnorm": _flag,
                "d_ssm": _optional(_WIDTH), "dt_rank": _rank, "dt_init": _text,
                "dt_scale": _number, "use_fast_path": _flag,
                # Mamba3's own arguments
                "rope_fraction": _number, "A_floor": _number, "is_outproj_norm": _flag,
                "is_mimo": _flag, "mimo_rank": _WIDTH, "fuse_pregate_headwise_norm": _flag,
                "dropout": _number},
    "attn_cfg": {"num_heads": _WIDTH, "num_heads_kv": _optional(_WIDTH),
                 "head_dim": _optional(_WIDTH), "rotary_emb_dim": _integer(MAX_WIDTH, low=0),
                 "rotary_emb_base": _number, "rotary_emb_interleaved": _flag,
                 "qkv_proj_bias": _flag, "out_proj_bias": _flag, "causal": _flag,
                 "softmax_scale": _optional(_number), "d_conv": _optional(_WIDTH),
                 "mlp_dim": _optional(_integer(MAX_MLP, low=0))}}
_NEMOTRON_H_FIELDS = {
    "hidden_size": _WIDTH, "vocab_size": _VOCAB,
    "layers_block_type": _list(_text, "layer type names"),
    "hybrid_override_pattern": _text, "expand": _WIDTH, "mamba_expand": _WIDTH,
    "mamba_num_heads": _WIDTH, "mamba_head_dim": _WIDTH, "ssm_state_size": _WIDTH,
    "conv_kernel": _WIDTH, "mamba_d_conv": _WIDTH, "n_groups": _WIDTH,
    "mamba_n_groups": _WIDTH, "chunk_size": _WIDTH, "mamba_chunk_size": _WIDTH,
    "time_step_min": _number, "mamba_dt_min": _number, "time_step_max": _number,
    "mamba_dt_max": _number, "time_step_floor": _number, "mamba_dt_init_floor": _number,
    "use_conv_bias": _flag, "mamba_conv_bias": _flag, "use_bias": _flag,
    "layer_norm_epsilon": _number, "residual_in_fp32": _flag, "tie_word_embeddings": _flag,
    "intermediate_size": _integer(MAX_MLP, low=0), "num_attention_heads": _WIDTH,
    "num_key_value_heads": _optional(_WIDTH), "head_dim": _optional(_WIDTH),
    "mamba_hidden_act": _text, "mlp_hidden_act": _text, "mlp_bias": _flag,
    "num_nextn_predict_layers": _integer(MAX_LAYERS, low=0)}


_HF_MAMBA1_TYPES = {"mamba": "MambaForCausalLM", "falcon_mamba": "FalconMambaForCausalLM"}


def config_from_hf_mamba1(d: dict, path="config.json") -> Mamba2Config:
    """A transformers MambaConfig or FalconMambaConfig dict -> Mamba2Config of Mamba-1
    layers (Falcon-Mamba's: with mamba1.bc_dt_rms). HF does not pad the vocabulary."""
    _check_fields(d, path, _HF_MAMBA1_FIELDS, ("hidden_size", "num_hidden_layers",
                                               "vocab_size"))
    d_model, expand = d["hidden_size"], d.get("expand", 2)
    _require(d.get("intermediate_size", d_model * expand) == d_model * expand, path,
             f"intermediate_size={d.get('intermediate_size')} != hidden_size*expand = "
             f"{d_model * expand}")
    _require(d.get("hidden_act", "silu") == "silu", path, "hidden_act must be silu")
    falcon = d.get("model_type") == "falcon_mamba"
    return Mamba2Config.from_dict(dict(
        d_model=d_model, n_layer=d["num_hidden_layers"], vocab_size=d["vocab_size"],
        pad_vocab_size_multiple=1, layer_pattern="1" * d["num_hidden_layers"],
        mamba1=dict(d_state=d.get("state_size", 16), d_conv=d.get("conv_kernel", 4),
                    expand=expand, dt_rank=d.get("time_step_rank", "auto"),
                    dt_min=d.get("time_step_min", 0.001), dt_max=d.get("time_step_max", 0.1),
                    dt_init=d.get("time_step_init_scheme", "random"),
                    dt_scale=d.get("time_step_scale", 1.0),
                    dt_init_floor=d.get("time_step_floor", 1e-4),
                    conv_bias=d.get("use_conv_bias", True), bias=d.get("use_bias", False),
                    bc_dt_rms=falcon, bc_dt_rms_eps=d.get("mixer_rms_eps", 1e-6)),
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        residual_in_fp32=d.get("residual_in_fp32", True),
        tie_embeddings=d.get("tie_word_embeddings", True)))


def config_from_hf(d: dict, path="config.json") -> Mamba2Config:
    """A transformers Mamba2Config dict -> Mamba2Config (MambaConfig and FalconMambaConfig:
    config_from_hf_mamba1). HF does not pad the vocabulary."""
    if isinstance(d, dict) and d.get("model_type") in _HF_MAMBA1_TYPES:
        return config_from_hf_mamba1(d, path)
    _check_fields(d, path, _HF_FIELDS, ("hidden_size", "num_hidden_layers", "vocab_size"))
    d_model, expand, headdim = d["hidden_size"], d.get("expand", 2), d.get("head_dim", 64)
    nheads = d.get("num_heads", d_model * expand // headdim)
    _require(nheads * headdim == d_model * expand, path,
             f"num_heads={nheads} * head_dim={headdim} != hidden_size*expand = "
             f"{d_model * expand}; only d_ssm = d_inner checkpoints are supported")
    _require(not d.get("norm_before_gate", False), path,
             "norm_before_gate=True is not supported (Mamba2 checkpoints use False)")
    _require(d.get("rms_norm", True), path, "rms_norm=False is not supported")
    # transformers' Mamba2 applies hidden_act after the conv (and the gate's SiLU is fixed)
    _require(d.get("hidden_act", "silu") == "silu", path, "hidden_act must be silu")
    limit = d.get("time_step_limit", (0.0, math.inf))
    return Mamba2Config.from_dict(dict(
        d_model=d_model, n_layer=d["num_hidden_layers"], vocab_size=d["vocab_size"],
        pad_vocab_size_multiple=1, d_state=d.get("state_size", 128),
        d_conv=d.get("conv_kernel", 4), expand=expand, headdim=headdim,
        ngroups=d.get("n_groups", 1), chunk_size=d.get("chunk_size", 256),
        dt_min=d.get("time_step_min", 0.001), dt_max=d.get("time_step_max", 0.1),
        dt_init_floor=d.get("time_step_floor", 1e-4),
        dt_limit=_decode_limit(limit),
        conv_bias=d.get("use_conv_bias", True), bias=d.get("use_bias", False),
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        residual_in_fp32=d.get("residual_in_fp32", True),
        # transformers' Mamba2Config unties by default (its Mamba and FalconMamba tie)
        tie_embeddings=d.get("tie_word_embeddings", False)))


def _attn_from_mamba_ssm(d: dict, path) -> dict:
    """mamba_ssm's attn_cfg (MHA keyword arguments) -> our attn_* fields."""
    attn = dict(d.get("attn_cfg", {}))
    _require("num_heads" in attn, path, "attn_cfg.num_heads is required with attn_layer_idx")
    heads = attn.pop("num_heads")
    out = dict(attn_num_heads=heads, attn_num_heads_kv=attn.pop("num_heads_kv", None) or heads,
               attn_head_dim=attn.pop("head_dim", None) or d["d_model"] // heads,
               attn_rotary_emb_dim=attn.pop("rotary_emb_dim", 0),
               attn_rotary_emb_base=float(attn.pop("rotary_emb_base", 10000.0)),
               attn_rotary_interleaved=attn.pop("rotary_emb_interleaved", False),
               # MHA's defaults: both projections have biases.
               attn_qkv_bias=attn.pop("qkv_proj_bias", True),
               attn_out_bias=attn.pop("out_proj_bias", True))
    _require(attn.pop("causal", False), path, "attn_cfg.causal must be true (a language "
             "model's attention is causal; MHA's default is false)")
    for key in ("softmax_scale", "d_conv", "mlp_dim"):
        _require(not attn.pop(key, None), path, f"attn_cfg.{key} is not supported (leave it "
                 "unset)")
    _require(not attn, path, f"attn_cfg has fields we do not support: {sorted(attn)}")
    return out


def config_from_mamba_ssm(d: dict, path="config.json") -> Mamba2Config:
    """A mamba_ssm MambaConfig dict (ssm_cfg, attn_cfg nested) -> Mamba2Config in mamba_ssm's
    form (attn_layer_idx, d_intermediate rounded up as GatedMLP does)."""
    _check_fields(d, path, _MAMBA_SSM_FIELDS, ("d_model", "n_layer", "vocab_size"))
    ssm = dict(d.get("ssm_cfg", {}))
    layer = ssm.pop("layer", "Mamba1")  # MambaConfig's default
    _require(layer in ("Mamba1", "Mamba2", "Mamba3"), path,
             f"ssm_cfg.layer={layer!r} must be 'Mamba1', 'Mamba2' or 'Mamba3'")
    _require(d.get("rms_norm", True), path, "rms_norm=False is not supported")
    if layer == "Mamba3":
        return _mamba3_from_mamba_ssm(d, ssm, path)
    if layer == "Mamba1":
        return _mamba1_from_mamba_ssm(d, ssm, path)
    for key in ("dt_rank", "dt_init", "dt_scale", "use_fast_path"):
        _require(key not in ssm, path, f"ssm_cfg.{key} is a Mamba1 argument; Mamba2 has none")
    hybrid = {}
    if d.get("attn_layer_idx"):
        hybrid.update(attn_layer_idx=tuple(d["attn_layer_idx"]), **_attn_from_mamba_ssm(d, path))
    if d.get("d_intermediate", 0):
        hybrid["d_intermediate"] = _gated_mlp_width(d)
    for flag, ok in (("norm_before_gate", False), ("rmsnorm", True)):
        _require(ssm.pop(flag, ok) == ok, path, f"ssm_cfg.{flag} must be {ok}")
    # its D of d_inner, one a head channel: our D [h, p]
    per_channel = {"mamba2.D_has_hdim": ssm.pop("D_has_hdim", False)}
    _require(ssm.pop("d_ssm", None) is None, path, "ssm_cfg.d_ssm is not supported")
    if "dt_limit" in ssm:
        ssm["dt_limit"] = _decode_limit(ssm["dt_limit"])
    return Mamba2Config.from_dict(dict(
        d_model=d["d_model"], n_layer=d["n_layer"], vocab_size=d["vocab_size"],
        pad_vocab_size_multiple=d.get("pad_vocab_size_multiple", 8),
        residual_in_fp32=d.get("residual_in_fp32", True),
        tie_embeddings=d.get("tie_embeddings", True), **ssm, **per_channel, **hybrid))


def _mamba1_from_mamba_ssm(d: dict, ssm: dict, path) -> Mamba2Config:
    """config_from_mamba_ssm for ssm_cfg.layer 'Mamba1': the blocks spelt out as a
    layer_pattern (1 Mamba-1, * attention, each followed by - where d_intermediate > 0)."""
    for key in ("headdim", "ngroups", "chunk_size", "dt_limit", "A_init_range", "D_has_hdim",
                "norm_before_gate", "rmsnorm", "d_ssm"):
        _require(key not in ssm, path, f"ssm_cfg.{key} is a Mamba2 argument; Mamba1 has none")
    ssm.pop("use_fast_path", None)  # mamba_ssm's kernel choice, not the model's
    return _blocks_config(d, path, "1", mamba1=ssm)


def _gated_mlp_width(d: dict) -> int:
    """d_intermediate rounded up to GATED_MLP_MULTIPLE, as mamba_ssm's GatedMLP does."""
    m = GATED_MLP_MULTIPLE
    return -(-d["d_intermediate"] // m) * m


def _blocks_config(d: dict, path, symbol: str, **section) -> Mamba2Config:
    """A MambaConfig's blocks spelt out as a layer_pattern: `symbol` (its ssm_cfg.layer's
    mixer) or * at attn_layer_idx, each followed by - where d_intermediate > 0; section:
    the mixer's config section, {name: its ssm_cfg}."""
    attn = set(d.get("attn_layer_idx") or ())
    extra = _attn_from_mamba_ssm(d, path) if attn else {}
    mlp = ""
    if d.get("d_intermediate", 0):
        extra["d_intermediate"], mlp = _gated_mlp_width(d), "-"
    pattern = "".join(("*" if i in attn else symbol) + mlp for i in range(d["n_layer"]))
    return Mamba2Config.from_dict(dict(
        d_model=d["d_model"], n_layer=len(pattern), layer_pattern=pattern,
        vocab_size=d["vocab_size"], pad_vocab_size_multiple=d.get("pad_vocab_size_multiple", 8),
        residual_in_fp32=d.get("residual_in_fp32", True),
        tie_embeddings=d.get("tie_embeddings", True), **section, **extra))


_MAMBA3_FIELDS = ("d_state", "expand", "headdim", "ngroups", "rope_fraction", "dt_min",
                  "dt_max", "dt_init_floor", "A_floor", "is_outproj_norm", "is_mimo",
                  "mimo_rank", "chunk_size")


def _mamba3_from_mamba_ssm(d: dict, ssm: dict, path) -> Mamba2Config:
    """A MambaConfig with ssm_cfg.layer "Mamba3" -> Mamba2Config with a layer_pattern of
    Mamba-3 (3), attention (*) and MLP (-) layers as its Blocks are."""
    # How mamba_ssm runs the MIMO out-projection norm (fused or not), not what it computes.
    ssm.pop("fuse_pregate_headwise_norm", None)
    # mamba_ssm's Mamba3 accepts a dropout argument and applies none
    _require(ssm.pop("dropout", 0.0) == 0.0, path, "ssm_cfg.dropout must be 0.0 (mamba_ssm's "
             "Mamba3 accepts it and drops nothing)")
    unknown = sorted(set(ssm) - set(_MAMBA3_FIELDS))
    _require(not unknown, path, f"ssm_cfg has fields Mamba3 does not take: {unknown}")
    return _blocks_config(d, path, "3", mamba3=ssm)


def config_from_nemotron_h(d: dict, path="config.json") -> Mamba2Config:
    """A transformers NemotronHConfig dict -> Mamba2Config with a layer_pattern, every field
    read as transformers' NemotronHForCausalLM reads it (docs/nemotron_h.md has the table):
    the Mamba width is mamba_num_heads * mamba_head_dim (expand is not read), the attention
    width num_attention_heads * head_dim (head_dim defaults to 128, not hidden_size /
    heads), dt is clamped below at time_step_min whatever time_step_limit says, the residual
    stays in the compute dtype (residual_in_fp32 is not read), the head is never tied to the
    embedding (tie_word_embeddings is not read), and multi-token-prediction layers
    (num_nextn_predict_layers, tensors mtp.*) are not part of the model, and the MLP is up ->
    activation -> down (mlp_hidden_act: relu2, gelu or gelu_pytorch_tanh,
    NEMOTRON_MLP_ACTIVATIONS). The legacy mamba_* spellings of the Mamba fields are taken as
    NemotronHConfig takes them."""
    _check_fields(d, path, _NEMOTRON_H_FIELDS, ("hidden_size", "vocab_size"))
    _require(d.get("layers_block_type") or "hybrid_override_pattern" in d, path,
             "layers_block_type or hybrid_override_pattern is required")
    get = lambda key, legacy, default: d.get(legacy, d.get(key, default))
    if d.get("layers_block_type"):
        types = d["layers_block_type"]
        unknown = sorted({t for t in types if t not in _NEMOTRON_TYPES})
        _require(not unknown, path, f"layers_block_type has {unknown}; supported: "
                 f"{sorted(_NEMOTRON_TYPES)} (MoE layers are not)")
        pattern = "".join(_NEMOTRON_TYPES[t] for t in types)
    else:
        pattern = d["hybrid_override_pattern"]
    _require("E" not in pattern, path, f"layer pattern {pattern!r} has MoE layers (E), which "
             "are not supported")
    d_model, expand = d["hidden_size"], get("expand", "mamba_expand", 2)
    heads, headdim = d.get("mamba_num_heads", 128), d.get("mamba_head_dim", 64)
    _require(d.get("mamba_hidden_act", "silu") == "silu", path, "mamba_hidden_act must be silu")
    activation = {hf: ours for ours, hf in NEMOTRON_MLP_ACTIVATIONS.items()}.get(
        d.get("mlp_hidden_act", "relu2"))
    _require(activation is not None, path, f"mlp_hidden_act must be one of "
             f"{sorted(NEMOTRON_MLP_ACTIVATIONS.values())}")
    _require(not d.get("mlp_bias", False), path, "mlp_bias=true is not supported")
    dt_min = get("time_step_min", "mamba_dt_min", 0.001)
    attn_heads = d.get("num_attention_heads", 32)
    return Mamba2Config.from_dict(dict(
        d_model=d_model, n_layer=len(pattern), layer_pattern=pattern,
        vocab_size=d["vocab_size"], pad_vocab_size_multiple=1,
        d_state=d.get("ssm_state_size", 128), d_conv=get("conv_kernel", "mamba_d_conv", 4),
        expand=expand, headdim=headdim,
        # Kept implicit where it is what expand gives, so our configs compare equal.
        **{"mamba2.nheads": None if heads * headdim == expand * d_model else heads},
        ngroups=get("n_groups", "mamba_n_groups", 8),
        chunk_size=get("chunk_size", "mamba_chunk_size", 128), dt_min=dt_min,
        dt_max=get("time_step_max", "mamba_dt_max", 0.1),
        dt_init_floor=get("time_step_floor", "mamba_dt_init_floor", 1e-4),
        dt_limit=(dt_min, math.inf), conv_bias=get("use_conv_bias", "mamba_conv_bias", True),
        bias=d.get("use_bias", False), norm_eps=d.get("layer_norm_epsilon", 1e-5),
        residual_in_fp32=False, tie_embeddings=False,
        d_intermediate=d.get("intermediate_size", 21504) if "-" in pattern else 0,
        mlp_activation=activation, attn_num_heads=attn_heads,
        # Absent: NemotronHConfig's default 8; null: one per query head.
        attn_num_heads_kv=_default(d.get("num_key_value_heads", 8), attn_heads),
        attn_head_dim=_default(d.get("head_dim", 128), 128)))


def _default(value, default):
    return default if value is None else value


OWN = "mamba_jax"  # our own layout's name (config.json's model_type and section)
_OWN_FIELDS = {"d_model": _WIDTH, "n_layer": _LAYERS, "vocab_size": _VOCAB,
               "layer_pattern": _text}


def own_config_dict(cfg: Mamba2Config) -> dict:
    """Our layout's config.json: cfg whole (to_dict, infinities as HF writes them) under
    "mamba_jax", and HF's names of its width, layers and vocabulary (the embedding's rows)
    for tools that read those; transformers has no model_type "mamba_jax"."""
    return {"architectures": ["Mamba2LM"], "model_type": OWN, "hidden_size": cfg.d_model,
            "num_hidden_layers": len(cfg.layers), "vocab_size": cfg.padded_vocab_size,
            "hybrid_override_pattern": cfg.layers, "dtype": "float32",
            OWN: _encode_floats(cfg.to_dict())}


def config_from_own(d: dict, path="config.json") -> Mamba2Config:
    """Our layout's config.json -> its Mamba2Config (own_config_dict's inverse)."""
    _check_fields(d, path, {OWN: lambda v: None if isinstance(v, dict) else "a JSON object"},
                  (OWN,))
    fields = _decode_floats(d[OWN])
    _check_fields(fields, path, _OWN_FIELDS, where=f"{OWN}.")
    try:
        return Mamba2Config.from_dict(fields)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {OWN}: {error}") from None


def _encode_floats(value):
    """A JSON-ready copy of a config dict: tuples as lists, an infinite float as HF's
    {"__float__": "Infinity"} (json.dumps would write bare Infinity, which strict readers
    refuse)."""
    if isinstance(value, dict):
        return {key: _encode_floats(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode_floats(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return {"__float__": "Infinity" if value > 0 else "-Infinity"}
    return value


def _decode_floats(value):
    """_encode_floats' inverse (lists stay lists: the config takes them for its tuples)."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {key: _decode_floats(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_decode_floats(v) for v in value]
    return value


def detect_format(d: dict) -> str:
    if not isinstance(d, dict):
        raise ValueError("config.json must hold a JSON object")
    if OWN in d or d.get("model_type") == OWN:
        return OWN
    if "ssm_cfg" in d or "d_model" in d:
        return "mamba_ssm"
    kind = d.get("model_type")
    if kind == "nemotron_h":
        return "nemotron_h"
    # model_type names the architecture: another one's hidden_size is no Mamba2's
    if kind in ("mamba2", *_HF_MAMBA1_TYPES) or (kind is None and "hidden_size" in d):
        return "hf"
    known = "transformers' (model_type 'mamba2', 'mamba', 'falcon_mamba', 'nemotron_h') or " \
        "mamba_ssm's (d_model, ssm_cfg)"
    if kind is not None:
        raise ValueError(f"model_type {kind!r} is no Mamba model; the config must be {known}")
    raise ValueError(f"no model_type, d_model or hidden_size; the config must be {known}")


def config_from(d: dict, fmt: str, path="config.json") -> Mamba2Config:
    parse = {"hf": config_from_hf, "mamba_ssm": config_from_mamba_ssm,
             "nemotron_h": config_from_nemotron_h, OWN: config_from_own}[fmt]
    return parse(d, path)


def published_layouts(cfg: Mamba2Config) -> tuple[str, ...]:
    """The published layouts "hf" writes a model of cfg in, the first that holds it (its
    natural one first): Mamba2ForCausalLM (or MambaForCausalLM) for a model of Mamba2 (or
    Mamba-1) layers only, else NemotronHForCausalLM (a Mamba width of its own) or
    mamba_ssm's; for a hybrid NemotronHForCausalLM, else mamba_ssm's (its own hybrids:
    SwiGLU MLPs, rotary attention, dt unclamped); mamba_ssm's for Mamba-3 layers
    (transformers has none). Where none holds it, our own (OWN)."""
    if "3" in cfg.layers:
        return ("mamba_ssm",)
    if set(cfg.layers) == {"M"}:
        return ("hf", "nemotron_h", "mamba_ssm")
    return ("hf", "mamba_ssm") if set(cfg.layers) == {"1"} else ("nemotron_h", "mamba_ssm")


def export_format(cfg: Mamba2Config, fmt: str) -> str:
    """The layout written for `fmt`, as cfg's config.json alone decides it: "hf" is the
    first of published_layouts whose config.json holds cfg, else our own (OWN); other
    layouts are themselves. (convert.check_exportable asks the layers' parameters too: a
    learnable initial state no published layout holds.)"""
    if fmt != "hf":
        return fmt
    return next((layout for layout in published_layouts(cfg) if refusal(cfg, layout) is None),
                OWN)


def hf_mamba1_config_dict(cfg: Mamba2Config) -> dict:
    """MambaForCausalLM's config, FalconMambaForCausalLM's with mamba1.bc_dt_rms."""
    m = cfg.mamba1
    model_type = "falcon_mamba" if m.bc_dt_rms else "mamba"
    out = {
        "architectures": [_HF_MAMBA1_TYPES[model_type]], "model_type": model_type,
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer,
        "vocab_size": cfg.padded_vocab_size, "state_size": m.d_state, "expand": m.expand,
        "conv_kernel": m.d_conv, "intermediate_size": mamba1.dims(cfg).i,
        "time_step_rank": m.dt_rank, "time_step_scale": m.dt_scale,
        "time_step_min": m.dt_min, "time_step_max": m.dt_max,
        "time_step_init_scheme": m.dt_init, "time_step_floor": m.dt_init_floor,
        "use_bias": m.bias, "use_conv_bias": m.conv_bias, "hidden_act": "silu",
        "layer_norm_epsilon": cfg.norm_eps, "residual_in_fp32": cfg.residual_in_fp32,
        "tie_word_embeddings": cfg.tie_embeddings, "rescale_prenorm_residual": False,
        "dtype": "float32"}
    if m.bc_dt_rms:
        out["mixer_rms_eps"] = m.bc_dt_rms_eps
    return out


def _derived_width(cfg: Mamba2Config, fmt: str):
    """Refuse a Mamba width other than expand * d_model where the layout derives it."""
    d = mamba2.dims(cfg)
    if d.d_inner != cfg.mamba2.expand * cfg.d_model:
        raise ValueError(f"format={fmt!r} derives the Mamba width from expand * d_model = "
                         f"{cfg.mamba2.expand * cfg.d_model}, but mamba2.nheads * headdim = "
                         f"{d.h} * {d.p} = {d.d_inner}")


def hf_config_dict(cfg: Mamba2Config) -> dict:
    if set(cfg.layers) not in ({"M"}, {"1"}):
        raise ValueError(f"format='hf': transformers' Mamba2ForCausalLM and MambaForCausalLM "
                         f"hold Mamba2 or Mamba-1 layers alone, not layers {cfg.layers!r}")
    if set(cfg.layers) == {"1"}:
        return hf_mamba1_config_dict(cfg)
    v, m = cfg.padded_vocab_size, cfg.mamba2
    _derived_width(cfg, "hf")
    if m.D_has_hdim:
        raise ValueError("format='hf': transformers' Mamba2 has one D a head, not one a head "
                         "channel (mamba2.D_has_hdim)")
    return {
        "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2",
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer, "vocab_size": v,
        "state_size": m.d_state, "conv_kernel": m.d_conv, "expand": m.expand,
        "head_dim": m.headdim, "num_heads": mamba2.dims(cfg).h, "n_groups": m.ngroups,
        "chunk_size": m.chunk_size, "time_step_min": m.dt_min, "time_step_max": m.dt_max,
        "time_step_floor": m.dt_init_floor, "time_step_limit": _encode_limit(m.dt_limit),
        "use_conv_bias": m.conv_bias, "use_bias": m.bias,
        "layer_norm_epsilon": cfg.norm_eps, "residual_in_fp32": cfg.residual_in_fp32,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "rescale_prenorm_residual": False, "dtype": "float32",
    }


def mamba_ssm_blocks(cfg: Mamba2Config) -> tuple[str, bool]:
    """cfg's layers as mamba_ssm Blocks: (each block's mixer symbol, M, 1 or *; whether
    every block has an MLP). A pattern of other shape is a ValueError saying what fits."""
    layers = cfg.layers
    kinds = set(layers) & set("M13")
    if len(kinds) > 1:
        raise ValueError(f"format='mamba_ssm': layers {layers!r} mix Mamba kinds "
                         f"{sorted(kinds)}; a MambaLMHeadModel has one ssm_cfg.layer")
    if re.fullmatch(r"[M13*]*", layers):
        return layers, False
    if re.fullmatch(r"([M13*]-)+", layers):
        return layers[0::2], True
    raise ValueError(f"format='mamba_ssm': layers {layers!r} are not mamba_ssm Blocks (each a "
                     "Mamba2, Mamba-1, Mamba-3 or attention mixer, every one followed by one "
                     "MLP or none)")


def _mamba1_ssm_cfg(cfg: Mamba2Config) -> dict:
    """mamba_ssm's ssm_cfg of Mamba-1 layers (its Mamba's arguments)."""
    m = cfg.mamba1
    if m.bc_dt_rms:
        raise ValueError("format='mamba_ssm': its Mamba has no RMSNorms on dt, B and C "
                         "(mamba1.bc_dt_rms, Falcon-Mamba's; format='hf' writes "
                         "FalconMambaForCausalLM)")
    return {"layer": "Mamba1", "d_state": m.d_state, "d_conv": m.d_conv, "expand": m.expand,
            "dt_rank": m.dt_rank, "dt_min": m.dt_min, "dt_max": m.dt_max,
            "dt_init": m.dt_init, "dt_scale": m.dt_scale, "dt_init_floor": m.dt_init_floor,
            "conv_bias": m.conv_bias, "bias": m.bias}


def _mamba2_ssm_cfg(cfg: Mamba2Config) -> dict:
    """mamba_ssm's ssm_cfg of Mamba2 layers. Its reader passes ssm_cfg to Mamba2 as
    keyword arguments, as json.load gives them: dt_limit goes as plain numbers (an
    infinite one as json's bare Infinity, which json.load reads), and not at all where it
    is Mamba2's default (0, inf), as mamba_ssm's own configs leave it."""
    m = cfg.mamba2
    _derived_width(cfg, "mamba_ssm")
    limit = {} if m.dt_limit == (0.0, math.inf) else {"dt_limit": list(m.dt_limit)}
    per_channel = {"D_has_hdim": True} if m.D_has_hdim else {}  # as its default, left out
    return {"layer": "Mamba2", "d_state": m.d_state, "d_conv": m.d_conv, "expand": m.expand,
            "headdim": m.headdim, "ngroups": m.ngroups, "chunk_size": m.chunk_size,
            "dt_min": m.dt_min, "dt_max": m.dt_max, "dt_init_floor": m.dt_init_floor,
            **limit, "A_init_range": list(m.A_init_range), "conv_bias": m.conv_bias,
            "bias": m.bias, **per_channel}


def mamba_ssm_config_dict(cfg: Mamba2Config) -> dict:
    a = cfg.attention
    # MambaLMHeadModel builds every RMSNorm with its default epsilon: its config has no field
    if cfg.norm_eps != Mamba2Config.norm_eps:
        raise ValueError(f"format='mamba_ssm' has no norm epsilon (its norms take "
                         f"{Mamba2Config.norm_eps}); this model has norm_eps={cfg.norm_eps}")
    mixers, mlp = mamba_ssm_blocks(cfg)
    if "3" in mixers:
        ssm = {"layer": "Mamba3", **{f: getattr(cfg.mamba3, f) for f in _MAMBA3_FIELDS}}
    else:
        ssm = _mamba1_ssm_cfg(cfg) if "1" in mixers else _mamba2_ssm_cfg(cfg)
    if mlp and (cfg.mlp.activation != "swiglu" or cfg.mlp.d_intermediate % GATED_MLP_MULTIPLE):
        raise ValueError(f"format='mamba_ssm': GatedMLP is SwiGLU with a width that is a "
                         f"multiple of {GATED_MLP_MULTIPLE}; this model has mlp.activation="
                         f"{cfg.mlp.activation!r}, mlp.d_intermediate={cfg.mlp.d_intermediate}")
    attn_layer_idx = [i for i, symbol in enumerate(mixers) if symbol == "*"]
    attn = {} if not attn_layer_idx else {
        "num_heads": a.num_heads, "num_heads_kv": a.num_heads_kv, "head_dim": a.head_dim,
        "rotary_emb_dim": a.rotary_emb_dim, "rotary_emb_base": a.rotary_emb_base,
        "rotary_emb_interleaved": a.rotary_interleaved, "qkv_proj_bias": a.qkv_bias,
        "out_proj_bias": a.out_bias, "causal": True}
    return {"d_model": cfg.d_model, "d_intermediate": cfg.mlp.d_intermediate if mlp else 0,
            "n_layer": len(mixers), "vocab_size": cfg.vocab_size, "ssm_cfg": ssm,
            "attn_layer_idx": attn_layer_idx, "attn_cfg": attn, "rms_norm": True,
            "residual_in_fp32": cfg.residual_in_fp32,
            "fused_add_norm": True, "pad_vocab_size_multiple": cfg.pad_vocab_size_multiple,
            "tie_embeddings": cfg.tie_embeddings}


# Our MLP activations NemotronH's up -> act -> down MLP holds -> its mlp_hidden_act (the
# names of transformers' ACT2FN: "gelu" is the exact GeLU, "gelu_pytorch_tanh" the tanh one).
# Not SwiGLU: a gated MLP has a third matrix that layout has no place for.
NEMOTRON_MLP_ACTIVATIONS = {"relu2": "relu2", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def nemotron_h_config_dict(cfg: Mamba2Config) -> dict:
    layers, m, a = cfg.layers, cfg.mamba2, cfg.attention
    if set(layers) - set(_NEMOTRON_NAMES):
        raise ValueError(f"format='nemotron_h' holds Mamba2 (M), attention (*) and MLP (-) "
                         f"layers, not layers {layers!r}")
    problems = [text for bad, text in (
        ("-" in layers and cfg.mlp.activation not in NEMOTRON_MLP_ACTIVATIONS,
         f"mlp.activation={cfg.mlp.activation!r} (NemotronH's MLP is ungated: "
         f"{', '.join(NEMOTRON_MLP_ACTIVATIONS)})"),
        ("*" in layers and a.rotary_emb_dim > 0,
         f"attention.rotary_emb_dim={a.rotary_emb_dim} (NemotronH has no rotary)"),
        ("*" in layers and (a.qkv_bias or a.out_bias),
         "attention biases (NemotronH has none)"),
        (m.dt_limit != (m.dt_min, math.inf),
         f"mamba2.dt_limit={m.dt_limit} (NemotronH clamps dt at time_step_min: set dt_limit="
         f"({m.dt_min}, inf))"),
        ("M" in layers and m.D_has_hdim,
         "mamba2.D_has_hdim (NemotronH has one D a head)")) if bad]
    if problems:
        raise ValueError("format='nemotron_h' cannot express " + "; ".join(problems))
    return {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "hidden_size": cfg.d_model, "vocab_size": cfg.padded_vocab_size,
        "layers_block_type": [_NEMOTRON_NAMES[s] for s in layers],
        "hybrid_override_pattern": layers, "num_hidden_layers": len(layers),
        "ssm_state_size": m.d_state, "conv_kernel": m.d_conv, "expand": m.expand,
        "mamba_num_heads": mamba2.dims(cfg).h, "mamba_head_dim": m.headdim,
        "n_groups": m.ngroups, "chunk_size": m.chunk_size, "time_step_min": m.dt_min,
        "time_step_max": m.dt_max, "time_step_floor": m.dt_init_floor,
        "time_step_limit": _encode_limit(m.dt_limit), "use_conv_bias": m.conv_bias,
        "use_bias": m.bias, "mamba_proj_bias": m.bias, "mamba_hidden_act": "silu",
        "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_heads_kv,
        "head_dim": a.head_dim,
        "attention_bias": False, "intermediate_size": cfg.mlp.d_intermediate,
        "mlp_hidden_act": NEMOTRON_MLP_ACTIVATIONS.get(cfg.mlp.activation, "relu2"),
        "mlp_bias": False, "layer_norm_epsilon": cfg.norm_eps,
        "residual_in_fp32": cfg.residual_in_fp32,
        # NemotronHForCausalLM never ties its head: a tied model is written with its
        # embedding as lm_head.weight too (convert.params_to_torch).
        "tie_word_embeddings": False, "rescale_prenorm_residual": False,
        "num_nextn_predict_layers": 0, "dtype": "float32",
    }


# ---------------------------------------------------------------- Megatron-LM's arguments
# A Megatron-LM checkpoint's config is the argparse namespace its training run saved
# (`args`): its flags' values, with Megatron's defaults where a run gave none. The fields of
# it that shape a hybrid model of Mamba2 (M), attention (*) and MLP (-) layers:
_MEGATRON_FIELDS = {
    "hidden_size": _WIDTH, "num_layers": _optional(_LAYERS),
    "hybrid_layer_pattern": _optional(_text), "hybrid_override_pattern": _optional(_text),
    "hybrid_attention_ratio": _number, "hybrid_mlp_ratio": _number,
    "mamba_state_dim": _WIDTH, "mamba_head_dim": _WIDTH, "mamba_num_groups": _WIDTH,
    "mamba_num_heads": _optional(_WIDTH), "num_attention_heads": _optional(_WIDTH),
    "num_query_groups": _optional(_WIDTH), "group_query_attention": _flag,
    "kv_channels": _optional(_WIDTH), "ffn_hidden_size": _optional(_integer(MAX_MLP)),
    "swiglu": _flag, "squared_relu": _flag, "openai_gelu": _flag, "add_bias_linear": _flag,
    "add_qkv_bias": _flag, "untie_embeddings_and_output_weights": _flag,
    "normalization": _text, "norm_epsilon": _number, "apply_layernorm_1p": _flag,
    "qk_layernorm": _flag, "position_embedding_type": _text, "rotary_percent": _number,
    "rotary_base": _number, "rotary_interleaved": _flag, "fp32_residual_connection": _flag,
    "padded_vocab_size": _optional(_VOCAB), "num_experts": _optional(_integer(MAX_WIDTH, 0))}
# Megatron-LM's defaults (megatron/training/arguments.py) of those a namespace may lack.
MEGATRON_DEFAULTS = {
    "hybrid_attention_ratio": 0.0, "hybrid_mlp_ratio": 0.0, "mamba_state_dim": 128,
    "mamba_head_dim": 64, "mamba_num_groups": 8, "group_query_attention": False,
    "swiglu": False, "squared_relu": False, "openai_gelu": False, "add_bias_linear": True,
    "add_qkv_bias": False, "untie_embeddings_and_output_weights": False,
    "normalization": "LayerNorm", "norm_epsilon": 1e-5, "apply_layernorm_1p": False,
    "qk_layernorm": False, "position_embedding_type": "learned_absolute",
    "rotary_percent": 1.0, "rotary_base": 10000, "rotary_interleaved": False,
    "fp32_residual_connection": False}
# The layer symbols of Megatron-LM's hybrid patterns we have no kind for.
_MEGATRON_OTHER_LAYERS = {"E": "MoE", "G": "gated delta net", "D": "DeepSeek sparse attention",
                          "+": "multi-latent attention"}
# Megatron-LM's Mamba mixer normalises y * silu(z) with a fixed epsilon (its RMSNormGated).
MEGATRON_MAMBA_NORM_EPS = 1e-5


def megatron_pattern(args: dict) -> str | None:
    """The layers of a Megatron-LM hybrid's arguments: its --hybrid-layer-pattern (or the
    older --hybrid-override-pattern) without pipeline-stage separators (|) and without the
    multi-token-prediction layers after a /, else the pattern its ratios allocate over
    --num-layers; None where the arguments give neither."""
    pattern = args.get("hybrid_layer_pattern") or args.get("hybrid_override_pattern")
    if pattern:
        return pattern.split("/")[0].replace("|", "")
    if args.get("num_layers"):
        return hybrid_pattern(args["num_layers"], args["hybrid_attention_ratio"],
                              args["hybrid_mlp_ratio"])
    return None


def config_from_megatron(args: dict, vocab_rows: int, path="args") -> Mamba2Config:
    """A Megatron-LM checkpoint's arguments (the saved namespace's fields, a dict) ->
    Mamba2Config. vocab_rows: the embedding's rows (Megatron's padded vocabulary, which the
    logits have too). What Megatron computes and we cannot (MoE and other layer kinds,
    LayerNorm, position embeddings other than RoPE, MLP biases, query-key norms) is
    refused by name. dt is not clamped (Megatron's Mamba mixer passes no dt_limit)."""
    _check_fields(args, path, _MEGATRON_FIELDS, ("hidden_size",))
    args = {**MEGATRON_DEFAULTS, **{k: v for k, v in args.items() if v is not None}}
    pattern = megatron_pattern(args)
    _require(pattern, path, "holds no layer pattern (hybrid_layer_pattern, "
             "hybrid_override_pattern, or num_layers with the hybrid ratios)")
    other = sorted({f"{s} ({_MEGATRON_OTHER_LAYERS.get(s, 'unknown')})"
                    for s in pattern if s not in "M*-"})
    _require(not other, path, f"layer pattern {pattern!r} has layers we have no kind for: "
             f"{', '.join(other)}; Mamba2 (M), attention (*) and MLP (-) layers are supported")
    _require(not args.get("num_experts"), path, f"num_experts={args.get('num_experts')}: MoE "
             "layers are not supported")
    for flag, ok in (("normalization", "RMSNorm"), ("apply_layernorm_1p", False),
                     ("qk_layernorm", False)):
        _require(args[flag] == ok, path, f"{flag}={args[flag]!r} is not supported (only "
                 f"{ok!r})")
    position = args["position_embedding_type"]
    _require(position in ("none", "rope"), path, f"position_embedding_type={position!r} is "
             "not supported ('none' or 'rope')")
    _require("-" not in pattern or not args["add_bias_linear"], path,
             "add_bias_linear=True gives the MLP layers biases, which our MLP has none of")
    d = args["hidden_size"]
    _require("M" not in pattern or args["norm_epsilon"] == MEGATRON_MAMBA_NORM_EPS, path,
             f"norm_epsilon={args['norm_epsilon']}: Megatron's Mamba mixer norm takes "
             f"{MEGATRON_MAMBA_NORM_EPS} whatever it says, and our layers take one epsilon")
    _require("*" not in pattern or args.get("num_attention_heads"), path,
             "num_attention_heads is required with attention layers")
    rows = args.get("padded_vocab_size")
    _require(rows in (None, vocab_rows), path, f"padded_vocab_size={rows}, but the "
             f"embedding has {vocab_rows} rows")
    sections = {}
    if "M" in pattern:
        headdim, nheads = args["mamba_head_dim"], args.get("mamba_num_heads")
        sections["mamba2"] = dict(
            d_state=args["mamba_state_dim"], headdim=headdim, ngroups=args["mamba_num_groups"],
            chunk_size=128, nheads=None if nheads in (None, 2 * d // headdim) else nheads)
    if "*" in pattern:
        heads = args["num_attention_heads"]
        head_dim = args.get("kv_channels") or d // heads
        sections["attention"] = dict(
            num_heads=heads, head_dim=head_dim,
            num_heads_kv=(args.get("num_query_groups") or heads)
            if args["group_query_attention"] else heads,
            rotary_emb_dim=int(head_dim * args["rotary_percent"]) if position == "rope" else 0,
            rotary_emb_base=float(args["rotary_base"]),
            rotary_interleaved=args["rotary_interleaved"],
            qkv_bias=args["add_qkv_bias"] or args["add_bias_linear"],
            out_bias=args["add_bias_linear"])
    if "-" in pattern:
        sections["mlp"] = dict(
            d_intermediate=args.get("ffn_hidden_size") or 4 * d,
            activation="swiglu" if args["swiglu"] else "relu2" if args["squared_relu"]
            else "gelu_tanh" if args["openai_gelu"] else "gelu")
    return Mamba2Config.from_dict(dict(
        d_model=d, n_layer=len(pattern), layer_pattern=pattern, vocab_size=vocab_rows,
        pad_vocab_size_multiple=1, norm_eps=args["norm_epsilon"],
        residual_in_fp32=args["fp32_residual_connection"],
        tie_embeddings=not args["untie_embeddings_and_output_weights"], **sections))


def megatron_args_dict(cfg: Mamba2Config) -> dict:
    """cfg as the fields of a Megatron-LM checkpoint's saved arguments that build its model
    (mamba_jax.megatron adds the parallel sizes and the run's); a ValueError naming what
    Megatron's hybrid model cannot express."""
    layers, m, a = cfg.layers, cfg.mamba2, cfg.attention
    mlp = "-" in layers
    problems = [text for bad, text in (
        (set(layers) - set("M*-"), f"layers {layers!r} (Megatron's hybrid has Mamba2 (M), "
                                   "attention (*) and MLP (-) layers)"),
        ("M" in layers and (m.bias or not m.conv_bias or m.d_conv != 4),
         f"mamba2.bias={m.bias}, conv_bias={m.conv_bias}, d_conv={m.d_conv} (Megatron's "
         "Mamba mixer has no projection biases and a biased conv of 4 taps)"),
        ("M" in layers and cfg.norm_eps != MEGATRON_MAMBA_NORM_EPS,
         f"norm_eps={cfg.norm_eps} (Megatron's Mamba mixer norm takes "
         f"{MEGATRON_MAMBA_NORM_EPS})"),
        ("M" in layers and m.D_has_hdim,
         "mamba2.D_has_hdim (Megatron-LM's arguments have no D per head channel)"),
        ("*" in layers and a.out_bias and (not a.qkv_bias or mlp),
         "attention.out_bias without qkv_bias, or beside MLP layers (Megatron's "
         "add_bias_linear gives every linear layer a bias)")) if bad]
    if problems:
        raise ValueError("format 'megatron' cannot express " + "; ".join(problems))
    heads, kv = (a.num_heads, a.num_heads_kv) if "*" in layers else (None, None)
    return {
        "hidden_size": cfg.d_model, "num_layers": len(layers),
        "hybrid_layer_pattern": layers, "hybrid_override_pattern": layers,
        "hybrid_attention_ratio": 0.0, "hybrid_mlp_ratio": 0.0,
        "mamba_state_dim": m.d_state, "mamba_head_dim": m.headdim,
        "mamba_num_groups": m.ngroups, "mamba_num_heads": mamba2.dims(cfg).h,
        "num_attention_heads": heads, "num_query_groups": kv,
        "group_query_attention": kv is not None and kv < heads,
        "kv_channels": a.head_dim if heads else None,
        "ffn_hidden_size": cfg.mlp.d_intermediate if mlp else None,
        "swiglu": mlp and cfg.mlp.activation == "swiglu",
        "squared_relu": mlp and cfg.mlp.activation == "relu2",
        "openai_gelu": mlp and cfg.mlp.activation == "gelu_tanh",
        "add_bias_linear": a.out_bias and "*" in layers,
        "add_qkv_bias": a.qkv_bias and "*" in layers,
        "untie_embeddings_and_output_weights": not cfg.tie_embeddings,
        "normalization": "RMSNorm", "norm_epsilon": cfg.norm_eps, "apply_layernorm_1p": False,
        "qk_layernorm": False,
        "position_embedding_type": "rope" if heads and a.rotary_emb_dim else "none",
        "rotary_percent": a.rotary_emb_dim / a.head_dim if heads else 1.0,
        "rotary_base": a.rotary_emb_base, "rotary_interleaved": a.rotary_interleaved,
        "use_rotary_position_embeddings": bool(heads and a.rotary_emb_dim),
        "add_position_embedding": False,
        "fp32_residual_connection": cfg.residual_in_fp32,
        "padded_vocab_size": cfg.padded_vocab_size, "num_experts": None}


def layout_notes(cfg: Mamba2Config, fmt: str) -> list[str]:
    """What the layout fmt (as written) computes otherwise than cfg, beyond the fields it
    refuses: a line each, for an export to say."""
    notes = []
    if fmt == "megatron" and "M" in cfg.layers and cfg.mamba2.dt_limit != (0.0, math.inf):
        notes.append(f"Megatron-LM does not clamp dt; this model clamps it to "
                     f"{cfg.mamba2.dt_limit} (NemotronH's clamp at dt_min)")
    if fmt == "megatron" and "-" in cfg.layers and cfg.mlp.activation == "gelu_tanh":
        notes.append("Megatron-LM's loader does not take --openai-gelu from a checkpoint's "
                     "arguments: give it to the run that loads this one")
    if fmt == "nemotron_h" and cfg.residual_in_fp32:
        notes.append("NemotronH keeps the residual in the compute dtype (transformers, and a "
                     "reload here, do not read residual_in_fp32): its bf16 logits differ "
                     "slightly from this model's, float32 ones do not")
    return notes


def with_token_ids(config: dict, token_ids: dict) -> dict:
    """A written config dict with the tokenizer's {"bos_token_id", "eos_token_id",
    "pad_token_id"} (ids or None), where the layout has them: the HF layouts
    (transformers' generate reads them); mamba_ssm's MambaConfig takes no such fields."""
    return config if detect_format(config) == "mamba_ssm" else {**config, **token_ids}


def config_dict(cfg: Mamba2Config, fmt: str) -> dict:
    """cfg as the layout fmt's config.json; a ValueError naming what the layout cannot
    express (convert.check_exportable adds the layout that can)."""
    return _WRITERS[fmt](cfg)


def refusal(cfg: Mamba2Config, fmt: str) -> str | None:
    """Why the layout fmt's config.json cannot express cfg, or None where it can."""
    try:
        config_dict(cfg, fmt)
    except ValueError as error:
        return str(error)
    return None


def _encode_limit(limit):
    """dt_limit (low, high) -> JSON: json.dumps would write an infinite high as bare
    `Infinity`, which strict JSON readers reject."""
    low, high = limit
    return [low, {"__float__": "Infinity"} if math.isinf(high) else high]


_WRITERS = {"hf": hf_config_dict, "mamba_ssm": mamba_ssm_config_dict,
            "nemotron_h": nemotron_h_config_dict, OWN: own_config_dict}
