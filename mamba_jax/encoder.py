"""Mamba2Encoder: the layers of a Mamba2LM without its LM head, for representations rather
than next tokens: per-token outputs or their mean over each row. With bidirectional layers
(layer_pattern "BBBB": mamba_jax.layers.bidirectional) every output reads the whole
sequence, as an encoder of text, image patches or audio frames should; with causal layers
it is a Mamba2LM's backbone.

    cfg = Mamba2Config(d_model=256, n_layer=4, layer_pattern="BBBB", vocab_size=1000)
    encoder = Mamba2Encoder(cfg, rngs=nnx.Rngs(0))
    tokens = encoder(input_ids)               # [b, l, d]: per-token outputs
    pooled = encoder(input_ids, pool="mean")  # [b, d] float32
    pooled = encoder(features, pool="mean")   # features [b, l, d] float: no embedding

Legend: b batch, l sequence (this device's part under cp), d d_model. The forward is
Mamba2LM's (the same embedding, layers and final norm, and the same code inside the
trainer's or a user's shard_map with a ParallelContext).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from mamba_jax.model import Mamba2LM, check_per_token, check_tokens, init_backbone
from mamba_jax.sharding import SINGLE_DEVICE, ParallelContext

POOLS = (None, "mean")


class Mamba2Encoder(nnx.Module):
    """The embedding, the layers of cfg.layers and the final norm; no LM head. Parameters
    float32; `dtype` the compute dtype."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, dtype=jnp.float32):
        init_backbone(self, cfg, rngs, dtype)

    # The LM's backbone code, which reads only the attributes above.
    residual_dtype = Mamba2LM.residual_dtype
    embed = Mamba2LM.embed
    _layers = Mamba2LM._layers
    _check_initial_states = Mamba2LM._check_initial_states
    _final = Mamba2LM._final

    def __call__(self, inputs, seq_idx=None, *, mask=None, pool=None,
                 ctx: ParallelContext = SINGLE_DEVICE, remat="none", scan_layers=True):
        """inputs [b, l] token ids, or [b, l, d] float features (image patches, audio
        frames: the embedding is skipped) -> per-token outputs [b, l, d] in the compute
        dtype (`hidden`), or with pool="mean" their mean [b, d] float32 over each row's
        tokens (those where mask [b, l] is true, when given; under cp over the whole row).
        seq_idx [b, l]: packed documents, each encoded as if alone. remat, scan_layers: as
        Mamba2LM.hidden's."""
        if pool not in POOLS:
            raise ValueError(f"Mamba2Encoder: pool={pool!r}; use one of {POOLS}")
        if mask is not None and pool is None:  # per-token outputs: every position, unmasked
            raise ValueError("Mamba2Encoder: mask selects the tokens pool='mean' averages; "
                             "give pool='mean', or leave mask out for per-token outputs")
        check_per_token("Mamba2Encoder", jnp.shape(inputs)[:2], mask=mask)
        hidden = self.hidden(inputs, seq_idx, ctx=ctx, remat=remat, scan_layers=scan_layers)
        if pool is None:
            return hidden
        weight = (jnp.ones(hidden.shape[:2], jnp.float32) if mask is None
                  else mask.astype(jnp.float32))
        total = ctx.psum_cp(jnp.einsum("bld,bl->bd", hidden.astype(jnp.float32), weight))
        return total / jnp.maximum(ctx.psum_cp(weight.sum(1)), 1.0)[:, None]

    def hidden(self, inputs, seq_idx=None, *, ctx: ParallelContext = SINGLE_DEVICE,
               remat="none", scan_layers=True):
        """inputs as __call__'s -> the final norm's output [b, l, d] in the compute dtype
        (every position of this device's part, as Mamba2LM.hidden)."""
        if not hasattr(inputs, "dtype"):  # a list: its dtype is no attribute
            raise ValueError(f"Mamba2Encoder: inputs is a {type(inputs).__name__}; give an "
                             "array of [batch, seqlen] token ids or [batch, seqlen, d_model] "
                             "features")
        if jnp.issubdtype(inputs.dtype, jnp.integer):
            check_tokens("Mamba2Encoder", inputs, self.config.padded_vocab_size,
                         seq_idx=seq_idx)
            residual = self.embed(inputs, ctx)
        else:
            if inputs.ndim != 3 or inputs.shape[-1] != self.config.d_model:
                raise ValueError(f"Mamba2Encoder: features of shape {inputs.shape}; give "
                                 f"[batch, seqlen, d_model={self.config.d_model}] floats or "
                                 "[batch, seqlen] token ids")
            check_per_token("Mamba2Encoder", inputs.shape[:2], seq_idx=seq_idx)
            residual = ctx.sequence_shard(inputs.astype(self.residual_dtype))
        stream, _ = self._layers(residual, seq_idx, ctx, remat, scan=scan_layers)
        return self._final(stream, ctx)
