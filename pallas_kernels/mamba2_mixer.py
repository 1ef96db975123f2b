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

One device's or tensor-parallel rank's share (its heads), on any mesh, as the layer's
composed form (mamba_jax.layers.mamba2) computes it:
- `conv_before`: the conv's k - 1 inputs before the first token (the previous device's last
  ones under context parallelism, a continued sequence's window), which the conv kernel reads
  as its own operand (no copy of xBC with them in front) and whose gradient it writes;
- `shapes.sequence_axis`: the SSD passes its state across the devices of that mesh axis
  (pallas_kernels.ssd's context parallelism), inside this custom_vjp: its forward and its
  recomputation in the backward each all-gather the parts' states;
- `head_groups`: a tensor-parallel rank whose heads read groups that tp does not divide holds
  every group's B and C (the conv over all of them); the scan reads its heads' groups
  (pallas_kernels.ssd.reference.take_groups), and their gradients go back to those groups;
- `shapes.norm_axis`: where tp splits a group of the gated norm, the norm is the composed
  form's (pallas_kernels.norm.gated_rms_norm_spanning: the groups' sums of squares psummed
  over that axis) in XLA, differentiated by JAX, and its dz is the first h*p columns of the
  in-projection's gradient buffer, which the conv's backward kernel then fills in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import fp8
