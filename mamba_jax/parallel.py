"""The whole model over one named mesh, as explicit `jax.shard_map` code.

    mesh = make_mesh("dp=2,tp=4")                 # axes dp, fsdp, cp, tp; omitted axes are 1
    specs = param_specs(params, cfg, mesh)        # PartitionSpecs shaped like params
    params = jax.device_put(params, shardings(mesh, specs))
    loss = make_loss_fn(graphdef, specs, mesh)    # loss(params, inputs, targets) -> scalar

Legend: b batch, l sequence, d d_model, h nheads, p headdim, g ngroups, n d_state,
v padded vocabulary, f MLP width, e attention head dim; a trailing `_loc` (or "/tp") is one
device's share.

Layout (DESIGN.md, "Parallel layout"):
- `dp`, `fsdp`: the batch rows. `fsdp` also shards every parameter (and so the optimizer
  state) on its largest axis that tp leaves free; a layer's parameters are all-gathered
  where the layer runs and re-gathered in the backward pass (ZeRO-3).
- `tp`: heads (z, x, dt projections, x conv, dt_bias, A_log, D, the gated norm, out_proj's
  input axis), groups (B, C) where ngroups % tp == 0 (else B and C are replicated and each
  rank reads the groups of its heads), and the vocabulary (embedding, LM head). Attention
  layers: query heads (q_proj, o_proj's input axis), KV heads where attn_num_heads_kv % tp
  == 0 (else replicated, and each rank reads its query heads' KV heads). MLP layers:
  up/gate column-parallel, down row-parallel (f split).
- `cp` (context parallel): the sequence, for the whole model. Device k of cp holds tokens
  [k*l/cp, (k+1)*l/cp) of every row; the only traffic is each mixer's conv halo (the
  previous part's last d_conv-1 inputs) and the scan's state exchange
  (pallas_kernels/ssd/context_parallel.py): neither grows with the sequence. Attention
  layers all-gather their keys and values over cp (each device's queries attend to every
  earlier key): [b, l, k_loc, e] per layer, which does grow with the sequence.
- sequence parallel: between layers the residual stream is [b, l/(cp*tp), d]; each mixer
  (Mamba2, attention or MLP) all-gathers the normed input on l over tp (to its cp part) and
  reduce-scatters its output.
Every device runs the same per-device code below; the collectives are written out.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from mamba_jax.attention import attend, attention_mask, document_starts
from mamba_jax.config import Mamba2Config
from mamba_jax.layers import gated_rms_norm
from mamba_jax.model import param_name

AXES = ("dp", "fsdp", "cp", "tp")
REMAT = ("none", "block", "full")
BATCH_AXES = ("dp", "fsdp")  # the batch rows are split over both
TOKENS = P(BATCH_AXES, "cp")  # a [b, l] array of tokens: rows over dp, fsdp; sequence over cp

# Parameter name (its last key) -> the axis tp splits: heads for the Mamba mixer and the
# attention queries, the hidden width of the MLP, rows of the vocabulary for the embedding
# and LM head. Layer norms ("weight") and output biases stay replicated.
_HEAD_AXIS = {"z_proj": 1, "x_proj": 1, "dt_proj": 1, "x_conv": 1, "z_bias": 0, "x_bias": 0,
              "dt_proj_bias": 0, "x_conv_bias": 0, "dt_bias": 0, "A_log": 0, "D": 0,
              "norm": 0, "out_proj": 0, "q_proj": 1, "q_bias": 0, "o_proj": 0,
              "up_proj": 1, "gate_proj": 1, "down_proj": 0, "embedding": 0, "lm_head": 0}
# B and C by group: split over tp only when ngroups % tp == 0.
_GROUP_AXIS = {"B_proj": 1, "C_proj": 1, "B_conv": 1, "C_conv": 1, "B_bias": 0, "C_bias": 0,
               "B_conv_bias": 0, "C_conv_bias": 0}
# Attention keys and values by KV head: split only when attn_num_heads_kv % tp == 0.
_KV_AXIS = {"k_proj": 1, "v_proj": 1, "k_bias": 0, "v_bias": 0}
_GATHERED = "fsdp_gathered"  # checkpoint name of gathered weights: recomputed, never saved


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """"dp=2,tp=4" -> {"dp": 2, "fsdp": 1, "tp": 4}."""
    sizes = dict.fromkeys(AXES, 1)
    for part in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in AXES or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"mesh spec {spec!r}: {part!r} should be AXIS=SIZE with AXIS one "
                             f"of {AXES} and SIZE a positive integer, e.g. 'dp=2,tp=4'")
        sizes[name] = int(value)
    return sizes


def make_mesh(spec: str | None = None, devices=None) -> jax.sharding.Mesh:
    """A mesh with axes (dp, fsdp, cp, tp) from a spec string; None puts every device on dp.

    tp is the innermost axis, so a tp group is neighbouring devices (one host, NVLink).
    The axes are Explicit, jax.make_mesh's default: arrays carry their sharding.
    """
    devices = jax.devices() if devices is None else list(devices)
    sizes = parse_mesh_spec(spec or f"dp={len(devices)}")
    product = math.prod(sizes.values())
    if product != len(devices):
        kinds = sorted({f"{d.platform}:{d.device_kind}" for d in devices})
        raise ValueError(f"--mesh {spec!r}: {'*'.join(AXES)} = "
                         f"{'*'.join(str(sizes[a]) for a in AXES)} = {product}, but there are "
                         f"{len(devices)} devices ({', '.join(kinds)}); make the product "
                         f"{len(devices)}")
    return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES,
                         axis_types=(jax.sharding.AxisType.Explicit,) * len(AXES),
                         devices=devices)


def check_layout(cfg: Mamba2Config, mesh, *, batch_size=None, seq_len=None,
                 sequence_parallel=True, loss_chunk=None):
    """Raise a ValueError naming the value and the fix if cfg or the batch cannot be split."""
    tp = mesh.shape["tp"]
    kinds = cfg.layers
    if "M" in kinds and cfg.nheads % tp:
        works = [t for t in range(1, cfg.nheads + 1) if cfg.nheads % t == 0]
        raise ValueError(f"tp={tp} does not divide nheads={cfg.nheads} (d_model*expand/"
                         f"headdim); tensor parallelism splits whole heads: use tp in {works}")
    if "*" in kinds and cfg.attn_num_heads % tp:
        h = cfg.attn_num_heads
        works = [t for t in range(1, h + 1) if h % t == 0]
        raise ValueError(f"tp={tp} does not divide attn_num_heads={h}; tensor parallelism "
                         f"splits whole attention heads: use tp in {works}")
    if "-" in kinds and cfg.d_intermediate % tp:
        raise ValueError(f"tp={tp} does not divide the MLP width d_intermediate="
                         f"{cfg.d_intermediate}; use a multiple of {tp}")
    if cfg.padded_vocab_size % tp:
        raise ValueError(f"tp={tp} does not divide the padded vocabulary "
                         f"{cfg.padded_vocab_size}; set pad_vocab_size_multiple to a multiple "
                         f"of {tp}")
    shards = mesh.shape["dp"] * mesh.shape["fsdp"]
    if batch_size is not None and batch_size % shards:
        raise ValueError(f"batch size {batch_size} is not divisible by dp*fsdp = {shards}; "
                         f"use a multiple of {shards}")
    cp = mesh.shape["cp"]
    if seq_len is None:
        return
    if seq_len % cp:
        raise ValueError(f"sequence length {seq_len} is not divisible by cp={cp}, which "
                         f"context parallelism splits it over; use a multiple of {cp}")
    if cp > 1 and seq_len // cp < cfg.d_conv - 1:
        raise ValueError(f"sequence length {seq_len} over cp={cp} leaves {seq_len // cp} "
                         f"tokens per device, fewer than the conv's halo d_conv-1 = "
                         f"{cfg.d_conv - 1}; use a sequence of at least "
                         f"{cp * (cfg.d_conv - 1)} tokens or a smaller cp")
    if sequence_parallel and tp > 1 and seq_len % (cp * tp):
        raise ValueError(f"sequence length {seq_len} is not divisible by cp*tp = {cp}*{tp}, "
                         f"which context and sequence parallelism split it over; use a "
                         f"multiple of {cp * tp} or --no-sequence-parallel")
    if loss_chunk is not None and (seq_len // cp) % loss_chunk:
        raise ValueError(f"--loss-chunk {loss_chunk} does not divide the {seq_len // cp} "
                         f"positions each device holds (sequence length {seq_len} over "
                         f"cp={cp}); use a divisor of {seq_len // cp}")


def param_specs(params, cfg: Mamba2Config, mesh):
    """A PartitionSpec per parameter (a pytree shaped like params; leaves may be abstract)."""
    tp, fsdp = mesh.shape["tp"], mesh.shape["fsdp"]
    tp_axes = dict(_HEAD_AXIS, **(_GROUP_AXIS if cfg.ngroups % tp == 0 else {}),
                   **(_KV_AXIS if cfg.attn_num_heads_kv % tp == 0 else {}))

    def spec(path, leaf):
        axes = [None] * leaf.ndim
        tp_axis = tp_axes.get(param_name(path).split(".")[-1])
        if tp_axis is not None:
            axes[tp_axis] = "tp"
        # fsdp takes the largest axis that tp leaves free and it divides; none: replicated.
        free = [i for i in range(leaf.ndim) if i != tp_axis and leaf.shape[i] % fsdp == 0]
        if fsdp > 1 and free:
            axes[max(free, key=lambda i: leaf.shape[i])] = "fsdp"
        return P(*axes)
    return jax.tree_util.tree_map_with_path(spec, params)


def shardings(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def global_array(array, sharding):
    """A host array (the same on every process) -> a jax.Array placed as sharding; each
    process supplies only its own devices' pieces."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _gather_fsdp(tree, specs):
    """All-gather each fsdp-sharded parameter of tree (inside shard_map)."""
    def gather(x, spec):
        if "fsdp" not in spec:
            return x
        return checkpoint_name(lax.all_gather(x, "fsdp", axis=spec.index("fsdp"), tiled=True),
                               _GATHERED)
    return jax.tree.map(gather, tree, specs)


