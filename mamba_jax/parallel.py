"""The trainer's mesh and its sharded loss: the model's own forward inside `jax.shard_map`.

    mesh = make_mesh("dp=2,tp=4")                 # axes dp, fsdp, cp, tp; omitted axes are 1
    specs = param_specs(params, mesh)             # PartitionSpecs from the params' axes
    params = jax.device_put(params, shardings(mesh, specs))
    loss = make_loss_fn(graphdef, specs, mesh)    # loss(params, inputs, targets) -> scalar

Legend: b batch, l sequence, d d_model, v padded vocabulary.

Every device runs Mamba2LM.loss on its shard of the parameters and of the tokens, with the
ParallelContext of the mesh (mamba_jax.sharding, which also says where each axis lives):
- `dp`, `fsdp`: the batch rows; `fsdp` also shards every parameter on its "embed" axis (and
  so the optimizer state), gathered where the layer runs and again in the backward pass.
- `tp`: heads, groups, KV heads, the MLP width and the vocabulary; with sequence parallel
  (the default) the residual stream between layers is [b, l/(cp*tp), d] and each layer
  all-gathers its normed input and reduce-scatters its output.
- `cp` (context parallel): the sequence, for the whole model. Device k of cp holds tokens
  [k*l/cp, (k+1)*l/cp) of every row; the Mamba layers exchange only the conv halo and the
  scan's small states (pallas_kernels/ssd/context_parallel.py), neither growing with the
  sequence; attention layers all-gather their keys and values.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from mamba_jax import sharding
from mamba_jax.model import Mamba2LM, Stream, check_per_token
from mamba_jax.sharding import AxisNames, ParallelContext
from pallas_kernels.mamba3 import Mamba3State

AXES = ("dp", "fsdp", "cp", "tp")
BATCH_AXES = ("dp", "fsdp")  # the batch rows are split over both
TOKENS = P(BATCH_AXES, "cp")  # a [b, l] array of tokens: rows over dp, fsdp; sequence over cp

def parse_mesh_spec(spec: str) -> dict[str, int]:
    """"dp=2,tp=4" -> {"dp": 2, "fsdp": 1, "tp": 4}."""
    sizes, given = dict.fromkeys(AXES, 1), set()
    for part in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in AXES or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"mesh spec {spec!r}: {part!r} should be AXIS=SIZE with AXIS one "
                             f"of {AXES} and SIZE a positive integer, e.g. 'dp=2,tp=4'")
        if name in given:
            raise ValueError(f"mesh spec {spec!r} gives {name} twice: give each axis once")
        given.add(name)
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


def check_layout(cfg, mesh, *, batch_size=None, seq_len=None, sequence_parallel=True,
                 loss_chunk=None):
    """Raise a ValueError naming the value and the fix if cfg or the batch cannot be split:
    every parameter's axes over the mesh (param_specs, on the model's shapes alone), then
    the batch and the sequence."""
    param_specs(nnx.state(nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0))), nnx.Param),
                mesh)
    check_split(cfg, dict(mesh.shape), batch_size=batch_size, seq_len=seq_len,
                sequence_parallel=sequence_parallel, loss_chunk=loss_chunk)


def _sizes(mesh, axis_names: AxisNames) -> dict[str, int]:
    """{role: the size of the mesh axis axis_names gives it} (1 where the mesh lacks it)."""
    return {role: sharding.axis_size(mesh, getattr(axis_names, role))
            for role in ("dp", "fsdp", "cp", "tp")}


def check_split(cfg, sizes: dict, *, batch_size=None, seq_len=None, sequence_parallel=True,
                loss_chunk=None):
    """check_layout's batch and sequence part, the mesh as {role: size}: the model's
    functions on a mesh (make_loss_fn, make_hidden_fn) call it on their inputs' shapes,
    where a sequence too short for cp gave other numbers without an error."""
    shards = sizes["dp"] * sizes["fsdp"]
    if batch_size is not None and batch_size % shards:
        raise ValueError(f"batch size {batch_size} is not divisible by dp*fsdp = {shards}; "
                         f"use a multiple of {shards}")
    cp, tp = sizes["cp"], sizes["tp"]
    if seq_len is None:
        return
    if seq_len % cp:
        raise ValueError(f"sequence length {seq_len} is not divisible by cp={cp}, which "
                         f"context parallelism splits it over; use a multiple of {cp}")
    # The convs' halo: the previous device's last d_conv - 1 tokens (each Mamba kind's own)
    halo = max([cfg.mamba2.d_conv - 1] * ("M" in cfg.layers)
               + [cfg.mamba1.d_conv - 1] * ("1" in cfg.layers) + [0])
    if cp > 1 and halo and seq_len // cp < halo:
        split = cp * tp if sequence_parallel and tp > 1 else cp  # what must divide it
        least = -(-cp * halo // split) * split
        raise ValueError(f"sequence length {seq_len} over cp={cp} leaves {seq_len // cp} "
                         f"tokens per device, fewer than the conv's halo d_conv-1 = {halo}; "
                         f"use a sequence of at least {least} tokens or a smaller cp")
    if sequence_parallel and tp > 1 and seq_len % (cp * tp):
        raise ValueError(f"sequence length {seq_len} is not divisible by cp*tp = {cp}*{tp}, "
                         f"which context and sequence parallelism split it over; use a "
                         f"multiple of {cp * tp} or --no-sequence-parallel")
    if loss_chunk is not None and (seq_len // cp) % loss_chunk:
        raise ValueError(f"--loss-chunk {loss_chunk} does not divide the {seq_len // cp} "
                         f"positions each device holds (sequence length {seq_len} over "
                         f"cp={cp}); use a divisor of {seq_len // cp}")


def param_specs(params, mesh, axis_names: AxisNames = AxisNames()):
    """A PartitionSpec per parameter, from each one's logical axes (a pytree shaped like
    params; leaves may be abstract): mamba_jax.sharding.param_specs."""
    return sharding.param_specs(params, mesh, axis_names)


def shardings(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def init_params(build, param_shardings):
    """The parameters (an nnx.State) of the module build() makes, created in place on
    param_shardings by one jit: no device holds the whole model first, and every process
    computes the same values from build's seed."""
    return jax.jit(lambda: nnx.split(build())[1], out_shardings=param_shardings)()


