"""Small building blocks: RMSNorm, gated per-group RMSNorm, causal depthwise conv1d.

Legend: b batch, l sequence, d model width, k conv width, "..." channel axes (e.g. h p).
Norms compute in float32 and return the input's dtype, as mamba_ssm's Triton norms do.
The norms and the conv are rematerialised (jax.checkpoint): the backward pass recomputes
their cheap elementwise float32 intermediates from the inputs instead of keeping them, as
mamba_ssm's fused kernels do (kept, they were about 250 KB per token per 1.3b layer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x, weight, eps):
    """x [..., d], weight [d] -> x / rms(x) * weight, in float32, cast back to x.dtype."""
    @jax.checkpoint
    def norm(x, weight):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (y * weight.astype(jnp.float32)).astype(x.dtype)
    return norm(x, weight)


def gated_rms_norm(y, z, weight, eps, ngroups):
    """mamba_ssm's RMSNormGated(norm_before_gate=False, group_size=d_inner/ngroups).

    y, z [..., h, p], weight [h, p]: normalise y * silu(z) over each group of h/ngroups heads.
    """
    @jax.checkpoint
    def norm(y, z, weight):
        *lead, h, p = y.shape
        gated = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        grouped = gated.reshape(*lead, ngroups, (h // ngroups) * p)
        normed = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True)
                                         + eps)
        return (normed.reshape(*lead, h, p) * weight.astype(jnp.float32)).astype(y.dtype)
    return norm(y, z, weight)


@jax.checkpoint
def causal_conv1d(x, weight, bias=None, doc=None):
    """Depthwise causal conv along l followed by SiLU, as mamba_ssm's causal_conv1d.

    x [b, l, ...], weight [k, ...], bias [...] or None, doc [b, l] document ids or None
    (no tap reads across a document start). Float32 accumulation; returns x.dtype.
    y_t = silu(bias + sum_j weight[j] * x_{t-k+1+j}).
    """
    k = weight.shape[0]
    l = x.shape[1]
    pad = [(0, 0), (k - 1, 0)] + [(0, 0)] * (x.ndim - 2)
    xp = jnp.pad(x.astype(jnp.float32), pad)
    w = weight.astype(jnp.float32)
    y = jnp.zeros(x.shape, jnp.float32) if bias is None else jnp.broadcast_to(
        bias.astype(jnp.float32), x.shape)
    if doc is not None:
        docp = jnp.pad(doc, ((0, 0), (k - 1, 0)), constant_values=-1)
    for j in range(k):
        tap = xp[:, j:j + l] * w[j]
        if doc is not None:
            same = docp[:, j:j + l] == doc
            tap = jnp.where(same.reshape(same.shape + (1,) * (x.ndim - 2)), tap, 0.0)
        y = y + tap
    return jax.nn.silu(y).astype(x.dtype)


def causal_conv1d_step(window, weight, bias=None):
    """One decode step of `causal_conv1d`. window [b, k, ...]: the last k inputs, newest last.

    Returns [b, ...] in window.dtype.
    """
    y = jnp.einsum("bk...,k...->b...", window.astype(jnp.float32), weight.astype(jnp.float32))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return jax.nn.silu(y).astype(window.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis; weight [d] float32, initialised to ones."""

    def __init__(self, d: int, eps: float):
        self.weight = nnx.Param(jnp.ones((d,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)
