"""The Mamba-3 angle state after each token as one Triton kernel each way (the forward and its
gradient), in place of XLA's sums of reference.cumulative_angles.

    theta = angle_sums(angles, dt, starts, initial)

angles [b, l, a] (the projection, before tanh), dt [b, l, h] float32 (after softplus),
starts [b, l] bool or None (a document starts: the sum restarts there), initial [b, h, a]
or None (the angle entering the row's first document) -> theta [b, l, h, a] float32 in
[0, 2 pi): wrap(theta_{t-1} + pi tanh(angles_t) dt_t), the value reference.cumulative_angles
gives for reference.angle_increments.

Each program walks one (row, head) through the row in blocks of `block` tokens: the sums
within a block are a product with the block's mask of (s <= t, same document) in IEEE
float32 (no TF32), and the angle leaving a block, wrapped, enters the next, so no partial
sum grows with the row. The gradient walks back: the cotangent summed over the rest of each
token's document (the mask's transpose, and the carry from the blocks after), then dt's and
the angles' gradients through pi tanh(angles) dt (the wrap's is one; its floor's is zero).
The forward writes theta once, where XLA's form wrote the increments, their sums (a
float32 product on FMA units) and the wrapped angles, and its gradient as many passes more.
The angles' gradient leaves each program per head ([b, h, l, a]), summed over the heads by
XLA. The scan took less time with it than with XLA's sums, forward and forward+backward,
at 8 x 2048 and 8 x 8192 (`bench.mamba3 --only-ours`; docs/performance.md).

A program walks its row's blocks in turn, so `takes` keeps XLA's log-depth form where the
(row, head) programs are fewer than two waves of the multiprocessors (a long single row).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import hardware
from pallas_kernels.mamba3.reference import wrap
from pallas_kernels.triton_call import call, off_gpu

_HIGHEST = jax.lax.Precision.HIGHEST  # IEEE float32 dots (not TF32): sums of angles
# Tokens a step of the walk: 32 was the fastest of 16, 32 and 64 alone at 8 x 2048 and
# 8 x 8192, forward and with its gradient (docs/performance.md).
BLOCK = 32
_WARPS = 4


def takes(b, h) -> bool:
    """Whether angle_sums' walks have two waves of (row, head) programs for b rows of h heads
    (off a GPU, an H200's: hardware.two_waves)."""
    return b * h >= hardware.two_waves()


def _block(starts_ref, bi, c, T, *, transposed=False):
    """Block c's tokens (a slice), their document index within the block [T] (0: the
    document entering it), and its sums as a [T, T] matrix of ones where [t, s] has s <= t
    in one document (transposed: [s, t], the sums over the rest of each document)."""
    ts = pl.ds(pl.multiple_of(c * T, T), T)
    doc = jnp.cumsum(starts_ref[bi, ts], axis=0)
    i = jax.lax.broadcasted_iota(jnp.int32, (T, T), 0)  # the product's row
    j = jax.lax.broadcasted_iota(jnp.int32, (T, T), 1)  # and column
    ordered = j >= i if transposed else j <= i
    return ts, doc, jnp.where(ordered & (doc[:, None] == doc[None, :]), 1.0, 0.0)


def _row(tile, rows, i):
    """Row i of a [T, a] tile as [a] (a masked sum: Triton has no register indexing)."""
    return jnp.sum(jnp.where(rows == i, tile, 0.0), axis=0)


def _sums_kernel(angles_ref, dt_ref, starts_ref, initial_ref, theta_ref, *, T):
    """Program (row bi, head hi): theta[bi, :, hi] [L, A], block by block, the angle leaving
    each block entering the next."""
    bi, hi = pl.program_id(0), pl.program_id(1)
    L, A = angles_ref.shape[1:]
    rows = jax.lax.broadcasted_iota(jnp.int32, (T, A), 0)

    def block(c, entering):
        ts, doc, within = _block(starts_ref, bi, c, T)
        inc = math.pi * jnp.tanh(angles_ref[bi, ts, :]) * dt_ref[bi, ts, hi][:, None]
        local = jnp.dot(within, inc, precision=_HIGHEST)  # [T, A]
        theta = wrap(local + jnp.where((doc == 0)[:, None], entering[None, :], 0.0))
        theta_ref[bi, ts, hi, :] = theta
        return _row(theta, rows, T - 1)
    jax.lax.fori_loop(0, L // T, block, initial_ref[bi, hi, :])


def _sums_backward_kernel(angles_ref, dt_ref, starts_ref, g_ref, ddt_ref, dangles_ref,
                          dinitial_ref, *, T):
    """Program (row bi, head hi), the blocks from the last: dt's gradient [L] and the
    angles' [L, A] of this head, and the initial angle's [A] (the first document's sum)."""
    bi, hi = pl.program_id(0), pl.program_id(1)
    L, A = angles_ref.shape[1:]
    rows = jax.lax.broadcasted_iota(jnp.int32, (T, A), 0)
    first = jax.lax.broadcasted_iota(jnp.int32, (T,), 0) == 0
    n = L // T

    def block(k, later):
        """later [A]: the cotangents summed over the tokens after this block in the document
        its last token is in."""
        ts, doc, after = _block(starts_ref, bi, n - 1 - k, T, transposed=True)
        G = jnp.dot(after, g_ref[bi, ts, hi, :], precision=_HIGHEST)
        G = G + jnp.where((doc == jnp.max(doc))[:, None], later[None, :], 0.0)
        tanh = jnp.tanh(angles_ref[bi, ts, :])
        dt = dt_ref[bi, ts, hi]
        ddt_ref[bi, ts, hi] = jnp.sum(G * (math.pi * tanh), axis=1)
        dangles_ref[bi, hi, ts, :] = G * (math.pi * (1.0 - tanh * tanh)) * dt[:, None]
        # The first token's sum runs on into the block before unless a document starts here.
        opens = jnp.sum(jnp.where(first, doc, 0)) > 0
        return jnp.where(opens, 0.0, _row(G, rows, 0))
    dinitial_ref[bi, hi, :] = jax.lax.fori_loop(0, n, block, jnp.zeros((A,), jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _sums(angles, dt, starts, initial, T, interpret):
    return _sums_fwd(angles, dt, starts, initial, T, interpret)[0]


def _sums_fwd(angles, dt, starts, initial, T, interpret):
    b, L, A = angles.shape
    h = dt.shape[-1]
    theta = call(functools.partial(_sums_kernel, T=T), (b, h),
                 jax.ShapeDtypeStruct((b, L, h, A), jnp.float32), _WARPS, None, interpret,
                 "mamba3_angle_sums")(angles, dt, starts, initial)
    return theta, (angles, dt, starts)


def _sums_bwd(T, interpret, residuals, g):
    angles, dt, starts = residuals
    b, L, A = angles.shape
    h = dt.shape[-1]
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    ddt, dangles, dinitial = call(
        functools.partial(_sums_backward_kernel, T=T), (b, h),
        [f32(b, L, h), f32(b, h, L, A), f32(b, h, A)], _WARPS, None, interpret,
        "mamba3_angle_sums_backward")(angles, dt, starts, g)
    return dangles.sum(1), ddt, None, dinitial


_sums.defvjp(_sums_fwd, _sums_bwd)


def angle_sums(angles, dt, starts=None, initial=None, *, block=BLOCK, interpret=None):
    """theta [b, l, h, a] float32 (see the module docstring); interpret=None runs Pallas's
    interpreter where there is no GPU. The rows are padded to whole blocks and the angles
    to a power of two of at least 16 (Triton's smallest product), the padding sliced off."""
    b, l, a = angles.shape
    h = dt.shape[-1]
    interpret = off_gpu() if interpret is None else interpret
    L, A = -(-l // block) * block, max(16, 1 << (a - 1).bit_length())
    starts = (jnp.zeros((b, l), jnp.int32) if starts is None else starts.astype(jnp.int32))
    initial = (jnp.zeros((b, h, a), jnp.float32) if initial is None
               else initial.astype(jnp.float32))
    theta = _sums(jnp.pad(angles.astype(jnp.float32), ((0, 0), (0, L - l), (0, A - a))),
                  jnp.pad(dt.astype(jnp.float32), ((0, 0), (0, L - l), (0, 0))),
                  jnp.pad(starts, ((0, 0), (0, L - l))),
                  jnp.pad(initial, ((0, 0), (0, 0), (0, A - a))), block, interpret)
    return theta if (L, A) == (l, a) else theta[:, :l, :, :a]