from pallas_kernels import ssd as ssd_kernels
from pallas_kernels.conv import triton as conv
from pallas_kernels.norm import gated_rms_norm_spanning
from pallas_kernels.norm import triton as norm
from pallas_kernels.ssd.reference import document_ids, take_groups
from pallas_kernels.triton_call import off_gpu


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The mixer's static sizes and options (legend above): heads, headdim, the groups of B
    and C in zxbcdt's columns (this rank's, or every group: `head_groups`), d_state;
    chunk_size, dt_limit and the norm's eps and groups (this rank's whole groups, or with
    norm_axis the layer's, which span the norm_ranks devices of that mesh axis); dtype, the
    compute dtype of out_proj's matmuls; out_dtype, their output's: the compute dtype where
    the caller rounds the output to it anyway (the matmul then writes half the bytes, and
    its cotangent arrives in it), else float32; sequence_axis: the mesh axis the sequence is
    split over (context parallelism), or None; fp8: None, or out_proj's matmuls in FP8
    (pallas_kernels.fp8, current scaling), each amax reduced over these mesh axes."""
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
    sequence_axis: str | None = None
    norm_axis: str | None = None
    norm_ranks: int = 1
    fp8: tuple[str, ...] | None = None

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(12,))
def mamba2_mixer(zxbcdt, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_proj, initial_state,
                 conv_before, seq_idx, head_groups, shapes: Shapes):
    """zxbcdt [b, l, W] (the compute dtype), conv_w [k, e] and conv_b [e] or None float32,
    dt_bias, A_log [h], D [h] or [h, p] (mamba_ssm's D_has_hdim), norm_w [h, p], out_proj [h,
    p, d] float32, initial_state [b, h, p, n] float32 or None, conv_before [b, k - 1, e] in
    zxbcdt's dtype or None (zeros), seq_idx [b, l] int or None ([b, k - 1 + l] with
    conv_before: the ids of its rows first), head_groups int32 [1] or [h] or None (B and C
    hold this rank's groups: the module docstring) -> (out_proj's output [b, l, d] in
    shapes.out_dtype, without its bias; the final state [b, h, p, n] float32, this device's
    under shapes.sequence_axis)."""
    return _mixer_fwd(zxbcdt, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_proj,
                      initial_state, conv_before, seq_idx, head_groups, shapes)[0]


def _x_B_C(shapes, zxbcdt, conv_w, conv_b, conv_before, doc):
    """The conv's x [b, l, h, p], B, C [b, l, g, n], from zxbcdt's xBC columns in place."""
    b, l, _ = zxbcdt.shape
    x, B, C = conv.forward(zxbcdt, conv_w, conv_b, doc, l, shapes.parts, config=conv.Config(),
                           interpret=off_gpu(), x_start=shapes.xBC_start, before=conv_before)
    return (x.reshape(b, l, shapes.h, shapes.p), B.reshape(b, l, shapes.g, shapes.n),
            C.reshape(b, l, shapes.g, shapes.n))


def _scan(shapes, x, B, C, dt, A_log, D, dt_bias, initial_state, seq_idx, head_groups):
    """The SSD scan with its D skip on the kernels over the groups the heads read ->
    (y [b, l, h, p], final state)."""
    if head_groups is not None:
        B, C = take_groups(B, head_groups), take_groups(C, head_groups)
    return ssd_kernels.ssd(x, dt, -jnp.exp(A_log), B, C, chunk_size=shapes.chunk_size, D=D,
                           dt_bias=dt_bias, dt_softplus=True, dt_limit=shapes.dt_limit,
                           initial_state=initial_state, seq_idx=seq_idx,
                           return_final_state=True, sequence_axis=shapes.sequence_axis,
                           segments=1, implementation="triton")


def _documents(zxbcdt, seq_idx):
    """(the conv's document ids over seq_idx's rows, the scan's seq_idx [b, l]: its last l),
    or Nones."""
    if seq_idx is None:
        return None, None
    return document_ids(seq_idx), seq_idx[:, seq_idx.shape[1] - zxbcdt.shape[1]:]


def _dt(shapes, zxbcdt):
    """dt [b, l, h] float32 (before its bias and softplus): zxbcdt's last h columns."""
    return zxbcdt[..., shapes.dt_start:].astype(jnp.float32)


def _z(shapes, zxbcdt):
    """z [b, l, h, p]: zxbcdt's first h*p columns."""
    return zxbcdt[..., :shapes.xBC_start].reshape(*zxbcdt.shape[:2], shapes.h, shapes.p)


def _spanning_norm(shapes, y, z, norm_w):
    """The gated norm of a rank whose groups span shapes.norm_axis (module docstring)."""
    return gated_rms_norm_spanning(y, z, norm_w, shapes.eps, shapes.norm_groups,
                                   shapes.norm_axis, shapes.norm_ranks)


def _normed(shapes, y, zxbcdt, norm_w):
    """The gated norm of y [b, l, h, p] by z, zxbcdt's first h*p columns (read in place by the
    kernel)."""
    if shapes.norm_axis is not None:
        return _spanning_norm(shapes, y, _z(shapes, zxbcdt), norm_w)
    return norm.forward(y, zxbcdt, norm_w, shapes.eps, shapes.norm_groups,
                        config=norm.Config(), interpret=off_gpu())


def _norm_backward(shapes, y, zxbcdt, norm_w, dnormed):
    """The gated norm's backward -> (dy, the in-projection's gradient buffer [b, l, W] with
    dz in its first h*p columns, dnorm_w, the norm's output recomputed)."""
    if shapes.norm_axis is not None:
        normed, norm_vjp = jax.vjp(functools.partial(_spanning_norm, shapes), y,
                                   _z(shapes, zxbcdt), norm_w)
        dy, dz, dnorm_w = norm_vjp(dnormed)
        dz = dz.reshape(*zxbcdt.shape[:2], -1)
        # one buffer, dz then zeros: the conv's and dt's columns are written into it
        dzxbcdt = jnp.pad(dz, ((0, 0), (0, 0), (0, zxbcdt.shape[-1] - dz.shape[-1])))
        return dy, dzxbcdt, dnorm_w, normed
    dy, dzxbcdt, dnorm_w, normed = norm.backward(y, zxbcdt, norm_w, dnormed, shapes.eps,
                                                 shapes.norm_groups, config=norm.Config(),
                                                 interpret=off_gpu(), with_out=True)
    return dy, dzxbcdt.reshape(zxbcdt.shape), dnorm_w, normed


_OUT_PROJ = "blhp,hpd->bld"


def _out_proj(shapes, normed, out_proj):
    """The out-projection of the normed y [b, l, h, p] -> ([b, l, d] in out_dtype, the FP8
    scales of normed and out_proj, or None in the compute dtype)."""
    out_dtype = jnp.dtype(shapes.out_dtype)
    if shapes.fp8 is None:
        return jnp.einsum(_OUT_PROJ, normed, out_proj.astype(shapes.dtype),
                          preferred_element_type=out_dtype), None
    (q_n, s_n), (q_w, s_w) = fp8.operands(normed, out_proj, shapes.dtype, shapes.fp8)
    return jnp.einsum(_OUT_PROJ, fp8.dequantize(q_n, s_n), fp8.dequantize(q_w, s_w),
                      preferred_element_type=out_dtype), (s_n, s_w)


def _out_proj_backward(shapes, dout, out_proj, scales):
    """out_proj's backward products: (dnormed [b, l, h, p] in the compute dtype, a function
    of the normed y [b, l, h, p] -> out_proj's gradient [h, p, d] float32). In the compute
    dtype where `scales` is None; else in FP8: dout in E5M2 with its own scale, normed and
    out_proj in E4M3 with the forward's `scales`."""
    dtype = shapes.dtype
    spec_dnormed, spec_dw = fp8.transposed(_OUT_PROJ)
    if scales is None:
        # dnormed in the compute dtype straight from the matmul (its accumulation is
        # float32 either way): a float32 product and its conversion were two more passes
        # over [b, l, h, p]
        dout = dout.astype(dtype)
        w, as_operand, precision = out_proj.astype(dtype), lambda normed: normed, None
    else:
        s_n, s_w = scales
        dout = fp8.gradient(dout, dtype, shapes.fp8)
        w = fp8.dequantize(fp8.quantize(out_proj, fp8.E4M3, s_w), s_w)
        as_operand = lambda normed: fp8.dequantize(fp8.quantize(normed, fp8.E4M3, s_n), s_n)
        precision = fp8.BACKWARD
    product = functools.partial(jnp.einsum, precision=precision)
    dnormed = product(spec_dnormed, dout, w, preferred_element_type=dtype)
    return dnormed, lambda normed: product(spec_dw, as_operand(normed), dout,
                                           preferred_element_type=jnp.float32)


def _mixer_fwd(zxbcdt, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_proj, initial_state,
               conv_before, seq_idx, head_groups, shapes):
    doc, scan_seq_idx = _documents(zxbcdt, seq_idx)
    x, B, C = _x_B_C(shapes, zxbcdt, conv_w, conv_b, conv_before, doc)
    y, final_state = _scan(shapes, x, B, C, _dt(shapes, zxbcdt), A_log, D, dt_bias,
                           initial_state, scan_seq_idx, head_groups)
    out, scales = _out_proj(shapes, _normed(shapes, y, zxbcdt, norm_w), out_proj)
    return (out, final_state), (zxbcdt, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_proj,
                                initial_state, conv_before, seq_idx, head_groups, y, scales)


def _mixer_bwd(shapes, residuals, cotangents):
    (zxbcdt, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_proj, initial_state, conv_before,
     seq_idx, head_groups, y, scales) = residuals
    dout, dfinal = cotangents
    dnormed, weight_gradient = _out_proj_backward(shapes, dout, out_proj, scales)
    # the norm: dy, dz into the first h*p columns of the in-projection's gradient, and its
    # output recomputed in the same pass for out_proj's weight gradient
    dy, dzxbcdt, dnorm_w, normed = _norm_backward(shapes, y, zxbcdt, norm_w, dnormed)
    dout_proj = weight_gradient(normed)
    # the scan's backward over x, B, C recomputed
    doc, scan_seq_idx = _documents(zxbcdt, seq_idx)
    x, B, C = _x_B_C(shapes, zxbcdt, conv_w, conv_b, conv_before, doc)
    scan = lambda x, B, C, dt, A_log, D, dt_bias, state: _scan(
        shapes, x, B, C, dt, A_log, D, dt_bias, state, scan_seq_idx, head_groups)
    _, scan_vjp = jax.vjp(scan, x, B, C, _dt(shapes, zxbcdt), A_log, D, dt_bias, initial_state)
    dx, dB, dC, ddt, dA_log, dD, ddt_bias, dinitial = scan_vjp((dy, dfinal))
    # the conv's backward writes dxBC into the next e columns, in place; ddt the last h
    flat = lambda a: a.reshape(*a.shape[:2], -1)
    dzxbcdt, dconv_w, dconv_b, dbefore = conv.backward(
        zxbcdt, conv_w, conv_b, doc, (flat(dx), flat(dB), flat(dC)), config=conv.Config(),
        interpret=off_gpu(), x_start=shapes.xBC_start, dx_into=dzxbcdt, before=conv_before)
    dzxbcdt = dzxbcdt.at[..., shapes.dt_start:].set(ddt.astype(dzxbcdt.dtype))
    ints = lambda a: None if a is None else jnp.zeros(a.shape, jax.dtypes.float0)
    return (dzxbcdt, dconv_w.astype(conv_w.dtype),
            None if conv_b is None else dconv_b.astype(conv_b.dtype), ddt_bias, dA_log, dD,
            dnorm_w, dout_proj.astype(out_proj.dtype), dinitial, dbefore, ints(seq_idx),
            ints(head_groups))


mamba2_mixer.defvjp(_mixer_fwd, _mixer_bwd)
