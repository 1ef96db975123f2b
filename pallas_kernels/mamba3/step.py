"""One decoding step of a Mamba-3 layer between its projections as one Pallas kernel: the
recurrence's token (reference.mamba3_step) for every head, with the angle state's update,
the rotary turn of B and C, the trapezoid's previous-token term, the SSM update and its
read-out in one launch, where XLA makes about a dozen small fusions of them (12 in its CPU
compile of a mamba3-1.3b layer's step).

    y, state = decode_step(state, C, B, x, adt, dt, trap, angles, C_bias, B_bias, D=D,
                           mimo_x=None, rotary="pairwise", implementation="triton")

Legend: b batch, h heads, p headdim, g groups, r MIMO rank (1 for SISO), n d_state, a
rotary angles. As reference.mamba3_step without `start` (a decoding step continues its
row): state a Mamba3State (angle [b, h, a] float32, ssm [b, h, p, n] float32, bfloat16 or
an Int8State (pallas_kernels.ssd.step), k [b, r, h, n] and x [b, h, p] float32), C, B
[b, r, g, n] (normed, before their biases), x [b, h, p], adt, dt, trap [b, h], angles
[b, a] (before tanh), C_bias, B_bias [h, r, n], D [h] or None, mimo_x [h, r, p] or None.
Returns y [b, r, h, p] float32 and the new Mamba3State, stored as state is, all computed in
float32. `implementation`: "xla" (reference.mamba3_step over the state loaded as float32,
the new one stored back as the state was) or "triton" (the kernel below; on a machine
without a GPU it runs in Pallas's interpreter).

Grid (b, h, p / bp), as pallas_kernels.ssd.step's (`filled_blocks`): each program turns its
head's q and k itself (its group's C and B plus the head's biases, by the head's angles),
reads its [bp, n] rows of the state once and writes them in place (an Int8State's values
and scale too), and the same rows of x. A head's new angle and k are new buffers written
by its first program, since every program of the head reads the old ones. The rotary's
pairs are never gathered: d_state is read as power-of-two slices (`pieces`), the pairs'
first entries, their second entries and the unturned rest, each a strided slice ("pairwise":
entries 2i and 2i + 1) or a contiguous one ("halves": i and n/2 + i), and every product over
n is a sum over the pieces.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.mamba3.reference import Mamba3State, mamba3_step, wrap
from pallas_kernels.ssd.step import (INT8_LEVELS, Blocks, Int8State, filled_blocks, load_state,
                                     quantized_values, store_state)
from pallas_kernels.triton_call import call, off_gpu

IMPLEMENTATIONS = ("xla", "triton")


def supports(p, n, a) -> bool:
    """Whether the kernel takes headdim p, d_state n and a rotary angles: its slices are
    powers of two (p's largest dividing power of two, at least 16; n, a and n - 2a where
    not 0)."""
    powers = lambda *v: all(x > 0 and x & (x - 1) == 0 for x in v)
    return p % 16 == 0 and powers(n, a) and (2 * a == n or 2 * a < n and powers(n - 2 * a))


def decode_step(state: Mamba3State, C, B, x, adt, dt, trap, angles, C_bias, B_bias, *,
                D=None, mimo_x=None, rotary="pairwise", implementation="xla",
                blocks=Blocks()):
    """See the module docstring for shapes and dtypes."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"mamba3 decode_step: implementation={implementation!r} is not one "
                         f"of {IMPLEMENTATIONS}")
    args = (C, B, x, adt, dt, trap, angles, C_bias, B_bias)
    options = dict(D=D, mimo_x=mimo_x, rotary=rotary)
    if implementation == "triton":
        return _triton(state, *args, **options, blocks=blocks)
    y, new = mamba3_step(state._replace(ssm=load_state(state.ssm)), *args, **options)
    return y.astype(jnp.float32), new._replace(ssm=store_state(new.ssm, state.ssm))


def pieces(n, a, rotary):
    """d_state's entries as slices: (the turned pairs' first entries, their second entries,
    the unturned entries in one or two slices)."""
    if rotary == "pairwise":
        rest = (pl.ds(2 * a, n - 2 * a),) if n > 2 * a else ()
        return (pl.ds(0, a, stride=2), pl.ds(1, a, stride=2)) + rest
    half = n // 2
    rest = (pl.ds(a, half - a), pl.ds(half + a, half - a)) if half > a else ()
    return (pl.ds(0, a), pl.ds(half, a)) + rest


def _at(*indices):
    """An index of whole slices (an int as a slice of one): Pallas's interpreter takes a
    strided slice only among slices."""
    return tuple(pl.ds(i, 1) if not isinstance(i, pl.Slice) else i for i in indices)


