"""The Mamba-3 scan on the SSD's Pallas kernels (pallas_kernels.ssd: forward and backward,
their custom_vjp), with XLA elementwise work around them.

Legend as reference.py. After `reference.prepare` (the angles, the rotated q and k, the
trapezoid weights w and eta), the scan is an SSD whose decay is adt and whose weight on
v_s k_s^T is w_s, read out through q, less a term local to each token:

    y_t,R = sum_{(s, r) <= (t, R)} exp(adt_{s+1} + ... + adt_t) w_s (q_t,R . k_s,r) v_s,r
            + sum_{r > R} w_t (q_t,R . k_t,r) v_t,r - eta_t sum_r (q_t,R . k_t,r) v_t,r
            + D v_t,R

The kernels run it over the l * r positions (t, r) in order, each with its rank's k (their
B), q (C) and v (x), the weight w_t, and the decay adt_t on the first rank of each token and
none on the others, as tokens of r positions (ssd_weighted's `rank` and `eta`): in their
intra-chunk products y_t,R reads every rank of its own token, those after R too, and the
token's own pairs are weighted w_t - eta_t, so the two local terms above are computed where
q . k and v already are, and their gradients with the others'. For SISO (r = 1) it is
-eta_t (q_t . k_t) v_t, a per-token skip (ssd_weighted's `skip`) that the kernels apply as
they apply D, so XLA makes no pass over y and x for it, nor over dy and x for its gradients
(docs/performance.md);
q . k comes from the unrotated C and B (`token_products`). Written in XLA around the
kernels instead (q_t,R . k_t,r from the unrotated B and C, then a product with v per
token), the MIMO term was most of a rank-4 forward's time as dot_generals (batches of r x r
products), and as sums in fusions still slower than the term in the kernels
(docs/performance.md).
The initial state enters with its previous token's trapezoid term folded in, as in the
chunked form.

The rotation is the forward kernel's own (ssd_weighted's `rotation`): it reads the group's C
and B and, per head, adds its biases and turns them by its angles theta as it loads each
chunk (`to_kernel_order` puts the pairs the rotary turns where the kernels turn them), so the
forward has no per-head q or k in memory: written out by XLA, with the turn's cos and sin,
they were most of a forward's GPU time (docs/performance.md). The backward kernels turn
them too, with a kernel of their own turning the gradients back (triton.turned_back), where
the batch gives their chunk walks enough programs; else they read per-head turned copies
that XLA makes inside the custom_vjp (triton.turned; triton.Config.backward_turns says where
and why).

A long row with few (row, head) programs is scanned in parts at once (`segments`, as
pallas_kernels.ssd's): the angles are per token, so a part reads its own, and the state
entering each part is joined from the parts' zero-state final states in the turned values
(ssd.vjp, `weighted_state` turning B as the forward kernel does, and C with C's biases for
the backward's read-out). At 1 x 65536 with 64 heads, 8 parts take less time than the whole
row, forward and backward (BENCHMARKS.md, Mamba-3 against mamba_ssm).

The angle state theta is summed by a kernel of its own each way (angles.py) where its walks,
one (row, head) a program, have two waves of programs (`angles.takes`), else by XLA
(reference.cumulative_angles, checkpointed).

Gradients: the kernels' custom_vjp for x, the weights, the decays, B, C, theta, the biases,
the initial state and D; the angle sums' custom_vjp (or XLA's) and automatic
differentiation carry them through the angles' sum and the trapezoid weights to every
input. With the gate checkpointed too (mamba_jax.layers.mamba3), a mamba3-1.3b
layer on the kernels keeps no per-head copy of B or C for the backward pass.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from pallas_kernels.mamba3.angles import angle_sums, takes as angles_take
from pallas_kernels.mamba3.reference import (Mamba3State, accumulation_dtype, entering_ssm,
                                             first_weight, rotated, token_terms, values)
from pallas_kernels.ssd import auto_segments, triton
from pallas_kernels.ssd.vjp import ssd_weighted


# The SSD kernels' settings for Mamba-3. The per-chunk states are recomputed in the backward,
# not kept from the forward (triton.Config.keep_states, as mamba_ssm's Mamba-3 keeps them):
# kept, mamba3-1.3b's training step fits fewer rows of 2048, for about the same tokens/s at
# the largest batch each fits (docs/performance.md).
CONFIG = triton.Config()


def kernels_take(C, angles):
    """Whether the kernels take this layout: the MIMO rank dividing their chunk and n / (2a)
    a power of two (the rotary over all of d_state or half of it) for C [b, l, r, g, n],
    angles [b, l, a]."""
    return triton.takes_rotation(C.shape[-1], angles.shape[-1], C.shape[2],
                                 triton.Config().chunk)


def to_kernel_order(t, a, rotary):
    """t [..., n] with its n entries in the order in which the kernels turn them: adjacent
    pairs, pair j the rotary's pair j / s where s = n / (2a) divides j, the pairs it leaves
    unturned between (triton._rotation_args). The rotary's pair i is (2i, 2i + 1)
    ("pairwise") or (i, i + n / 2) ("halves"), turned for i < a. Reshapes and transposes
    only: the transpose of a gather by an index array would be a scatter."""
    *lead, n = t.shape
    half = n // 2
    pairs = t.reshape(*lead, half, 2) if rotary == "pairwise" else \
        jnp.swapaxes(t.reshape(*lead, 2, half), -1, -2)  # [..., n / 2, 2]
    unturned = pairs[..., a:, :].reshape(*lead, a, half // a - 1, 2)
    return jnp.concatenate([pairs[..., :a, None, :], unturned], axis=-2).reshape(t.shape)


def from_kernel_order(t, a, rotary):
    """to_kernel_order's inverse."""
    *lead, n = t.shape
    half = n // 2
    pairs = t.reshape(*lead, a, half // a, 2)
    pairs = jnp.concatenate([pairs[..., 0, :], pairs[..., 1:, :].reshape(*lead, half - a, 2)],
                            axis=-2)  # [..., n / 2, 2], the rotary's pair order
    return pairs.reshape(t.shape) if rotary == "pairwise" else \
        jnp.swapaxes(pairs, -1, -2).reshape(t.shape)


def mamba3_kernels(C, B, x, adt, dt, trap, angles, C_bias, B_bias, *, D=None, mimo_x=None,
                   rotary="pairwise", initial_state=None, seq_idx=None, segments="auto",
                   interpret=None):
    """Arguments and results as reference.mamba3_chunked (its chunk is the kernels' own);
    interpret=None runs Pallas's interpreter where there is no GPU. segments: each row's
    l * r positions scanned as this many parts at once, joined by their states (as
    pallas_kernels.ssd's `segments`, in the turned values; an int dividing l); "auto":
    `auto_segments`' choice for the positions, where the parts are whole tokens."""
    b, l, h, p = x.shape
    r, _, n = C.shape[2:]
    if segments == "auto":
        segments = auto_segments(b, l * r, h, "triton")
        segments = segments if l % segments == 0 else 1
    if not isinstance(segments, int) or segments < 1 or l % segments:
        raise ValueError(f"mamba3 scan: segments={segments!r} must be a positive int dividing "
                         f"the sequence length {l}, or 'auto'")
    if not kernels_take(C, angles):
        raise ValueError(f"mamba3 scan: the kernels take a MIMO rank dividing "
                         f"{triton.Config().chunk} and d_state / (2 * angles) a power of two; "
                         f"got rank {r}, d_state {n}, {angles.shape[-1]} angles (use "
                         "implementation='xla')")
    acc = accumulation_dtype(x)
    init = None if initial_state is None else Mamba3State(*(s.astype(acc)
                                                            for s in initial_state))
    theta, sigma, w, eta = token_terms(
        x, dt, trap, angles, seq_idx=seq_idx, initial_angle=None if init is None else init.angle,
        angle_sums=functools.partial(angle_sums, interpret=interpret) if angles_take(b, h)
        else None)
    h0 = None if init is None else entering_ssm(init, first_weight(sigma, dt), mimo_x)

    turnable = lambda t: to_kernel_order(t, angles.shape[-1], rotary)
    positions = lambda t: t.reshape(b, l * r, *t.shape[3:])  # [b, l, r, ...] -> (t, r) rows
    per_rank = lambda t: jnp.broadcast_to(t[:, :, None], (b, l, r, *t.shape[2:]))
    # What the kernels' x, B and C are computed of (mimo_x only for MIMO: an argument, not a
    # closure, so that its gradient comes back through the kernels' vjp).
    args = (C, B, x) + (() if mimo_x is None else (mimo_x,))

    def vBC(C, B, x, mimo_x=None):
        v = values(x, mimo_x, acc).astype(x.dtype)
        return positions(v), positions(turnable(B)), positions(turnable(C))

    # SISO's own-token term, -eta_t (q_t . k_t) x_t, is a per-token skip the kernels apply
    # as they apply D (no pass over y and x in XLA, nor over dy and x for its gradients);
    # MIMO's, which mixes the token's ranks, is the kernels' products over tokens of r
    # positions (`rank` and `eta`).
    skip = -eta * token_products(C[:, :, 0], B[:, :, 0], C_bias[:, 0], B_bias[:, 0], h,
                                 acc) if r == 1 else None
    first_rank = jnp.zeros((1, 1, r, 1), acc).at[:, :, 0].set(1.0)
    y, final_ssm = ssd_weighted(
        None, positions(per_rank(w)), positions(first_rank * adt.astype(acc)[:, :, None]),
        None, None, backend=triton, config=CONFIG, interpret=interpret, D=D, segments=segments,
        initial_state=None if h0 is None else turnable(h0),
        seq_idx=None if seq_idx is None else positions(per_rank(seq_idx)),
        inputs=(vBC, args), skip=skip, rank=r,
        eta=None if r == 1 else positions(per_rank(eta)),
        rotation=(theta, turnable(C_bias), turnable(B_bias)))
    y = y.reshape(b, l, r, h, p)
    _, k_last, _ = rotated(C[:, -1:], B[:, -1:], x[:, -1:], theta[:, -1:], C_bias, B_bias,
                           mimo_x, rotary=rotary)
    final = Mamba3State(theta[:, -1], from_kernel_order(final_ssm, angles.shape[-1], rotary),
                        k_last[:, 0], x[:, -1])
    return y, final


def token_products(C, B, C_bias, B_bias, h, acc):
    """q_t . k_t [b, l, h] in acc for SISO's C, B [b, l, g, n] and their biases [h, n]: the
    product of a token's rotated q and k, taken before the rotation, which turns both by the
    same angle and so keeps their dot product. Summed as the group's C . B and the bias
    terms, no per-head q or k is made ([b, l, h, n], h / g copies of C and B)."""
    b, l, g, n = C.shape
    per_group = lambda bias: bias.astype(C.dtype).astype(acc).reshape(g, h // g, n)
    C, B = C.astype(acc), B.astype(acc)
    C_bias, B_bias = per_group(C_bias), per_group(B_bias)
    qk = (jnp.sum(C * B, axis=-1)[..., None]  # [b, l, g, 1]
          + jnp.einsum("blgn,gGn->blgG", C, B_bias)
          + jnp.einsum("gGn,blgn->blgG", C_bias, B)
          + jnp.einsum("gGn,gGn->gG", C_bias, B_bias))
    return qk.reshape(b, l, h)
