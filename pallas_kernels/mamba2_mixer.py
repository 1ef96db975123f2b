"""Mamba2's mixer after its in-projection on the kernels, as one custom_vjp: the causal conv
and SiLU, the SSD scan with its D skip, the gated RMSNorm and the out-projection, reading the
in-projection's output zxbcdt in place and writing its gradient as one array (what
mamba_ssm's mamba_split_conv1d_scan_combined does).

Legend: b batch, l sequence, d d_model, h heads, p headdim, g groups, n d_state, k conv taps,
e = h*p + 2*g*n (x, B, C), W = h*p + e + h (z, xBC, dt: zxbcdt's columns).

Composed of separate operations, the mixer's autodiff copies what it slices: z and xBC out
of zxbcdt in the forward pass (for the kernels, which read whole arrays, and into the layer
scan's stacks of saved residuals), and in the backward pass the concatenation of dz, dxBC
and ddt into the in-projection's gradient. Here:
- the forward reads z (the norm kernel) and xBC (the conv kernel) as column ranges of
  zxbcdt, and keeps zxbcdt, the scan's output y and the weights: nothing else;
- the backward recomputes x, B, C (the conv kernel) and the norm's output (for
  out_proj's weight gradient, in the norm's backward kernel, which reads y and z once for
  both), runs the SSD's backward (pallas_kernels.ssd's own vjp: its
  forward kernel's outputs are unused there, and XLA drops the kernel), and assembles
  dzxbcdt in one buffer: the norm's backward kernel writes dz into its first h*p columns, the
  conv's backward kernel writes dxBC into the next e in place (input_output_aliases), and
  ddt goes into the last h.

One device's or tensor-parallel rank's share (its heads and whole groups); the layer keeps
its composed form (the reference) under context parallelism, for a continued conv window
and where tp splits a group (mamba_jax.layers.mamba2).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import ssd as ssd_kernels
from pallas_kernels.conv import triton as conv
from pallas_kernels.norm import triton as norm
from pallas_kernels.ssd.reference import document_ids
from pallas_kernels.triton_call import off_gpu


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The mixer's static sizes and options (legend above): heads, headdim, groups, d_state;
    chunk_size, dt_limit and the norm's eps and groups (this rank's); dtype, the compute
    dtype of out_proj's matmuls; out_dtype, their output's: the compute dtype where the
    caller rounds the output to it anyway (the matmul then writes half the bytes, and its
    cotangent arrives in it), else float32."""
    h: int
    p: int
    g: int
    n: int
    chunk_size: int
    dt_limit: tuple
    eps: float
    norm_groups: int
    dtype: str
    out_dtype: str

    @property
    def parts(self):
        """The conv's output channels: x, B, C."""
        return (self.h * self.p, self.g * self.n, self.g * self.n)

    @property
    def xBC_start(self):
        """zxbcdt's first column of xBC (after z's h*p)."""
        return self.h * self.p

    @property
    def dt_start(self):
        """zxbcdt's first column of dt (after z and xBC)."""
        return self.xBC_start + sum(self.parts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def mamba2_mixer(zxbcdt, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_proj, initial_state,
                 seq_idx, shapes: Shapes):
    """zxbcdt [b, l, W] (the compute dtype), conv_w [k, e] and conv_b [e] or None float32,
    dt_bias, A_log, D [h], norm_w [h, p], out_proj [h, p, d] float32, initial_state [b, h, p,
    n] float32 or None, seq_idx [b, l] int or None -> (out_proj's output [b, l, d] in
    shapes.out_dtype, without its bias; the final state [b, h, p, n] float32)."""
    return _mixer_fwd(zxbcdt, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_proj,
                      initial_state, seq_idx, shapes)[0]


def _x_B_C(shapes, zxbcdt, conv_w, conv_b, doc):
    """The conv's x [b, l, h, p], B, C [b, l, g, n], from zxbcdt's xBC columns in place."""
    b, l, _ = zxbcdt.shape
    x, B, C = conv.forward(zxbcdt, conv_w, conv_b, doc, l, shapes.parts, config=conv.Config(),
                           interpret=off_gpu(), x_start=shapes.xBC_start)
    return (x.reshape(b, l, shapes.h, shapes.p), B.reshape(b, l, shapes.g, shapes.n),
            C.reshape(b, l, shapes.g, shapes.n))


def _scan(shapes, x, B, C, dt, A_log, D, dt_bias, initial_state, seq_idx):
    """The SSD scan with its D skip on the kernels -> (y [b, l, h, p], final state)."""
    return ssd_kernels.ssd(x, dt, -jnp.exp(A_log), B, C, chunk_size=shapes.chunk_size, D=D,
                           dt_bias=dt_bias, dt_softplus=True, dt_limit=shapes.dt_limit,
                           initial_state=initial_state, seq_idx=seq_idx,
                           return_final_state=True, segments=1, implementation="triton")


def _dt(shapes, zxbcdt):
    """dt [b, l, h] float32 (before its bias and softplus): zxbcdt's last h columns."""
    return zxbcdt[..., shapes.dt_start:].astype(jnp.float32)


def _normed(shapes, y, zxbcdt, norm_w):
    """The gated norm of y [b, l, h, p] by z, zxbcdt's first h*p columns (read in place)."""
    return norm.forward(y, zxbcdt, norm_w, shapes.eps, shapes.norm_groups,
                        config=norm.Config(), interpret=off_gpu())


def _out_proj(shapes, normed, out_proj):
    return jnp.einsum("blhp,hpd->bld", normed, out_proj.astype(shapes.dtype),
                      preferred_element_type=jnp.dtype(shapes.out_dtype))


def _mixer_fwd(zxbcdt, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_proj, initial_state,
               seq_idx, shapes):
    doc = None if seq_idx is None else document_ids(seq_idx)
    x, B, C = _x_B_C(shapes, zxbcdt, conv_w, conv_b, doc)
    y, final_state = _scan(shapes, x, B, C, _dt(shapes, zxbcdt), A_log, D, dt_bias,
                           initial_state, seq_idx)
    out = _out_proj(shapes, _normed(shapes, y, zxbcdt, norm_w), out_proj)
    return (out, final_state), (zxbcdt, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_proj,
                                initial_state, seq_idx, y)


def _mixer_bwd(shapes, residuals, cotangents):
    (zxbcdt, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_proj, initial_state, seq_idx,
     y) = residuals
    dout, dfinal = cotangents
    dtype = shapes.dtype
    # out_proj's input gradient, in the compute dtype straight from the matmul (its
    # accumulation is float32 either way): a float32 product and its conversion were two
    # more passes over [b, l, h, p]
    dout = dout.astype(dtype)
    dnormed = jnp.einsum("bld,hpd->blhp", dout, out_proj.astype(dtype),
                         preferred_element_type=dtype)
    # the norm: dy, dz into the first h*p columns of the in-projection's gradient, and its
    # output recomputed in the same pass for out_proj's weight gradient
    dy, dzxbcdt, dnorm_w, normed = norm.backward(y, zxbcdt, norm_w, dnormed, shapes.eps,
                                                 shapes.norm_groups, config=norm.Config(),
                                                 interpret=off_gpu(), with_out=True)
    dzxbcdt = dzxbcdt.reshape(zxbcdt.shape)
    dout_proj = jnp.einsum("blhp,bld->hpd", normed, dout, preferred_element_type=jnp.float32)
    # the scan's backward over x, B, C recomputed
    doc = None if seq_idx is None else document_ids(seq_idx)
    x, B, C = _x_B_C(shapes, zxbcdt, conv_w, conv_b, doc)
    scan = lambda x, B, C, dt, A_log, D, dt_bias, state: _scan(shapes, x, B, C, dt, A_log, D,
                                                               dt_bias, state, seq_idx)
    _, scan_vjp = jax.vjp(scan, x, B, C, _dt(shapes, zxbcdt), A_log, D, dt_bias, initial_state)
    dx, dB, dC, ddt, dA_log, dD, ddt_bias, dinitial = scan_vjp((dy, dfinal))
    # the conv's backward writes dxBC into the next e columns, in place; ddt the last h
    flat = lambda a: a.reshape(*a.shape[:2], -1)
    dzxbcdt, dconv_w, dconv_b = conv.backward(
        zxbcdt, conv_w, conv_b, doc, (flat(dx), flat(dB), flat(dC)), config=conv.Config(),
        interpret=off_gpu(), x_start=shapes.xBC_start, dx_into=dzxbcdt)
    dzxbcdt = dzxbcdt.at[..., shapes.dt_start:].set(ddt.astype(dzxbcdt.dtype))
    dseq = None if seq_idx is None else jnp.zeros(seq_idx.shape, jax.dtypes.float0)
    return (dzxbcdt, dconv_w.astype(conv_w.dtype),
            None if conv_b is None else dconv_b.astype(conv_b.dtype), ddt_bias, dA_log, dD,
            dnorm_w, dout_proj.astype(out_proj.dtype), dinitial, dseq)


mamba2_mixer.defvjp(_mixer_fwd, _mixer_bwd)
