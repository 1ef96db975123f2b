"""`scan(step, carry, xs)`: `lax.scan` for the model's run of layers, differentiable, with
each step's residuals for the backward pass kept in stacks that are never zero-filled.

Differentiated, `lax.scan` keeps what each step's backward needs in stacked arrays [n, ...]
that it first fills with zeros (jax lowers their initial value as a broadcast zero), and
XLA does not elide that fill although every slot is written: in a mamba2-1.3b training step
those fills were a few percent of the time (bench/profile_step.py). Here a custom_vjp runs the
forward loop itself: each step takes `jax.vjp` of `step`, whose pullback is a pytree of
residual arrays, writes those into stacks made by `lax.empty` (XLA's no-op AllocateBuffer
on a GPU: allocated, not written; zeros on a CPU), and the backward loop reads them back
in reverse, rebuilds each step's pullback and runs it. The stacked outputs `ys` are made
the same way. What is kept is what `jax.vjp` of `step` keeps, so a jax.checkpoint policy
on `step` (the trainer's --remat) chooses it as under `lax.scan`.

A residual that is the step's own slice of xs (a layer's weight that its backward reads,
every weight under --remat full) is not stacked again: the backward loop slices it from
xs, which the gradient holds anyway, as `lax.scan` forwards such residuals. Stacked, a
mamba2-1.3b layer's float32 out_proj alone was a 33.5 MB copy in and out of a stack per
layer and step, 1.6 GB held.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def scan(step, carry, xs):
    """lax.scan(step, carry, xs) -> (carry, ys) for step(carry, x) -> (carry, y), over the
    leading axis of every leaf of xs (no `length`, `reverse` or `unroll`). Its gradient
    flows to carry and to the floating-point leaves of xs; an integer leaf gets float0."""
    n = jax.tree.leaves(xs)[0].shape[0]
    traced = {}  # a step pullback's structure and which of its leaves are slices of xs

    @jax.custom_vjp
    def run(carry, xs):
        return lax.scan(step, carry, xs)

    def vjp(carry, x):
        """jax.vjp of step -> ((carry, y), the pullback's leaves). Records the pullback's
        structure (the loop body's trace, run last, is the one the backward rebuilds) and
        which leaf of x each leaf is (or None), checked equal on every trace: the loop's
        body must keep what the stacks were made for."""
        out, pullback = jax.vjp(step, carry, x)
        leaves, traced["treedef"] = jax.tree.flatten(pullback)
        which = {id(a): k for k, a in enumerate(jax.tree.leaves(x))}
        of_xs = tuple(which.get(id(a)) for a in leaves)
        if traced.setdefault("of_xs", of_xs) != of_xs:
            raise RuntimeError("layer_scan: a trace of the step kept other residuals than "
                               "its first trace, which the stacks were made for")
        return out, leaves

    def run_fwd(carry, xs):
        (_, y), leaves = jax.eval_shape(vjp, carry, _at(xs, 0))
        stacks = [None if k is not None else lax.empty((n, *a.shape), a.dtype)
                  for a, k in zip(leaves, traced["of_xs"])]
        ys = jax.tree.map(lambda a: lax.empty((n, *a.shape), a.dtype), y)

        def body(i, state):
            carry, stacks, ys = state
            (carry, y), leaves = vjp(carry, _at(xs, i))
            stacks = [s if s is None else _set(s, leaf, i) for s, leaf in zip(stacks, leaves)]
            return carry, stacks, jax.tree.map(lambda s, leaf: _set(s, leaf, i), ys, y)
        carry, stacks, ys = lax.fori_loop(0, n, body, (carry, stacks, ys))
        return (carry, ys), (stacks, xs)

    def run_bwd(residuals, cotangents):
        stacks, xs = residuals
        xs_leaves = jax.tree.leaves(xs)
        dcarry, dys = cotangents
        differentiable = lambda a: jnp.issubdtype(a.dtype, jnp.inexact)
        dxs = jax.tree.map(lambda a: lax.empty(a.shape, a.dtype) if differentiable(a) else None,
                           xs)

        def body(j, state):
            dcarry, dxs = state
            i = n - 1 - j
            leaves = [_at(s if k is None else xs_leaves[k], i)
                      for s, k in zip(stacks, traced["of_xs"])]
            dcarry, dx = jax.tree.unflatten(traced["treedef"], leaves)((dcarry, _at(dys, i)))
            dxs = jax.tree.map(lambda s, d: None if s is None else _set(s, d, i), dxs, dx,
                               is_leaf=lambda a: a is None)
            return dcarry, dxs
        dcarry, dxs = lax.fori_loop(0, n, body, (dcarry, dxs))
        dxs = jax.tree.map(lambda d, a: d if d is not None or a is None else
                           jnp.zeros(a.shape, jax.dtypes.float0), dxs, xs,
                           is_leaf=lambda a: a is None)
        return dcarry, dxs

    run.defvjp(run_fwd, run_bwd)
    return run(carry, xs)


def _at(tree, i):
    """Every leaf's slice i of its leading axis."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _set(stack, value, i):
    return lax.dynamic_update_index_in_dim(stack, value, i, 0)
