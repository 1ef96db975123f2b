"""Mamba2LM: embedding, pre-norm residual layers, final norm, LM head.

Legend: b batch, l sequence, d d_model, v padded vocabulary.

The residual stream follows mamba_ssm's Block(fused_add_norm, prenorm): r = embedding;
r = r + mixer(norm(r)) per layer; logits = lm_head(norm_f(r)); r is float32 when
`residual_in_fp32`, else the compute dtype. A layer's mixer is a Mamba2Mixer, an Attention
or an MLP, by its symbol in `cfg.layers` (M, *, -); every layer keeps the names
`layers.{i}.norm` and `layers.{i}.mixer`, as Megatron and NemotronH name them. mamba_ssm's
Block of mixer + MLP (r += mixer(norm(r)); r += mlp(norm2(r))) is two such layers.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mamba_jax.attention import Attention
from mamba_jax.config import LAYER_KINDS, Mamba2Config
from mamba_jax.layers import MLP, RMSNorm, matmul, uniform
from mamba_jax.mixer import Mamba2Mixer, uses_fused_step


def param_name(path) -> str:
    """A parameter's dotted name ("layers.0.mixer.A_log") from a jax tree path into the
    model's state or its pure dict (attribute steps such as a Variable's `.value` skipped)."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
    return ".".join(parts)


def make_mixer(kind: str, cfg: Mamba2Config, *, rngs: nnx.Rngs, dtype):
    """The mixer of one layer: kind "mamba", "attention" or "mlp" (LAYER_KINDS' values)."""
    if kind == "mamba":
        return Mamba2Mixer(cfg, rngs=rngs, dtype=dtype)
    if kind == "attention":
        return Attention(cfg, rngs=rngs, dtype=dtype)
    return MLP(cfg.d_model, cfg.d_intermediate, cfg.mlp_activation, rngs=rngs,
               n_residuals=len(cfg.layers), dtype=dtype)


class Block(nnx.Module):
    """norm -> mixer (Mamba2, attention or MLP), added to the residual stream.

    The decoding cache of a layer is a MambaCache, an AttentionCache, or None (MLP)."""

    def __init__(self, cfg: Mamba2Config, kind: str = "mamba", *, rngs: nnx.Rngs,
                 dtype=jnp.float32):
        self.kind = kind
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = make_mixer(kind, cfg, rngs=rngs, dtype=dtype)

    def __call__(self, residual, seq_idx=None, return_cache=False, cache_len=None):
        """residual [b, l, d] -> residual [b, l, d] (and the layer's cache; an attention
        layer's has cache_len slots)."""
        hidden = self.norm(residual).astype(self.mixer.dtype)
        cache = None
        if self.kind == "mlp":
            out = self.mixer(hidden)
        elif self.kind == "attention":
            out = self.mixer(hidden, seq_idx=seq_idx, return_cache=return_cache,
                             cache_len=cache_len)
        else:
            out = self.mixer(hidden, seq_idx=seq_idx, return_cache=return_cache)
        if return_cache and self.kind != "mlp":
            out, cache = out
        residual = residual + out.astype(residual.dtype)
        return (residual, cache) if return_cache else residual

    def step(self, residual, cache, weights=None, implementation="xla"):
        """residual [b, d] -> (residual [b, d], the layer's updated cache). weights: a Mamba
        layer's StepWeights, or with fused steps an attention or MLP layer's step_weights(),
        built before the decode loop (DecodeWeights); implementation: a Mamba layer's conv
        and SSM update's (Mamba2Mixer.step); "triton" runs a block of up to
        mixer.FUSED_STEP_MAX_BATCH rows as its mixer's fused_step (Mamba2Mixer, Attention or
        MLP), the norm inside its first kernel."""
        if uses_fused_step(implementation, residual.shape[0]):
            norm = self.norm.weight[...], self.norm.eps
            if self.kind == "mlp":  # no cache
                return self.mixer.fused_step(residual, *norm, weights), cache
            return self.mixer.fused_step(residual, *norm, cache, weights)
        hidden = self.norm(residual).astype(self.mixer.dtype)
        if self.kind == "mlp":
            out = self.mixer(hidden)
        elif self.kind == "attention":
            out, cache = self.mixer.step(hidden, cache)
        else:
            out, cache = self.mixer.step(hidden, cache, weights, implementation)
        return residual + out.astype(residual.dtype), cache


class DecodeWeights(NamedTuple):
    """What every decoding step reads that is derived from the parameters, built once before
    the decode loop: XLA does not hoist it out of a while_loop, and would rebuild it at every
    token (the fused input projection is a copy of the layer's largest weights).

    head [v, d]: the LM head in the compute dtype; layers: per layer, a Mamba layer's
    `Mamba2Mixer.step_weights()`, for fused steps an attention or MLP layer's
    `step_weights()`, else None."""

    head: jax.Array
    layers: tuple


