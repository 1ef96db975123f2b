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
Every device runs the same per-device code (here and in parallel_layers.py); the
collectives are written out.
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

from mamba_jax.config import Mamba2Config
from mamba_jax.layers import matmul
from mamba_jax.model import param_name
from mamba_jax.parallel_layers import (block_local, vocab_parallel_cross_entropy,
                                       vocab_parallel_embed)

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
            return block_local(layer, residual, cfg, sp, seq_idx), None
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
    return matmul("bld,vd->blv", hidden, head, hidden.dtype)


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
