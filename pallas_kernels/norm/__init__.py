"""The gated grouped RMSNorm of Mamba2's output (mamba_ssm's RMSNormGated with
norm_before_gate=False) behind one dispatch point.

    out = gated_rms_norm(y, z, weight, eps=1e-5, ngroups=1)

Legend: h heads, p headdim, "..." leading axes (e.g. b l), N their product (rows).
y, z [..., h, p] (bfloat16 in training, or float32), weight [h, p] (float32), h divisible
by ngroups -> out [..., h, p] in y's dtype. In float32: gated = y * silu(z); each of the
ngroups contiguous groups of (h / ngroups) * p entries of the flattened (h, p) axes times
rsqrt(mean(gated**2 over the group) + eps); times weight; rounded to y's dtype.

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
"""

from __future__ import annotations

from pallas_kernels import fallback, hardware
from pallas_kernels.norm import reference, triton
from pallas_kernels.norm.reference import gated_rms_norm_reference
from pallas_kernels.triton_call import off_gpu

__all__ = ["gated_rms_norm", "gated_rms_norm_reference", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("auto", "xla", "triton")


def gated_rms_norm(y, z, weight, eps, ngroups, *, implementation="auto"):
    """y, z [..., h, p], weight [h, p] -> [..., h, p] in y's dtype; see the module
    docstring."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"gated_rms_norm: implementation={implementation!r} is not one of "
                         f"{IMPLEMENTATIONS}")
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
