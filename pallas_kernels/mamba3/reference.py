"""The Mamba-3 scan in plain JAX: the naive recurrence (the oracle) and the chunked form.

Legend for every shape here: b batch, l sequence, h heads, p headdim, r the MIMO rank (1:
SISO), g B/C groups (head i reads group i // (h/g)), n d_state, a rotary angles (a <= n/2),
c chunks, t and s positions inside one chunk.

Mamba-3 (Lahoti, Gu, Dao et al., 2026; mamba_ssm's Mamba3) per head, per document of a
packed row, with sigma_t = sigmoid(trap_t):

    theta_t = theta_{t-1} + pi * tanh(angles_t) * dt_t                (mod 2 pi; [a])
    q_t,r = R(theta_t) (C_t,r + C_bias_r)     k_t,r = R(theta_t) (B_t,r + B_bias_r)
    v_t,r = x_t * mimo_x_r                    (SISO: v = x)
    h_t = exp(adt_t) h_{t-1}
          + (1 - sigma_t) dt_t exp(adt_t) sum_r v_{t-1},r k_{t-1},r^T    (the trapezoid's
          + sigma_t dt_t sum_r v_t,r k_t,r^T                              two ends)
    y_t,r = h_t q_t,r + D v_t,r                                         (h_t: [p, n])

R(theta) rotates pairs of state entries by the angles: adjacent pairs (2i, 2i+1) for SISO
("pairwise", mamba_ssm's Triton kernels), (i, i + n/2) for MIMO ("halves", its TileLang
kernels), the i < a pairs only. The state carried from token to token (`Mamba3State`) is
theta, h, and the previous token's rotated k and its x: the next token's trapezoid reads
them. At a document start all four restart from zero; the initial state belongs to the
row's first document.

`mamba3_naive` runs the loop token by token; `mamba3_chunked` is the chunked (SSD) form:
the contribution of token s to h_t (s < t) is exp(sum_{s<u<=t} adt_u) w_s v_s k_s^T with
w_s = sigma_s dt_s + (1 - sigma_{s+1}) dt_{s+1}, so within a chunk the output is masked
decay-weighted attention q_t . k_s times v_s, minus the part of w_t the diagonal s = t does
not get yet ((1 - sigma_{t+1}) dt_{t+1} q_t . k_t v_t), and across chunks a short
recurrence of chunk states, as mamba_ssm's reference functions.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.norm.reference import rms_norm_reference
from pallas_kernels.ssd.reference import accumulation_dtype, document_ids

ROTARY = ("pairwise", "halves")
BC_NORM_EPS = 1e-5  # mamba_ssm's B_norm, C_norm and out-projection norm eps (fixed)


class Mamba3State(NamedTuple):
    """The scan's state between tokens: angle [b, h, a] (theta, in [0, 2 pi)), ssm
    [b, h, p, n] (float32, float64 for float64 inputs), k [b, r, h, n] (the last token's
    rotated k with its bias) and x [b, h, p] (the last token's x)."""

    angle: jax.Array
    ssm: jax.Array
    k: jax.Array
    x: jax.Array


def rotate(t, theta, rotary: str):
    """t [..., n] rotated by theta [..., a] (broadcast against t's leading axes) over the
    pairs `rotary` names; entries of pairs i >= a are unchanged. Computes in theta's dtype
    and returns it."""
    n, a = t.shape[-1], theta.shape[-1]
    cos = jnp.pad(jnp.cos(theta), [(0, 0)] * (theta.ndim - 1) + [(0, n // 2 - a)],
                  constant_values=1.0)
    sin = jnp.pad(jnp.sin(theta), [(0, 0)] * (theta.ndim - 1) + [(0, n // 2 - a)])
    t = t.astype(theta.dtype)
    if rotary == "halves":
        t0, t1 = t[..., :n // 2], t[..., n // 2:]
        return jnp.concatenate([t0 * cos - t1 * sin, t0 * sin + t1 * cos], axis=-1)
    pairs = t.reshape(*t.shape[:-1], n // 2, 2)
    t0, t1 = pairs[..., 0], pairs[..., 1]
    return jnp.stack([t0 * cos - t1 * sin, t0 * sin + t1 * cos], axis=-1).reshape(t.shape)


def angle_increments(angles, dt):
    """angles [b, l, a] (the projection, before tanh), dt [b, l, h] -> the angle each token
    adds, pi * tanh(angles) * dt [b, l, h, a] in dt's dtype."""
    return math.pi * jnp.tanh(angles.astype(dt.dtype))[:, :, None, :] * dt[..., None]


def wrap(theta):
    """theta mod 2 pi, in [0, 2 pi): where the angle state is kept."""
    return theta - 2 * math.pi * jnp.floor(theta / (2 * math.pi))


def cumulative_angles(increments, starts, initial=None, block=64):
    """The angle state after each token: increments [b, l, h, a], starts [b, l] bool (a
    document starts: the sum restarts there) or None (one document a row), initial
    [b, h, a] or None (the angle entering the row's first document) -> theta [b, l, h, a] in
    [0, 2 pi).

    Summed within blocks of `block` tokens, and the wrapped block totals carried from block
    to block, so that no partial sum grows with the sequence (a plain cumulative sum over a
    long row would lose float32 precision before the wrap). Without starts there is no
    restart to look up: the gather that finds one would have constant indices, and XLA
    folded its transpose (a scatter over every angle) at compile time, for minutes."""
    b, l, h, a = increments.shape
    pad = (-l) % block
    inc = jnp.pad(increments, ((0, 0), (0, pad), (0, 0), (0, 0)))
    c = (l + pad) // block
    inc = inc.reshape(b, c, block, h, a)
    # The sums within each block as a product with a triangle of ones, in full float32: a
    # cumulative sum is a reduce-window on a GPU, a visible share of a mamba3-1.3b-sized
    # forward, and its transpose more (docs/performance.md). One
    # triangle a block, as a batched product [t, s] x [s, h * a] whose result is already in
    # [b, c, t, h * a] order: with one shared triangle the product's free axes came out
    # [t, b, c, h, a], and XLA transposed the increments in and the sums out.
    triangle = jnp.broadcast_to(jnp.tril(jnp.ones((block, block), inc.dtype)),
                                (b, c, block, block))
    cs = jax.lax.dot_general(triangle, inc.reshape(b, c, block, h * a),
                             (((3,), (2,)), ((0, 1), (0, 1))),
                             precision=jax.lax.Precision.HIGHEST).reshape(b, c, block, h, a)
    if starts is None:
        local, inside = cs, jnp.zeros((b, c, block, 1, 1), bool)
    else:
        starts = jnp.pad(starts, ((0, 0), (0, pad))).reshape(b, c, block)
        # The last start at or before each position inside its block (-1: none): the sum
        # runs from there, else from the block's entry angle.
        last = jax.lax.cummax(jnp.where(starts, jnp.arange(block), -1), axis=2)  # [b, c, t]
        before = cs - inc  # the sum of the block's tokens before each position
        base = jnp.take_along_axis(before, jnp.maximum(last, 0)[..., None, None], axis=2)
        inside = (last >= 0)[..., None, None]  # [b, c, t, 1, 1]: a document started
        local = jnp.where(inside, cs - base, cs)  # [b, c, t, h, a]
    opened = inside[:, :, -1]  # [b, c, 1, 1]: a document starts in the block

    # Block c passes on E -> wrap(end_c + E), or wrap(end_c) where a document opens in it.
    # Composed, two blocks are again one such map, so the blocks' maps compose in a
    # log-depth associative scan (a sequential scan over the blocks was a loop of small
    # kernels, one iteration a block), each partial sum wrapped.
    def compose(first, then):
        (end_1, opened_1), (end_2, opened_2) = first, then
        return jnp.where(opened_2, end_2, wrap(end_1 + end_2)), opened_1 | opened_2
    through, reset = jax.lax.associative_scan(compose, (local[:, :, -1], opened), axis=1)
    entry0 = jnp.zeros((b, 1, h, a), inc.dtype) if initial is None else \
        initial.astype(inc.dtype)[:, None]
    # The angle entering block c: the maps of blocks 0..c-1 applied to the initial angle.
    after = wrap(through + jnp.where(reset, 0.0, entry0))  # [b, c, h, a]: leaving block c
    entries = jnp.concatenate([entry0, after[:, :-1]], axis=1)[:, :, None]  # [b, c, 1, h, a]
    theta = local + jnp.where(inside, 0.0, entries)
    return wrap(theta.reshape(b, c * block, h, a)[:, :l])


def _document_starts(seq_idx, b, l):
    if seq_idx is None:
        return jnp.zeros((b, l), bool)
    return jnp.pad(seq_idx[:, 1:] != seq_idx[:, :-1], ((0, 0), (1, 0)))


def heavy_tail(x):
    """mamba_ssm's heavy_tail_activation: 1 + x for x >= 0, 1 / (1 - x) for x < 0."""
    return jnp.maximum(x, 0) + 1 / (1 - jnp.minimum(x, 0))


def projected(B, C, dd_dt, dd_A, B_norm, C_norm, dt_bias, A_floor):
    """The scan's B, C and decays from the in-projection's B, C [..., r, g, n] and dd_dt, dd_A
    [..., h] (mamba_ssm's Mamba3): B and C RMS-normed over n (B_norm, C_norm [n]) in their
    dtype; dt = softplus(dd_dt + dt_bias) and adt = A dt with A = min(-heavy_tail(dd_A),
    -A_floor), [..., h] float32. -> (B, C, dt, adt)."""
    B, C = (rms_norm_reference(t, norm, BC_NORM_EPS) for t, norm in ((B, B_norm), (C, C_norm)))
    A = jnp.minimum(-heavy_tail(dd_A.astype(jnp.float32)), -A_floor)
    dt = jax.nn.softplus(dd_dt.astype(jnp.float32) + dt_bias)
    return B, C, dt, A * dt


def gate(y, z, mimo_z=None, mimo_o=None, norm=None):
    """The scan's y [..., r, h, p] and z [..., h, p] -> [..., h, p] float32: per rank
    y * silu(z_r) (with norm [h, p], mamba_ssm's is_outproj_norm: RMSNorm of y per head
    times norm times silu(z_r)), z_r = z * mimo_z_r, summed over ranks through mimo_o [h, r,
    p] (SISO, mimo_z and mimo_o None: z_r = z, one rank)."""
    y = y.astype(jnp.float32)
    z = z.astype(jnp.float32)[..., None, :, :]
    if mimo_z is not None:
        z = z * jnp.swapaxes(mimo_z, 0, 1)
    if norm is not None:
        y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + BC_NORM_EPS)
        y = y * norm
    y = y * jax.nn.silu(z)
    if mimo_o is not None:
        # the ranks summed in one fusion: as a dot_general, a batch of h * p products of
        # contraction r
        return jnp.sum(y * jnp.swapaxes(mimo_o, 0, 1), axis=-3)
    return y[..., 0, :, :]


def _by_head(t, h):
    """t [b, l, r, g, n] -> [b, l, r, h, n]: the group each head reads."""
    return jnp.repeat(t, h // t.shape[3], axis=3)


def values(x, mimo_x, acc):
    """x [b, l, h, p] (or [b, h, p]) -> v [..., r, h, p] in acc: x times each rank's mimo_x
    [h, r, p] (SISO, None: r = 1, v = x)."""
    x = x.astype(acc)
    if mimo_x is None:
        return x[..., None, :, :]
    return x[..., None, :, :] * jnp.swapaxes(mimo_x, 0, 1).astype(acc)


def zero_state(b, h, p, n, r, a, acc=jnp.float32, kx_dtype=jnp.float32):
    """The state before any token: zeros of Mamba3State's shapes."""
    return Mamba3State(jnp.zeros((b, h, a), acc), jnp.zeros((b, h, p, n), acc),
                       jnp.zeros((b, r, h, n), kx_dtype), jnp.zeros((b, h, p), kx_dtype))


def check_shapes(C, B, x, adt, dt, trap, angles, C_bias, B_bias, D, mimo_x, rotary,
                 initial_state, seq_idx):
    """A ValueError naming the argument whose shape does not fit the others."""
    b, l, h, p = x.shape
    if C.ndim != 5 or C.shape != B.shape or C.shape[:2] != (b, l):
        raise ValueError(f"mamba3 scan: C {C.shape} and B {B.shape} must both be "
                         f"[b, l, r, g, n] with b, l = {b, l} of x {x.shape}")
    r, g, n = C.shape[2:]
    if h % g:
        raise ValueError(f"mamba3 scan: {h} heads are not divisible by {g} B/C groups")
    for name, t in (("adt", adt), ("dt", dt), ("trap", trap)):
        if t.shape != (b, l, h):
            raise ValueError(f"mamba3 scan: {name} {t.shape} must be [b, l, h] = {(b, l, h)}")
    if angles.ndim != 3 or angles.shape[:2] != (b, l) or not 0 < angles.shape[2] <= n // 2:
        raise ValueError(f"mamba3 scan: angles {angles.shape} must be [b, l, a] with "
                         f"0 < a <= n/2 = {n // 2}")
    for name, t in (("C_bias", C_bias), ("B_bias", B_bias)):
        if t.shape != (h, r, n):
            raise ValueError(f"mamba3 scan: {name} {t.shape} must be [h, r, n] = {(h, r, n)}")
    if D is not None and D.shape != (h,):
        raise ValueError(f"mamba3 scan: D {D.shape} must be [h] = {(h,)}")
    if r > 1 and mimo_x is None:
        raise ValueError(f"mamba3 scan: rank {r} > 1 needs mimo_x [h, r, p]")
    if mimo_x is not None and mimo_x.shape != (h, r, p):
        raise ValueError(f"mamba3 scan: mimo_x {mimo_x.shape} must be [h, r, p] = "
                         f"{(h, r, p)}")
    if n % 2 or rotary not in ROTARY:
        raise ValueError(f"mamba3 scan: rotary={rotary!r} must be one of {ROTARY}, over an "
                         f"even d_state (n = {n})")
    if initial_state is not None:
        want = Mamba3State((b, h, angles.shape[2]), (b, h, p, n), (b, r, h, n), (b, h, p))
        got = Mamba3State(*(s.shape for s in initial_state))
        if got != want:
            raise ValueError(f"mamba3 scan: initial_state shapes {got} must be {want}")
    if seq_idx is not None and seq_idx.shape != (b, l):
        raise ValueError(f"mamba3 scan: seq_idx {seq_idx.shape} must be [b, l] = {(b, l)}")


def mamba3_step(state: Mamba3State, C, B, x, adt, dt, trap, angles, C_bias, B_bias, *,
                D=None, mimo_x=None, rotary="pairwise", start=None):
    """One token of the recurrence: C, B [b, r, g, n], x [b, h, p], adt, dt, trap [b, h],
    angles [b, a], start [b] bool or None (a document starts here: the state restarts) ->
    (y [b, r, h, p] in the state's ssm dtype, the new Mamba3State). Other arguments as
    `mamba3_naive`."""
    acc = state.ssm.dtype
    h = x.shape[1]
    keep = (jnp.ones(x.shape[:1], acc) if start is None
            else jnp.where(start, 0.0, 1.0).astype(acc))[:, None]  # [b, 1]
    dt, adt, trap = dt.astype(acc), adt.astype(acc), trap.astype(acc)
    theta = wrap(state.angle.astype(acc) * keep[..., None]
                 + angle_increments(angles[:, None], dt[:, None])[:, 0])  # [b, h, a]
    q = rotate(_by_head(C[:, None].astype(acc), h)[:, 0]
               + jnp.swapaxes(C_bias, 0, 1).astype(acc), theta[:, None], rotary)
    k = rotate(_by_head(B[:, None].astype(acc), h)[:, 0]
               + jnp.swapaxes(B_bias, 0, 1).astype(acc), theta[:, None], rotary)
    sigma = jax.nn.sigmoid(trap)
    prev = jnp.einsum("brhp,brhn->bhpn", values(state.x, mimo_x, acc),
                      state.k.astype(acc) * keep[:, :, None, None])
    v = values(x, mimo_x, acc)  # [b, r, h, p]
    now = jnp.einsum("brhp,brhn->bhpn", v, k)
    ssm = (jnp.exp(adt)[..., None, None] * (state.ssm.astype(acc) * keep[..., None, None]
                                            + ((1 - sigma) * dt)[..., None, None] * prev)
           + (sigma * dt)[..., None, None] * now)
    y = jnp.einsum("bhpn,brhn->brhp", ssm, q)
    if D is not None:
        y = y + D.astype(acc)[:, None] * v
    return y, Mamba3State(theta, ssm, k.astype(state.k.dtype), x.astype(state.x.dtype))


def mamba3_naive(C, B, x, adt, dt, trap, angles, C_bias, B_bias, *, D=None, mimo_x=None,
                 rotary="pairwise", initial_state=None, seq_idx=None):
    """The recurrence, one token at a time (`mamba3_step` in a loop). Slow; the oracle for
    every other implementation.

    C, B [b, l, r, g, n] (normed, before their biases), x [b, l, h, p], adt [b, l, h]
    (A * dt, <= 0), dt [b, l, h] (after softplus), trap [b, l, h] (before the sigmoid),
    angles [b, l, a] (before tanh), C_bias, B_bias [h, r, n], D [h] or None, mimo_x
    [h, r, p] or None (SISO), initial_state a Mamba3State or None, seq_idx [b, l] or None.
    Returns (y [b, l, r, h, p] in x.dtype, the final Mamba3State, ssm in float32 or
    float64 for float64 inputs).
    """
    b, l, h, p = x.shape
    r, _, n = C.shape[2:]
    acc = accumulation_dtype(x)
    state = (zero_state(b, h, p, n, r, angles.shape[-1], acc, acc) if initial_state is None
             else Mamba3State(*(s.astype(acc) for s in initial_state)))

    def step(state, inputs):
        *token, start = inputs
        y, state = mamba3_step(state, *token, C_bias, B_bias, D=D, mimo_x=mimo_x,
                               rotary=rotary, start=start)
        return state, y

    time_major = [jnp.moveaxis(t, 1, 0) for t in (
        C, B, x.astype(acc), adt, dt, trap, angles, _document_starts(seq_idx, b, l))]
    state, y = jax.lax.scan(step, state, time_major)
    return jnp.moveaxis(y, 0, 1).astype(x.dtype), state


def prepare(C, B, x, dt, trap, angles, C_bias, B_bias, *, mimo_x, rotary, seq_idx,
            initial_angle=None, block=64):
    """The per-token terms of the chunked form: theta [b, l, h, a] (the angle state after
    each token), q, k [b, l, r, h, n] (rotated, with biases) and v [b, l, r, h, p] in x's
    dtype, sigma [b, l, h], w [b, l, h] (the weight of v_s k_s^T in every later state) and
    eta [b, l, h] (the part of w that the next token adds), in float32 (float64); block:
    cumulative_angles'. `token_terms`, then `rotated`."""
    theta, sigma, w, eta = token_terms(x, dt, trap, angles, seq_idx=seq_idx,
                                       initial_angle=initial_angle, block=block)
    q, k, v = rotated(C, B, x, theta, C_bias, B_bias, mimo_x, rotary=rotary)
    return theta, q, k, v, sigma, w, eta


def token_terms(x, dt, trap, angles, *, seq_idx, initial_angle=None, block=64,
                angle_sums=None):
    """prepare's theta, sigma, w and eta (x [b, l, h, p] gives the shapes and dtype).
    angle_sums(angles, dt, starts or None, initial_angle) -> theta sums the angle state
    (pallas_kernels.mamba3.angles.angle_sums, its kernels); None: cumulative_angles."""
    b, l, h, _ = x.shape
    acc = accumulation_dtype(x)
    dt = dt.astype(acc)
    starts = _document_starts(seq_idx, b, l)
    if angle_sums is None:
        # Checkpointed: the backward pass recomputes the sum's wrapped and masked terms (36 MB
        # a mamba3-1.3b layer per 2048-token row) from angles and dt rather than keep them.
        angle_sums = lambda angles, dt, starts, initial: jax.checkpoint(
            cumulative_angles, static_argnums=(3,))(
                angle_increments(angles, dt), starts, initial, block)
    theta = angle_sums(angles, dt, None if seq_idx is None else starts, initial_angle)
    sigma = jax.nn.sigmoid(trap.astype(acc))
    # The next token's trapezoid weight on this token, where the next token continues its
    # document in this row (the last token's goes through the state's k and x instead).
    follows = (1 - sigma[:, 1:]) * dt[:, 1:] * ~starts[:, 1:, None]
    eta = jnp.pad(follows, ((0, 0), (0, 1), (0, 0)))
    return theta, sigma, sigma * dt + eta, eta


def rotated(C, B, x, theta, C_bias, B_bias, mimo_x, *, rotary):
    """prepare's q, k and v in x's dtype, of C, B [b, l, r, g, n], x [b, l, h, p] and theta
    [b, l, h, a] (any matching leading axes: [b, 1, ...] for one token)."""
    h = x.shape[2]
    q = rotate(_by_head(C, h) + jnp.swapaxes(C_bias, 0, 1).astype(C.dtype),
               theta[:, :, None], rotary).astype(x.dtype)
    k = rotate(_by_head(B, h) + jnp.swapaxes(B_bias, 0, 1).astype(B.dtype),
               theta[:, :, None], rotary).astype(x.dtype)
    return q, k, values(x, mimo_x, accumulation_dtype(x)).astype(x.dtype)


def first_weight(sigma, dt):
    """The first token's trapezoid weight on the token before it, (1 - sigma_0) dt_0 [b, h],
    of sigma, dt [b, l, h]."""
    return (1 - sigma[:, 0]) * dt[:, 0].astype(sigma.dtype)


def entering_ssm(init: Mamba3State, weight, mimo_x):
    """The SSM state entering a part with its previous token's trapezoid term added, before
    the first token's decay: init.ssm + weight sum_r v_r k_r^T from init's k and x ([b, h,
    p, n] in init.ssm's dtype); weight [b, h] (`first_weight`)."""
    prev = jnp.einsum("brhp,brhn->bhpn", values(init.x, mimo_x, init.ssm.dtype), init.k)
    return init.ssm + weight[..., None, None] * prev


def mamba3_chunked(C, B, x, adt, dt, trap, angles, C_bias, B_bias, *, chunk_size, D=None,
                   mimo_x=None, rotary="pairwise", initial_state=None, seq_idx=None):
    """The chunked algorithm in XLA ops; any l (padded to a chunk multiple inside; a
    chunk_size above l is one chunk of l tokens). Arguments and results as `mamba3_naive`. Matmul operands are in x's dtype (bf16
    allowed) with float32 accumulation; angles, decays, cumulative sums and states are
    float32 (float64 for float64 inputs)."""
    b, l, h, p = x.shape
    r, _, n = C.shape[2:]
    chunk_size = min(chunk_size, l)
    acc = accumulation_dtype(x)
    cd = x.dtype  # the matmul operands' dtype
    dt, adt = dt.astype(acc), adt.astype(acc)
    doc = None if seq_idx is None else document_ids(seq_idx)
    init = None if initial_state is None else Mamba3State(*(s.astype(acc)
                                                            for s in initial_state))

    theta, q, k, v, sigma, w, eta = prepare(
        C, B, x, dt, trap, angles, C_bias, B_bias, mimo_x=mimo_x, rotary=rotary,
        seq_idx=seq_idx, initial_angle=None if init is None else init.angle, block=chunk_size)

    # The first token's decay applies to the entering state and its trapezoid term: it is
    # applied with the chunk decays below.
    h0 = (jnp.zeros((b, h, p, n), acc) if init is None
          else entering_ssm(init, first_weight(sigma, dt), mimo_x))

    pad = (-l) % chunk_size
    if pad:
        zeros = lambda t: jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2))
        q, k, v, adt, w, eta = map(zeros, (q, k, v, adt, w, eta))
        if doc is not None:
            doc = jnp.pad(doc, ((0, 0), (0, pad)), mode="edge")
    c, Q = (l + pad) // chunk_size, chunk_size
    q, k, v = (t.reshape(b, c, Q, r, h, -1) for t in (q, k, v))
    adt, w, eta = (t.reshape(b, c, Q, h) for t in (adt, w, eta))
    cs = jnp.cumsum(adt, axis=2)  # [b, c, t, h]

    causal = jnp.tril(jnp.ones((Q, Q), bool))
    if doc is None:
        same_doc = causal[None, None]
    else:
        doc = doc.reshape(b, c, Q)
        same_doc = causal & (doc[:, :, :, None] == doc[:, :, None, :])  # [b, c, t, s]

    # 1. Inside each chunk: q . k masked by the decay from s to t, times w_s v_s; minus the
    # diagonal's share of w_t that belongs to the next token.
    qk = jnp.einsum("bctRhn,bcsrhn->bchtsRr", q, k, preferred_element_type=acc)
    segsum = jnp.moveaxis(cs[:, :, :, None] - cs[:, :, None, :], -1, 2)  # [b, c, h, t, s]
    decay = jnp.exp(jnp.where(same_doc[:, :, None], segsum, -jnp.inf))
    M = qk * (decay * jnp.moveaxis(w, 3, 2)[:, :, :, None, :])[..., None, None]
    y = jnp.einsum("bchtsRr,bcsrhp->bctRhp", M.astype(cd), v, preferred_element_type=acc)
    diag = jnp.einsum("bctRhn,bctrhn->bctRrh", q, k, preferred_element_type=acc)
    y = y - jnp.einsum("bctRrh,bctrhp->bctRhp", (diag * eta[:, :, :, None, None]).astype(cd),
                       v, preferred_element_type=acc)

    # 2. Each chunk's own state at its end, from the tokens of the document open there.
    to_end = jnp.exp(cs[:, :, -1:] - cs)  # [b, c, s, h]
    if doc is not None:
        to_end = to_end * (doc == doc[:, :, -1:])[..., None]
    kw = (k.astype(acc) * (to_end * w)[:, :, :, None, :, None]).astype(cd)
    own = jnp.einsum("bcsrhp,bcsrhn->bchpn", v, kw, preferred_element_type=acc)

    # 3. Across chunks: a sequential scan of whole-chunk decays (no long cumulative sum).
    chunk_decay = jnp.exp(cs[:, :, -1])  # [b, c, h]
    if doc is not None:
        entry_doc = jnp.concatenate([doc[:, :1, 0], doc[:, :-1, -1]], axis=1)  # [b, c]
        chunk_decay = chunk_decay * (doc[:, :, -1] == entry_doc)[..., None]

    def pass_state(state, inputs):
        decay_c, own_c = inputs
        return state * decay_c[..., None, None] + own_c, state

    final_ssm, entry = jax.lax.scan(
        pass_state, h0, (jnp.moveaxis(chunk_decay, 1, 0), jnp.moveaxis(own, 1, 0)))
    entry = jnp.moveaxis(entry, 0, 1)  # [b, c, h, p, n]

    # 4. The state entering each chunk, decayed to each position and read out through q.
    from_entry = jnp.exp(cs)  # [b, c, t, h]
    if doc is not None:
        from_entry = from_entry * (doc == entry_doc[:, :, None])[..., None]
    y_entry = jnp.einsum("bctRhn,bchpn->bctRhp", q, entry.astype(cd),
                         preferred_element_type=acc)
    y = y + y_entry * from_entry[:, :, :, None, :, None]
    y = y.reshape(b, c * Q, r, h, p)[:, :l]
    if D is not None:
        y = y + D.astype(acc)[:, None] * values(x, mimo_x, acc)
    final = Mamba3State(theta[:, -1], final_ssm,
                        k.reshape(b, c * Q, r, h, n)[:, l - 1], x[:, -1])
    return y.astype(x.dtype), final