def global_array(array, sharding, dtype=None):
    """A host array (the same on every process) -> a jax.Array placed as sharding, of
    `dtype` (default: the array's); each process supplies only its own devices' pieces,
    each piece cast on its own and made once for the devices that hold the same one, so no
    cast copy of the whole array is made where it is sharded."""
    pieces = {}

    def piece(index):
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in pieces:
            pieces[key] = np.asarray(array[index], dtype)
        return pieces[key]
    return jax.make_array_from_callback(array.shape, sharding, piece)


def _shard_map(body, mesh, specs, n_batch_args, out_specs):
    # check_vma=False: the SSD's Pallas kernels and the reference's scans carry no
    # varying-axis types. shard_map's transpose still sums the gradients of parameters
    # replicated over an axis (the tests compare every gradient with one device's).
    return jax.shard_map(body, mesh=mesh, in_specs=(specs,) + (TOKENS,) * n_batch_args,
                         out_specs=out_specs, check_vma=False)


def make_loss_fn(graphdef, specs, mesh, *, sequence_parallel=True, remat="none",
                 loss_chunk=None, scan_layers=True, per_row=False, fp8=None):
    """loss(params, inputs [b, l], targets [b, l], seq_idx=None, loss_mask=None) -> mean
    next-token cross-entropy (nats) over the counted tokens: Mamba2LM.loss on every device,
    summed over the mesh and divided by the count of counted tokens (per_row: each row's
    mean, [b] float32). seq_idx [b, l]: packed documents (no state crosses a boundary).
    loss_mask [b, l] bool or ints: the targets that count (nonzero); None: every target.
    A target outside the mask adds exactly nothing, to the value or to any gradient; where
    none counts the loss is 0 (and so is its gradient).

    params are placed as `specs`; the token arrays as TOKENS (rows over dp and fsdp, the
    sequence over cp). remat: "none", "block" or "full" activation checkpointing of each
    layer (model.remat_policy). loss_chunk: the logits and cross-entropy that many positions
    at a time (Mamba2LM.loss); None: all at once. scan_layers: Mamba2LM.loss's. fp8: a
    model.Fp8 recipe, the layers' projections in FP8 (their scales reduced over the mesh, so
    that the loss and its gradients are one device's); None: the compute dtype."""
    ctx = ParallelContext.for_mesh(mesh, sequence_parallel)
    token_axes = BATCH_AXES + ("cp",)
    n_shards = math.prod(mesh.shape[a] for a in token_axes)
    sums = "cp" if per_row else token_axes  # what a device's sums are summed over

    def body(params, inputs, targets, seq_idx=None, loss_mask=None):
        token_loss = nnx.merge(graphdef, params).loss(inputs, targets, seq_idx, ctx=ctx,
                                                      remat=remat, loss_chunk=loss_chunk,
                                                      scan_layers=scan_layers, fp8=fp8)
        axes = -1 if per_row else None
        if loss_mask is None:
            count = token_loss.shape[-1] * mesh.shape["cp"] if per_row else \
                token_loss.size * n_shards
        else:
            # a select, not a product: a masked position's cotangent is exactly 0, even
            # where its loss is not finite
            token_loss = jnp.where(loss_mask != 0, token_loss, 0.0)
            count = jnp.maximum(lax.psum((loss_mask != 0).sum(axes, dtype=jnp.int32), sums),
                                1).astype(jnp.float32)
        return lax.psum(token_loss.sum(axes), sums) / count
    out_spec = P(BATCH_AXES) if per_row else P()

    def loss(params, inputs, targets, seq_idx=None, loss_mask=None):
        # the arrays' own shapes: inside, a device's parts' were named
        check_per_token("make_loss_fn", inputs.shape[:2], targets=targets, seq_idx=seq_idx,
                        loss_mask=loss_mask)
        if loss_mask is not None and not (jnp.issubdtype(loss_mask.dtype, jnp.integer)
                                          or loss_mask.dtype == jnp.bool_):
            raise ValueError(f"make_loss_fn: loss_mask of dtype {loss_mask.dtype}; give bools "
                             "or integers (nonzero: the target counts)")
        check_split(nnx.merge(graphdef, params).config, dict(mesh.shape),
                    batch_size=inputs.shape[0], seq_len=inputs.shape[1],
                    sequence_parallel=sequence_parallel, loss_chunk=loss_chunk)
        given = {name: a for name, a in (("seq_idx", seq_idx), ("loss_mask", loss_mask))
                 if a is not None}
        mapped = _shard_map(lambda p, i, t, *more: body(p, i, t, **dict(zip(given, more))),
                            mesh, specs, 2 + len(given), out_spec)
        return mapped(params, inputs, targets, *given.values())
    return loss


