"""The attention layer (layer_pattern symbol *): causal multi-head attention with grouped KV
heads and rotary position embeddings, as mamba_ssm's MHA (and NemotronH's attention, which
has no rotary); its config section (cfg.attention), KV cache and one-token steps, checkpoint
keys and FLOPs.

Legend: b batch, l sequence (queries), s keys (the whole sequence, or the cache's length),
d d_model, h query heads, k KV heads (k divides h; query head i reads KV head i // (h/k)),
e head dim, r rotary dims.

Positions count from each document's first token (seq_idx, as the Mamba layers restart
their state there), so a packed or left-padded row attends and rotates exactly as if alone.

Tensor parallel: q, k, v column-parallel on this rank's query heads (and KV heads, or every
KV head where tp does not divide them: each rank reads its queries' ones), o_proj
row-parallel. Context parallel: each device rotates its keys at their global positions, then
all-gathers the keys and values of the whole sequence, and its queries attend to every
earlier key (causal and within a document, by global index): [b, l, k, e] per layer, which
grows with the sequence.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mamba_jax.layers.checkpoint_keys import Flat, GroupedQKV, Linear
from mamba_jax.layers.common import Mixer, dense, groups_of_local_heads, matmul, param, uniform
from mamba_jax.sharding import SINGLE_DEVICE, ParallelContext
from pallas_kernels.decode.norm_matmul import rms_norm_matmul
from pallas_kernels.ssd import document_ids


@dataclasses.dataclass(frozen=True)
class AttentionSection:
    """cfg.attention: mamba_ssm's MHA arguments (its attn_cfg)."""

    num_heads: int = 8
    num_heads_kv: int = 8  # grouped KV heads; must divide num_heads
    head_dim: int = 64
    rotary_emb_dim: int = 0  # rotary on the first dims of each head; 0: none
    rotary_emb_base: float = 10000.0
    rotary_interleaved: bool = False  # pairs (2i, 2i+1) instead of halves (GPT-NeoX)
    qkv_bias: bool = False
    out_bias: bool = False


