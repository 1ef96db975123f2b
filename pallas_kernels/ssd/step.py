"""One decoding step of a Mamba2 layer between its projections: the conv window's shift, the
causal conv over it, dt, the SSM state update and its read-out (mamba_ssm's
causal_conv1d_update and selective_state_update), in plain JAX and as one Pallas kernel.

    y, conv_state, state = mamba_step(conv_state, zxbcdt, conv_w, conv_b, A, D, dt_bias,
                                      state, dt_limit=(0.0, inf), y_dtype=jnp.float32,
                                      implementation="xla")
    y, state = mamba_step_shifted(window, zxbcdt, conv_w, conv_b, A, D, dt_bias, state,
                                  ...)

Legend: b batch, h heads, p headdim, g groups, r = h // g heads per group, n d_state,
k d_conv, e = h*p + 2*g*n conv channels (x, then B, then C: mamba_ssm's xBC order).

conv_state [b, e, k]: the last k conv inputs before this token, newest last (the cache's
window), in the compute dtype. zxbcdt [b, h*p + e + h]: the input projection's output in
mamba_ssm's in_proj order z, xBC, dt, read in place (no slicing kernel runs between the
projection and the step), any float dtype. Its xBC [b, e] is this token's conv input (kept
rounded to conv_state's dtype, as the cache stores it): the conv sees conv_state shifted by
one with it appended, which is also the conv_state returned. Its dt [b, h] is used before
dt_bias, softplus (Mamba2's, always) and the dt_limit clamp, in float32. conv_w [e, k] and
conv_b [e] (or None): the depthwise conv. A [h] (negative), D [h] (or [h, p], one a headdim
channel: mamba_ssm's D_has_hdim), dt_bias [h] float32.
state [b, h, p, n], float32 or bfloat16, or an Int8State (int8 values and a float32 scale per
headdim channel, below). `mamba_step_shifted` takes the window already shifted, with this
token's input its last column (the batch-1 decoding step's in-projection kernel,
norm_matmul's `window=`, shifts it in place): no window copy after it.

Returns y [b, h, p] (C . h_new + D x, before the gated norm; computed in float32, returned
in y_dtype), the new conv_state (not from mamba_step_shifted), and the new state stored as
state is (its dtype, or an Int8State), computed in float32. x, B and C leave the conv
rounded to the window's dtype, as from mamba_ssm's causal_conv1d_update. With
`norm_weight=` (the gated RMSNorm's weight [h*p]) mamba_step's y is a `Gated`: y * silu(z)
times that weight, [b, h*p] in y_dtype, and its squares summed per head, so that the norm's
rstd can multiply the out-projection's product (Mamba2Mixer.step): no pass of its own sums
y's squares and none normalises it.

`implementation`: "xla" (`reference`: XLA fuses it into about six kernels per layer) or
"triton" (`step_program`, grid (b, h, p / bp), one kernel: each program convolves bp of its
head's x channels and its group's B and C channels (mamba_step: shifting their window too,
into a new buffer, since a group's programs read its old B and C columns while one of them
stores the shifted ones), reads its [bp, n] of the state once and writes it in place; bp < p
only where b * h is small, or as `blocks` (Blocks) sets; on a machine without a GPU it runs
in Pallas's interpreter). A decode step at batch 1 is bound by its kernel count, not its
bytes (BENCHMARKS.md, Decoding, ours alone): the window's shift and the projection's split
are in kernels rather than XLA fusions of their own. pallas_kernels.decode.step_out goes on
through the out-projection, at batch 1 in the same kernel where it can.

An Int8State stores each (row, head, headdim channel)'s n state values as int8 with one
float32 scale, max |value| / 127 over the n (`quantize`; 0 for a row of zeros), which is
every program's own: a program of the kernel owns whole [bp, n] rows, so it dequantises what
it loads and quantises what it stores with no reduction across programs, at any block_p
(a scale per (row, head) would need every program of a head). 1 + 4/n bytes an element:
0.52x bf16's at n = 128. Each step quantises the new state from float32 afresh, so a head's
decay, the same factor over the whole row, moves the scale and leaves the int8 values
as they were: only the new input's term is rounded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import hardware
from pallas_kernels.decode.norm_matmul import largest_power_of_two_dividing, shift_window
from pallas_kernels.ssd.reference import d_skip, process_dt
from pallas_kernels.triton_call import call, off_gpu

IMPLEMENTATIONS = ("xla", "triton")
INT8_LEVELS = 127  # symmetric int8: -127..127, so a row's scale maps its max to 127


class Int8State(NamedTuple):
    """An SSM state in int8: values [b, h, p, n] int8 and scale [b, h, p] float32, the state
    being values * scale[..., None] (module docstring). shape and dtype are the values', as an
    array's."""

    values: jax.Array
    scale: jax.Array

    @property
    def shape(self):
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype


def quantize(state) -> Int8State:
    """A float32 state [..., n] -> Int8State: per row of n, scale = max |state| / 127 and
    values = state / scale rounded to the nearest integer (half to even), 0 where the row is
    all zeros. Each value is off by at most scale / 2."""
    peak = jnp.max(jnp.abs(state), axis=-1)
    return Int8State(quantized_values(state, peak), peak / INT8_LEVELS)


# v + 1.5 * 2**23 in float32 holds v rounded to an integer (half to even) in its low mantissa
# bits for |v| <= 2**22: a multiply-add and an integer subtract round and convert, where
# floor(v + 0.5) and a conversion took three instructions more a value in a kernel that
# issues instructions, not bytes, at its limit (docs/decoding.md).
_ROUNDER = 12582912.0
_ROUNDER_BITS = 0x4B400000  # its bits as an int32


def quantized_values(state, peak):
    """The int8 values of `quantize` for rows whose largest |value| is peak [...] (a kernel
    that holds a row in pieces quantises each piece against the row's peak)."""
    inverse = jnp.where(peak > 0, INT8_LEVELS / jnp.where(peak > 0, peak, 1.0), 0.0)
    # |state * inverse| <= 127 up to a rounding of the product: never rounds past 127
    shifted = state * inverse[..., None] + _ROUNDER
    return (jax.lax.bitcast_convert_type(shifted, jnp.int32) - _ROUNDER_BITS).astype(jnp.int8)


def dequantize(state: Int8State):
    """An Int8State -> the float32 state [..., n] it stores."""
    return state.values.astype(jnp.float32) * state.scale[..., None]


def load_state(state):
    """A decoding cache's SSM state [..., n] (array or Int8State) as float32."""
    return dequantize(state) if isinstance(state, Int8State) else state.astype(jnp.float32)


def store_state(new, like):
    """The float32 state `new` [..., n] stored as `like` is (its dtype, or an Int8State)."""
    return quantize(new) if isinstance(like, Int8State) else new.astype(like.dtype)


def state_in(state, ssm_state_dtype: str):
    """A state [..., n] stored in ssm_state_dtype ("float32", "bfloat16", or "int8": an
    Int8State quantised from it in float32), as a decoding cache holds it."""
    state = state.astype(jnp.float32)
    return quantize(state) if ssm_state_dtype == "int8" else state.astype(ssm_state_dtype)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The kernel's tiles: headdim rows per program (block_p, a power of two dividing p) and
    warps per program. None: chosen from the shapes (`_triton`: the whole headdim unless
    batch x heads is small; 2 warps for a [block_p, n] tile of 8192 elements or more, else
    4)."""
    block_p: int | None = None
    num_warps: int | None = None


class Gated(NamedTuple):
    """mamba_step's y with `norm_weight`: the gated RMSNorm's input y * silu(z) times the
    norm's weight, y [b, h*p] in y_dtype, and the squares of y * silu(z) summed over each
    head's headdim, sum_sq [b, h] float32: the norm's rstd then multiplies the
    out-projection's product (Mamba2Mixer.step), so no pass over y normalises it."""

    y: jax.Array
    sum_sq: jax.Array