def make_logits_fn(graphdef, specs, mesh, *, sequence_parallel=True):
    """logits(params, input_ids [b, l]) -> float32 [b, l, v], sharded on l over cp and on
    v over tp (no device holds the full vocabulary): Mamba2LM.__call__ on every device."""
    ctx = ParallelContext.for_mesh(mesh, sequence_parallel)

    def body(params, input_ids):
        return nnx.merge(graphdef, params)(input_ids, ctx=ctx)
    return _shard_map(body, mesh, specs, 1, P(BATCH_AXES, "cp", "tp"))


def token_spec(axis_names: AxisNames = AxisNames(), mesh=None) -> P:
    """TOKENS on a mesh whose axes axis_names names: rows over dp and fsdp, the sequence
    over cp (given `mesh`, over those of them it has)."""
    names = axis_names if mesh is None else axis_names.on(mesh)
    return P(_present(names.dp, names.fsdp), names.cp)


def _present(*names) -> tuple[str, ...]:
    """The mesh axes among `names` but a None (absent) one: what one array axis is split
    over (a batch's rows over dp and fsdp)."""
    return tuple(name for name in names if name is not None)


# The axis of a state's field that tp shards where it is not axis 1: Mamba-3's k [b, r, h, n]
_TP_AXIS = {(Mamba3State, "k"): 2}


