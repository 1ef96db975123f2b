"""One device's share of each layer, as it runs inside the `jax.shard_map` of
mamba_jax.parallel (whose docstring gives the layout): the Mamba2 mixer, attention and MLP on
this tensor-parallel rank's heads or columns, the layer around them with the
sequence-parallel collectives, and the vocabulary-parallel embedding and cross-entropy.
Every collective is written out; the mesh axes are parallel.AXES.

Legend: b batch, l sequence, d d_model, h nheads, p headdim, g ngroups, n d_state,
v padded vocabulary, f MLP width, e attention head dim; a trailing `_loc` (or "/tp") is one
device's share.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mamba_jax.attention import attend, attention_mask, document_starts
from mamba_jax.config import Mamba2Config
from mamba_jax.layers import gated_rms_norm


def _groups_of_local_heads(B, nheads: int, ngroups: int, h_loc: int):
    """B [b, l, g, n] (every group, replicated over tp) -> the groups this rank's heads read:
    [b, l, 1, n] when they all read one group, else one group per head [b, l, h_loc, n].
    (Mamba's B and C by group, or attention's keys and values by KV head.)"""
    heads_per_group = nheads // ngroups
    first_head = lax.axis_index("tp") * h_loc
    if heads_per_group % h_loc == 0:
        return lax.dynamic_slice_in_dim(B, first_head // heads_per_group, 1, axis=2)
    return jnp.take(B, (first_head + jnp.arange(h_loc)) // heads_per_group, axis=2)


def _gated_norm_local(y, z, weight, cfg: Mamba2Config):
    """The gated per-group RMSNorm on this rank's heads y, z [b, l, h_loc, p].

    When tp splits a norm group (ngroups % tp != 0), each rank sums the squares of its part
    of every group and one psum over tp completes them: [b, l, g] floats, not activations.
    """
    tp = lax.axis_size("tp")
    if cfg.ngroups % tp == 0:
        return gated_rms_norm(y, z, weight, cfg.norm_eps, cfg.ngroups // tp)
    h_loc = y.shape[-2]
    heads = lax.axis_index("tp") * h_loc + jnp.arange(h_loc)
    member = (heads[:, None] // (cfg.nheads // cfg.ngroups)
              == jnp.arange(cfg.ngroups)).astype(jnp.float32)  # [h_loc, g]

    @jax.checkpoint  # as layers.gated_rms_norm: recompute the float32 intermediates
    def norm(y, z, weight):
        gated = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        sum_sq = lax.psum(jnp.einsum("blhp,hg->blg", gated * gated, member), "tp")
        inv_rms = lax.rsqrt(sum_sq / (cfg.d_inner // cfg.ngroups) + cfg.norm_eps) @ member.T
        return (gated * inv_rms[..., None] * weight.astype(jnp.float32)).astype(y.dtype)
    return norm(y, z, weight)


def _conv_with_halo(mixer, xBC, seq_idx):
    """The mixer's causal conv on this device's part of the sequence (xBC [b, l, e],
    seq_idx [b, l] or None, l the cp part) -> conv'd x, B, C.

    The first d_conv-1 outputs read the previous part's last d_conv-1 inputs: one ppermute
    over cp brings them (part 0 receives zeros, the conv's own padding), with their seq_idx
    so that no tap reads across a document start, and their outputs are dropped."""
    cp, k = lax.axis_size("cp"), mixer.cfg.d_conv - 1
    if cp == 1 or k == 0:
        return mixer.conv(xBC, seq_idx)
    parts = (xBC,) + (() if seq_idx is None else (seq_idx,))
    halos = lax.ppermute(tuple(a[:, -k:] for a in parts), "cp",
                         [(i, i + 1) for i in range(cp - 1)])
    xBC, *seq_idx = (jnp.concatenate(pair, axis=1) for pair in zip(halos, parts))
    return tuple(a[:, k:] for a in mixer.conv(xBC, *seq_idx))


def _mixer_local(mixer, u, cfg: Mamba2Config, seq_idx=None):
    """One rank's mixer: u [b, l, d] (every token of this device's cp part) -> its share of
    out_proj [b, l, d] f32. seq_idx [b, l] (the same tokens) or None: packed documents.

    Column-parallel projections and conv on local heads (and local or all groups), the SSD
    and gated norm on local heads with no communication over tp, row-parallel out_proj (the
    caller sums the shares). Over cp the conv takes a halo and the scan carries its state
    from the previous parts."""
    z, xBC, dt = mixer.project(u)
    x, B, C = _conv_with_halo(mixer, xBC, seq_idx)
    if cfg.ngroups % lax.axis_size("tp"):
        B, C = (_groups_of_local_heads(t, cfg.nheads, cfg.ngroups, x.shape[2]) for t in (B, C))
    y, _ = mixer.scan(x, dt, B, C, seq_idx,
                      sequence_axis="cp" if lax.axis_size("cp") > 1 else None)
    return mixer.out_proj_partial(_gated_norm_local(y, z, mixer.norm[...], cfg))


def _attention_local(attn, u, cfg: Mamba2Config, seq_idx=None):
    """One rank's attention: u [b, l, d] (every token of this device's cp part) -> its share
    of o_proj [b, l, d] f32. seq_idx [b, l] or None: packed documents.

    Column-parallel q, k, v on local query heads (and local or all KV heads), attention with
    no communication over tp, row-parallel o_proj (the caller sums the shares). Over cp each
    device rotates its keys at their global positions, then all-gathers the keys and values
    of the whole sequence: its queries attend to every earlier key (causal and within a
    document, by global index)."""
    q, k, v = attn.project(u)
    if cfg.attn_num_heads_kv % lax.axis_size("tp"):
        k, v = (_groups_of_local_heads(t, cfg.attn_num_heads, cfg.attn_num_heads_kv,
                                       q.shape[2]) for t in (k, v))
    cp, l = lax.axis_size("cp"), u.shape[1]
    index = lax.axis_index("cp") * l + jnp.arange(l, dtype=jnp.int32)  # global positions
    if cp > 1 and seq_idx is not None:
        seq_idx = lax.all_gather(seq_idx, "cp", axis=1, tiled=True)
    k_starts = document_starts(seq_idx, cp * l)  # [b, cp*l] (or [1, cp*l])
    starts = lax.dynamic_slice_in_dim(k_starts, index[0], l, axis=1)
    q, k = attn.rotate(q, k, index - starts)
    if cp > 1:
        k, v = (lax.all_gather(t, "cp", axis=1, tiled=True) for t in (k, v))
    mask = None  # one device, one document per row: attend's own causal mask
    if cp > 1 or seq_idx is not None:
        mask = attention_mask(index, jnp.arange(cp * l), starts, k_starts)
    return attn.out_proj_partial(attend(q, k, v, attn.scale, mask))


def _mlp_local(mlp, u, cfg: Mamba2Config, seq_idx=None):
    """One rank's MLP: u [b, l, d] -> its share of down_proj [b, l, d] f32 (column-parallel
    up and gate on f/tp columns, row-parallel down; the caller sums the shares)."""
    return mlp.out_proj_partial(mlp.hidden(u))


_LOCAL = {"mamba": _mixer_local, "attention": _attention_local, "mlp": _mlp_local}


def block_local(block, residual, cfg: Mamba2Config, sp: bool, seq_idx=None):
    """One layer (Mamba2, attention or MLP): residual [b, l/(cp*tp), d] under sequence
    parallel (else [b, l/cp, d]) -> the same shape."""
    dtype = block.mixer.dtype
    hidden = block.norm(residual).astype(dtype)
    if sp:
        hidden = lax.all_gather(hidden, "tp", axis=1, tiled=True)
    # The shares are summed in the compute dtype, as mamba_ssm's RowParallelLinear does.
    out = _LOCAL[block.kind](block.mixer, hidden, cfg, seq_idx).astype(dtype)
    if sp:
        out = lax.psum_scatter(out, "tp", scatter_dimension=1, tiled=True)
    else:
        out = lax.psum(out, "tp")
    bias = getattr(block.mixer, "out_bias", None)  # replicated: added once, after the sum
    if bias is not None:
        out = (out + bias[...]).astype(dtype)
    return residual + out.astype(residual.dtype)


def vocab_parallel_embed(table, ids, sp: bool):
    """table [v/tp, d] (this rank's rows), ids [b, l] -> [b, l/tp, d] under SP, else
    [b, l, d]: each rank looks up the ids in its rows, zeros elsewhere, and the sum over tp
    completes every row."""
    v_loc = table.shape[0]
    local = ids - lax.axis_index("tp") * v_loc
    mine = (local >= 0) & (local < v_loc)
    rows = jnp.where(mine[..., None], jnp.take(table, jnp.where(mine, local, 0), axis=0), 0)
    if sp:
        return lax.psum_scatter(rows, "tp", scatter_dimension=1, tiled=True)
    return lax.psum(rows, "tp")


def vocab_parallel_cross_entropy(logits, targets):
    """logits [..., v/tp] float32 (this rank's vocabulary slice), targets [...] ->
    per-token -log softmax(logits)[target] [...], from three [...]-sized reductions over tp."""
    v_loc = logits.shape[-1]
    # The max only steadies exp; its gradient cancels, so it stays out of the graph.
    top = lax.pmax(lax.stop_gradient(logits.max(-1)), "tp")
    sum_exp = lax.psum(jnp.exp(logits - top[..., None]).sum(-1), "tp")
    local = targets - lax.axis_index("tp") * v_loc
    mine = (local >= 0) & (local < v_loc)
    picked = jnp.take_along_axis(logits, jnp.where(mine, local, 0)[..., None], -1)[..., 0]
    target_logit = lax.psum(jnp.where(mine, picked, 0.0), "tp")
    return jnp.log(sum_exp) + top - target_logit
