"""Where parameters and activations live on the mesh: one table of logical axis -> mesh axis
rules, and the parallel context a layer's forward calls for its collectives.

    specs = param_specs(abstract_params, mesh)   # PartitionSpecs from each Param's axes
    ctx = ParallelContext.for_mesh(mesh)          # inside jax.shard_map
    logits = model(input_ids, ctx=ctx)            # the same forward as on one device

Every parameter declares its logical axes where it is created, `nnx.Param(value,
axes=("embed", "heads", "head_dim"))` (mamba_jax.layers.common.param); RULES places each name
on a mesh axis. A parameter without axes, or with a name RULES lacks, is an error: nothing
falls back to replicated unnoticed.

Mesh axes (mamba_jax.parallel.make_mesh): `dp` batch rows; `fsdp` batch rows and the
"embed" axis of every parameter (ZeRO-3: gathered where a layer runs, re-gathered in the
backward pass); `cp` the sequence, for the whole model; `tp` heads, groups, KV heads, the
MLP width and the vocabulary, and (sequence parallel) the residual stream's sequence between
layers. These are roles: a user's mesh may name them otherwise (AxisNames, given to
param_specs and ParallelContext.for_mesh).

The parallel context is the only thing a layer knows of the mesh. On one device it is
SINGLE_DEVICE, whose collectives are the identity, so one forward serves both.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

# Logical axis -> the role of its mesh axis (None: never split), whose name on a mesh
# AxisNames gives. One table for every layer kind.
RULES = {
    "vocab": "tp",      # the embedding's and LM head's rows (vocabulary-parallel)
    "embed": "fsdp",    # d_model: the axis FSDP shards every large parameter on
    "heads": "tp",      # Mamba heads, attention query heads
    "kv_heads": "tp",   # attention KV heads
    "groups": "tp",     # Mamba B/C groups
    "mlp": "tp",        # the MLP's hidden width
    "head_dim": None,
    "state": None,      # Mamba's d_state
    "mimo_rank": None,  # Mamba-3's MIMO rank
    "angles": None,     # Mamba-3's rotary angles (shared by its heads)
    "conv": None,       # a causal conv's taps
    "dt_rank": None,    # Mamba-1's low-rank dt projection
    "lora_rank": None,  # a LoRA adapter's rank (mamba_jax.adapters): its factors are split
                        # as the input and output axes of the weight they adapt
}
# Axes kept whole on every rank where their mesh axis does not divide them: each rank then
# reads the groups or KV heads its own heads use (the published Mamba2 checkpoints have one
# B/C group, and GQA models fewer KV heads than tp). Every other axis must divide.
REPLICATED_WHEN_UNEVEN = frozenset({"groups", "kv_heads"})
GATHERED = "fsdp_gathered"  # checkpoint name of gathered weights: recomputed, never saved

# What a size that does not divide means to a user, and what to change.
_AXIS_HELP = {
    "vocab": "the padded vocabulary; set pad_vocab_size_multiple to a multiple of {size}",
    "embed": "d_model",
    "heads": "heads; tensor parallelism splits whole heads",
    "mlp": "the MLP width (mlp.d_intermediate)",
}


class AxisNames(NamedTuple):
    """The mesh's axis names by role (RULES and ParallelContext speak of roles): a user's
    mesh may call them anything, e.g. AxisNames(dp="data", tp="model"); a role the mesh
    lacks has size 1."""

    dp: str | None = "dp"
    fsdp: str | None = "fsdp"
    cp: str | None = "cp"
    tp: str | None = "tp"

    def on(self, mesh) -> "AxisNames":
        """These names with None for the roles `mesh` lacks (a spec cannot name an axis the
        mesh does not have)."""
        return AxisNames(*(name if name in mesh.axis_names else None for name in self))


def axis_size(mesh, name: str) -> int:
    """The size of mesh axis `name`, 1 where the mesh has no such axis."""
    return dict(mesh.shape).get(name, 1)


def is_param(x) -> bool:
    return isinstance(x, nnx.Variable)


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


def logical_axes(variable, name: str = "parameter") -> tuple:
    """A Param's declared logical axes; an error naming it when it has none."""
    axes = variable.get_metadata().get("axes")
    if axes is None or len(axes) != variable.ndim:
        raise ValueError(f"{name} {tuple(variable.shape)} declares logical axes {axes}: give "
                         f"one name per axis where it is created, nnx.Param(value, axes=...), "
                         f"from {sorted(RULES)}")
    unknown = [a for a in axes if a not in RULES]
    if unknown:
        raise ValueError(f"{name} has logical axes {unknown} that mamba_jax.sharding.RULES "
                         f"does not place; use names from {sorted(RULES)} or add a rule")
    return tuple(axes)