def state_specs(states, axis_names: AxisNames = AxisNames(), mesh=None):
    """A PartitionSpec per leaf of per-layer states (Mamba2LM.hidden's initial_states and
    the states it returns): rows over dp and fsdp, the channels or heads (axis 1, _TP_AXIS
    where not) over tp, the rest whole (a state is the same on every cp device). Under tp a
    MambaCache's conv_state then holds the ranks' channels one rank after the other (each
    rank's x, B, C in turn), not a one-device cache's order: states a sharded call returns
    go back into one with the same tp, as they are. Given `mesh`, over the axes it has."""
    if mesh is not None:
        axis_names = axis_names.on(mesh)
    rows = _present(axis_names.dp, axis_names.fsdp)

    def spec(a, axis=1):
        return P(rows, *(None,) * (axis - 1), axis_names.tp, *(None,) * (a.ndim - axis - 1))

    def layer(state):  # a layer's state: a NamedTuple of arrays (or None), or None
        if state is None:
            return None
        return type(state)(*(jax.tree.map(lambda a, name=name: spec(
            a, _TP_AXIS.get((type(state), name), 1)), value)
            for name, value in zip(state._fields, state)))
    return None if states is None else type(states)(map(layer, states))


def make_hidden_fn(graphdef, specs, mesh, *, sequence_parallel=True,
                   axis_names: AxisNames = AxisNames(), return_states=False, remat="none",
                   scan_layers=True):
    """hidden(params, inputs [b, l], seq_idx=None, initial_states=None) -> the final norm's
    output [b, l, d] in the compute dtype, rows over dp and fsdp and the sequence over cp:
    the model's `hidden` (Mamba2LM's, or Mamba2Encoder's, whose inputs may also be [b, l,
    d] features) on every device of `mesh`, whose axes axis_names names (a role the mesh
    lacks has size 1). params placed as `specs` (param_specs(params, mesh, axis_names)).

    return_states (Mamba2LM): (hidden, states), each layer's state after the last token,
    placed as state_specs; initial_states: the states to continue from, placed so. Both
    differentiable: a custom training loop takes gradients through them. remat,
    scan_layers: as Mamba2LM.hidden's."""
    ctx = ParallelContext.for_mesh(mesh, sequence_parallel, axis_names)
    tokens = token_spec(axis_names, mesh)
    out = P(*tokens, None)

    def hidden(params, inputs, seq_idx=None, initial_states=None):
        whole = nnx.merge(graphdef, params)  # its config and cache's kinds, outside the map
        check_per_token("make_hidden_fn", inputs.shape[:2], seq_idx=seq_idx)
        check_split(whole.config, _sizes(mesh, axis_names),
                    batch_size=inputs.shape[0], seq_len=inputs.shape[1],
                    sequence_parallel=sequence_parallel)

        def body(params, inputs, seq_idx, initial_states):
            model = nnx.merge(graphdef, params)
            options = {} if initial_states is None else {"initial_states": initial_states}
            if return_states:
                options["return_states"] = True
            return model.hidden(inputs, seq_idx, ctx=ctx, remat=remat,
                                scan_layers=scan_layers, **options)
        batch = P(*tokens, *(None,) * (inputs.ndim - 2))
        if return_states and whole.cache_grows:
            raise ValueError("make_hidden_fn(return_states=True): an attention layer's state "
                             "is the keys and values of every token, which a mesh holds in "
                             "parts; return its states from Mamba2LM.hidden on one device, or "
                             "decode with generate()")
        states_out = state_specs(nnx.eval_shape(lambda: whole.init_cache(1)), axis_names,
                                 mesh) if return_states else None
        return jax.shard_map(
            body, mesh=mesh, check_vma=False,
            in_specs=(specs, batch, None if seq_idx is None else tokens,
                      state_specs(initial_states, axis_names, mesh)),
            out_specs=(out, states_out) if return_states else out)(
                params, inputs, seq_idx, initial_states)
    return hidden


