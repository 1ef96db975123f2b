"""The norms' kernels behind one dispatch point each: the gated grouped RMSNorm of Mamba2's
output (mamba_ssm's RMSNormGated with norm_before_gate=False) and the residual stream's add
and RMSNorm at each layer's start (mamba_ssm's fused_add_norm).

    out = gated_rms_norm(y, z, weight, eps=1e-5, ngroups=1)
    summed, normed = add_rms_norm(residual, delta, weight, eps=1e-5)

Legend: h heads, p headdim, "..." leading axes (e.g. b l), N their product (rows).
y, z [..., h, p] (bfloat16 in training, or float32), weight [h, p] (float32), h divisible
by ngroups -> out [..., h, p] in y's dtype. In float32: gated = y * silu(z); each of the
ngroups contiguous groups of (h / ngroups) * p entries of the flattened (h, p) axes times
rsqrt(mean(gated**2 over the group) + eps); times weight; rounded to y's dtype.
gated_rms_norm_spanning(y, z, weight, eps, ngroups, axis_name, ranks): the same inside
jax.shard_map for a device's heads of a layer whose groups span the devices of a mesh axis
(tensor parallelism that does not divide the groups), in XLA: each device sums its part of
every group's squares, and one psum over axis_name completes them.

`implementation`: "xla" (reference.py, any platform), "triton" (triton.py: one Pallas
kernel for the forward, reading y and z and writing out once, and one for the backward,
recomputing gated and the groups' rstd from y and z and writing dy, dz and float32 partial
sums of dweight; a custom_vjp whose residuals are y, z and weight only, no float32 copy of
an activation. Off a GPU they run in Pallas's interpreter) or "auto": "triton" on a GPU of
compute capability 9.0 or more (Hopper) where the kernels take the case (float32 or
bfloat16 y, groups of at most triton.MAX_GROUP = 8192 entries, any row count and any group
size, a group size that is no power of two in masked power-of-two blocks), else "xla". On
such a GPU a case the kernels do not take is logged once (pallas_kernels.fallback), never a
silent slow path.

add_rms_norm: residual [..., d] (float32 when residual_in_fp32, or the compute dtype), delta
[..., d] (a layer's output in the compute dtype, not yet added), weight [d] float32 ->
summed = residual + delta in residual's dtype, and normed = summed * rsqrt(mean(summed**2) +
eps) * weight computed in float32 and rounded to delta's dtype. "triton": one kernel for the
forward, reading residual and delta and writing summed and normed once; one for the
backward, reading summed, the two cotangents and writing the gradient of summed (dresidual,
and ddelta in delta's dtype where it differs) with float32 partials of dweight; a custom_vjp
whose residuals are summed (the next layer's residual, kept anyway) and weight. "auto" as
gated_rms_norm's, for float32 or bfloat16 residual and delta and rows of at most MAX_GROUP.
"""

from __future__ import annotations

from pallas_kernels import fallback, hardware
from pallas_kernels.norm import reference, triton
from pallas_kernels.norm.reference import (add_rms_norm_reference, gated_rms_norm_reference,
                                           gated_rms_norm_spanning, rms_norm_reference)
from pallas_kernels.triton_call import off_gpu

__all__ = ["gated_rms_norm", "gated_rms_norm_reference", "gated_rms_norm_spanning",
           "add_rms_norm", "add_rms_norm_reference", "rms_norm_reference", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("auto", "xla", "triton")


def gated_rms_norm(y, z, weight, eps, ngroups, *, implementation="auto"):
    """y, z [..., h, p], weight [h, p] -> [..., h, p] in y's dtype; see the module
    docstring."""
    _check_implementation("gated_rms_norm", implementation)
    if y.ndim < 2 or z.shape != y.shape or weight.shape != y.shape[-2:]:
        raise ValueError(f"gated_rms_norm: y and z must be [..., h, p] and weight [h, p]; got "
                         f"y {y.shape}, z {z.shape}, weight {weight.shape}")
    if ngroups < 1 or y.shape[-2] % ngroups:
        raise ValueError(f"gated_rms_norm: ngroups={ngroups} must divide the heads, "
                         f"{y.shape[-2]}")
    if implementation == "auto":
        implementation = "triton" if kernels_run(y, ngroups) else "xla"
    if implementation == "triton":
        return triton.gated_rms_norm(y, z, weight, eps, ngroups,
                                     interpret=off_gpu())
    return reference.gated_rms_norm_reference(y, z, weight, eps, ngroups)


def kernels_run(y, ngroups) -> bool:
    """"auto"'s choice for y [..., h, p]: whether the kernels run (module docstring), a
    fallback logged once where they would but cannot."""
    if not hardware.measured_gpu():
        return False
    if not triton.supports(y.shape, y.dtype, ngroups):
        *_, h, p = y.shape
        fallback.log_once("gated_rms_norm", f"y {y.dtype} [..., {h}, {p}] with {ngroups} "
                          f"groups (the kernels take float32 and bfloat16, at least one row "
                          f"and groups of at most {triton.MAX_GROUP} entries)")
        return False
    return True


def add_rms_norm(residual, delta, weight, eps, *, implementation="auto"):
    """mamba_ssm's fused add and RMSNorm of the residual stream: residual, delta [..., d],
    weight [d] -> (summed = residual + delta in residual's dtype, its RMSNorm times weight
    in delta's dtype); see the module docstring."""
    _check_implementation("add_rms_norm", implementation)
    if delta.shape != residual.shape or weight.shape != residual.shape[-1:]:
        raise ValueError(f"add_rms_norm: residual and delta must be [..., d] and weight [d]; "
                         f"got residual {residual.shape}, delta {delta.shape}, weight "
                         f"{weight.shape}")
    if implementation == "auto":
        implementation = "triton" if add_kernels_run(residual, delta) else "xla"
    if implementation == "triton":
        return triton.add_rms_norm(residual, delta, weight, eps, interpret=off_gpu())
    return reference.add_rms_norm_reference(residual, delta, weight, eps)


def add_kernels_run(residual, delta) -> bool:
    """"auto"'s choice for add_rms_norm: whether its kernels run (module docstring), a
    fallback logged once where they would but cannot."""
    if not hardware.measured_gpu():
        return False
    if not triton.supports_add(residual.shape, residual.dtype, delta.dtype):
        fallback.log_once("add_rms_norm", f"residual {residual.dtype} and delta "
                          f"{delta.dtype} [..., {residual.shape[-1]}] (the kernels take "
                          f"float32 and bfloat16, at least one row and at most "
                          f"{triton.MAX_GROUP} entries a row)")
        return False
    return True


def _check_implementation(name, implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{name}: implementation={implementation!r} is not one of "
                         f"{IMPLEMENTATIONS}")
