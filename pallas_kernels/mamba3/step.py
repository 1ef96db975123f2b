"""One decoding step of a Mamba-3 layer between its projections as one Pallas kernel: from
the in-projection's output row, the B/C norms, dt's softplus and the heavy-tail A, the
recurrence's token (reference.mamba3_step) for every head, with the angle state's update,
the rotary turn of B and C, the trapezoid's previous-token term, the SSM update, its
read-out and the gate, in one launch, where XLA makes about a dozen small fusions of them.

    y, state = decode_step(state, zxbcdt, params, A_floor=A_floor, rotary="pairwise",
                           implementation="triton")

Legend: b batch, h heads, p headdim, g groups, r MIMO rank (1 for SISO), n d_state, a
rotary angles. state: a Mamba3State (angle [b, h, a] float32, ssm [b, h, p, n] float32,
bfloat16 or an Int8State (pallas_kernels.ssd.step), k [b, r, h, n] and x [b, h, p]
float32); zxbcdt [b, N]: the in-projection's output in mamba_ssm's order [z (h*p), x (h*p),
B (r*g*n), C (r*g*n), dd_dt (h), dd_A (h), trap (h), angles (a)] in the compute dtype;
params: `StepParams`. As reference.projected, then reference.mamba3_step without `start` (a
decoding step continues its row), its y rounded to the compute dtype, then reference.gate.
Returns the gated y [b, h, p] in zxbcdt's dtype, ready for out_proj, and the new
Mamba3State, stored as state is, all computed in float32.
`implementation`: "xla" (those reference functions over the state loaded as float32, the
new one stored back as the state was) or "triton" (the kernel below; on a machine without
a GPU it runs in Pallas's interpreter).

Grid (b, h, p / bp), as pallas_kernels.ssd.step's (`filled_blocks`): each program reads its
head's scalars (dd_dt, dd_A, trap) and the angles from the row, norms its group's C and B
and turns them by the head's angles with the head's biases, reads its [bp, n] rows of the
state once and writes them in place (an Int8State's values and scale too), and the same
rows of x, and writes its rows of the gated y. A head's new angle and k are new buffers
written by its first program, since every program of the head reads the old ones. The
rotary's pairs are never gathered: d_state is read as power-of-two slices (`pieces`), the
pairs' first entries, their second entries and the unturned rest, each a strided slice
("pairwise": entries 2i and 2i + 1) or a contiguous one ("halves": i and n/2 + i), and every
product or sum over n is a sum over the pieces.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.mamba3.reference import (BC_NORM_EPS, Mamba3State, gate, heavy_tail,
                                             mamba3_step, projected, wrap)
from pallas_kernels.ssd.step import (INT8_LEVELS, Blocks, Int8State, filled_blocks, load_state,
                                     quantized_values, softplus, store_state)
from pallas_kernels.triton_call import call, off_gpu

IMPLEMENTATIONS = ("xla", "triton")


def supports(p, n, a, outproj_norm=False) -> bool:
    """Whether the kernel takes headdim p, d_state n and a rotary angles: its slices are
    powers of two (p's largest dividing power of two, at least 16; n, a and n - 2a where
    not 0); with the out-projection norm, whose RMS spans the headdim (one program a head),
    p itself a power of two."""
    powers = lambda *v: all(x > 0 and x & (x - 1) == 0 for x in v)
    return (p % 16 == 0 and powers(n, a) and (2 * a == n or 2 * a < n and powers(n - 2 * a))
            and (not outproj_norm or powers(p)))


class StepParams(NamedTuple):
    """What a step reads of a layer's parameters: dt_bias [h], B_norm, C_norm [n], C_bias,
    B_bias [h, r, n], D [h] or None, for MIMO mimo_x, mimo_z, mimo_o [h, r, p] (None for
    SISO), and the out-projection norm [h, p] or None (is_outproj_norm; the kernel then
    takes a head a program, and a headdim that is a power of two)."""

    dt_bias: jax.Array
    B_norm: jax.Array
    C_norm: jax.Array
    C_bias: jax.Array
    B_bias: jax.Array
    D: jax.Array | None = None
    mimo_x: jax.Array | None = None
    mimo_z: jax.Array | None = None
    mimo_o: jax.Array | None = None
    norm: jax.Array | None = None


def columns(h, p, r, g, n):
    """The first column of each part of the in-projection's row (module docstring)."""
    at = dict(z=0, x=h * p, B=2 * h * p, C=2 * h * p + r * g * n)
    at.update(dd_dt=at["C"] + r * g * n, dd_A=at["C"] + r * g * n + h,
              trap=at["C"] + r * g * n + 2 * h, angles=at["C"] + r * g * n + 3 * h)
    return at


def _sizes(state: Mamba3State, zxbcdt, params: StepParams):
    """(h, p, r, g, n, a) of a step's arguments, g from the row's width."""
    h, p = state.x.shape[1:]
    r, n = params.C_bias.shape[1:]
    a = state.angle.shape[-1]
    g, left = divmod(zxbcdt.shape[-1] - 2 * h * p - 3 * h - a, 2 * r * n)
    if left or g < 1 or h % g:
        raise ValueError(f"mamba3 decode_step: a row of {zxbcdt.shape[-1]} columns does not "
                         f"hold {h} heads of {p}, rank {r}, d_state {n} and {a} angles")
    return h, p, r, g, n, a