# ---- per-device code (runs inside shard_map) ----

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


def _conv_with_halo(mixer, x, B, C, seq_idx):
    """The mixer's causal conv on this device's part of the sequence (x [b, l, h, p],
    B, C [b, l, g, n], seq_idx [b, l] or None, l the cp part) -> conv'd x, B, C.

    The first d_conv-1 outputs read the previous part's last d_conv-1 inputs: one ppermute
    over cp brings them (part 0 receives zeros, the conv's own padding), with their seq_idx
    so that no tap reads across a document start, and their outputs are dropped."""
    cp, k = lax.axis_size("cp"), mixer.cfg.d_conv - 1
    if cp == 1 or k == 0:
        return mixer.conv(x, B, C, seq_idx)[:3]
    parts = (x, B, C) + (() if seq_idx is None else (seq_idx,))
    halos = lax.ppermute(tuple(a[:, -k:] for a in parts), "cp",
                         [(i, i + 1) for i in range(cp - 1)])
    x, B, C, *seq_idx = (jnp.concatenate(pair, axis=1) for pair in zip(halos, parts))
    return tuple(a[:, k:] for a in mixer.conv(x, B, C, *seq_idx)[:3])


def _mixer_local(mixer, u, cfg: Mamba2Config, seq_idx=None):
    """One rank's mixer: u [b, l, d] (every token of this device's cp part) -> its share of
    out_proj [b, l, d] f32. seq_idx [b, l] (the same tokens) or None: packed documents.

    Column-parallel projections and conv on local heads (and local or all groups), the SSD
    and gated norm on local heads with no communication over tp, row-parallel out_proj (the
    caller sums the shares). Over cp the conv takes a halo and the scan carries its state
    from the previous parts."""
    z, x, B, C, dt = mixer.project(u)
    x, B, C = _conv_with_halo(mixer, x, B, C, seq_idx)
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
    mask = None
    if cp > 1:
        k, v = (lax.all_gather(t, "cp", axis=1, tiled=True) for t in (k, v))
        mask = (attention_mask(index, jnp.arange(cp * l), starts, k_starts)
                if seq_idx is not None else attention_mask(index, jnp.arange(cp * l)))
    elif seq_idx is not None:
        mask = attention_mask(index, index, starts, starts)
    return attn.out_proj_partial(attend(q, k, v, attn.scale, mask))