def mamba_step(conv_state, zxbcdt, conv_w, conv_b, A, D, dt_bias, state, *,
               dt_limit=(0.0, math.inf), y_dtype=jnp.float32, implementation="xla",
               blocks=Blocks(), norm_weight=None):
    """See the module docstring for shapes and dtypes. norm_weight: None, or the gated
    RMSNorm's weight [h*p]: y is then a Gated (y rounded to y_dtype times silu(z) in
    float32, z the first h*p columns of zxbcdt, times norm_weight; and its sums of
    squares)."""
    _check(conv_state, state, implementation)
    e, (b, h, p) = conv_state.shape[1], state.shape[:3]
    xbc_at, dt_at = h * p, zxbcdt.shape[1] - h
    if implementation == "triton":
        return _triton(conv_state, (zxbcdt, xbc_at), conv_w, conv_b, (zxbcdt, dt_at), A, D,
                       dt_bias, state, dt_limit=dt_limit, y_dtype=y_dtype, blocks=blocks,
                       norm_weight=norm_weight)
    y, window, state = reference(conv_state, zxbcdt[:, xbc_at:xbc_at + e], conv_w, conv_b,
                                 zxbcdt[:, dt_at:], A, D, dt_bias, state, dt_limit=dt_limit)
    y = y.astype(y_dtype)
    if norm_weight is not None:
        gated = _gated(y, zxbcdt)
        y = Gated((gated.reshape(b, -1) * norm_weight.astype(jnp.float32)).astype(y_dtype),
                  jnp.sum(gated * gated, axis=-1))
    return y, window, state


def _gated(y, zxbcdt):
    """The reference's gate: y [b, h, p] (rounded to its dtype) times silu(z) in float32, z
    the first h*p columns of zxbcdt."""
    z = zxbcdt[:, :y.shape[1] * y.shape[2]].reshape(y.shape).astype(jnp.float32)
    return y.astype(jnp.float32) * jax.nn.silu(z)


def mamba_step_shifted(window, zxbcdt, conv_w, conv_b, A, D, dt_bias, state, *,
                       dt_limit=(0.0, math.inf), y_dtype=jnp.float32, gate=False,
                       implementation="xla", blocks=Blocks()):
    """mamba_step after the window's shift: window [b, e, k] already ends with this token's
    conv input (as norm_matmul.rms_norm_matmul(window=...) leaves it), dt is the last h
    columns of zxbcdt [b, N], read in place. Returns (y, the new state).

    gate: y, rounded to y_dtype, times silu(z) in float32, with z the first h*p columns of
    zxbcdt (its in_proj order): the gated RMSNorm's input (mamba_ssm's RMSNormGated,
    norm_before_gate=False), the values norm_matmul's `z=` computes, so that the
    out-projection's kernel, whose every program reads the whole row, need not gate it."""
    _check(window, state, implementation)
    dt_at = zxbcdt.shape[1] - state.shape[1]
    if implementation == "triton":
        return _triton(window, None, conv_w, conv_b, (zxbcdt, dt_at), A, D, dt_bias, state,
                       dt_limit=dt_limit, y_dtype=y_dtype, gate=gate, blocks=blocks)
    y, state = reference_shifted(window, conv_w, conv_b, zxbcdt[:, dt_at:], A, D, dt_bias,
                                 state, dt_limit=dt_limit)
    y = y.astype(y_dtype)
    return (_gated(y, zxbcdt) if gate else y), state


def _check(conv_state, state, implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"mamba_step: implementation={implementation!r} is not one of "
                         f"{IMPLEMENTATIONS}")
    if implementation == "triton" and not supports(state.shape[2], state.shape[3],
                                                   conv_state.shape[2]):
        raise ValueError(f"mamba_step: implementation='triton' needs a headdim divisible by "
                         f"16 and d_state, d_conv powers of two (d_state >= 16); got state "
                         f"{state.shape}, conv_state {conv_state.shape}: use 'xla'")


def supports(p, n, k):
    """Whether the kernel takes headdim p, d_state n and d_conv k: its loads are power-of-two
    blocks, of headdim a power of two >= 16 dividing it (80: 16, 96: 32, 192: 64)."""
    return p % 16 == 0 and all(v & (v - 1) == 0 for v in (n, k)) and n >= 16


