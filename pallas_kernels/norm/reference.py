"""The norms in plain JAX: the oracles of the kernels and the "xla" path.

Legend: h heads, p headdim, d the normed axis, "..." leading axes (e.g. b l).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


# Rematerialised: the backward pass recomputes the float32 intermediates from y and z rather
# than keep them, as mamba_ssm's fused norm does.
@functools.partial(jax.checkpoint, static_argnums=(3, 4))
def gated_rms_norm_reference(y, z, weight, eps, ngroups):
    """mamba_ssm's RMSNormGated(norm_before_gate=False, group_size=h*p/ngroups), as
    mamba_jax.layers.common.gated_rms_norm takes it where a device holds whole groups.

    y, z [..., h, p] (any float dtype), weight [h, p], h % ngroups == 0 -> [..., h, p] in
    y's dtype. In float32 (float64 for float64 inputs, the tests' oracle): gated = y *
    silu(z); each of the ngroups contiguous groups of (h / ngroups) * p entries of the
    flattened (h, p) axes times rsqrt(mean(gated**2 over the group) + eps); times weight."""
    *lead, h, p = y.shape
    compute = jnp.promote_types(y.dtype, jnp.float32)
    gated = y.astype(compute) * jax.nn.silu(z.astype(compute))
    grouped = gated.reshape(*lead, ngroups, (h // ngroups) * p)
    inv_rms = jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + eps)
    normed = (grouped * inv_rms).reshape(*lead, h, p)
    return (normed * weight.astype(compute)).astype(y.dtype)


@functools.partial(jax.checkpoint, static_argnums=(3, 4, 5, 6))
def gated_rms_norm_spanning(y, z, weight, eps, ngroups, axis_name, ranks):
    """gated_rms_norm_reference where the layer's heads are split over the `ranks` devices of
    the mesh axis `axis_name` (inside jax.shard_map) but its ngroups groups are not, so that
    a group spans devices: y, z [..., h, p], device r's heads [r*h, (r+1)*h) of the layer's
    h * ranks, weight [h, p] -> [..., h, p] in y's dtype, computed in float32. Each device
    sums the squares of its part of every group and one psum over axis_name completes them:
    [..., ngroups] floats, not activations."""
    h, p = y.shape[-2:]
    gated = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    heads = jax.lax.axis_index(axis_name) * h + jnp.arange(h)
    member = (heads[:, None] // (h * ranks // ngroups)
              == jnp.arange(ngroups)).astype(jnp.float32)  # [h, ngroups]
    sum_sq = jax.lax.psum(jnp.einsum("...hp,hg->...g", gated * gated, member), axis_name)
    inv_rms = jax.lax.rsqrt(sum_sq / (h * ranks * p // ngroups) + eps) @ member.T
    normed = gated * inv_rms[..., None]
    return (normed * weight.astype(jnp.float32)).astype(y.dtype)


@functools.partial(jax.checkpoint, static_argnums=(2,))
def rms_norm_reference(x, weight, eps):
    """x [..., d], weight [d] -> x * rsqrt(mean(x**2) + eps) * weight in x's dtype, computed
    in float32 (float64 for float64 x). Rematerialised: the backward pass recomputes it from
    x rather than keep a float32 copy."""
    compute = jnp.promote_types(x.dtype, jnp.float32)
    x32 = x.astype(compute)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(compute)).astype(x.dtype)


def add_rms_norm_reference(residual, delta, weight, eps):
    """mamba_ssm's fused add and RMSNorm (layer_norm_fn with a residual, prenorm, as its
    Blocks call it): residual, delta [..., d], weight [d] -> (summed = residual + delta in
    residual's dtype, rms_norm_reference(summed) in delta's dtype)."""
    summed = residual + delta.astype(residual.dtype)
    return summed, rms_norm_reference(summed, weight, eps).astype(delta.dtype)
