"""Mamba2LM: embedding, pre-norm residual Mamba2 blocks, final norm, LM head.

Legend: b batch, l sequence, d d_model, v padded vocabulary.

The residual stream follows mamba_ssm's Block(fused_add_norm, prenorm): r = embedding;
r = r + mixer(norm(r)) per layer; logits = lm_head(norm_f(r)); r is float32 when
`residual_in_fp32`, else the compute dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mamba_jax.config import Mamba2Config
from mamba_jax.layers import RMSNorm
from mamba_jax.mixer import Mamba2Mixer, MambaCache


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


class Mamba2Block(nnx.Module):
    """norm -> Mamba2Mixer, added to the residual stream."""

    def __init__(self, cfg: Mamba2Config, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = Mamba2Mixer(cfg, rngs=rngs, dtype=dtype)

    def __call__(self, residual, seq_idx=None, return_cache=False):
        """residual [b, l, d] -> residual [b, l, d] (and the layer's MambaCache)."""
        hidden = self.norm(residual).astype(self.mixer.dtype)
        out = self.mixer(hidden, seq_idx=seq_idx, return_cache=return_cache)
        if return_cache:
            out, cache = out
            return residual + out.astype(residual.dtype), cache
        return residual + out.astype(residual.dtype)

    def step(self, residual, cache: MambaCache):
        """residual [b, d] -> (residual [b, d], MambaCache)."""
        out, cache = self.mixer.step(self.norm(residual).astype(self.mixer.dtype), cache)
        return residual + out.astype(residual.dtype), cache


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
        self.layers = nnx.List([Mamba2Block(cfg, rngs=rngs, dtype=dtype)
                                for _ in range(cfg.n_layer)])
        self.norm_f = RMSNorm(d, cfg.norm_eps)
        if not cfg.tie_embeddings:
            # Stored [v, d] like the embedding (torch's nn.Linear layout).
            bound = 1.0 / math.sqrt(d)
            self.lm_head = nnx.Param(jax.random.uniform(rngs.params(), (v, d), jnp.float32,
                                                        -bound, bound))

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

        head [v, d]: the LM head already in the compute dtype (decoding casts it once, not at
        every token); None uses head_weight()."""
        hidden = self.norm_f(residual).astype(self.dtype)
        head = self.head_weight() if head is None else head
        return jnp.einsum("...d,vd->...v", hidden, head.astype(self.dtype),
                          preferred_element_type=jnp.float32)

    def __call__(self, input_ids, seq_idx=None):
        """input_ids [b, l] -> logits [b, l, v] float32. seq_idx [b, l]: packed documents."""
        residual = self.embed(input_ids)
        for layer in self.layers:
            residual = layer(residual, seq_idx=seq_idx)
        return self.logits(residual)

    def init_cache(self, batch_size: int) -> tuple[MambaCache, ...]:
        """An empty decoding cache: one MambaCache per layer."""
        return tuple(layer.mixer.init_cache(batch_size) for layer in self.layers)

    def prefill(self, input_ids, seq_idx=None):
        """input_ids [b, l] -> (logits [b, l, v], cache after the last token).

        seq_idx [b, l]: the cache holds only the last document of each row (so left padding
        given its own seq_idx leaves no trace in the state)."""
        residual = self.embed(input_ids)
        cache = []
        for layer in self.layers:
            residual, layer_cache = layer(residual, seq_idx=seq_idx, return_cache=True)
            cache.append(layer_cache)
        return self.logits(residual), tuple(cache)

    def step(self, token_ids, cache, head=None):
        """One decoding step: token_ids [b] -> (logits [b, v], the updated cache).

        head: as in `logits`."""
        residual = self.embed(token_ids)
        new_cache = []
        for layer, layer_cache in zip(self.layers, cache):
            residual, layer_cache = layer.step(residual, layer_cache)
            new_cache.append(layer_cache)
        return self.logits(residual, head), tuple(new_cache)