def decode_step(state: Mamba3State, zxbcdt, params: StepParams, *, A_floor, rotary="pairwise",
                implementation="xla", blocks=Blocks()):
    """See the module docstring for shapes and dtypes."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"mamba3 decode_step: implementation={implementation!r} is not one "
                         f"of {IMPLEMENTATIONS}")
    sizes = _sizes(state, zxbcdt, params)
    if implementation == "triton":
        return _triton(state, zxbcdt, params, sizes, A_floor=A_floor, rotary=rotary,
                       blocks=blocks)
    h, p, r, g, n, a = sizes
    at = columns(h, p, r, g, n)
    part = lambda name, width, *shape: zxbcdt[:, at[name]:at[name] + width].reshape(
        zxbcdt.shape[:1] + shape)
    B, C, dt, adt = projected(part("B", r * g * n, r, g, n), part("C", r * g * n, r, g, n),
                              part("dd_dt", h, h), part("dd_A", h, h), params.B_norm,
                              params.C_norm, params.dt_bias, A_floor)
    f32 = lambda v: v.astype(jnp.float32)
    y, new = mamba3_step(state._replace(ssm=load_state(state.ssm)), C, B,
                         part("x", h * p, h, p), adt, dt, f32(part("trap", h, h)),
                         f32(part("angles", a, a)), params.C_bias, params.B_bias, D=params.D,
                         mimo_x=params.mimo_x, rotary=rotary)
    y = gate(y.astype(zxbcdt.dtype), part("z", h * p, h, p), params.mimo_z, params.mimo_o,
             params.norm)
    return y.astype(zxbcdt.dtype), new._replace(ssm=store_state(new.ssm, state.ssm))


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


def _step_kernel(*refs, r, g, bp, slices, at, A_floor, int8, has_D, mimo, has_norm):
    refs = list(refs)
    take = lambda present=True: refs.pop(0) if present else None
    angle_ref, ssm_ref, scale_ref = take(), take(), take(int8)
    k_ref, xprev_ref, zx_ref = take(), take(), take()
    dt_bias_ref, B_norm_ref, C_norm_ref, C_bias_ref, B_bias_ref = (take() for _ in range(5))
    D_ref = take(has_D)
    mimo_x_ref, mimo_z_ref, mimo_o_ref = (take(mimo) for _ in range(3))
    norm_ref = take(has_norm)
    y_ref, angle_out, ssm_out, scale_out = take(), take(), take(), take(int8)
    k_out, x_out = take(), take()
    bi, hi, pi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    h, p = xprev_ref.shape[1:]
    n, a = B_norm_ref.shape[0], angle_ref.shape[-1]
    gi = hi // (h // g)
    start = pl.multiple_of(pi * bp, bp)
    rows = pl.ds(start, bp)
    dtype = zx_ref.dtype
    f32 = lambda v: v.astype(jnp.float32)

    # The state first: its load, the largest, is then in flight during the rest.
    old = [f32(ssm_ref[_at(bi, hi, rows, s)].reshape(bp, s.size)) for s in slices]
    scale = scale_ref[bi, hi, rows] if int8 else None  # an int8 state's values unscaled
    # reference.projected's dt and adt, and the head's trapezoid weight and angles
    dt = softplus(f32(zx_ref[bi, at["dd_dt"] + hi]) + dt_bias_ref[hi])
    adt = jnp.minimum(-heavy_tail(f32(zx_ref[bi, at["dd_A"] + hi])), -A_floor) * dt
    sigma = jax.nn.sigmoid(f32(zx_ref[bi, at["trap"] + hi]))
    angles = f32(zx_ref[_at(bi, pl.ds(at["angles"], a))].reshape(a))
    theta = wrap(angle_ref[bi, hi, :] + math.pi * jnp.tanh(angles) * dt)
    cos, sin = jnp.cos(theta), jnp.sin(theta)

    def turned(part, norm_ref, bias_ref, ri):
        """The group's B or C of rank ri in pieces: RMS-normed over n and rounded to the
        compute dtype (reference.projected), plus the head's bias, turned."""
        col = at[part] + (ri * g + gi) * n
        v = [f32(zx_ref[_at(bi, pl.ds(col + s.start, s.size, s.stride))].reshape(s.size))
             for s in slices]
        rstd = jax.lax.rsqrt(sum(jnp.sum(u * u) for u in v) / n + BC_NORM_EPS)
        v = [f32((u * rstd * norm_ref[s]).astype(dtype)) + bias_ref[_at(hi, ri, s)].reshape(
            s.size) for u, s in zip(v, slices)]
        first, second, *rest = v
        return [first * cos - second * sin, first * sin + second * cos, *rest]

    def values(x_rows, ri):
        return x_rows * mimo_x_ref[hi, ri, rows] if mimo else x_rows
    x_rows = f32(zx_ref[bi, pl.ds(at["x"] + hi * p + start, bp)])
    xprev_rows = f32(xprev_ref[bi, hi, rows])
    ranks = range(r)
    q = [turned("C", C_norm_ref, C_bias_ref, ri) for ri in ranks]
    k = [turned("B", B_norm_ref, B_bias_ref, ri) for ri in ranks]
    k_prev = [[f32(k_ref[_at(bi, ri, hi, s)].reshape(s.size)) for s in slices] for ri in ranks]
    v = [values(x_rows, ri) for ri in ranks]
    v_prev = [values(xprev_rows, ri) for ri in ranks]
    decay, w_prev, w_now = jnp.exp(adt), (1 - sigma) * dt, sigma * dt
    # decay * (old + w_prev v_prev k_prev^T) + w_now v k^T with the factors on the rows
    # first (an int8 row's scale with the decay, as pallas_kernels.ssd.step's kernel takes
    # it), so that a state value takes one product and a multiply-add a rank.
    old_factor = (decay * scale)[:, None] if int8 else decay
    v_prev = [vp * (decay * w_prev) for vp in v_prev]
    v_now = [vr * w_now for vr in v]
    new = [o * old_factor
           + sum(vp[:, None] * kp[j][None, :] for vp, kp in zip(v_prev, k_prev))
           + sum(vr[:, None] * kr[j][None, :] for vr, kr in zip(v_now, k))
           for j, o in enumerate(old)]
    # Each rank's y, rounded to the compute dtype, then reference.gate: y (RMS-normed over
    # the headdim, which the program holds whole, with the out-projection norm) times
    # silu(z_r), z_r = z * mimo_z_r, summed through mimo_o.
    z_rows = f32(zx_ref[bi, pl.ds(at["z"] + hi * p + start, bp)])
    gated = 0.0
    for ri in ranks:
        y = sum(jnp.sum(s * qj[None, :], axis=1) for s, qj in zip(new, q[ri]))
        if has_D:
            y = y + D_ref[hi] * v[ri]
        z = z_rows * mimo_z_ref[hi, ri, rows] if mimo else z_rows
        y = f32(y.astype(dtype))
        if has_norm:
            y = y * jax.lax.rsqrt(jnp.mean(y * y) + BC_NORM_EPS) * norm_ref[hi, rows]
        y = y * jax.nn.silu(z)
        gated = gated + (y * mimo_o_ref[hi, ri, rows] if mimo else y)
    y_ref[bi, hi, rows] = gated.astype(y_ref.dtype)
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