def reference(conv_state, xBC_in, conv_w, conv_b, dt, A, D, dt_bias, state, *,
              dt_limit=(0.0, math.inf)):
    """mamba_step in plain JAX over zxbcdt's xBC_in [b, e] and dt [b, h], y in float32."""
    window = shift_window(conv_state, xBC_in)
    y, state = reference_shifted(window, conv_w, conv_b, dt, A, D, dt_bias, state,
                                 dt_limit=dt_limit)
    return y, window, state


def reference_shifted(window, conv_w, conv_b, dt, A, D, dt_bias, state, *,
                      dt_limit=(0.0, math.inf)):
    """The step after the window's shift, in plain JAX: -> (y in float32, new state)."""
    b, h, p, n = state.shape
    # HIGHEST: float32 products, as the kernel's, whatever XLA picks for these small dots
    # (its default precision allows TF32 for a float32 dot on a GPU).
    conv = jnp.einsum("bek,ek->be", window.astype(jnp.float32), conv_w.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    if conv_b is not None:
        conv = conv + conv_b.astype(jnp.float32)
    xBC = jax.nn.silu(conv).astype(window.dtype).astype(jnp.float32)
    g = (xBC.shape[1] - h * p) // (2 * n)
    x = xBC[:, :h * p].reshape(b, h, p)
    B, C = (part.reshape(b, g, n) for part in jnp.split(xBC[:, h * p:], 2, axis=1))
    dt = process_dt(dt, dt_bias, True, dt_limit)  # [b, h] float32
    decay = jnp.exp(dt * A)
    B_h = jnp.repeat(B, h // g, axis=1)  # [b, h, n]
    C_h = jnp.repeat(C, h // g, axis=1)
    dtx = dt[:, :, None] * x  # [b, h, p]
    old = load_state(state)
    # y = C.h_new = decay * C.h_old + dtx * (C.B): both terms read the old state, so XLA
    # fuses the state update and the read-out into one pass over the state (read once,
    # written once) instead of writing h_new and reading it back.
    new = old * decay[:, :, None, None] + dtx[..., None] * B_h[:, :, None, :]
    y = (decay[:, :, None] * jnp.einsum("bhpn,bhn->bhp", old, C_h,
                                        precision=jax.lax.Precision.HIGHEST)
         + dtx * jnp.sum(B_h * C_h, axis=-1)[:, :, None] + d_skip(D, x, jnp.float32))
    return y, store_state(new, state)


def softplus(v):
    """jax.nn.softplus's values (log(1 + e^v), v itself past 20 where they agree in float32)
    in operations the Triton lowering has, for the step kernels."""
    return jnp.where(v > 20.0, v, jnp.log1p(jnp.exp(jnp.minimum(v, 20.0))))


def _step_kernel(conv_ref, *refs, **kw):
    step_program(conv_ref, *refs, ids=(pl.program_id(0), pl.program_id(1), pl.program_id(2)),
                  **kw)


def step_program(conv_ref, *refs, p, bp, n, r, g, k, xbc_at, dt_at, has_bias, dt_limit,
                  y_dtype, gate, ids, int8=False, flat_y=False, norm=False):
    """The kernel's work for program ids (bi, hi, pi); flat_y: y_ref is [b, h*p]; int8: the
    state is an Int8State's values, its scale the next operand and the last output; norm
    (with gate; y_ref then [b, h*p]): the norm's weight [h*p] is the operand before the
    state, the gated y is stored times it and its squares' sum [b, h, p / bp] is the output
    after y."""
    shifts = xbc_at is not None  # else the window already ends with this token's input
    if shifts:
        xbc_ref, *refs = refs
    w_ref, *refs = refs
    if has_bias:
        bias_ref, *refs = refs
    dt_ref, A_ref, D_ref, dt_bias_ref, *refs = refs
    if norm:
        norm_ref, *refs = refs
    state_ref, *refs = refs
    if int8:
        scale_ref, *refs = refs
    y_ref, *refs = refs
    if norm:
        sum_sq_ref, *refs = refs
    if shifts:
        window_ref, *refs = refs
    new_ref, *refs = refs
    new_scale_ref = refs[0] if int8 else None
    bi, hi, pi = ids
    gi = hi // r
    h_p = conv_ref.shape[1] - 2 * g * n  # the x channels, h * p
    rows = pl.ds(pl.multiple_of(pi * bp, bp), bp)  # this program's bp of the head's p
    # The state first: its load, the largest, is then in flight during the conv.
    old = state_ref[bi, hi, rows, :].astype(jnp.float32)  # [bp, n]; int8: values unscaled
    old_scale = scale_ref[bi, hi, rows] if int8 else None  # [bp]

    def conv(start, size, write):
        """silu(conv) of channels [start, start + size) -> [size] float32, rounded to the
        window's dtype; where the kernel shifts, stores those channels' shifted window where
        `write` (True, or a traced bool) holds. The window's columns are loaded and stored one
        at a time: k - 1 of them is no block size Triton takes."""
        channels = pl.ds(start, size)
        if shifts:
            columns = [conv_ref[bi, channels, j] for j in range(1, k)]
            columns.append(xbc_ref[bi, pl.ds(xbc_at + start, size)].astype(conv_ref.dtype))
        else:
            columns = [conv_ref[bi, channels, j] for j in range(k)]
        out = sum(column.astype(jnp.float32) * w_ref[channels, j].astype(jnp.float32)
                  for j, column in enumerate(columns))
        if has_bias:
            out = out + bias_ref[channels].astype(jnp.float32)

        def store():
            for j, column in enumerate(columns):
                window_ref[bi, channels, j] = column
        if shifts and write is True:
            store()
        elif shifts:
            pl.when(write)(store)
        return jax.nn.silu(out).astype(conv_ref.dtype).astype(jnp.float32)

    x_start = pl.multiple_of(hi * p + pi * bp, bp)  # this program's channels of h*p
    x = conv(x_start, bp, True)
    # A group's B and C channels serve its r heads: its first head's first program stores
    # their window (the others read the old one, a separate buffer, so nothing races).
    first = (hi % r == 0) & (pi == 0)
    B = conv(h_p + gi * n, n, first)
    C = conv(h_p + g * n + gi * n, n, first)
    dt = softplus(dt_ref[bi, dt_at + hi].astype(jnp.float32) + dt_bias_ref[hi])
    lo, hi_limit = dt_limit
    if lo > 0.0 or hi_limit < math.inf:
        dt = jnp.clip(dt, lo, hi_limit)
    decay = jnp.exp(dt * A_ref[hi])
    dtx = dt * x
    read = jnp.sum(old * C[None, :], axis=1)  # [bp]
    old_decay = decay
    if int8:  # the scale multiplies the read-out and the decay, not each value
        read, old_decay = read * old_scale, (decay * old_scale)[:, None]
    D = D_ref[hi] if len(D_ref.shape) == 1 else D_ref[hi, rows]  # [h] or [h, p]
    y = (decay * read + dtx * jnp.sum(B * C) + D * x).astype(y_dtype)
    channels = pl.ds(x_start, bp)  # y's, z's and the norm weight's, as x's
    if gate:  # z: dt_ref's (zxbcdt's) first h*p columns
        z = dt_ref[bi, channels].astype(jnp.float32)
        y = y.astype(jnp.float32) * jax.nn.silu(z)
    if norm:
        sum_sq_ref[bi, hi, pl.ds(pi, 1)] = jnp.sum(y * y)[None]
        y = (y * norm_ref[channels].astype(jnp.float32)).astype(y_dtype)
    if flat_y or norm:
        y_ref[bi, channels] = y
    else:
        y_ref[bi, hi, rows] = y
    new = old * old_decay + dtx[:, None] * B[None, :]
    if int8:  # this program's rows, each quantised alone (module docstring)
        new, scale = quantize(new)
        new_scale_ref[bi, hi, rows] = scale
    new_ref[bi, hi, rows, :] = new.astype(new_ref.dtype)


def filled_blocks(blocks, b, h, p, n):
    """(block_p, warps) of the step kernel: Blocks with its Nones filled."""
    # Heads' headdim split over programs until there are about two waves of them over the
    # SMs (a batch-1 step has only h programs otherwise), down to 16 rows each.
    # A headdim that is no power of two (80, 96, 192) is split into its largest power-of-two
    # divisor: each program still reads its rows of the state once.
    waves = hardware.two_waves() / (b * h)
    target = p // min(p // 16, 1 << max(0, math.ceil(math.log2(waves))))
    bp = blocks.block_p or largest_power_of_two_dividing(p, target)
    if bp & (bp - 1) or p % bp:
        raise ValueError(f"mamba_step: Blocks(block_p={bp}) must be a power of two dividing "
                         f"headdim {p}")
    # At batch 64 (bp = p = 64, n = 128) 2 warps beat 4, and 8 were much slower; at
    # bp = 32, 4 warps beat 2 (bench/step.py; docs/performance.md).
    return bp, blocks.num_warps or (2 if bp * n >= 8192 else 4)


def step_call(conv_state, xbc, conv_w, conv_b, dt, A, D, dt_bias, state, *, bp, dt_limit,
               y_dtype, gate, norm_weight=None):
    """(the static options of `step_program`, its operands in order) for _triton's
    arguments; an Int8State's values and scale are the last two operands."""
    h, p, n = state.shape[1:]
    g = (conv_state.shape[1] - h * p) // (2 * n)
    (xbc, xbc_at), (dt, dt_at) = xbc or (None, None), dt
    int8 = isinstance(state, Int8State)
    options = dict(p=p, bp=bp, n=n, r=h // g, g=g, k=conv_state.shape[2], xbc_at=xbc_at,
                   dt_at=dt_at, has_bias=conv_b is not None, dt_limit=tuple(dt_limit),
                   y_dtype=jnp.dtype(y_dtype), gate=gate or norm_weight is not None,
                   int8=int8, norm=norm_weight is not None)
    args = (conv_state,) + (() if xbc is None else (xbc,)) + (conv_w,) + (
        () if conv_b is None else (conv_b,)) + (
        dt, A.astype(jnp.float32), D.astype(jnp.float32), dt_bias.astype(jnp.float32)) + (
        () if norm_weight is None else (norm_weight,)) + (
        tuple(state) if int8 else (state,))
    return options, args


def _triton(conv_state, xbc, conv_w, conv_b, dt, A, D, dt_bias, state, *, dt_limit, y_dtype,
            gate=False, blocks=Blocks(), norm_weight=None):
    """The kernel; xbc and dt are (array, the column where xBC_in / dt starts in it), xbc
    None for a window already shifted (then no window is returned); norm_weight: y is a
    Gated (mamba_step)."""
    b, h, p, n = state.shape
    bp, warps = filled_blocks(blocks, b, h, p, n)
    norm = norm_weight is not None
    options, args = step_call(conv_state, xbc, conv_w, conv_b, dt, A, D, dt_bias, state,
                               bp=bp, dt_limit=dt_limit, y_dtype=y_dtype, gate=gate,
                               norm_weight=norm_weight)
    # The state (an Int8State's values and scale) is updated in place; a shifted window is
    # a new buffer (module docstring).
    window = [] if xbc is None else [jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype)]
    states = jax.tree.leaves(state)
    if norm:
        ys = [jax.ShapeDtypeStruct((b, h * p), y_dtype),
              jax.ShapeDtypeStruct((b, h, p // bp), jnp.float32)]
    else:
        ys = [jax.ShapeDtypeStruct((b, h, p), jnp.float32 if gate else y_dtype)]
    out_shape = [*ys, *window, *(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in states)]
    outs = call(functools.partial(_step_kernel, **options), (b, h, p // bp), out_shape,
                warps, None, off_gpu(), "mamba_step",
                {len(args) - i: len(out_shape) - i for i in range(1, len(states) + 1)})(*args)
    y = Gated(outs[0], jnp.sum(outs[1], axis=-1)) if norm else outs[0]
    outs = outs[len(ys):]
    new = jax.tree.unflatten(jax.tree.structure(state), outs[len(window):])
    return (y, *outs[:len(window)], new)
