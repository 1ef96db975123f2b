"""Checkpoint key tables: how a layer's torch tensors are made of its parameters, declared
once per layer kind and format and applied both ways (mamba_jax.convert).

A table maps a tensor's key (after the layer's prefix, e.g. "in_proj.weight") to an entry
naming our parameters it holds:

    Linear("z_proj", "x_proj", "B_proj", "C_proj", "dt_proj")   # in_proj.weight [z|x|B|C|dt]
    Conv("x_conv", "B_conv", "C_conv")                          # conv1d.weight
    Flat("norm")                                                # norm.weight
    AsIs("A_log")                                   # Mamba-1's A_log [d_inner, d_state]
    GroupedQKV("q_proj", "k_proj", "v_proj")        # Megatron's linear_qkv, per KV group

An entry applies where the layer has all its parameters (an optional bias is simply absent);
a layer that has only some of them is an error, but for the parameters an entry names
`optional` (Megatron's linear_fc1 holds [gate | up] for SwiGLU, up alone otherwise).

Tensor parallel layouts (Megatron-LM's per-rank files): a tensor splits across the ranks
where its parameters split across our tp axis (their logical axes, mamba_jax.sharding.RULES),
each part on its own (`tp_parts`): rank r's in_proj is [z_r | x_r | B_r | C_r | dt_r], its
out_proj the columns of its heads, its linear_qkv its KV groups' rows; `split_ranks` and
`merge_ranks` cut and join them.
"""

from __future__ import annotations

import copy
import math

import numpy as np


class _Entry:
    """Parameters concatenated, in order, along one axis of a torch tensor; `optional`: those
    of them a layer may lack (the entry then holds the others)."""

    inputs = 0  # the parameters' leading dimensions that are a torch weight's input axis

    def __init__(self, *params: str, optional: tuple[str, ...] = ()):
        self.params = params
        self.optional = optional

    def _split(self, joined, sizes, axis):
        return np.split(joined, np.cumsum(sizes)[:-1], axis=axis)

    def held(self, names):
        """This entry over the parameters of `names` (a layer's) it names, or None where it
        names none of them; a ValueError where a required one is missing."""
        present = tuple(p for p in self.params if p in names)
        missing = [p for p in self.params if p not in names and p not in self.optional]
        if present and missing:
            raise ValueError(f"checkpoint entry {self.params} needs {missing}, which the "
                             "layer lacks")
        if not present:
            return None
        entry = copy.copy(self)
        entry.params = present
        return entry

    def tp_parts(self, shapes, tp_dims):
        """(the torch axis its tensor splits on across tensor-parallel ranks, the sizes of
        its parts along it, each cut in tp pieces), or None where it is whole on every rank.
        shapes: the parameters' shapes; tp_dims: each one's dimension split over tp (None:
        not split). The parameters' dimensions before `self.inputs` are the torch tensor's
        second axis, the others its first (as Linear stacks them)."""
        dims = [d for d in tp_dims if d is not None]
        if not dims:
            return None
        if dims[0] < self.inputs:  # a row-parallel weight: the input axis, one part
            return 1, [math.prod(shapes[0][:self.inputs])]
        return 0, [math.prod(s[self.inputs:]) for s in shapes]


class Linear(_Entry):
    """An nn.Linear weight [out, in]: our parameters, each [in..., out...] with `inputs`
    leading input axes, flattened and concatenated along out (e.g. mamba_ssm's fused
    in_proj, [z | x | B | C | dt]); `inputs=2` for an out_proj [h, p, d]."""

    def __init__(self, *params: str, inputs: int = 1, optional: tuple[str, ...] = ()):
        super().__init__(*params, optional=optional)
        self.inputs = inputs

    def torch_shape(self, shapes):
        return (sum(math.prod(s[self.inputs:]) for s in shapes),
                math.prod(shapes[0][:self.inputs]))

    def to_torch(self, arrays):
        n_in = math.prod(arrays[0].shape[:self.inputs])
        return np.concatenate([a.reshape(n_in, -1) for a in arrays], axis=1).T

    def from_torch(self, tensor, shapes):
        sizes = [math.prod(s[self.inputs:]) for s in shapes]
        return [a.reshape(s) for a, s in zip(self._split(tensor.T, sizes, 1), shapes)]


class Conv(_Entry):
    """A depthwise nn.Conv1d weight [channels, 1, k]: our parameters, each [k, channels...],
    concatenated along the channels (mamba_ssm's conv1d over [x | B | C])."""

    def torch_shape(self, shapes):
        return (sum(math.prod(s[1:]) for s in shapes), 1, shapes[0][0])

    def to_torch(self, arrays):
        k = arrays[0].shape[0]
        return np.concatenate([a.reshape(k, -1) for a in arrays], axis=1).T[:, None, :]

    def from_torch(self, tensor, shapes):
        sizes = [math.prod(s[1:]) for s in shapes]
        return [a.reshape(s) for a, s in zip(self._split(tensor[:, 0].T, sizes, 1), shapes)]

    def tp_parts(self, shapes, tp_dims):
        if all(d is None for d in tp_dims):
            return None
        return 0, [math.prod(s[1:]) for s in shapes]