class AttentionCache(NamedTuple):
    """One attention layer's decoding state.

    k, v [b, s, k, e]: keys (rotated) and values of the tokens so far, then unused slots;
    length int32 [] or [b]: tokens written (the next one goes at index `length`), one count
    for every row (generate's), or one a row (the server's slots, each its own sequence);
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



class AttentionWeights(NamedTuple):
    """An attention layer's weights as a decoding step reads them, in the compute dtype,
    built once before the decode loop. For the XLA step: q [d, h, e], k, v [d, k, e], o [h,
    e, d] (the parameters' layout). For the fused step: qkv [(h + 2k) e, d], q's outputs then
    k's and v's, and o [d, h e], both transposed (the kernels read contiguous rows); k and v
    None."""

    q: jax.Array
    k: jax.Array | None
    v: jax.Array | None
    o: jax.Array


_MAMBA_SSM_KEYS = {"in_proj.weight": Linear("q_proj", "k_proj", "v_proj"),
                   "in_proj.bias": Flat("q_bias", "k_bias", "v_bias"),
                   "out_proj.weight": Linear("o_proj", inputs=2),
                   "out_proj.bias": Flat("out_bias")}
_NEMOTRON_H_KEYS = {"q_proj.weight": Linear("q_proj"), "k_proj.weight": Linear("k_proj"),
                    "v_proj.weight": Linear("v_proj"),
                    "o_proj.weight": Linear("o_proj", inputs=2)}
# Megatron-LM's SelfAttention: linear_qkv per KV group [q.. | k | v] (add_qkv_bias or
# add_bias_linear gives it a bias), linear_proj (its bias: add_bias_linear).
_MEGATRON_KEYS = {"self_attention.linear_qkv.weight": GroupedQKV("q_proj", "k_proj", "v_proj"),
                  "self_attention.linear_qkv.bias": GroupedQKV("q_bias", "k_bias", "v_bias",
                                                               inputs=0),
                  "self_attention.linear_proj.weight": Linear("o_proj", inputs=2),
                  "self_attention.linear_proj.bias": Flat("out_bias")}


class Attention(Mixer):
    """The attention mixer. q_proj [d, h, e], k_proj, v_proj [d, k, e], o_proj [h, e, d]
    (and q_bias [h, e], k_bias, v_bias [k, e], out_bias [d] when configured) are float32;
    `dtype` is the compute dtype of the matmuls and of the KV cache."""

    symbol = "*"
    name = "attention"
    Config = AttentionSection
    # mamba_ssm's MHA fuses in_proj [q | k | v]; NemotronH has one projection each and no
    # biases; Megatron-LM's linear_qkv interleaves them by KV group.
    checkpoint_keys = {"mamba_ssm": _MAMBA_SSM_KEYS, "nemotron_h": _NEMOTRON_H_KEYS,
                       "megatron": _MEGATRON_KEYS}
    step_kernels = ("fused",)
    cache_grows = True
    takes_initial_state = True

    def __init__(self, cfg, *, rngs: nnx.Rngs, dtype=jnp.float32):
        a = cfg.attention
        d, h, k, e = cfg.d_model, a.num_heads, a.num_heads_kv, a.head_dim
        self.cfg = cfg
        self.dtype = dtype
        bound = 1.0 / math.sqrt(d)  # nn.Linear's default init; biases zero
        self.q_proj = param(uniform(rngs, (d, h, e), bound), "embed", "heads", "head_dim")
        self.k_proj = param(uniform(rngs, (d, k, e), bound), "embed", "kv_heads", "head_dim")
        self.v_proj = param(uniform(rngs, (d, k, e), bound), "embed", "kv_heads", "head_dim")
        if a.qkv_bias:  # biases train without weight decay
            zeros = lambda *shape: jnp.zeros(shape, jnp.float32)
            self.q_bias = param(zeros(h, e), "heads", "head_dim", decay=False)
            self.k_bias = param(zeros(k, e), "kv_heads", "head_dim", decay=False)
            self.v_bias = param(zeros(k, e), "kv_heads", "head_dim", decay=False)
        # Rescaled by 1/sqrt(residual layers), as mamba_ssm's _init_weights does out_proj.
        self.o_proj = param(uniform(rngs, (h, e, d), 1.0 / math.sqrt(h * e))
                            / math.sqrt(len(cfg.layers)), "heads", "head_dim", "embed")
        if a.out_bias:
            self.out_bias = param(jnp.zeros((d,), jnp.float32), "embed", decay=False)

    @property
    def scale(self):
        return 1.0 / math.sqrt(self.cfg.attention.head_dim)

    def __call__(self, u, seq_idx=None, *, ctx: ParallelContext = SINGLE_DEVICE,
                 cache_len=None, initial_state: AttentionCache | None = None):
        """Mixer.__call__: u [b, l, d] -> (this rank's share of o_proj [b, l, d] float32, an
        AttentionCache of cache_len slots or None). seq_idx [b, l]: packed documents; no
        token attends across a document start and positions restart there. initial_state:
        the AttentionCache the tokens continue (`continue_cache`)."""
        a = self.cfg.attention
        q, k, v = self.project(u, ctx=ctx)
        if a.num_heads_kv % ctx.tp:  # every KV head on every rank: take our queries' ones
            k, v = (groups_of_local_heads(t, a.num_heads, a.num_heads_kv, ctx) for t in (k, v))
        if initial_state is not None:
            return self.continue_cache(q, k, v, seq_idx, initial_state, cache_len, ctx)
        cp, l = ctx.cp, u.shape[1]
        index = ctx.cp_index() * l + jnp.arange(l, dtype=jnp.int32)  # positions in the row
        k_starts = document_starts(None if seq_idx is None else ctx.all_gather_cp(seq_idx),
                                   cp * l)  # [b, cp*l] (or [1, cp*l])
        starts = jax.lax.dynamic_slice_in_dim(k_starts, index[0], l, axis=1)
        q, k = self.rotate(q, k, index - starts)
        keys, values = ctx.all_gather_cp(k), ctx.all_gather_cp(v)
        mask = None  # one device, one document per row: attend's own causal mask
        if cp > 1 or seq_idx is not None:
            mask = attention_mask(index, jnp.arange(cp * l), starts, k_starts)
        out = self.out_proj_partial(attend(q, keys, values, self.scale, mask), ctx=ctx)
        if cache_len is None:
            return out, None
        pad = ((0, 0), (0, cache_len - l), (0, 0), (0, 0))
        start = jnp.broadcast_to(starts[:, -1], (u.shape[0],))
        return out, AttentionCache(jnp.pad(k, pad), jnp.pad(v, pad), jnp.int32(l), start)

    def continue_cache(self, q, k, v, seq_idx, cache: AttentionCache, cache_len,
                       ctx: ParallelContext):
        """The forward of tokens that continue `cache` (a prefill in pieces, each from the
        last one's cache): q [b, l, h, e], k, v [b, l, k, e] projected -> (o_proj's share [b,
        l, d] float32, the AttentionCache with the tokens' keys written after each row's
        `length`, of max(its slots, cache_len) slots). The tokens' first document continues
        the cache's (its positions and keys); a later one (seq_idx) starts afresh. The cache
        must have a free slot for every token: a write past its end is dropped."""
        if ctx.cp > 1:
            raise ValueError("attention: a cache to continue from (initial_state) is for one "
                             "device's prefill, not a context-parallel forward")
        b, l = q.shape[:2]
        pad = max(cache_len or 0, cache.k.shape[1]) - cache.k.shape[1]
        keys, values = (jnp.pad(t, ((0, 0), (0, pad), (0, 0), (0, 0))) for t in (cache.k,
                                                                                  cache.v))
        length = jnp.broadcast_to(cache.length, (b,))
        index = length[:, None] + jnp.arange(l, dtype=jnp.int32)[None]  # [b, l] in the cache
        starts = jnp.broadcast_to(cache.start[:, None], (b, l))
        if seq_idx is not None:
            doc = document_ids(seq_idx)
            starts = jnp.where(doc == doc[:, :1], starts,
                               length[:, None] + document_starts(seq_idx, l))
        q, k = self.rotate(q, k, index - starts)
        rows = jnp.arange(b)[:, None]
        keys = keys.at[rows, index].set(k.astype(keys.dtype), mode="drop")
        values = values.at[rows, index].set(v.astype(values.dtype), mode="drop")
        slots = jnp.arange(keys.shape[1], dtype=jnp.int32)[None, None]
        mask = (slots <= index[..., None]) & (slots >= starts[..., None])  # [b, l, s]
        out = self.out_proj_partial(attend(q, keys, values, self.scale, mask[:, None]))
        return out, AttentionCache(keys, values, length + l, starts[:, -1])

    def output_bias(self):
        return self.out_bias[...] if self.cfg.attention.out_bias else None

    def project(self, u, weights: AttentionWeights | None = None,
                ctx: ParallelContext = SINGLE_DEVICE):
        """u [..., d] -> q [..., h, e], k, v [..., k, e] in the compute dtype (over a
        tensor-parallel shard, this rank's heads). weights: AttentionWeights for the XLA
        step; None reads the parameters."""
        w = weights or AttentionWeights(self.q_proj[...], self.k_proj[...], self.v_proj[...],
                                        None)
        bias = lambda name: getattr(self, name)[...] if self.cfg.attention.qkv_bias else None
        return tuple(dense(u, w_r, self.dtype, bias(name), out_dtype=self.dtype, ctx=ctx)
                     for w_r, name in ((w.q, "q_bias"), (w.k, "k_bias"), (w.v, "v_bias")))

    def rotate(self, q, k, positions):
        """Rotary on q [b, l, h, e] and k [b, l, k, e] at positions [b, l] (identity when
        attention.rotary_emb_dim is 0)."""
        a = self.cfg.attention
        if not a.rotary_emb_dim:
            return q, k
        rot = lambda x: rotary(x, positions, a.rotary_emb_dim, a.rotary_emb_base,
                               a.rotary_interleaved)
        return rot(q), rot(k)

    def out_proj_partial(self, o, o_proj=None, ctx: ParallelContext = SINGLE_DEVICE):
        """o [..., h, e] -> [..., d] float32, without the bias: over a shard of the heads, one
        tensor-parallel rank's share of the sum. o_proj [h, e, d]: None reads the parameter."""
        w = self.o_proj[...] if o_proj is None else o_proj
        return matmul("...he,hed->...d", o, w, self.dtype, ctx=ctx)

    # ------------------------------------------------------------ decoding

    def init_cache(self, batch_size: int, cache_len: int) -> AttentionCache:
        a = self.cfg.attention
        kv = jnp.zeros((batch_size, cache_len, a.num_heads_kv, a.head_dim), self.dtype)
        return AttentionCache(kv, kv, jnp.int32(0), jnp.zeros((batch_size,), jnp.int32))

    def step_weights(self, how: str = "xla") -> AttentionWeights:
        """AttentionWeights for the XLA step, or with how "fused" for fused_step."""
        cast = lambda w: w[...].astype(self.dtype)
        if how != "fused":
            return AttentionWeights(*(cast(w) for w in (self.q_proj, self.k_proj, self.v_proj,
                                                        self.o_proj)))
        d = self.cfg.d_model
        w_qkv = jnp.concatenate([w[...].reshape(d, -1)
                                 for w in (self.q_proj, self.k_proj, self.v_proj)], axis=1)
        return AttentionWeights(w_qkv.T.astype(self.dtype), None, None,
                                self.o_proj[...].reshape(-1, d).T.astype(self.dtype))

    def step(self, u, cache: AttentionCache, weights: AttentionWeights, how="xla"):
        """One token: u [b, d] -> (o_proj's output [b, d] float32 before its bias, the
        updated AttentionCache). The cache must have a free slot (generate sizes it to the
        prompt plus the new tokens); a row whose length is past its slots writes nothing."""
        o, cache = self._attend_step(*self.project(u[:, None], weights), cache)
        return self.out_proj_partial(o, weights.o), cache

    def fused_step(self, residual, norm_weight, norm_eps, cache: AttentionCache,
                   weights: AttentionWeights):
        """residual [b, d] -> (residual + attention(rms_norm(residual)), the updated
        AttentionCache), the projections as two pallas_kernels.decode.norm_matmul kernels:
        the layer's RMSNorm (norm_weight [d], norm_eps) with q, k and v's projections, then
        o_proj with its bias and the residual add, where the XLA step runs the norm, the
        four products and the add as XLA's kernels. The arithmetic of Block.step over step(),
        but for where the norm's operand is rounded (pallas_kernels.decode.norm_matmul); for
        a decoding step of a few rows. weights: step_weights("fused")."""
        a = self.cfg.attention
        b, e = residual.shape[0], a.head_dim
        qkv = rms_norm_matmul(residual, norm_weight, weights.q, eps=norm_eps,
                              w_transposed=True, implementation="triton")  # [b, (h + 2k) e]
        q, k, v = jnp.split(qkv, [a.num_heads * e, (a.num_heads + a.num_heads_kv) * e], axis=1)
        q, k, v = (x.reshape(b, 1, -1, e) for x in (q, k, v))
        if a.qkv_bias:  # after the rounding, as dense adds it
            q, k, v = (x + getattr(self, name)[...].astype(x.dtype)
                       for x, name in zip((q, k, v), ("q_bias", "k_bias", "v_bias")))
        o, cache = self._attend_step(q, k, v, cache)
        return rms_norm_matmul(o.reshape(b, -1), None, weights.o, eps=None,
                               bias=self.output_bias(), residual=residual, w_transposed=True,
                               implementation="triton"), cache

    def _attend_step(self, q, k, v, cache: AttentionCache):
        """One token's q [b, 1, h, e], k, v [b, 1, k, e] -> (the attention o [b, h, e], the
        AttentionCache with k and v written to its next slot)."""
        q, k = self.rotate(q, k, (cache.length - cache.start)[:, None])
        if jnp.ndim(cache.length) == 0:  # every row's next key at one index
            write = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(
                buf, x.astype(buf.dtype), cache.length, axis=1)
        else:  # each row's at its own
            rows = jnp.arange(k.shape[0])
            write = lambda buf, x: buf.at[rows, cache.length].set(x[:, 0].astype(buf.dtype),
                                                                  mode="drop")
        keys, values = write(cache.k, k), write(cache.v, v)
        index = jnp.arange(keys.shape[1], dtype=jnp.int32)
        mask = (index >= cache.start[:, None]) & (index <= cache.length[..., None])  # [b, s]
        o = attend(q, keys, values, self.scale, mask[:, None, None, :])
        return o[:, 0], AttentionCache(keys, values, cache.length + 1, cache.start)

    # ------------------------------------------------------------ the kind

    @classmethod
    def check_section(cls, cfg):
        a = cfg.attention
        for name in ("num_heads", "num_heads_kv", "head_dim"):
            value = getattr(a, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Mamba2Config.attention.{name}={value!r} must be a positive "
                                 "integer")
        if a.num_heads % a.num_heads_kv:
            raise ValueError(f"Mamba2Config: attention.num_heads_kv={a.num_heads_kv} does "
                             f"not divide attention.num_heads={a.num_heads}; each KV head "
                             "serves an equal group of query heads")
        r = a.rotary_emb_dim
        if r < 0 or r % 2 or r > a.head_dim:
            raise ValueError(f"Mamba2Config.attention.rotary_emb_dim={r} must be even and in "
                             f"[0, head_dim={a.head_dim}] (0: no rotary)")
        base = a.rotary_emb_base
        if r and not (isinstance(base, (int, float)) and math.isfinite(base) and base > 1):
            # the frequencies base^(-2i/r): 0 or below gives NaN, 1 no rotation at all
            raise ValueError(f"Mamba2Config.attention.rotary_emb_base={base!r} must be a "
                             "number above 1 (10000 in most models)")

    @classmethod
    def flops_per_token(cls, cfg, seq_len: int) -> float:
        """q, k, v and out projections; Q K^T and P V under the causal mask (seq_len / 2
        keys on average, two matmuls)."""
        a, d = cfg.attention, cfg.d_model
        h, k, e = a.num_heads, a.num_heads_kv, a.head_dim
        return 2 * d * (h + 2 * k) * e + 2 * h * e * d + 2 * h * e * seq_len
