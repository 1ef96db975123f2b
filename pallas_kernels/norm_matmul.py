"""An RMSNorm (optionally gated and grouped) feeding a matrix product, for a few rows at a
time: the projections of a one-token decoding step, each with its norm, as one kernel.

    out = rms_norm_matmul(x, weight, w, eps=1e-5)                            # in_proj
    out = rms_norm_matmul(y, weight, w_t, eps=1e-5, z=z, ngroups=g,          # out_proj
                          residual=residual, w_transposed=True)

Legend: b rows (a decoding batch), k input features, n output features.

x [b, k], any float dtype. z [b, >= k] or None: the gate, its first k columns (so a fused
projection's output can be passed whole); mamba_ssm's RMSNormGated(norm_before_gate=False).
weight [k]: the norm's scale. w [k, n], or [n, k] with w_transposed (nn.Linear's layout),
in the compute dtype. bias [n] or None. residual [b, n] or None.

In float32: v = x (times silu(z)); v over the RMS of each of ngroups equal groups of its k
columns, times weight; rounded to w's dtype; out = v @ w with float32 accumulation, plus
bias, rounded to w's dtype (the model's norm-then-matmul arithmetic, layers.rms_norm /
gated_rms_norm and layers.matmul). With residual: residual + out, in residual's dtype.
Returns [b, n] in w's dtype, or residual's dtype.

`implementation`: "xla" (`reference`) or "triton": one Pallas kernel, grid (n / bn,); each
program normalises every row (the norm's reduction is over k, so each program reads the
rows whole: a few KB each, from L2) and reduces its bn columns of w against them, w read
once. A decode step at batch 1 is bound by its kernel count (BENCHMARKS.md, Generation):
this is one kernel where XLA runs a norm fusion and a matrix-vector product. The rows are
unrolled in the kernel, so it is for a few of them; w [n, k] (w_transposed) reads
contiguous rows of k, where [k, n] reads bn columns at a stride of n. On a machine without
a GPU it runs in Pallas's interpreter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

IMPLEMENTATIONS = ("xla", "triton")


def rms_norm_matmul(x, weight, w, *, eps, z=None, ngroups=1, bias=None, residual=None,
                    w_transposed=False, implementation="xla"):
    """See the module docstring for shapes and dtypes."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"rms_norm_matmul: implementation={implementation!r} is not one of "
                         f"{IMPLEMENTATIONS}")
    k = x.shape[1]
    n = w.shape[0] if w_transposed else w.shape[1]
    if (w.shape[1] if w_transposed else w.shape[0]) != k or k % ngroups:
        raise ValueError(f"rms_norm_matmul: x {x.shape} does not match w {w.shape} "
                         f"(w_transposed={w_transposed}) or ngroups={ngroups}")
    f = _triton if implementation == "triton" else reference
    return f(x, weight, w, eps=eps, z=z, ngroups=ngroups, bias=bias, residual=residual,
             w_transposed=w_transposed)


def reference(x, weight, w, *, eps, z, ngroups, bias, residual, w_transposed):
    """rms_norm_matmul in plain JAX."""
    b, k = x.shape
    v = x.astype(jnp.float32)
    if z is not None:
        v = v * jax.nn.silu(z[:, :k].astype(jnp.float32))
    grouped = v.reshape(b, ngroups, k // ngroups)
    grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True)
                                      + eps)
    v = (grouped.reshape(b, k) * weight.astype(jnp.float32)).astype(w.dtype)
    out = jnp.einsum("bk,nk->bn" if w_transposed else "bk,kn->bn", v, w,
                     preferred_element_type=jnp.float32)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    out = out.astype(w.dtype)
    return out if residual is None else residual + out.astype(residual.dtype)


def _largest_power_of_two_dividing(v, at_most):
    return min(at_most, v & -v)


def _kernel(x_ref, weight_ref, w_ref, *refs, eps, ngroups, bk, bn, has_z, has_bias,
            has_residual, w_transposed):
    refs = list(refs)
    z_ref = refs.pop(0) if has_z else None
    bias_ref = refs.pop(0) if has_bias else None
    residual_ref = refs.pop(0) if has_residual else None
    (out_ref,) = refs
    columns = pl.ds(pl.multiple_of(pl.program_id(0) * bn, bn), bn)
    rows, k = x_ref.shape
    group_size = k // ngroups
    chunks = group_size // bk

    def span(start):
        return pl.ds(pl.multiple_of(start, bk), bk)

    def gated(row, features):
        """Row `row`'s v over `features` (bk of them): [bk] float32, gated, not yet
        normalised."""
        v = x_ref[row, features].astype(jnp.float32)
        if has_z:
            v = v * jax.nn.silu(z_ref[row, features].astype(jnp.float32))
        return v

    # Every row is reduced against each block of w as it is loaded: w is read once.
    accs = tuple(jnp.zeros((bn,), jnp.float32) for _ in range(rows))
    for gi in range(ngroups):  # static, as the rows: both are a few
        first = gi * group_size
        rstd = [jax.lax.rsqrt(jax.lax.fori_loop(
            0, chunks,
            lambda c, s, row=row: s + jnp.sum(jnp.square(gated(row, span(first + c * bk)))),
            jnp.float32(0)) / group_size + eps) for row in range(rows)]

        def body(c, accs):
            features = span(first + c * bk)
            w = (w_ref[columns, features] if w_transposed  # [bn, bk], rows contiguous in k
                 else w_ref[features, columns].T).astype(jnp.float32)
            scale = weight_ref[features].astype(jnp.float32)
            out = []
            for row, acc in enumerate(accs):
                v = (gated(row, features) * rstd[row] * scale).astype(w_ref.dtype)
                out.append(acc + jnp.sum(w * v.astype(jnp.float32)[None, :], axis=1))
            return tuple(out)

        accs = jax.lax.fori_loop(0, chunks, body, accs)
    for row, acc in enumerate(accs):
        if has_bias:
            acc = acc + bias_ref[columns].astype(jnp.float32)
        out = acc.astype(w_ref.dtype)
        if has_residual:
            out = residual_ref[row, columns] + out.astype(residual_ref.dtype)
        out_ref[row, columns] = out.astype(out_ref.dtype)


def _triton(x, weight, w, *, eps, z, ngroups, bias, residual, w_transposed):
    b, k = x.shape
    n = w.shape[0] if w_transposed else w.shape[1]
    # bk: features per step (a [bn, bk] block of w in registers); bn: output columns per
    # program, at most 16 so that even a small n gives the GPU's SMs a program each.
    bk = _largest_power_of_two_dividing(k // ngroups, 512)
    bn = _largest_power_of_two_dividing(n, 16)
    kernel = functools.partial(_kernel, eps=eps, ngroups=ngroups, bk=bk, bn=bn,
                               has_z=z is not None, has_bias=bias is not None,
                               has_residual=residual is not None, w_transposed=w_transposed)
    args = [x, weight, w] + [a for a in (z, bias, residual) if a is not None]
    out_dtype = w.dtype if residual is None else residual.dtype
    return pl.pallas_call(
        kernel, grid=(n // bn,), interpret=jax.default_backend() != "gpu",
        name="rms_norm_matmul", out_shape=jax.ShapeDtypeStruct((b, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4),
    )(*args)