def make_block_fn(graphdef, specs, mesh, *, sequence_parallel=True,
                  axis_names: AxisNames = AxisNames()):
    """block(params, residual [b, l, d], seq_idx=None) -> the residual stream after one
    layer (model.Block: norm, mixer, added), on every device of `mesh`: graphdef and params
    one layer's, `nnx.split(model.layers[i])`, params placed as `specs`. The residual
    stream's rows over dp and fsdp, its sequence over cp and, under sequence parallel, tp
    (as between the trainer's layers); seq_idx [b, l] as the tokens."""
    ctx = ParallelContext.for_mesh(mesh, sequence_parallel, axis_names)
    tokens, present = token_spec(axis_names, mesh), axis_names.on(mesh)
    sequence = _present(present.cp, present.tp) if ctx.sequence_parallel else present.cp
    stream = P(tokens[0], sequence, None)

    def body(params, residual, seq_idx):
        block = nnx.merge(graphdef, ctx.gather_params(params))
        return block(Stream.start(residual, block.mixer.dtype), seq_idx, ctx=ctx)[0].value()

    def block(params, residual, seq_idx=None):
        return jax.shard_map(body, mesh=mesh, check_vma=False,
                             in_specs=(specs, stream, None if seq_idx is None else tokens),
                             out_specs=stream)(params, residual, seq_idx)
    return block


def initialize_distributed(coordinator_address=None, num_processes=None, process_id=None):
    """jax.distributed.initialize() when launched as several processes.

    Arguments left None come from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID; with none of them, a process of an srun step or an mpirun of several
    tasks (SLURM_STEP_NUM_TASKS, OMPI_COMM_WORLD_SIZE) lets jax's cluster detection give all
    three. Otherwise there is one process and nothing to do.
    """
    env = os.environ.get
    coordinator_address = coordinator_address or env("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and env("JAX_NUM_PROCESSES"):
        num_processes = int(env("JAX_NUM_PROCESSES"))
    if process_id is None and env("JAX_PROCESS_ID"):
        process_id = int(env("JAX_PROCESS_ID"))
    if coordinator_address is None and num_processes is None:
        # Set by the launcher in each task it starts (a batch script's own shell has no
        # step of several tasks, so it is one process)
        tasks = max(int(env(name, "1") or 1) for name in ("SLURM_STEP_NUM_TASKS",
                                                            "OMPI_COMM_WORLD_SIZE"))
        if tasks > 1:
            jax.distributed.initialize()
            return
        if process_id is not None:
            raise ValueError(f"--process-id {process_id} alone: several processes need "
                             "--num-processes and --coordinator-address too (or a launcher "
                             "jax detects: srun, mpirun)")
    if coordinator_address is not None or num_processes not in (None, 1):
        try:
            jax.distributed.initialize(coordinator_address, num_processes, process_id)
        except ValueError as error:  # jax's own words name none of our flags
            given = ", ".join(f"--{flag} {value}" for flag, value in (
                ("num-processes", num_processes), ("coordinator-address", coordinator_address),
                ("process-id", process_id)) if value is not None)
            raise ValueError(
                f"several processes ({given}): {str(error).rstrip('.')}. Give every process "
                "--coordinator-address HOST:PORT (process 0's), --num-processes and its own "
                "--process-id, or launch under a cluster manager that jax detects (SLURM, "
                "Open MPI)") from None