class Mamba2LM(nnx.Module):
    """A Mamba2 language model (mamba_ssm's MambaLMHeadModel / HF Mamba2ForCausalLM).

    Parameters are float32. `dtype` is the compute dtype (jnp.bfloat16 on GPUs); A_log, dt,
    D and the SSM state stay float32, and logits are returned in float32.
    """

    def __init__(self, cfg: Mamba2Config, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = cfg
        self.dtype = dtype
        v, d = cfg.padded_vocab_size, cfg.d_model
        self.embedding = nnx.Param(0.02 * jax.random.normal(rngs.params(), (v, d), jnp.float32))
        self.layers = nnx.List([Block(cfg, LAYER_KINDS[symbol], rngs=rngs, dtype=dtype)
                                for symbol in cfg.layers])
        self.norm_f = RMSNorm(d, cfg.norm_eps)
        if not cfg.tie_embeddings:
            # Stored [v, d] like the embedding (torch's nn.Linear layout).
            self.lm_head = nnx.Param(uniform(rngs, (v, d), 1.0 / math.sqrt(d)))

    @property
    def residual_dtype(self):
        return jnp.float32 if self.config.residual_in_fp32 else self.dtype

    def head_weight(self):
        """The LM head as [v, d] (the embedding when tied)."""
        return (self.embedding if self.config.tie_embeddings else self.lm_head)[...]

    def embed(self, input_ids):
        """input_ids [b, l] int -> residual stream [b, l, d]."""
        return jnp.take(self.embedding[...], input_ids, axis=0).astype(self.residual_dtype)

    def logits(self, residual, head=None):
        """residual [..., d] -> float32 logits [..., v] through norm_f and the LM head.

        head [v, d]: the LM head already in the compute dtype (DecodeWeights); None uses
        head_weight()."""
        hidden = self.norm_f(residual).astype(self.dtype)
        head = self.head_weight() if head is None else head
        return matmul("...d,vd->...v", hidden, head, self.dtype)

    def __call__(self, input_ids, seq_idx=None):
        """input_ids [b, l] -> logits [b, l, v] float32. seq_idx [b, l]: packed documents."""
        residual = self.embed(input_ids)
        for layer in self.layers:
            residual = layer(residual, seq_idx=seq_idx)
        return self.logits(residual)

    @property
    def has_attention(self) -> bool:
        return "*" in self.config.layers

    def init_cache(self, batch_size: int, cache_len: int = 0) -> tuple:
        """An empty decoding cache: per layer a MambaCache, an AttentionCache of cache_len
        slots, or None (MLP)."""
        def empty(layer):
            if layer.kind == "mamba":
                return layer.mixer.init_cache(batch_size)
            if layer.kind == "attention":
                return layer.mixer.init_cache(batch_size, cache_len)
            return None
        return tuple(empty(layer) for layer in self.layers)

    def prefill(self, input_ids, seq_idx=None, cache_len=None):
        """input_ids [b, l] -> (logits [b, l, v], cache after the last token).

        seq_idx [b, l]: the cache holds only the last document of each row (so left padding
        given its own seq_idx leaves no trace in the state). cache_len: the attention
        layers' KV slots (the prompt and every token to come; default l)."""
        residual = self.embed(input_ids)
        cache = []
        for layer in self.layers:
            residual, layer_cache = layer(residual, seq_idx=seq_idx, return_cache=True,
                                          cache_len=cache_len)
            cache.append(layer_cache)
        return self.logits(residual), tuple(cache)

    def decode_weights(self, fused: bool = False) -> DecodeWeights:
        """The DecodeWeights of the current parameters (build them outside the decode loop);
        fused: for steps whose blocks run as their mixers' fused_step
        (mixer.uses_fused_step)."""
        def layer_weights(layer):
            if layer.kind == "mamba":
                return layer.mixer.step_weights(fused)
            return layer.mixer.step_weights() if fused else None

        return DecodeWeights(head=self.head_weight().astype(self.dtype),
                             layers=tuple(layer_weights(layer) for layer in self.layers))

    def step(self, token_ids, cache, weights: DecodeWeights | None = None,
             implementation="xla"):
        """One decoding step: token_ids [b] -> (logits [b, v], the updated cache).

        weights: `decode_weights()`, built once before a decode loop; None builds them here.
        implementation: of the Mamba layers' conv and SSM update, pallas_kernels.ssd.step's
        ("xla" or "triton")."""
        if weights is None:
            weights = self.decode_weights(uses_fused_step(implementation, token_ids.shape[0]))
        residual = self.embed(token_ids)
        new_cache = []
        for layer, layer_cache, layer_weights in zip(self.layers, cache, weights.layers):
            residual, layer_cache = layer.step(residual, layer_cache, layer_weights,
                                                  implementation)
            new_cache.append(layer_cache)
        return self.logits(residual, weights.head), tuple(new_cache)