def _mlp_local(mlp, u, cfg: Mamba2Config, seq_idx=None):
    """One rank's MLP: u [b, l, d] -> its share of down_proj [b, l, d] f32 (column-parallel
    up and gate on f/tp columns, row-parallel down; the caller sums the shares)."""
    return mlp.out_proj_partial(mlp.hidden(u))


_LOCAL = {"mamba": _mixer_local, "attention": _attention_local, "mlp": _mlp_local}


def _block_local(block, residual, cfg: Mamba2Config, sp: bool, seq_idx=None):
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


def _remat_policy(remat: str, fsdp: bool):
    """The jax.checkpoint policy around each block, or None for no checkpoint.

    "block" keeps the block's matmul outputs and recomputes the rest (norms, conv, scan)
    in the backward pass; "full" keeps only the block's input. Gathered FSDP weights are
    never kept: the backward pass gathers them again."""
    if remat == "full":
        return jax.checkpoint_policies.nothing_saveable
    if remat == "block":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return jax.checkpoint_policies.save_anything_except_these_names(_GATHERED) if fsdp else None


def _local_hidden(state, input_ids, seq_idx, graphdef, specs, sp: bool, remat: str):
    """Per device: input_ids [b, l], seq_idx [b, l] or None (l: this device's cp part) ->
    (final hidden [b, l, d] in the compute dtype for all l, this rank's LM head rows
    [v/tp, d])."""
    model = nnx.merge(graphdef, state)  # the structure; weights are fsdp shards until gathered
    cfg = model.config
    gathered = lambda name: _gather_fsdp(state[name], specs[name])
    residual = vocab_parallel_embed(gathered("embedding")[...], input_ids, sp)
    residual = residual.astype(model.residual_dtype)
    policy = _remat_policy(remat, fsdp=lax.axis_size("fsdp") > 1)
    # One scan per run of consecutive layers of one kind, not a copy of the block per layer:
    # compile time and program size stay those of one layer per run (48 unrolled 1.3b
    # layers took minutes to compile). An all-Mamba model is one run, one scan; a hybrid
    # pattern such as Megatron's "M-M-M*-..." alternates kinds, so most of its runs are a
    # single layer, called directly (its program grows with the number of runs). The layers'
    # weights are stacked here, a copy of this device's shards.
    kinds = [layer.kind for layer in model.layers]
    runs = [i for i in range(len(kinds)) if i == 0 or kinds[i] != kinds[i - 1]]
    for first, end in zip(runs, runs[1:] + [len(kinds)]):
        block_graphdef = nnx.graphdef(model.layers[first])  # the same in the whole run

        def block(residual, layer_state, block_graphdef=block_graphdef, first=first):
            layer = nnx.merge(block_graphdef, _gather_fsdp(layer_state, specs["layers"][first]))
            return _block_local(layer, residual, cfg, sp, seq_idx), None
        if policy is not None:
            # Under FSDP this keeps a device from holding more than one layer's full weights.
            block = jax.checkpoint(block, policy=policy)
        if end - first == 1:
            residual, _ = block(residual, state["layers"][first])
        else:
            stacked = jax.tree.map(lambda *ws: jnp.stack(ws),
                                   *(state["layers"][i] for i in range(first, end)))
            residual, _ = lax.scan(block, residual, stacked)
    norm_f = nnx.merge(nnx.graphdef(model.norm_f), gathered("norm_f"))
    hidden = norm_f(residual).astype(model.dtype)
    if sp:
        hidden = lax.all_gather(hidden, "tp", axis=1, tiled=True)
    head = "embedding" if cfg.tie_embeddings else "lm_head"
    return hidden, gathered(head)[...].astype(model.dtype)


