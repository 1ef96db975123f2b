"""The attention layer: causal multi-head attention with grouped KV heads and rotary position
embeddings, as mamba_ssm's MHA (and NemotronH's attention, which has no rotary), and its KV
cache for generation.

Legend: b batch, l sequence (queries), s keys (the whole sequence, or the cache's length),
d d_model, h query heads, k KV heads (k divides h; query head i reads KV head i // (h/k)),
e head dim, r rotary dims.

Positions count from each document's first token (seq_idx, as the Mamba layers restart
their state there), so a packed or left-padded row attends and rotates exactly as if alone.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mamba_jax.config import Mamba2Config
from mamba_jax.layers import dense, matmul, uniform
from pallas_kernels.norm_matmul import rms_norm_matmul
from pallas_kernels.ssd import document_ids


class AttentionCache(NamedTuple):
    """One attention layer's decoding state.

    k, v [b, s, k, e]: keys (rotated) and values of the tokens so far, then unused slots;
    length int32 []: tokens written (the next one goes at index `length`);
    start int32 [b]: the index of each row's current document start (keys before it, e.g.
    left padding, are masked; positions count from it).
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array
    start: jax.Array


def document_starts(seq_idx, l):
    """seq_idx [b, l] or None -> [b, l] (or [1, l]) int32: the index of each token's document
    start in the row."""
    index = jnp.arange(l, dtype=jnp.int32)[None]
    if seq_idx is None:
        return jnp.zeros_like(index)
    doc = document_ids(seq_idx)
    first = jnp.concatenate([jnp.ones_like(doc[:, :1], bool), doc[:, 1:] != doc[:, :-1]], 1)
    return jax.lax.cummax(jnp.where(first, index, 0), axis=1)


def rotary(x, positions, dim, base, interleaved):
    """x [b, l, heads, e], positions [b, l] -> x with its first `dim` features rotated by
    position * base**(-2i/dim), as flash_attn's RotaryEmbedding: halves (x_i, x_{i+dim/2})
    as pairs, or (x_2i, x_2i+1) when `interleaved`. Float32 angles; returns x.dtype."""
    inv_freq = 1.0 / base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)  # [r/2]
    angles = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [b, l, 1, r/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xr = x[..., :dim].astype(jnp.float32)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).reshape(xr.shape)
    else:
        x1, x2 = jnp.split(xr, 2, axis=-1)
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    return jnp.concatenate([rotated.astype(x.dtype), x[..., dim:]], -1)


def attention_mask(q_index, k_index, q_start=None, k_start=None):
    """Causal, and within one document: q_index [l], k_index [s] (positions in the row),
    q_start [b, l], k_start [b, s] (their documents' start indices) or None ->
    mask [b or 1, 1, l, s] bool."""
    mask = (k_index[None, :] <= q_index[:, None])[None]
    if q_start is not None:
        mask = mask & (q_start[:, :, None] == k_start[:, None, :])
    return mask[:, None]


def attend(q, k, v, scale, mask=None):
    """q [b, l, h, e], k, v [b, s, k, e] (k divides h), mask [b, 1, l, s] bool or None
    (causal, l == s) -> [b, l, h, e].

    jax.nn.dot_product_attention: cuDNN's flash attention on a GPU where it takes the case
    (bf16/fp16, no explicit mask), XLA's attention otherwise (float32, masks, CPU)."""
    options = dict(scale=scale, is_causal=mask is None, mask=mask)
    if mask is None and jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16,
                                                                       jnp.float16):
        try:
            return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **options)
        except (NotImplementedError, ValueError, RuntimeError):
            pass  # a head dim or shape cuDNN does not support: the XLA path below
    return jax.nn.dot_product_attention(q, k, v, **options)