def _triton(state: Mamba3State, zxbcdt, params: StepParams, sizes, *, A_floor, rotary, blocks):
    """decode_step's kernel."""
    b = zxbcdt.shape[0]
    h, p, r, g, n, a = sizes
    if not supports(p, n, a, params.norm is not None):
        raise ValueError(f"mamba3 step kernel: needs headdim a multiple of 16 (a power of two "
                         f"with the out-projection norm) and d_state, the angles and d_state "
                         f"- 2 x angles powers of two; got headdim {p}, d_state {n}, {a} "
                         "angles: use the XLA step")
    if params.norm is not None:  # its RMS spans the headdim: one program a head
        blocks = dataclasses.replace(blocks, block_p=p)
    mimo = params.mimo_x is not None
    if any((v is None) == mimo for v in (params.mimo_z, params.mimo_o)):
        raise ValueError("mamba3 step kernel: mimo_x, mimo_z and mimo_o go together")
    bp, warps = filled_blocks(blocks, b, h, p, n)
    int8 = isinstance(state.ssm, Int8State)
    f32 = lambda v: v.astype(jnp.float32)
    ssm = list(state.ssm) if int8 else [state.ssm]
    args = [f32(state.angle), *ssm, state.k, state.x, zxbcdt] + [
        f32(v) for v in params if v is not None]
    like = lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype)
    out_shape = [jax.ShapeDtypeStruct((b, h, p), zxbcdt.dtype), like(args[0]),
                 *map(like, ssm), like(state.k), like(state.x)]
    kernel = functools.partial(_step_kernel, r=r, g=g, bp=bp, slices=pieces(n, a, rotary),
                               at=columns(h, p, r, g, n), A_floor=float(A_floor), int8=int8,
                               has_D=params.D is not None, mimo=mimo,
                               has_norm=params.norm is not None)
    # The state (an Int8State's values and scale) and x are updated in place; the angle and
    # k are new buffers (module docstring).
    aliases = {1 + i: 2 + i for i in range(len(ssm))}
    aliases[2 + len(ssm)] = 3 + len(ssm)
    y, angle, *new_ssm, k, x_new = call(kernel, (b, h, p // bp), out_shape, warps, None,
                                        off_gpu(), "mamba3_step",
                                        aliases)(*args)
    new_ssm = Int8State(*new_ssm) if int8 else new_ssm[0]
    return y, Mamba3State(angle, new_ssm, k, x_new)