def _local_logits(hidden, head):
    return jnp.einsum("bld,vd->blv", hidden, head, preferred_element_type=jnp.float32)


def _token_losses(hidden, head, targets, loss_chunk):
    """hidden [b, l, d], head [v/tp, d], targets [b, l] -> per-token cross-entropy [b, l].

    loss_chunk: positions per piece. The logits of one piece at a time, recomputed in the
    backward pass, so the largest logits buffer is [b, loss_chunk, v/tp], not [b, l, v/tp]
    (at 64K tokens and a 50K vocabulary that is 13 GB of float32 per row)."""
    b, l, d = hidden.shape
    if loss_chunk is None or loss_chunk >= l:
        return vocab_parallel_cross_entropy(_local_logits(hidden, head), targets)

    @jax.checkpoint
    def piece(_, xs):
        return None, vocab_parallel_cross_entropy(_local_logits(xs[0], head), xs[1])
    pieces = lambda a: a.reshape(b, l // loss_chunk, loss_chunk, *a.shape[2:]).swapaxes(0, 1)
    _, losses = lax.scan(piece, None, (pieces(hidden), pieces(targets)))
    return losses.swapaxes(0, 1).reshape(b, l)


def _shard_map(body, mesh, specs, n_batch_args, out_specs):
    # check_vma=False: the SSD's Pallas kernels and the reference's scans carry no
    # varying-axis types. shard_map's transpose still sums the gradients of parameters
    # replicated over an axis (the tests compare every gradient with one device's).
    return jax.shard_map(body, mesh=mesh, in_specs=(specs,) + (TOKENS,) * n_batch_args,
                         out_specs=out_specs, check_vma=False)


def make_loss_fn(graphdef, specs, mesh, *, sequence_parallel=True, remat="none",
                 loss_chunk=None):
    """loss(params, inputs [b, l], targets [b, l], seq_idx=None) -> mean next-token
    cross-entropy (nats). seq_idx [b, l]: packed documents (no state crosses a boundary).

    params are placed as `specs`; the token arrays as TOKENS (rows over dp and fsdp, the
    sequence over cp). remat:
    "none", "block" or "full" activation checkpointing of each block (_remat_policy).
    loss_chunk: compute the logits and cross-entropy that many positions at a time
    (_token_losses); None: all at once."""
    if remat not in REMAT:
        raise ValueError(f"--remat {remat!r}: use one of {REMAT}")
    sp = sequence_parallel and mesh.shape["tp"] > 1
    token_axes = BATCH_AXES + ("cp",)
    n_shards = math.prod(mesh.shape[a] for a in token_axes)

    def body(params, inputs, targets, seq_idx=None):
        hidden, head = _local_hidden(params, inputs, seq_idx, graphdef, specs, sp, remat)
        token_loss = _token_losses(hidden, head, targets, loss_chunk)
        return lax.psum(token_loss.sum(), token_axes) / (token_loss.size * n_shards)
    plain = _shard_map(body, mesh, specs, 2, P())
    packed = _shard_map(body, mesh, specs, 3, P())

    def loss(params, inputs, targets, seq_idx=None):
        if seq_idx is None:
            return plain(params, inputs, targets)
        return packed(params, inputs, targets, seq_idx)
    return loss


def make_logits_fn(graphdef, specs, mesh, *, sequence_parallel=True):
    """logits(params, input_ids [b, l]) -> float32 [b, l, v], sharded on l over cp and on
    v over tp (no device holds the full vocabulary)."""
    sp = sequence_parallel and mesh.shape["tp"] > 1

    def body(params, input_ids):
        return _local_logits(*_local_hidden(params, input_ids, None, graphdef, specs, sp,
                                            "none"))
    return _shard_map(body, mesh, specs, 1, P(BATCH_AXES, "cp", "tp"))


def initialize_distributed(coordinator_address=None, num_processes=None, process_id=None):
    """jax.distributed.initialize() when launched as several processes.

    Arguments left None come from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID, else from jax's cluster detection (SLURM, Open MPI, ...). With no
    address and no process count there is one process and nothing to do.
    """
    env = os.environ.get
    coordinator_address = coordinator_address or env("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and env("JAX_NUM_PROCESSES"):
        num_processes = int(env("JAX_NUM_PROCESSES"))
    if process_id is None and env("JAX_PROCESS_ID"):
        process_id = int(env("JAX_PROCESS_ID"))
    if coordinator_address is not None or num_processes not in (None, 1):
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