def param_specs(params, mesh, axis_names: AxisNames = AxisNames()):
    """A PartitionSpec per parameter: a pytree shaped like params (an nnx.State whose
    Variables hold specs; params' leaves may be abstract), each axis on RULES' mesh axis,
    named as axis_names says (a role the mesh lacks is not split). An axis whose mesh axis
    does not divide it is replicated if REPLICATED_WHEN_UNEVEN says so, else a ValueError
    naming the parameter, the sizes, and the mesh sizes that would work."""
    def spec(path, variable):
        name = param_name(path)
        axes = logical_axes(variable, name)
        placed = []
        for axis, dim in zip(axes, variable.shape):
            role = RULES[axis]
            mesh_axis = None if role is None else getattr(axis_names, role)
            size = 1 if mesh_axis is None else axis_size(mesh, mesh_axis)
            if size == 1:
                placed.append(None)
            elif dim % size == 0:
                placed.append(mesh_axis)
            elif axis in REPLICATED_WHEN_UNEVEN:
                placed.append(None)
            else:
                works = [s for s in range(1, dim + 1)  # of the sizes the devices allow
                         if dim % s == 0 and mesh.size % s == 0]
                what = _AXIS_HELP.get(axis, axis).format(size=size)
                raise ValueError(f"{mesh_axis}={size} does not divide the {dim} {axis} of "
                                 f"{name} {tuple(variable.shape)} ({what}): use {mesh_axis} "
                                 f"in {works}")
        return jax.tree.map(lambda _: P(*placed), variable)  # the Variable, holding its spec
    return jax.tree_util.tree_map_with_path(spec, params, is_leaf=is_param)


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """The mesh as a layer's forward sees it from inside `jax.shard_map`: the sizes of the
    tp, cp, fsdp and dp axes and whether the residual stream is sequence-parallel, and the
    collectives over them; and whether this layer's projections run as FP8 matmuls, whose
    per-tensor scales are reduced over the mesh (`fp8`, `scale_axes`). Every method is the
    identity where its axis has size 1, so SINGLE_DEVICE runs the one-device forward with no
    collective at all.

    Legend: b batch, l this device's tokens, d d_model.
    """

    tp: int = 1
    cp: int = 1
    fsdp: int = 1
    sequence_parallel: bool = False  # the residual stream [b, l/tp, d] between layers
    axis_names: AxisNames = AxisNames()  # the mesh's names of the tp, cp, fsdp and dp axes
    dp: int = 1
    # This layer's projections (layers.common.matmul and dense) as FP8 matmuls
    # (pallas_kernels.fp8); the model sets it per layer for training (model.Fp8).
    fp8: bool = False

    @classmethod
    def for_mesh(cls, mesh, sequence_parallel: bool = True,
                 axis_names: AxisNames = AxisNames()) -> "ParallelContext":
        """The context of `mesh`, whose axes are named as axis_names says (roles the mesh
        lacks have size 1)."""
        size = lambda role: axis_size(mesh, getattr(axis_names, role))
        return cls(tp=size("tp"), cp=size("cp"), fsdp=size("fsdp"),
                   sequence_parallel=sequence_parallel and size("tp") > 1,
                   axis_names=axis_names, dp=size("dp"))

    def scale_axes(self) -> tuple[str, ...]:
        """The mesh axes of size > 1, over which an FP8 scale's amax is reduced: every axis
        that an activation (rows over dp and fsdp, the sequence over cp, heads or the
        sequence over tp), a weight (tp) or a gradient may be split over, so that a scale
        equals one device's. Over an axis on which a tensor is whole, each device's max is
        already the max: one scalar all-reduce a matmul, whatever the tensor."""
        sizes = {"dp": self.dp, "fsdp": self.fsdp, "cp": self.cp, "tp": self.tp}
        return tuple(getattr(self.axis_names, role) for role, size in sizes.items()
                     if size > 1)

    # ------------------------------------------------------------ tensor parallel

    def tp_index(self):
        """This device's rank in tp (0 on one device)."""
        return lax.axis_index(self.axis_names.tp) if self.tp > 1 else 0

    def psum_tp(self, x):
        return lax.psum(x, self.axis_names.tp) if self.tp > 1 else x

    def pmax_tp(self, x):
        return lax.pmax(x, self.axis_names.tp) if self.tp > 1 else x

    def layer_input(self, x):
        """A layer's normed input [b, l/tp, d] under sequence parallel -> [b, l, d]: the
        all-gather before a column-parallel projection (else x itself)."""
        if not self.sequence_parallel:
            return x
        return lax.all_gather(x, self.axis_names.tp, axis=1, tiled=True)

    def layer_output(self, x, dtype=None):
        """The tp ranks' shares of a row-parallel output [b, l, d] -> their sum: [b, l/tp, d]
        scattered on the sequence under sequence parallel (half the bytes of an all-reduce,
        and the output already split), else all-reduced; x itself on one device. dtype: the
        shares are summed in it (the compute dtype, as mamba_ssm's RowParallelLinear sums
        them); None keeps x's."""
        if self.tp == 1:
            return x
        x = x if dtype is None else x.astype(dtype)
        if self.sequence_parallel:
            return lax.psum_scatter(x, self.axis_names.tp, scatter_dimension=1, tiled=True)
        return lax.psum(x, self.axis_names.tp)

    # ------------------------------------------------------------ context parallel

    @property
    def sequence_axis(self) -> str | None:
        """The mesh axis the sequence is split over, for the scan's state passing."""
        return self.axis_names.cp if self.cp > 1 else None

    def cp_index(self):
        return lax.axis_index(self.axis_names.cp) if self.cp > 1 else 0

    def all_gather_cp(self, x, axis: int = 1):
        """This device's part of the sequence -> the whole sequence (x itself on one cp)."""
        return lax.all_gather(x, self.axis_names.cp, axis=axis, tiled=True) if self.cp > 1 \
            else x

    def previous_tokens(self, x, width: int, before=None):
        """The `width` tokens before this device's x [b, l, ...] -> [b, width, ...]: the
        previous cp device's last ones, for a conv's window across the cut; on the first
        device (and on one device) `before` [b, width, ...], what stands before the sequence
        (a continued sequence's last inputs), or zeros where None; None where nothing stands
        before x (one cp device and no `before`, or width 0)."""
        if width == 0 or (self.cp == 1 and before is None):
            return None
        if self.cp == 1:
            return before.astype(x.dtype)
        halo = lax.ppermute(x[:, -width:], self.axis_names.cp,
                            [(i, i + 1) for i in range(self.cp - 1)])
        if before is not None:
            halo = jnp.where(self.cp_index() == 0, before.astype(x.dtype), halo)
        return halo

    def with_previous_tokens(self, x, width: int, before=None):
        """x [b, l, ...] -> [b, width + l, ...]: `previous_tokens` before x (x itself where
        there are none)."""
        halo = self.previous_tokens(x, width, before)
        return x if halo is None else jnp.concatenate([halo, x], axis=1)

    def with_next_tokens(self, x, width: int):
        """x [b, l, ...] -> [b, l + width, ...]: the next cp device's first `width` tokens
        after this device's (zeros after the last device's), for a non-causal conv's window
        across the cut; x itself on one cp."""
        if self.cp == 1 or width == 0:
            return x
        halo = lax.ppermute(x[:, :width], self.axis_names.cp,
                            [(i + 1, i) for i in range(self.cp - 1)])
        return jnp.concatenate([x, halo], axis=1)

    def psum_cp(self, x):
        """The sum over the cp devices (x itself on one cp)."""
        return lax.psum(x, self.axis_names.cp) if self.cp > 1 else x

    def sequence_shard(self, x):
        """The residual stream [b, l, d] whole on every tp rank -> this rank's part [b, l/tp,
        d] under sequence parallel (else x itself): an input that is not looked up in the
        embedding, e.g. an encoder's features."""
        if not self.sequence_parallel:
            return x
        part = x.shape[1] // self.tp
        return lax.dynamic_slice_in_dim(x, self.tp_index() * part, part, axis=1)

    def from_last_cp(self, x):
        """The last cp device's x on every cp device (the state after the whole sequence,
        which only the device holding its end computes); x itself on one cp."""
        if self.cp == 1:
            return x
        mine = jnp.where(self.cp_index() == self.cp - 1, x, jnp.zeros_like(x))
        return lax.psum(mine, self.axis_names.cp)

    # ------------------------------------------------------------ fsdp

    def gather_params(self, tree):
        """Parameters (a module's state, or one Variable) with their fsdp shards all-gathered
        along their "embed" axis, named so that remat policies recompute them (GATHERED)
        rather than keep them; the tree itself without fsdp."""
        if self.fsdp == 1:
            return tree

        def gather(variable):
            axes = logical_axes(variable)
            if "embed" not in axes:
                return variable
            full = lax.all_gather(variable[...], self.axis_names.fsdp,
                                  axis=axes.index("embed"), tiled=True)
            return variable.copy(checkpoint_name(full, GATHERED))
        return jax.tree.map(gather, tree, is_leaf=is_param)

    def gathered(self, module):
        """module with its parameters gathered (gather_params); module itself without fsdp."""
        if self.fsdp == 1:
            return module
        graphdef, state = nnx.split(module)
        return nnx.merge(graphdef, self.gather_params(state))


SINGLE_DEVICE = ParallelContext()
