"""The gated grouped RMSNorm in plain JAX: the oracle of the kernels and the "xla" path.

Legend: h heads, p headdim, "..." leading axes (e.g. b l).
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
