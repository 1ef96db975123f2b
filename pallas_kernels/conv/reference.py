"""The depthwise conv1d and SiLU in plain JAX: the reference for the kernels (triton.py) and
the path wherever they do not run. Shapes as in `pallas_kernels.conv`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


# Rematerialised: the backward pass recomputes the float32 taps from x rather than keep them
# (kept, a mamba2-1.3b layer's were about 100 KB a token).
@functools.partial(jax.checkpoint, static_argnums=(4,))
def conv1d(x, weight, bias, doc, left):
    """x [b, l, ...], weight [k, ...], bias [...] or None, doc [b, l] or None -> silu(bias +
    sum_j weight[j] * x_{t-left+j}) [b, l, ...] in x.dtype, float32 inside; zeros stand
    outside x and in place of taps of another document."""
    k = weight.shape[0]
    l = x.shape[1]
    pad = [(0, 0), (left, k - 1 - left)] + [(0, 0)] * (x.ndim - 2)
    xp = jnp.pad(x.astype(jnp.float32), pad)
    w = weight.astype(jnp.float32)
    y = jnp.zeros(x.shape, jnp.float32) if bias is None else jnp.broadcast_to(
        bias.astype(jnp.float32), x.shape)
    if doc is not None:
        docp = jnp.pad(doc, pad[:2], constant_values=-1)
    for j in range(k):
        tap = xp[:, j:j + l] * w[j]
        if doc is not None:
            same = docp[:, j:j + l] == doc
            tap = jnp.where(same.reshape(same.shape + (1,) * (x.ndim - 2)), tap, 0.0)
        y = y + tap
    return jax.nn.silu(y).astype(x.dtype)