class Attention(nnx.Module):
    """The attention mixer. q_proj [d, h, e], k_proj, v_proj [d, k, e], o_proj [h, e, d]
    (and q_bias [h, e], k_bias, v_bias [k, e], out_bias [d] when configured) are float32;
    `dtype` is the compute dtype of the matmuls and of the KV cache."""

    def __init__(self, cfg: Mamba2Config, *, rngs: nnx.Rngs, dtype=jnp.float32):
        d, h, k, e = cfg.d_model, cfg.attn_num_heads, cfg.attn_num_heads_kv, cfg.attn_head_dim
        self.cfg = cfg
        self.dtype = dtype
        bound = 1.0 / math.sqrt(d)  # nn.Linear's default init; biases zero
        self.q_proj = nnx.Param(uniform(rngs, (d, h, e), bound))
        self.k_proj = nnx.Param(uniform(rngs, (d, k, e), bound))
        self.v_proj = nnx.Param(uniform(rngs, (d, k, e), bound))
        if cfg.attn_qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((h, e), jnp.float32))
            self.k_bias = nnx.Param(jnp.zeros((k, e), jnp.float32))
            self.v_bias = nnx.Param(jnp.zeros((k, e), jnp.float32))
        # Rescaled by 1/sqrt(residual layers), as mamba_ssm's _init_weights does out_proj.
        self.o_proj = nnx.Param(uniform(rngs, (h, e, d), 1.0 / math.sqrt(h * e))
                                / math.sqrt(len(cfg.layers)))
        if cfg.attn_out_bias:
            self.out_bias = nnx.Param(jnp.zeros((d,), jnp.float32))

    @property
    def scale(self):
        return 1.0 / math.sqrt(self.cfg.attn_head_dim)

    def project(self, u):
        """u [..., d] -> q [..., h, e], k, v [..., k, e] in the compute dtype (over a
        tensor-parallel shard, this rank's heads)."""
        def proj(w, bias_name):
            bias = getattr(self, bias_name)[...] if self.cfg.attn_qkv_bias else None
            return dense(u, w[...], self.dtype, bias, out_dtype=self.dtype)
        return proj(self.q_proj, "q_bias"), proj(self.k_proj, "k_bias"), proj(self.v_proj,
                                                                              "v_bias")

    def rotate(self, q, k, positions):
        """Rotary on q [b, l, h, e] and k [b, l, k, e] at positions [b, l] (identity when
        attn_rotary_emb_dim is 0)."""
        c = self.cfg
        if not c.attn_rotary_emb_dim:
            return q, k
        rot = lambda x: rotary(x, positions, c.attn_rotary_emb_dim, c.attn_rotary_emb_base,
                               c.attn_rotary_interleaved)
        return rot(q), rot(k)

    def out_proj_partial(self, o):
        """o [..., h, e] -> [..., d] float32, without the bias: over a shard of the heads, one
        tensor-parallel rank's share of the sum."""
        return matmul("...he,hed->...d", o, self.o_proj[...], self.dtype)

    def _output(self, o):
        out = self.out_proj_partial(o)
        if self.cfg.attn_out_bias:
            out = out + self.out_bias[...]
        return out.astype(self.dtype)

    def __call__(self, u, seq_idx=None, return_cache=False, cache_len=None):
        """u [b, l, d] -> [b, l, d] in the compute dtype (and an AttentionCache of cache_len
        slots, default l, if asked). seq_idx [b, l]: packed documents; no token attends
        across a document start and positions restart there."""
        l = u.shape[1]
        q, k, v = self.project(u)
        index = jnp.arange(l, dtype=jnp.int32)
        starts = document_starts(seq_idx, l)
        q, k = self.rotate(q, k, index - starts)
        mask = None if seq_idx is None else attention_mask(index, index, starts, starts)
        out = self._output(attend(q, k, v, self.scale, mask))
        if not return_cache:
            return out
        pad = ((0, 0), (0, (cache_len or l) - l), (0, 0), (0, 0))
        start = jnp.broadcast_to(starts[:, -1], (u.shape[0],))
        return out, AttentionCache(jnp.pad(k, pad), jnp.pad(v, pad), jnp.int32(l), start)

    def init_cache(self, batch_size: int, cache_len: int) -> AttentionCache:
        c = self.cfg
        kv = jnp.zeros((batch_size, cache_len, c.attn_num_heads_kv, c.attn_head_dim),
                       self.dtype)
        return AttentionCache(kv, kv, jnp.int32(0), jnp.zeros((batch_size,), jnp.int32))

    def step(self, u, cache: AttentionCache):
        """One token: u [b, d] -> ([b, d], the updated AttentionCache). The cache must have
        a free slot (generate sizes it to the prompt plus the new tokens)."""
        o, cache = self._attend_step(*self.project(u[:, None]), cache)
        return self._output(o), cache

    def step_weights(self):
        """(w_qkv, w_o): the weights a fused decoding step reads (fused_step), built once
        before the decode loop, in the compute dtype and transposed (the kernels read
        contiguous rows). w_qkv [(h + 2k) e, d]: q_proj's outputs, then k_proj's and
        v_proj's; w_o [d, h e] (o_proj)."""
        d = self.cfg.d_model
        w_qkv = jnp.concatenate([w[...].reshape(d, -1)
                                 for w in (self.q_proj, self.k_proj, self.v_proj)], axis=1)
        return w_qkv.T.astype(self.dtype), self.o_proj[...].reshape(-1, d).T.astype(self.dtype)

    def fused_step(self, residual, norm_weight, norm_eps, cache: AttentionCache,
                   weights=None):
        """residual [b, d] -> (residual + attention(rms_norm(residual)), the updated
        AttentionCache), the projections as two pallas_kernels.norm_matmul kernels: the
        layer's RMSNorm (norm_weight [d], norm_eps) with q, k and v's projections, then o_proj
        with its bias and the residual add, where the XLA step runs the norm, the four
        products and the add as XLA's kernels. The arithmetic of Block.step over step(), but for
        where the norm's operand is rounded (pallas_kernels.norm_matmul); for a decoding
        step of a few rows. weights: step_weights(); None builds them here."""
        c = self.cfg
        w_qkv, w_o = self.step_weights() if weights is None else weights
        b, e = residual.shape[0], c.attn_head_dim
        qkv = rms_norm_matmul(residual, norm_weight, w_qkv, eps=norm_eps, w_transposed=True,
                              implementation="triton")  # [b, (h + 2k) e], compute dtype
        q, k, v = jnp.split(qkv, [c.attn_num_heads * e, (c.attn_num_heads
                                                         + c.attn_num_heads_kv) * e], axis=1)
        q, k, v = (x.reshape(b, 1, -1, e) for x in (q, k, v))
        if c.attn_qkv_bias:  # after the rounding, as dense adds it
            q, k, v = (x + getattr(self, name)[...].astype(x.dtype)
                       for x, name in zip((q, k, v), ("q_bias", "k_bias", "v_bias")))
        o, cache = self._attend_step(q, k, v, cache)
        return rms_norm_matmul(o.reshape(b, -1), None, w_o, eps=None,
                               bias=self.out_bias[...] if c.attn_out_bias else None,
                               residual=residual, w_transposed=True,
                               implementation="triton"), cache

    def _attend_step(self, q, k, v, cache: AttentionCache):
        """One token's q [b, 1, h, e], k, v [b, 1, k, e] -> (the attention o [b, h, e], the
        AttentionCache with k and v written to its next slot)."""
        q, k = self.rotate(q, k, (cache.length - cache.start)[:, None])
        write = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype),
                                                                   cache.length, axis=1)
        keys, values = write(cache.k, k), write(cache.v, v)
        index = jnp.arange(keys.shape[1], dtype=jnp.int32)
        mask = (index >= cache.start[:, None]) & (index <= cache.length)  # [b, s]
        o = attend(q, keys, values, self.scale, mask[:, None, None, :])
        return o[:, 0], AttentionCache(keys, values, cache.length + 1, cache.start)