def _step_kernel(*refs, r, g, bp, slices, int8, has_D, mimo):
    refs = list(refs)
    take = lambda present=True: refs.pop(0) if present else None
    angle_ref, ssm_ref, scale_ref = take(), take(), take(int8)
    k_ref, xprev_ref, C_ref, B_ref, x_ref = take(), take(), take(), take(), take()
    adt_ref, dt_ref, trap_ref, angles_ref, C_bias_ref, B_bias_ref = (take() for _ in range(6))
    D_ref, mimo_ref = take(has_D), take(mimo)
    y_ref, angle_out, ssm_out, scale_out = take(), take(), take(), take(int8)
    k_out, x_out = take(), take()
    bi, hi, pi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    gi = hi // (ssm_ref.shape[1] // g)
    rows = pl.ds(pl.multiple_of(pi * bp, bp), bp)
    f32 = lambda v: v.astype(jnp.float32)

    # The state first: its load, the largest, is then in flight during the rest.
    old = [f32(ssm_ref[_at(bi, hi, rows, s)].reshape(bp, s.size)) for s in slices]
    if int8:
        scale = scale_ref[bi, hi, rows]
        old = [v * scale[:, None] for v in old]
    dt, adt = f32(dt_ref[bi, hi]), f32(adt_ref[bi, hi])
    sigma = jax.nn.sigmoid(f32(trap_ref[bi, hi]))
    theta = angle_ref[bi, hi, :] + math.pi * jnp.tanh(f32(angles_ref[bi, :])) * dt
    theta = wrap(theta)
    cos, sin = jnp.cos(theta), jnp.sin(theta)

    def row(ref, ri, ref_head, bias_ref):
        """The group's (or the state's) vector of rank ri in pieces, plus the head's bias
        and turned, where bias_ref is given; else as stored."""
        v = [f32(ref[_at(bi, ri, ref_head, s)].reshape(s.size)) for s in slices]
        if bias_ref is None:
            return v
        v = [u + f32(bias_ref[_at(hi, ri, s)].reshape(s.size)) for u, s in zip(v, slices)]
        first, second, *rest = v
        return [first * cos - second * sin, first * sin + second * cos, *rest]

    def values(x_rows, ri):
        return x_rows * f32(mimo_ref[hi, ri, rows]) if mimo else x_rows
    x_rows, xprev_rows = f32(x_ref[bi, hi, rows]), f32(xprev_ref[bi, hi, rows])
    ranks = range(r)
    q = [row(C_ref, ri, gi, C_bias_ref) for ri in ranks]
    k = [row(B_ref, ri, gi, B_bias_ref) for ri in ranks]
    k_prev = [row(k_ref, ri, hi, None) for ri in ranks]
    v = [values(x_rows, ri) for ri in ranks]
    v_prev = [values(xprev_rows, ri) for ri in ranks]
    decay, w_prev, w_now = jnp.exp(adt), (1 - sigma) * dt, sigma * dt
    new = [decay * (o + w_prev * sum(vp[:, None] * kp[j][None, :]
                                     for vp, kp in zip(v_prev, k_prev)))
           + w_now * sum(vr[:, None] * kr[j][None, :] for vr, kr in zip(v, k))
           for j, o in enumerate(old)]
    for ri in ranks:
        y = sum(jnp.sum(s * qj[None, :], axis=1) for s, qj in zip(new, q[ri]))
        if has_D:
            y = y + D_ref[hi] * v[ri]
        y_ref[bi, ri, hi, rows] = y
    if int8:  # the row's peak over its pieces, then each piece against it
        peak = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(s), axis=1) for s in new])
        new = [quantized_values(s, peak) for s in new]
        scale_out[bi, hi, rows] = peak / INT8_LEVELS
    for s, piece in zip(slices, new):
        ssm_out[_at(bi, hi, rows, s)] = piece.reshape(1, 1, bp, s.size).astype(ssm_out.dtype)
    x_out[bi, hi, rows] = x_rows.astype(x_out.dtype)

    @pl.when(pi == 0)
    def _():
        angle_out[bi, hi, :] = theta
        for ri in ranks:
            for s, piece in zip(slices, k[ri]):
                k_out[_at(bi, ri, hi, s)] = piece.reshape(1, 1, 1, s.size).astype(k_out.dtype)


def _triton(state: Mamba3State, C, B, x, adt, dt, trap, angles, C_bias, B_bias, *, D, mimo_x,
            rotary, blocks):
    """decode_step's kernel."""
    b, h, p = x.shape
    r, g, n = C.shape[1:]
    a = state.angle.shape[-1]
    if not supports(p, n, a):
        raise ValueError(f"mamba3 step kernel: needs headdim a multiple of 16 and d_state, "
                         f"the angles and d_state - 2 x angles powers of two; got headdim {p}, "
                         f"d_state {n}, {a} angles: use the XLA step")
    bp, warps = filled_blocks(blocks, b, h, p, n)
    int8 = isinstance(state.ssm, Int8State)
    f32 = lambda v: v.astype(jnp.float32)
    ssm = list(state.ssm) if int8 else [state.ssm]
    args = [f32(state.angle), *ssm, state.k, state.x, C, B, x, adt, dt, trap, angles,
            f32(C_bias), f32(B_bias)] + ([] if D is None else [f32(D)]) + (
        [] if mimo_x is None else [f32(mimo_x)])
    like = lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype)
    out_shape = [jax.ShapeDtypeStruct((b, r, h, p), jnp.float32), like(args[0]),
                 *map(like, ssm), like(state.k), like(state.x)]
    kernel = functools.partial(_step_kernel, r=r, g=g, bp=bp, slices=pieces(n, a, rotary),
                               int8=int8, has_D=D is not None, mimo=mimo_x is not None)
    # The state (an Int8State's values and scale) and x are updated in place; the angle and
    # k are new buffers (module docstring).
    aliases = {1 + i: 2 + i for i in range(len(ssm))}
    aliases[2 + len(ssm)] = 3 + len(ssm)
    y, angle, *new_ssm, k, x_new = call(kernel, (b, h, p // bp), out_shape, warps, None,
                                        off_gpu(), "mamba3_step",
                                        aliases)(*args)
    new_ssm = Int8State(*new_ssm) if int8 else new_ssm[0]
    return y, Mamba3State(angle, new_ssm, k, x_new)
