"""FP8 matmuls for training with per-tensor current scaling, in the form that XLA's GPU
compiler runs as cuBLASLt FP8 GEMMs: E4M3 for both operands of the forward product, E5M2
for the gradient entering the backward products (Transformer Engine's "hybrid" format).

Legend: "..." an einsum's axes; amax = max |x| over a whole tensor.

Current scaling: each tensor's scale comes from its own amax at this step, s = amax /
fp8_max (Megatron-LM's `--fp8-recipe tensorwise`, the recipe Nemotron-H was pretrained with),
so nothing is kept between steps. Inside `jax.shard_map` the amax is reduced (pmax) over the
mesh axes the caller names, so that a tensor split over devices gets the scale one device
holding all of it would get. A tensor whose amax is 0 (all zeros) or not finite gets s = 1:
zeros stay zeros, and a NaN or inf propagates rather than becoming a scale. The scale is
rounded to the compute dtype, in which the dequantized operands are written; a value that
the rounding puts past fp8_max (by at most one part in 2**8) saturates there, as every
value past it would: never inf or NaN (E4M3 has no inf, and a plain cast of 449 is NaN).

XLA's GEMM rewriter (xla/service/gpu/transforms/gemm_rewriter.cc) matches
`dot(convert(a_f8) * s_a, convert(b_f8) * s_b)` (a dequantize around each operand of a
dot, through reshapes and transposes) and emits one `__cublas$lt$matmul$f8` custom call
with the scales folded into its alpha; the rewriter does not read `xla_gpu_enable_cublaslt`
(that flag picks the library of the other GEMMs). This module writes exactly that pattern;
on a CPU the same program runs with the dequantized operands multiplied in the compute
dtype: an emulation, for numerics. The backward products ask for Precision.HIGHEST, as
flax's FP8 ops (flax.linen.fp8_ops) do, for cuBLASLt's FP8 accumulation without its fast
accumulation (Transformer Engine's split accumulator for dgrad and wgrad); the forward
keeps DEFAULT.

flax.linen.fp8_ops has the same quantize and dequantize, but for delayed scaling only (an
amax history in linen variables that its custom VJPs overwrite through the gradient), with
no reduction of an amax over a mesh: not used here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

E4M3 = jnp.float8_e4m3fn  # weights and activations: max 448, 3 mantissa bits
E5M2 = jnp.float8_e5m2    # gradients: max 57344, 2 mantissa bits


def fp8_max(dtype) -> float:
    """The largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    return float(jnp.finfo(dtype).max)


def amax(x, axes: tuple[str, ...] = ()):
    """max |x| over the whole tensor, float32 [], reduced over the mesh axes `axes` (inside
    shard_map; () on one device)."""
    m = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return lax.pmax(m, axes) if axes else m


def scale(amax_value, dtype, compute_dtype):
    """The per-tensor scale of a tensor of amax `amax_value` [] quantized to `dtype`: amax /
    fp8_max rounded to compute_dtype (in which it multiplies the dequantized values); 1
    where amax is 0 or not finite."""
    s = amax_value / fp8_max(dtype)
    usable = (amax_value > 0) & jnp.isfinite(amax_value)
    return jnp.where(usable, s, 1.0).astype(compute_dtype)


def quantize(x, dtype, s):
    """x / s saturated to [-fp8_max, fp8_max] and cast to the FP8 dtype (computed in
    float32: one rounding, the cast's)."""
    top = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) / s.astype(jnp.float32), -top, top).astype(dtype)


def dequantize(q, s):
    """q (FP8) times its scale s, in s's dtype: the operand of a dot that XLA folds into the
    FP8 GEMM."""
    return q.astype(s.dtype) * s


def quantized(x, dtype, compute_dtype, axes=()):
    """x -> (its FP8 values in dtype, its scale [] in compute_dtype), current scaling."""
    s = scale(amax(x, axes), dtype, compute_dtype)
    return quantize(x, dtype, s), s


def operands(a, b, compute_dtype, axes=()):
    """A forward product's operands a, b -> ((a's E4M3 values, scale), (b's, scale)): their
    two amaxes reduced in one collective."""
    both = jnp.stack([amax(a), amax(b)])
    both = lax.pmax(both, axes) if axes else both
    s_a, s_b = (scale(m, E4M3, compute_dtype) for m in (both[0], both[1]))
    return (quantize(a, E4M3, s_a), s_a), (quantize(b, E4M3, s_b), s_b)


def gradient(g, compute_dtype, axes=()):
    """A product's output gradient g -> its E5M2 values dequantized (in compute_dtype), the
    operand of the backward products."""
    return dequantize(*quantized(g, E5M2, compute_dtype, axes))


# The backward products' precision: XLA's FP8 GEMMs without fast accumulation (split
# accumulators, as Transformer Engine's dgrad and wgrad); the forward's DEFAULT, with it.
BACKWARD = lax.Precision.HIGHEST


def transposed(spec: str) -> tuple[str, str]:
    """"A,B->C" -> the specs of its two backward products: ("C,B->A", "A,C->B")."""
    ins, out = spec.split("->")
    a, b = ins.split(",")
    return f"{out},{b}->{a}", f"{a},{out}->{b}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4, 5))
def matmul(spec, a, b, dtype, out_dtype=jnp.float32, axes: tuple[str, ...] = ()):
    """jnp.einsum(spec, a, b) as FP8 matmuls: a and b quantized to E4M3 with their current
    scales, the product accumulated in float32 and returned in out_dtype; dtype the compute
    dtype (of the dequantized operands and the scales). spec: two operands whose every
    index is in exactly two of the operands and the output (a projection: "...d,df->...f",
    "...hp,hpd->...d").

    Backward: the output's gradient quantized to E5M2 with its own current scale; a's
    gradient the product of it with b's E4M3 values, b's with a's, both in dtype (cast to
    a's and b's dtypes), as layers.common.matmul's backward runs in the compute dtype. The
    forward keeps a's and b's FP8 values and scales for it: half the bytes of bf16 operands.
    axes: the mesh axes every amax is reduced over (the axes a, b or the gradient may be
    split over, inside shard_map)."""
    return _matmul_fwd(spec, a, b, dtype, out_dtype, axes)[0]


def _matmul_fwd(spec, a, b, dtype, out_dtype, axes):
    (q_a, s_a), (q_b, s_b) = operands(a, b, dtype, axes)
    y = jnp.einsum(spec, dequantize(q_a, s_a), dequantize(q_b, s_b),
                   preferred_element_type=out_dtype)
    # zero-sized arrays carry a's and b's dtypes to the backward
    return y, (q_a, s_a, q_b, s_b, jnp.zeros((0,), a.dtype), jnp.zeros((0,), b.dtype))


def _matmul_bwd(spec, dtype, out_dtype, axes, residuals, g):
    q_a, s_a, q_b, s_b, a_like, b_like = residuals
    g = gradient(g, dtype, axes)
    spec_a, spec_b = transposed(spec)
    product = functools.partial(jnp.einsum, preferred_element_type=dtype, precision=BACKWARD)
    da = product(spec_a, g, dequantize(q_b, s_b))
    db = product(spec_b, dequantize(q_a, s_a), g)
    return da.astype(a_like.dtype), db.astype(b_like.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)
