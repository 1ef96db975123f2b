"""Mamba2Config: the fields every model has, and one section per layer kind.

    cfg = Mamba2Config(d_model=768, n_layer=24)                          # mamba2-130m
    cfg = Mamba2Config(d_model=64, layer_pattern="M*-", n_layer=3,
                       mamba2={"d_state": 16}, attention={"num_heads": 4},
                       mlp={"d_intermediate": 256})
    cfg.mamba2.d_state, cfg.attention.num_heads, cfg.mlp.activation
    cfg = Mamba2Config.preset("tiny", **{"mamba2.d_state": 16})

Each registered layer kind (mamba_jax.layers.registry) has its section, named after it
(cfg.mamba2, cfg.attention, cfg.mlp), the kind's own frozen `Config` dataclass; its field
names follow mamba_ssm (ssm_cfg's for Mamba2, attn_cfg's for attention). The config is
frozen, hashable and validated on creation. Wherever a section's field is named (the
constructor, `replace`, `preset`, `from_dict`, `--set`, recipes), the flat spelling configs
had before sections is taken too (LEGACY_NAMES: d_state for mamba2.d_state, attn_num_heads
for attention.num_heads, d_intermediate, ...), so older code, recipes and saved configs
still load.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from typing import Any

from mamba_jax.layers.common import FLOAT32_MAX
from mamba_jax.layers.registry import KINDS


@dataclasses.dataclass(frozen=True, init=False)
class ModelFields:
    """The fields every model has. `vocab_size` is the tokenizer's size; the embedding and
    logits have `padded_vocab_size` rows (rounded up to `pad_vocab_size_multiple`, as
    mamba_ssm does).

    The layers are `layer_pattern`, one symbol per layer as Megatron-LM's
    --hybrid-layer-pattern spells it (M Mamba2, * attention, - MLP, 3 Mamba-3, and 1
    Mamba-1, which Megatron lacks: the registry's symbols),
    each its own pre-norm residual layer. Empty, with `hybrid_attention_ratio` or
    `hybrid_mlp_ratio` above 0: the pattern Megatron-LM allocates from those ratios for
    n_layer layers (hybrid_pattern). A layer_pattern given with ratios must hold as many
    layers of each kind as the ratios allocate (Megatron's rule for an override pattern).
    Empty, without ratios: mamba_ssm's form, n_layer blocks of a mixer
    (attention where the block index is in attn_layer_idx, else Mamba2) each followed by an
    MLP layer when mlp.d_intermediate > 0 (mamba_ssm's Block adds the mixer to the residual,
    then runs norm2 + MLP: exactly two pre-norm layers)."""

    d_model: int = 768
    n_layer: int = 24
    vocab_size: int = 50277
    pad_vocab_size_multiple: int = 16
    norm_eps: float = 1e-5
    residual_in_fp32: bool = True
    tie_embeddings: bool = True
    layer_pattern: str = ""
    hybrid_attention_ratio: float = 0.0
    hybrid_mlp_ratio: float = 0.0
    attn_layer_idx: tuple[int, ...] = ()

    def __init__(self, **fields):
        """Keyword arguments only: shared fields (or their MEGATRON_NAMES), sections (their
        Config, or a dict of their fields), a section's fields as "section.field", or their
        flat LEGACY_NAMES."""
        values = _merge({}, fields)
        for field in dataclasses.fields(self):
            if field.name in values:
                value = values[field.name]
            elif field.default is not dataclasses.MISSING:
                value = field.default
            else:
                value = field.default_factory()
            if field.name in SECTIONS and isinstance(value, dict):
                value = _section(SECTIONS[field.name], value)
            object.__setattr__(self, field.name, value)
        self.__post_init__()

    def __post_init__(self):
        _check_types(self, "Mamba2Config")
        for name in SECTIONS:
            _check_types(getattr(self, name), f"Mamba2Config.{name}")
        index = lambda i: isinstance(i, numbers.Real) and not isinstance(i, bool) \
            and float(i) == int(i)
        if not isinstance(self.attn_layer_idx, (tuple, list)) \
                or not all(map(index, self.attn_layer_idx)):
            raise ValueError(f"Mamba2Config.attn_layer_idx={self.attn_layer_idx!r} must be a "
                             "list of block indices (integers)")
        object.__setattr__(self, "attn_layer_idx", tuple(int(i) for i in self.attn_layer_idx))
        for name in ("d_model", "n_layer", "vocab_size", "pad_vocab_size_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Mamba2Config.{name}={value!r} must be a positive integer")
        if not self.norm_eps > 0:
            raise ValueError(f"Mamba2Config.norm_eps={self.norm_eps!r} must be > 0")
        self._check_layers()
        read = set()
        for symbol in sorted(set(self.layers)):
            kind = KINDS[symbol]
            object.__setattr__(self, kind.name, kind.completed(self))
            kind.check_config(self)
            read.update((kind.name, *kind.reads))
        for name in sorted(set(SECTIONS) - read):  # read by no layer: still a valid one
            SECTIONS[name].check_section(self)

    def _check_layers(self):
        pattern = self.layer_pattern
        ratios = (self.hybrid_attention_ratio, self.hybrid_mlp_ratio)
        for name, ratio in zip(("hybrid_attention_ratio", "hybrid_mlp_ratio"), ratios):
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) \
                    or not 0 <= ratio <= 1:
                raise ValueError(f"Mamba2Config.{name}={ratio!r} must be a number in [0, 1] "
                                 "(the share of the layers of that kind)")
        if sum(ratios) > 1:
            raise ValueError(f"Mamba2Config: hybrid_attention_ratio + hybrid_mlp_ratio = "
                             f"{sum(ratios)} must be at most 1 (Mamba2 layers take the rest)")
        if any(ratios) and self.attn_layer_idx:
            raise ValueError("Mamba2Config: give hybrid ratios or attn_layer_idx="
                             f"{list(self.attn_layer_idx)} (mamba_ssm's form), not both")
        for i, symbol in enumerate(pattern):
            if symbol not in KINDS:
                names = ", ".join(f"{s} ({k.name})" for s, k in KINDS.items())
                raise ValueError(
                    f"Mamba2Config.layer_pattern={pattern!r}: unknown symbol {symbol!r} at "
                    f"position {i}\n    {pattern}\n    {' ' * i}^\nuse {names}, one per layer")
        if pattern and len(pattern) != self.n_layer:
            raise ValueError(f"Mamba2Config: layer_pattern {pattern!r} has {len(pattern)} "
                             f"layers but n_layer={self.n_layer}; set n_layer={len(pattern)} "
                             "(one layer per symbol, as Megatron's --num-layers), or a "
                             f"layer_pattern of {self.n_layer} symbols (the trainer's "
                             "--hybrid-override-pattern)")
        if pattern and self.attn_layer_idx:
            raise ValueError(f"Mamba2Config: give layer_pattern={pattern!r} or attn_layer_idx="
                             f"{list(self.attn_layer_idx)} (mamba_ssm's form), not both")
        bad = [i for i in self.attn_layer_idx if not 0 <= i < self.n_layer]
        if bad:
            raise ValueError(f"Mamba2Config.attn_layer_idx has {bad}, outside the "
                             f"n_layer={self.n_layer} blocks 0..{self.n_layer - 1}")
        if pattern and any(ratios):
            allocated = hybrid_pattern(self.n_layer, *ratios)
            if sorted(pattern) != sorted(allocated):
                # Megatron's three kinds, and any other the pattern uses
                shown = [s for s in KINDS if s in "M*-" or s in pattern]
                count = lambda p: ", ".join(f"{p.count(s)} {s}" for s in shown)
                raise ValueError(
                    f"Mamba2Config: layer_pattern {pattern!r} ({count(pattern)}) does not hold "
                    f"the layers hybrid_attention_ratio={ratios[0]}, hybrid_mlp_ratio="
                    f"{ratios[1]} allocate ({allocated!r}: {count(allocated)}); give a pattern "
                    "with those counts, or set both ratios to 0 to use the pattern alone")

    @property
    def layers(self) -> str:
        """One symbol per layer: layer_pattern, the hybrid ratios' allocation, or
        mamba_ssm's blocks spelt out."""
        if self.layer_pattern:
            return self.layer_pattern
        if self.hybrid_attention_ratio or self.hybrid_mlp_ratio:
            return hybrid_pattern(self.n_layer, self.hybrid_attention_ratio,
                                  self.hybrid_mlp_ratio)
        mlp = "-" if self.mlp.d_intermediate > 0 else ""
        return "".join(("*" if i in self.attn_layer_idx else "M") + mlp
                       for i in range(self.n_layer))

    def spelt_out(self) -> "Mamba2Config":
        """The same model with its layers as layer_pattern (no ratios, no attn_layer_idx):
        configs of one model spelt by Megatron's ratios, by mamba_ssm's blocks or by a
        pattern are equal spelt out (their models have the same layers and parameters)."""
        return self.replace(layer_pattern=self.layers, n_layer=len(self.layers),
                            hybrid_attention_ratio=0.0, hybrid_mlp_ratio=0.0, attn_layer_idx=())

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return -(-self.vocab_size // m) * m

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "Mamba2Config":
        """A named configuration (PRESETS) with overrides (as `replace` takes them). An
        override of a section that no layer of the result reads is refused: it would change
        nothing (d_state, a Mamba2 field, on a Mamba-3 preset)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets are {sorted(PRESETS)}")
        cfg = PRESETS[name].replace(**overrides)
        read = {section for symbol in set(cfg.layers)
                for section in (KINDS[symbol].name, *KINDS[symbol].reads)}
        for key in overrides:
            section = key if key in SECTIONS else _resolve(key)[0]
            if section is not None and section not in read:
                kinds = ", ".join(f"{KINDS[s].name}.* for its {s} layers" for s in
                                  dict.fromkeys(cfg.layers))
                raise ValueError(f"{key} sets cfg.{section}, which no layer of "
                                 f"{name!r} (layers {cfg.layers!r}) reads: set {kinds}")
            fields = (set(overrides[key]) if key == "mamba2" and isinstance(overrides[key], dict)
                      else {_resolve(key)[1]} if section == "mamba2" else set())
            if "expand" in fields and cfg.mamba2.nheads is not None:
                raise ValueError(f"mamba2.expand is not read where mamba2.nheads is set: the "
                                 f"Mamba2 width of {name!r} so is nheads x headdim = "
                                 f"{cfg.mamba2.nheads} x {cfg.mamba2.headdim}; set "
                                 "mamba2.nheads instead")
        return cfg

    def replace(self, **changes: Any) -> "Mamba2Config":
        """A copy with changes: shared fields by name, a section's fields as "section.field"
        (replace(**{"mamba2.d_state": 64})), by their flat LEGACY_NAMES, or as a dict merged
        into the section (replace(mamba2={"d_state": 64}))."""
        return type(self)(**_merge(self.to_dict(), changes))

    def to_dict(self) -> dict[str, Any]:
        """The shared fields, and each section as a dict under its name."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Mamba2Config":
        """to_dict's form, or the flat spelling of configs saved before sections."""
        return cls(**d)

    @classmethod
    def field_default(cls, name: str):
        """The default value of a field named as `replace` takes it (so a command line can
        parse a value to its type); a ValueError listing the names otherwise."""
        return cls().value_of(name)

    def value_of(self, name: str):
        """The value of a field named as `replace` takes it; a ValueError listing the names
        otherwise."""
        section, field = _resolve(name)
        return getattr(getattr(self, section) if section else self, field)


def hybrid_pattern(num_layers: int, attention_ratio: float = 0.0,
                   mlp_ratio: float = 0.0) -> str:
    """The layer pattern Megatron-LM allocates for --num-layers, --hybrid-attention-ratio and
    --hybrid-mlp-ratio (its pattern_from_ratios, formerly allocate_layers), e.g.
    hybrid_pattern(56, 0.08, 0.5) is the 8B hybrid's published
    "M-M-M--M-M*-M-M-M-M--M*-M-M-M-M-M*--M-M-M-M-M*-M--M-M-M-".

    round(num_layers * attention_ratio) attention layers (*) cut the Mamba2 layers into that
    many plus one sections of equal (fractional) length, an attention layer going where the
    running length left in a section falls below half a layer; then round(num_layers *
    mlp_ratio) of the Mamba2 layers become MLP layers (-) by the same walk over the Mamba2
    layers alone. Python's round (half to even), as Megatron's."""
    symbols = ["M"] * num_layers
    attention = round(num_layers * attention_ratio)
    mamba = num_layers - attention
    _allocate(symbols, "*", mamba / (attention + 1))
    mlp = round(num_layers * mlp_ratio)
    if mlp > 0:
        _allocate(symbols, "-", (mamba - mlp) / mlp)
    return "".join(symbols)


def _allocate(symbols: list[str], symbol: str, section: float) -> None:
    """hybrid_pattern's walk over the Mamba2 layers (M) of symbols, in place: one becomes
    `symbol` wherever the length left in the current section, `section` layers long, falls
    below half a layer."""
    left = section
    for i, current in enumerate(symbols):
        if current != "M":
            continue
        if left < 0.5:
            symbols[i] = symbol
            left += section
        else:
            left -= 1


# Megatron-LM's names of shared fields: its flags' (--num-layers, --hybrid-override-pattern,
# --hybrid-layer-pattern) spelt with underscores -> the field.
MEGATRON_NAMES = {"num_layers": "n_layer", "hybrid_override_pattern": "layer_pattern",
                  "hybrid_layer_pattern": "layer_pattern"}

# The flat names section fields had before the config had sections: old name -> (section,
# field). Recipes, --set and the configs saved with checkpoints may still use them.
LEGACY_NAMES = {
    **{name: ("mamba2", name) for name in (
        "d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size", "dt_min", "dt_max",
        "dt_init_floor", "dt_limit", "A_init_range", "conv_bias", "bias")},
    **{f"attn_{name}": ("attention", name) for name in (
        "num_heads", "num_heads_kv", "head_dim", "rotary_emb_dim", "rotary_emb_base",
        "rotary_interleaved", "qkv_bias", "out_bias")},
    "d_intermediate": ("mlp", "d_intermediate"),
    "mlp_activation": ("mlp", "activation"),
}


# What a scalar field's annotation admits: an int where a float is asked, never a bool for a
# number (a JSON config's true for a size) nor a string for a bool ("false" would be true).
_ADMITS = {bool: lambda v: isinstance(v, bool),
           int: lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
           float: lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
           str: lambda v: isinstance(v, str), type(None): lambda v: v is None}


def _check_types(fields, where: str):
    """Refuse a field whose value is not of its annotation's scalar types (fields of other
    types, tuples and sections, are checked where they are read)."""
    hints = typing.get_type_hints(type(fields))
    for field in dataclasses.fields(fields):
        hint = hints[field.name]
        kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        if not all(kind in _ADMITS for kind in kinds):
            continue
        value = getattr(fields, field.name)
        if not any(_ADMITS[kind](value) for kind in kinds):
            names = {bool: "true or false", int: "an integer", float: "a number",
                     str: "a string", type(None): "null (None)"}
            raise ValueError(f"{where}.{field.name}={value!r} must be "
                             f"{' or '.join(names[kind] for kind in kinds)}")
        if float in kinds and _ADMITS[float](value) and not (
                math.isfinite(value) and abs(value) <= FLOAT32_MAX):
            # an infinite dt bound or eps passed the range checks and gave NaN logits, and
            # so did one past float32's range, in which the parameters are made
            raise ValueError(f"{where}.{field.name}={value!r} must be a finite number within "
                             f"float32's range (at most {FLOAT32_MAX:.4g})")


def _section(kind, values: dict):
    """A kind's section from a dict, naming unknown fields."""
    fields = {f.name for f in dataclasses.fields(kind.Config)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"Mamba2Config.{kind.name} has no fields {unknown}; its fields are "
                         f"{sorted(fields)}")
    return kind.Config(**values)


SECTIONS = {kind.name: kind for kind in KINDS.values()}  # section name -> layer kind


def _resolve(name: str) -> tuple[str | None, str]:
    """A field's name as `replace` takes it -> (its section or None, its field)."""
    shared = {f.name for f in dataclasses.fields(ModelFields)}
    if name in LEGACY_NAMES:
        return LEGACY_NAMES[name]
    if name in MEGATRON_NAMES:
        return None, MEGATRON_NAMES[name]
    section, dot, field = name.partition(".")
    if dot and section in SECTIONS:
        fields = sorted(f.name for f in dataclasses.fields(SECTIONS[section].Config))
        if field not in fields:
            raise ValueError(f"Mamba2Config.{section} has no field {field!r}; its fields are "
                             f"{fields}")
        return section, field
    if not dot and name in shared:
        return None, name
    raise ValueError(f"Mamba2Config has no field {name!r}; fields are {sorted(shared)} and "
                     f"each section's as SECTION.FIELD, sections {sorted(SECTIONS)}")


def check_field(name: str) -> None:
    """A ValueError naming the fields where `replace` takes no field `name`."""
    _resolve(name)


def _merge(base: dict, changes: dict) -> dict:
    """base (to_dict's form) with changes applied: whole sections first (a dict merged into
    the section, a section object replacing it), then single fields by any name `_resolve`
    takes."""
    out = {key: dict(value) if isinstance(value, dict) else value for key, value in base.items()}
    for name, value in changes.items():
        if name in SECTIONS:
            if dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            if not isinstance(value, dict):
                raise ValueError(f"Mamba2Config.{name} must be a dict of its fields, got "
                                 f"{value!r}")
            out[name] = {**out.get(name, {}), **value}
    for name, value in changes.items():
        if name in SECTIONS:
            continue
        section, field = _resolve(name)
        if section is None:
            out[field] = value
        else:
            out[section] = {**out.get(section, {}), field: value}
    return out


Mamba2Config = dataclasses.make_dataclass(
    "Mamba2Config",
    [(kind.name, kind.Config, dataclasses.field(default_factory=kind.Config))
     for kind in KINDS.values()],
    bases=(ModelFields,), frozen=True, init=False, module=__name__)
Mamba2Config.__doc__ = (
    "A language model's shape and initialisation: ModelFields' shared fields, and one "
    "section per layer kind (" + ", ".join(f"{k.name}: {k.__name__}'s" for k in KINDS.values())
    + "), each the kind's Config. Frozen; validated on creation.")


# Megatron-LM's hybrid Mamba layouts (examples/mamba/train.sh): Megatron's Mamba defaults
# (d_state 128, headdim 64, 8 groups, chunk 128), GQA with 8 KV heads, no position
# embedding, no biases, untied embeddings, MLP width 4*d_model (Megatron's default
# ffn_hidden_size) with Megatron's default activation, exact GeLU (train.sh passes none of
# --swiglu, --squared-relu, --openai-gelu). The 800M layout is allocated from the ratios
# its recipe has always named (--hybrid-attention-ratio 0.08 --hybrid-mlp-ratio 0.5 over 48
# layers); the 8B layout is the pattern examples/mamba/README.md publishes, which the same
# ratios allocate over 56 layers. dt clamped below at dt_min, as HF NemotronH runs it, so
# the model exports as NemotronHForCausalLM. Vocabulary: the report's 256K SentencePiece;
# set vocab_size to your tokenizer's.
_MEGATRON_HYBRID = dict(vocab_size=256000, pad_vocab_size_multiple=128, tie_embeddings=False)
_MEGATRON_MAMBA = dict(ngroups=8, chunk_size=128, dt_limit=(0.001, math.inf))


def _nemotron_h(d_model, pattern, mamba_heads, attention_heads, mlp, headdim=64, d_state=128):
    """A published NVIDIA Nemotron-H / Nemotron Nano 2 shape, as formats.config_from_nemotron_h
    reads its config.json: 131072-token vocabulary unpadded, untied, the residual in the
    compute dtype; Mamba2 with 8 groups, chunk 128, dt clamped below at dt_min, its width
    mamba_heads * headdim; GQA with 8 KV heads of 128, no rotary; squared-ReLU MLP."""
    return Mamba2Config(
        vocab_size=131072, pad_vocab_size_multiple=1, tie_embeddings=False,
        residual_in_fp32=False, d_model=d_model, n_layer=len(pattern), layer_pattern=pattern,
        mamba2=dict(d_state=d_state, headdim=headdim, ngroups=8, chunk_size=128,
                    dt_limit=(0.001, math.inf),
                    nheads=None if mamba_heads * headdim == 2 * d_model else mamba_heads),
        attention=dict(num_heads=attention_heads, num_heads_kv=8, head_dim=128),
        mlp=dict(d_intermediate=mlp, activation="relu2"))


# The published state-spaces/mamba2-* checkpoints: mamba_ssm's Mamba2 defaults (d_state 128,
# d_conv 4, expand 2, headdim 64, ngroups 1, chunk 256), GPT-NeoX vocabulary padded to 16,
# tied embeddings.
PRESETS: dict[str, Mamba2Config] = {
    "mamba2-130m": Mamba2Config(d_model=768, n_layer=24),
    "mamba2-370m": Mamba2Config(d_model=1024, n_layer=48),
    "mamba2-780m": Mamba2Config(d_model=1536, n_layer=48),
    "mamba2-1.3b": Mamba2Config(d_model=2048, n_layer=48),
    "mamba2-2.7b": Mamba2Config(d_model=2560, n_layer=64),
    "megatron-hybrid-800m": Mamba2Config(
        **_MEGATRON_HYBRID, d_model=1024, n_layer=48, hybrid_attention_ratio=0.08,
        hybrid_mlp_ratio=0.5, mamba2=_MEGATRON_MAMBA,
        attention=dict(num_heads=16, num_heads_kv=8, head_dim=64),
        mlp=dict(d_intermediate=4096, activation="gelu")),
    "megatron-hybrid-8b": Mamba2Config(
        **_MEGATRON_HYBRID, d_model=4096, n_layer=56,
        layer_pattern="M-M-M--M-M*-M-M-M-M--M*-M-M-M-M-M*--M-M-M-M-M*-M--M-M-M-",
        mamba2=_MEGATRON_MAMBA, attention=dict(num_heads=32, num_heads_kv=8, head_dim=128),
        mlp=dict(d_intermediate=16384, activation="gelu")),
    # NVIDIA's Nemotron-H Base-8K and Nemotron Nano 2 (their config.json; layer patterns as
    # Megatron-Bridge's providers spell them). Nano 2's widths are not hidden_size's: 128
    # Mamba heads of 80 and 40 attention heads of 128 over d_model 4480 (9B).
    "nemotron-h-4b": _nemotron_h(
        3072, "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", 112, 32, 12288),
    "nemotron-h-8b": _nemotron_h(
        4096, "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", 128, 32, 21504),
    "nemotron-h-47b": _nemotron_h(
        8192, "M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-M-M"
        "---MM---M-M*-M-M-M-M-M-", 256, 64, 30720, d_state=256),
    "nemotron-h-56b": _nemotron_h(
        8192, "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-"
        "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", 256, 64, 32768, d_state=256),
    "nemotron-nano-9b-v2": _nemotron_h(
        4480, "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-", 128, 40, 15680,
        headdim=80),
    "nemotron-nano-12b-v2": _nemotron_h(
        5120, "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-", 128, 40, 20480,
        headdim=80),
    # Mamba-3 (mamba_ssm's Mamba3 defaults: d_state 128, headdim 64, ngroups 1, rope_fraction
    # 0.5, SISO, chunk 64) at the Mamba2 checkpoints' sizes, GPT-NeoX vocabulary.
    **{f"mamba3-{size}": Mamba2Config(d_model=d, n_layer=n, layer_pattern="3" * n)
       for size, d, n in (("130m", 768, 24), ("370m", 1024, 48), ("780m", 1536, 48),
                          ("1.3b", 2048, 48), ("2.7b", 2560, 64))},
    # Byte-level, small enough to train on a laptop CPU in minutes.
    "tiny": Mamba2Config(d_model=128, n_layer=2, vocab_size=256,
                         mamba2=dict(d_state=32, headdim=32, chunk_size=64)),
    # The same with Mamba-1 layers (mamba_ssm's Mamba defaults: d_state 16, dt_rank 8).
    "tiny-mamba1": Mamba2Config(d_model=128, n_layer=2, vocab_size=256, layer_pattern="11"),
    "mamba3-tiny": Mamba2Config(d_model=128, n_layer=2, vocab_size=256, layer_pattern="33",
                                mamba3=dict(d_state=32, headdim=32, chunk_size=64)),
}
# The published state-spaces/mamba-* checkpoints (Mamba-1): mamba_ssm's Mamba defaults
# (d_state 16, d_conv 4, expand 2, dt_rank ceil(d_model / 16)), GPT-NeoX vocabulary padded
# to 8, tied embeddings.
PRESETS.update({
    f"mamba-{size}": Mamba2Config(d_model=d_model, n_layer=n_layer, layer_pattern="1" * n_layer,
                                  pad_vocab_size_multiple=8)
    for size, d_model, n_layer in (("130m", 768, 24), ("370m", 1024, 48), ("790m", 1536, 48),
                                   ("1.4b", 2048, 48), ("2.8b", 2560, 64))})
