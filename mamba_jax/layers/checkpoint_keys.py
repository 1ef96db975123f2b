"""Checkpoint key tables: how a layer's torch tensors are made of its parameters, declared
once per layer kind and format and applied both ways (mamba_jax.convert).

A table maps a tensor's key (after the layer's prefix, e.g. "in_proj.weight") to an entry
naming our parameters it holds:

    Linear("z_proj", "x_proj", "B_proj", "C_proj", "dt_proj")   # in_proj.weight [z|x|B|C|dt]
    Conv("x_conv", "B_conv", "C_conv")                          # conv1d.weight
    Flat("norm")                                                # norm.weight
    AsIs("A_log")                                   # Mamba-1's A_log [d_inner, d_state]

An entry applies where the layer has all its parameters (an optional bias is simply absent);
a layer that has only some of them is an error.
"""

from __future__ import annotations

import math

import numpy as np


class _Entry:
    """Parameters concatenated, in order, along one axis of a torch tensor."""

    def __init__(self, *params: str):
        self.params = params

    def _split(self, joined, sizes, axis):
        return np.split(joined, np.cumsum(sizes)[:-1], axis=axis)


class Linear(_Entry):
    """An nn.Linear weight [out, in]: our parameters, each [in..., out...] with `inputs`
    leading input axes, flattened and concatenated along out (e.g. mamba_ssm's fused
    in_proj, [z | x | B | C | dt]); `inputs=2` for an out_proj [h, p, d]."""

    def __init__(self, *params: str, inputs: int = 1):
        super().__init__(*params)
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


class AsIs(_Entry):
    """One parameter stored with its own shape (Mamba-1's A_log [d_inner, d_state],
    mamba_ssm's Mamba3 B_bias [h, r, n])."""

    def torch_shape(self, shapes):
        return tuple(shapes[0])

    def to_torch(self, arrays):
        return arrays[0]

    def from_torch(self, tensor, shapes):
        return [tensor]


class Flat(_Entry):
    """A vector: our parameters flattened and concatenated (a bias, a norm weight, A_log)."""

    def torch_shape(self, shapes):
        return (sum(math.prod(s) for s in shapes),)

    def to_torch(self, arrays):
        return np.concatenate([a.reshape(-1) for a in arrays])

    def from_torch(self, tensor, shapes):
        sizes = [math.prod(s) for s in shapes]
        return [a.reshape(s) for a, s in zip(self._split(tensor, sizes, 0), shapes)]


def _applies(key, entry, names) -> bool:
    present = [p in names for p in entry.params]
    if any(present) and not all(present):
        missing = [p for p, there in zip(entry.params, present) if not there]
        raise ValueError(f"checkpoint key {key!r} holds {entry.params}; the layer lacks "
                         f"{missing}")
    return all(present)


def to_torch(table: dict, params: dict) -> dict:
    """One layer's parameters {name: array} -> its tensors {key: array} by table."""
    return {key: entry.to_torch([params[p] for p in entry.params])
            for key, entry in table.items() if _applies(key, entry, params)}


def from_torch(table: dict, take, shapes: dict) -> dict:
    """One layer's tensors -> its parameters {name: array} by table. shapes: {name: shape}
    of the layer's parameters; take(key, shape) returns the tensor at key, checked to have
    that shape."""
    out = {}
    for key, entry in table.items():
        if _applies(key, entry, shapes):
            param_shapes = [shapes[p] for p in entry.params]
            tensor = take(key, entry.torch_shape(param_shapes))
            out.update(zip(entry.params, entry.from_torch(tensor, param_shapes)))
    return out
