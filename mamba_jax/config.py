"""Mamba2Config: every field mamba_ssm's Mamba2 / MambaLMHeadModel uses for published models,
and the layer pattern and attention / MLP widths of hybrid models.

Field names follow mamba_ssm (`ssm_cfg` entries flattened into the top level; `attn_cfg`
entries as `attn_*`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class Mamba2Config:
    """A Mamba2 language model's shape and initialisation. Frozen; validated on creation.

    `vocab_size` is the tokenizer's size; the embedding and logits have `padded_vocab_size`
    rows (rounded up to `pad_vocab_size_multiple`, as mamba_ssm does).
    """

    d_model: int = 768
    n_layer: int = 24
    vocab_size: int = 50277
    pad_vocab_size_multiple: int = 16
    d_state: int = 128
    d_conv: int = 4
    expand: int = 2
    headdim: int = 64
    ngroups: int = 1
    chunk_size: int = 256
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    dt_limit: tuple[float, float] = (0.0, math.inf)
    A_init_range: tuple[float, float] = (1.0, 16.0)
    conv_bias: bool = True
    bias: bool = False
    norm_eps: float = 1e-5
    residual_in_fp32: bool = True
    tie_embeddings: bool = True
    # Hybrid models. The layers are `layer_pattern`, one symbol per layer as Megatron-LM's
    # --hybrid-layer-pattern spells it: M Mamba2, * attention, - MLP, each its own pre-norm
    # residual layer. Empty: mamba_ssm's form, n_layer blocks of a mixer (attention where
    # the block index is in attn_layer_idx, else Mamba2) each followed by an MLP layer when
    # d_intermediate > 0 (mamba_ssm's Block adds the mixer to the residual, then runs
    # norm2 + MLP: exactly two pre-norm layers).
    layer_pattern: str = ""
    attn_layer_idx: tuple[int, ...] = ()
    d_intermediate: int = 0  # the MLP's hidden width
    mlp_activation: str = "swiglu"  # "swiglu" (mamba_ssm GatedMLP) or "relu2" (NemotronH)
    attn_num_heads: int = 8
    attn_num_heads_kv: int = 8  # grouped KV heads; must divide attn_num_heads
    attn_head_dim: int = 64
    attn_rotary_emb_dim: int = 0  # rotary on the first dims of each head; 0: none
    attn_rotary_emb_base: float = 10000.0
    attn_rotary_interleaved: bool = False  # pairs (2i, 2i+1) instead of halves (GPT-NeoX)
    attn_qkv_bias: bool = False
    attn_out_bias: bool = False

    def __post_init__(self):
        # Lists from JSON become tuples, so configs stay hashable and compare equal.
        object.__setattr__(self, "dt_limit", tuple(float(v) for v in self.dt_limit))
        object.__setattr__(self, "A_init_range", tuple(float(v) for v in self.A_init_range))
        if any(float(i) != int(i) for i in self.attn_layer_idx):
            raise ValueError(f"Mamba2Config.attn_layer_idx={self.attn_layer_idx} must be block "
                             "indices (integers)")
        object.__setattr__(self, "attn_layer_idx", tuple(int(i) for i in self.attn_layer_idx))
        positive = ("d_model", "n_layer", "vocab_size", "pad_vocab_size_multiple", "d_state",
                    "d_conv", "expand", "headdim", "ngroups", "chunk_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Mamba2Config.{name}={value!r} must be a positive integer")
        for name in ("dt_min", "dt_max", "dt_init_floor", "norm_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Mamba2Config.{name}={getattr(self, name)!r} must be > 0")
        if self.dt_min > self.dt_max:
            raise ValueError(f"Mamba2Config.dt_min={self.dt_min} > dt_max={self.dt_max}: "
                             "swap them")
        lo, hi = self.dt_limit
        if len(self.dt_limit) != 2 or not 0.0 <= lo < hi:
            raise ValueError(f"Mamba2Config.dt_limit={self.dt_limit} must be (lo, hi) with "
                             "0 <= lo < hi; (0.0, inf) means no limit")
        a_lo, a_hi = self.A_init_range
        if len(self.A_init_range) != 2 or not 0.0 < a_lo <= a_hi:
            raise ValueError(f"Mamba2Config.A_init_range={self.A_init_range} must be (lo, hi) "
                             "with 0 < lo <= hi")
        if self.d_inner % self.headdim:
            divisors = [d for d in range(1, self.d_inner + 1) if self.d_inner % d == 0]
            nearby = [d for d in divisors if self.headdim // 2 <= d <= self.headdim * 2]
            raise ValueError(
                f"Mamba2Config: d_model*expand = {self.d_model}*{self.expand} = {self.d_inner} "
                f"is not divisible by headdim={self.headdim}; choose headdim among {nearby} "
                "or change d_model/expand")
        if self.nheads % self.ngroups:
            divisors = [d for d in range(1, self.nheads + 1) if self.nheads % d == 0]
            raise ValueError(
                f"Mamba2Config: nheads = d_inner/headdim = {self.nheads} is not divisible by "
                f"ngroups={self.ngroups}; choose ngroups among {divisors}")
        self._check_layers()

    def _check_layers(self):
        pattern = self.layer_pattern
        for i, symbol in enumerate(pattern):
            if symbol not in LAYER_KINDS:
                raise ValueError(
                    f"Mamba2Config.layer_pattern={pattern!r}: unknown symbol {symbol!r} at "
                    f"position {i}\n    {pattern}\n    {' ' * i}^\nuse M (Mamba2), * "
                    "(attention) or - (MLP), one per layer")
        if pattern and len(pattern) != self.n_layer:
            raise ValueError(f"Mamba2Config: layer_pattern {pattern!r} has {len(pattern)} "
                             f"layers but n_layer={self.n_layer}; set n_layer={len(pattern)} "
                             "(one layer per symbol, as Megatron's --num-layers)")
        if pattern and self.attn_layer_idx:
            raise ValueError(f"Mamba2Config: give layer_pattern={pattern!r} or attn_layer_idx="
                             f"{list(self.attn_layer_idx)} (mamba_ssm's form), not both")
        bad = [i for i in self.attn_layer_idx if not 0 <= i < self.n_layer]
        if bad:
            raise ValueError(f"Mamba2Config.attn_layer_idx has {bad}, outside the "
                             f"n_layer={self.n_layer} blocks 0..{self.n_layer - 1}")
        kinds = self.layers
        if "-" in kinds and self.d_intermediate <= 0:
            raise ValueError(f"Mamba2Config: the layers {kinds!r} have MLP layers (-) but "
                             f"d_intermediate={self.d_intermediate}; set the MLP width "
                             "d_intermediate > 0")
        if self.d_intermediate < 0:
            raise ValueError(f"Mamba2Config.d_intermediate={self.d_intermediate} must be >= 0")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"Mamba2Config.mlp_activation={self.mlp_activation!r}; use one of "
                             f"{MLP_ACTIVATIONS}")
        if "*" in kinds:
            for name in ("attn_num_heads", "attn_num_heads_kv", "attn_head_dim"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise ValueError(f"Mamba2Config.{name}={value!r} must be a positive integer")
            if self.attn_num_heads % self.attn_num_heads_kv:
                raise ValueError(f"Mamba2Config: attn_num_heads_kv={self.attn_num_heads_kv} "
                                 f"does not divide attn_num_heads={self.attn_num_heads}; each "
                                 "KV head serves an equal group of query heads")
            r = self.attn_rotary_emb_dim
            if r < 0 or r % 2 or r > self.attn_head_dim:
                raise ValueError(f"Mamba2Config.attn_rotary_emb_dim={r} must be even and in "
                                 f"[0, attn_head_dim={self.attn_head_dim}] (0: no rotary)")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: x, then B, then C (mamba_ssm's xBC order)."""
        return self.d_inner + 2 * self.ngroups * self.d_state

    @property
    def layers(self) -> str:
        """One symbol per layer (M, *, -): layer_pattern, or mamba_ssm's blocks spelt out."""
        if self.layer_pattern:
            return self.layer_pattern
        mlp = "-" if self.d_intermediate > 0 else ""
        return "".join(("*" if i in self.attn_layer_idx else "M") + mlp
                       for i in range(self.n_layer))

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return -(-self.vocab_size // m) * m

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "Mamba2Config":
        """A named configuration ("mamba2-130m" ... "mamba2-2.7b", "tiny") with overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets are {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def replace(self, **changes: Any) -> "Mamba2Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Mamba2Config":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"Mamba2Config has no fields {unknown}; fields are {sorted(fields)}")
        return cls(**d)


LAYER_KINDS = {"M": "mamba", "*": "attention", "-": "mlp"}
MLP_ACTIVATIONS = ("swiglu", "relu2")


# Megatron-LM's hybrid Mamba layouts (examples/mamba/train.sh and its hybrid layer
# allocation with --hybrid-attention-ratio 0.08 --hybrid-mlp-ratio 0.5; the 8B pattern
# is the one examples/mamba/README.md publishes): Megatron's Mamba defaults (d_state 128,
# headdim 64, 8 groups, chunk 128), GQA with 8 KV heads, no position embedding, no biases,
# untied embeddings, MLP width 4*d_model (Megatron's default ffn_hidden_size) with
# squared ReLU (Nemotron-H's; the example's default GeLU is not offered). dt clamped
# below at dt_min, as HF NemotronH runs it, so the model exports as NemotronHForCausalLM.
# Vocabulary: the report's 256K SentencePiece; set vocab_size to your tokenizer's.
_MEGATRON_HYBRID = dict(vocab_size=256000, pad_vocab_size_multiple=128, ngroups=8,
                        chunk_size=128, dt_limit=(0.001, math.inf), tie_embeddings=False,
                        mlp_activation="relu2", attn_num_heads_kv=8)

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
        **_MEGATRON_HYBRID, d_model=1024, n_layer=48,
        layer_pattern="M-M-M--M-*M-M-M-M--*M-M-M-M-*M--M-M-M-*M-M--M-M-",
        d_intermediate=4096, attn_num_heads=16, attn_head_dim=64),
    "megatron-hybrid-8b": Mamba2Config(
        **_MEGATRON_HYBRID, d_model=4096, n_layer=56,
        layer_pattern="M-M-M--M-M*-M-M-M-M--M*-M-M-M-M-M*--M-M-M-M-M*-M--M-M-M-",
        d_intermediate=16384, attn_num_heads=32, attn_head_dim=128),
    # Byte-level, small enough to train on a laptop CPU in minutes.
    "tiny": Mamba2Config(d_model=128, n_layer=2, vocab_size=256, d_state=32, headdim=32,
                         chunk_size=64),
}