class AsIs(_Entry):
    """One parameter stored with its own shape (Mamba-1's A_log [d_inner, d_state],
    mamba_ssm's Mamba3 B_bias [h, r, n])."""

    def torch_shape(self, shapes):
        return tuple(shapes[0])

    def to_torch(self, arrays):
        return arrays[0]

    def from_torch(self, tensor, shapes):
        return [tensor]

    def tp_parts(self, shapes, tp_dims):
        return None if tp_dims[0] is None else (tp_dims[0], [shapes[0][tp_dims[0]]])


class Flat(_Entry):
    """A vector: our parameters flattened and concatenated (a bias, a norm weight, A_log)."""

    def torch_shape(self, shapes):
        return (sum(math.prod(s) for s in shapes),)

    def to_torch(self, arrays):
        return np.concatenate([a.reshape(-1) for a in arrays])

    def from_torch(self, tensor, shapes):
        sizes = [math.prod(s) for s in shapes]
        return [a.reshape(s) for a, s in zip(self._split(tensor, sizes, 0), shapes)]


class GroupedQKV(Linear):
    """Megatron-LM's linear_qkv weight [k * (h/k + 2) * e, in] (or its bias, inputs=0):
    per KV group, the group's h/k query heads, then its key head and its value head, from
    our q [in..., h, e] and k, v [in..., k, e]. Tensor-parallel ranks hold whole groups'
    rows (contiguous), one part."""

    def __init__(self, q: str, k: str, v: str, inputs: int = 1):
        super().__init__(q, k, v, inputs=inputs)

    def _groups(self, shapes):
        (*_, h, e), (*_, k, _) = shapes[0], shapes[1]
        return k, h // k, e

    def to_torch(self, arrays):
        k, per, e = self._groups([a.shape for a in arrays])
        lead = arrays[0].shape[:self.inputs]
        q, kv = arrays[0].reshape(*lead, k, per, e), [a[..., None, :] for a in arrays[1:]]
        grouped = np.concatenate([q, *kv], axis=-2)  # [in..., k, per + 2, e]
        return grouped.reshape(math.prod(lead), -1).T.reshape(-1, *([math.prod(lead)]
                                                                   if self.inputs else []))

    def from_torch(self, tensor, shapes):
        k, per, e = self._groups(shapes)
        lead = shapes[0][:self.inputs]
        grouped = tensor.reshape(-1, math.prod(lead)).T.reshape(*lead, k, per + 2, e)
        q, key, value = np.split(grouped, [per, per + 1], axis=-2)
        return [q.reshape(shapes[0]), key.reshape(shapes[1]), value.reshape(shapes[2])]

    def torch_shape(self, shapes):
        rows = sum(math.prod(s[self.inputs:]) for s in shapes)
        return (rows, math.prod(shapes[0][:self.inputs])) if self.inputs else (rows,)

    def tp_parts(self, shapes, tp_dims):
        return None if tp_dims[0] is None else (0, [self.torch_shape(shapes)[0]])


def split_ranks(tensor, parts, tp: int) -> list:
    """A whole tensor -> its tp ranks' tensors: `parts` (tp_parts' (axis, sizes)) each cut
    in tp pieces, rank r's pieces joined in order. parts None: every rank holds it whole."""
    if parts is None:
        return [tensor] * tp
    axis, sizes = parts
    pieces = [np.split(part, tp, axis=axis)
              for part in np.split(tensor, np.cumsum(sizes)[:-1], axis=axis)]
    return [np.concatenate([part[r] for part in pieces], axis=axis) for r in range(tp)]


def merge_ranks(tensors: list, parts):
    """The inverse of split_ranks: tp ranks' tensors -> the whole tensor (where parts is
    None, the first rank's: each holds it whole)."""
    if parts is None:
        return tensors[0]
    axis, sizes = parts
    tp = len(tensors)
    local = [size // tp for size in sizes]
    cut = [np.split(t, np.cumsum(local)[:-1], axis=axis) for t in tensors]
    return np.concatenate([np.concatenate([rank[i] for rank in cut], axis=axis)
                           for i in range(len(sizes))], axis=axis)


def to_torch(table: dict, params: dict) -> dict:
    """One layer's parameters {name: array} -> its tensors {key: array} by table."""
    return {key: entry.to_torch([params[p] for p in entry.params])
            for key, entry in held_table(table, params).items()}


def held_table(table: dict, names) -> dict:
    """Of a kind's table, the entries a layer of parameters `names` has, each over the
    parameters it holds (_Entry.held); the key named in an error."""
    out = {}
    for key, entry in table.items():
        try:
            held = entry.held(names)
        except ValueError as error:
            raise ValueError(f"checkpoint key {key!r}: {error}") from None
        if held is not None:
            out[key] = held
    return out


def from_torch(table: dict, take, shapes: dict) -> dict:
    """One layer's tensors -> its parameters {name: array} by table. shapes: {name: shape}
    of the layer's parameters; take(key, shape) returns the tensor at key, checked to have
    that shape."""
    out = {}
    for key, entry in held_table(table, shapes).items():
        param_shapes = [shapes[p] for p in entry.params]
        tensor = take(key, entry.torch_shape(param_shapes))
        out.update(zip(entry.params, entry.from_torch(tensor, param_shapes)))
    return out
