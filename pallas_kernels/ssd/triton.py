"""SSD forward and backward kernels in Pallas, lowered through Triton (`pl.pallas_call`).

Legend: b batch, l sequence (padded to a multiple of the kernel chunk t), h heads, p headdim,
g groups, r = h // g heads per group, n d_state, c = l // t chunks, t and s positions inside
one chunk.

Every kernel sees chunk-local quantities computed outside in XLA, so automatic
differentiation handles the cheap parts: `dt [b, h, l]` after softplus and `cs [b, h, l]`, the
cumulative sum of dt * A restarted at every chunk. Document ids `doc [b, l]` (int32) mask
everything that would cross a document start (see reference.ssd_chunked).

Four kernels, and a fifth for scanning a row in parts (`weighted_state`, vjp.py):
- `_forward_kernel`, grid (b, h, p / bp): walks the chunks of one (batch, head) in order
  with the state [bp, n] in registers; per chunk the quadratic intra-chunk term, the read-out
  of the entering state, the D skip and the state update. Reads x, B, C once, writes y
  once.
- `_chunk_states_kernel`: the same walk without y, writing each chunk's entering state: the
  backward pass recomputes the states with it (reading x and B once) rather than the
  forward keeping them from one pass to the other (unless `Config.keep_states`: then the
  forward kernel writes them as it walks); they are the backward kernels' only input
  beyond the forward's.
- `_backward_state_kernel`, grid (b, h, p / bp): walks the chunks backwards carrying dS, the
  gradient of the state leaving the chunk; per chunk dx (with the D skip's), the dt-gradient
  of the x dt product, and the part of the cumsum gradient that comes through the leaving
  state; D's gradient summed over the chunks. Saves each chunk's dS.
- `_backward_bc_kernel`, grid (b, c, g * q): chunks in parallel; loops over r / q heads of
  the group accumulating dB and dC in registers (no atomics, no per-head copies of dB/dC),
  and writes each head's remaining cumsum gradient. q (Config.backward_bc_heads) partial
  dB, dC per group are summed after the kernel.

With `rotation` (Mamba-3's rotary embedding), the forward kernel reads the group's B and C
and, per head, adds its biases and turns them by its angles as it loads each chunk. The
backward kernels read per-head turned copies that XLA makes (`turned`), or turn as the
forward does (`Config.backward_turns`); either way their dB and dC are per head, of the
turned values, and `turned`'s vjp (XLA's, or the kernel `turned_back`) carries them back to
the group's B and C, the angles and the biases.

With `eta` and `rank` (Mamba-3's own-token terms; forward's docstring) the positions form
tokens: the intra-chunk products are causal by tokens, a token's own pairs weighted dt - eta;
the backward's state kernel reads the weighted pairs for dx, and the dB/dC kernel sums its
products into dt's and eta's intra-chunk gradients. With
`skip` (Mamba-3 SISO's own-token term, one position a token) the forward kernel adds
skip x as it adds D x, and the backward's state kernel its gradients.

The kernel chunk t is this module's own tile, independent of the caller's chunk_size: the
chunked algorithm is exact for any chunk, only rounding differs. Matmul operands are x's
dtype (bf16 allowed) with float32 accumulation; decays, cumulative sums and states are
float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import hardware
from pallas_kernels.triton_call import call, present, split_optional

_HIGHEST = jax.lax.Precision.HIGHEST  # IEEE float32 dots for float32 inputs (not TF32)
_LOG2_E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles and launch shapes. `chunk` (t) must be a power of two >= 16; `block_p` (bp) a
    divisor of headdim (its power-of-two blocks, _sub_block, must be >= 16 on a GPU)."""
    chunk: int = 64
    block_p: int | None = None  # None: the whole headdim, split in two when b*h is small
    forward_warps: int = 4
    backward_state_warps: int = 4
    backward_bc_warps: int = 8
    # The dB/dC kernel's warps where each of its programs takes one head (Mamba-3's turned B
    # and C, which differ per head; or one head a group): b * chunks * h small programs,
    # which fewer warps let share a multiprocessor: 4 warps beat 8 for the Mamba-3 scan
    # (docs/performance.md).
    one_head_bc_warps: int = 4
    # Heads of a group that one dB/dC program loops over; None: all of them. Fewer heads
    # per program multiply the programs (b * chunks * g is small for short batches) at the
    # cost of one float32 dB/dC partial per program, summed after the kernel.
    backward_bc_heads: int | None = None
    # Software-pipelining stages of the chunk and head loops. One for the backward kernels:
    # 2 stages made the state and dB/dC kernels slower (their registers, not their loads,
    # bound them; docs/performance.md).
    forward_stages: int = 2
    backward_stages: int = 1
    # The dB/dC kernel's stages where its programs loop over several heads (a group's): the
    # next head's x, dy, state and state gradient load while a head is computed: a long
    # row's kernel gains, training steps are on par (docs/performance.md). A
    # program of one head (Mamba-3's turned B and C) has no loop to pipeline: it keeps
    # backward_stages.
    backward_bc_stages: int = 2
    # The forward's stages when it turns B and C (`rotation`): two were much slower than one
    # (docs/performance.md).
    rotation_forward_stages: int = 1
    # The per-chunk states the backward pass recomputes and their gradients, stored in x's
    # dtype instead of float32 (they are carried and summed in float32 either way): half
    # their memory and traffic for bf16 inputs, at bf16 rounding of what the backward reads,
    # as mamba_ssm's chunk scan reads its states in C's dtype: less time forward+backward
    # than float32 states, with the same error against mamba_ssm (BENCHMARKS.md, SSD scan).
    # float32 inputs keep float32 states.
    states_in_input_dtype: bool = True
    # The per-chunk states kept from the forward kernel for the backward (under
    # differentiation only; a forward alone writes none) instead of recomputed there by
    # `chunk_states`: the forward writes them as it walks, and the backward skips a walk
    # that reads x and B again, at twice x's memory (t = 64, d_state 128, in x's dtype) a
    # layer until its backward. With Mamba-3's scan it saved little time alone or in
    # mamba3-1.3b's training step, for more memory (docs/performance.md). Off by default: it
    # lowers the largest batch that fits, for about the same tokens/s at each one's.
    keep_states: bool = False
    # With `rotation`, the backward's B and C and their gradients: True, its kernels turn the
    # group's B and C as they load them, as the forward does, and a kernel turns their
    # gradients back (`turned_back`); False, its kernels read per-head turned copies that
    # XLA writes (`turned`) and XLA's vjp of that turn takes their gradients back (at 8 x
    # 2048 with 64 heads and d_state 128 each copy and each gradient is 268 MB in bf16).
    # None: True where the kernels that walk the chunks (grid (b, h, p / bp)) have at least
    # two waves of (batch, head) programs (`turns_in_backward`): turning beat the copies at
    # 8 x 2048 and 8 x 8192 and lost at 1 x 65536, where each of the 128 programs walks
    # 1,024 chunks and the turn lengthens every step of the walk (docs/performance.md).
    backward_turns: bool | None = None
    # The positions (rows) of one turned_back program; None: 16, or 32 where the biases have
    # several rows (MIMO ranks; at least the rank, and dividing the rows): 16 suited SISO
    # and 32 MIMO rank 4, where 16 rows are 4 of its tokens and its biases' partial sums, a
    # [rank, n] per program and head, were 1 GB in float32 (docs/performance.md).
    turned_back_rows: int | None = None

    def turns_in_backward(self, b, h):
        """Whether the backward kernels turn B and C themselves (`backward_turns`) for x
        [b, l, h, p]."""
        if self.backward_turns is not None:
            return self.backward_turns
        return b * h >= hardware.two_waves()


def supports(x, B):
    """Whether these kernels take the shapes: headdim a multiple of 16 (processed in
    power-of-two blocks, _sub_blocks) and d_state a power of two >= 16."""
    p, n = x.shape[-1], B.shape[-1]
    return p % 16 == 0 and n >= 16 and n & (n - 1) == 0


def _block_p(config, b, h, p):
    """The headdim columns of one program: p, or a divisor of it (processed in blocks of
    _sub_block(bp))."""
    if config.block_p is not None:
        bp = min(config.block_p, p)
        if p % bp:
            raise ValueError(f"ssd: Config.block_p={config.block_p} must divide headdim {p}")
        return bp
    # Fewer (batch, head) programs than about two waves of the multiprocessors leaves the
    # GPU half idle; halving headdim doubles the programs at the cost of recomputing C B^T
    # once more.
    half = p // 2
    few = b * h < hardware.two_waves()
    return half if few and half >= 16 and half % _sub_block(p) == 0 else p


def _dot(a, b, contract=(1, 0)):
    return jax.lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())),
                               precision=_HIGHEST, preferred_element_type=jnp.float32)


def _weighted(a, weights):
    """a [t, c] times weights [t] per position, in float32, rounded back to a's dtype: a
    matmul operand (the kernels' and reference.weighted_state's rounding)."""
    return (a.astype(jnp.float32) * weights[:, None]).astype(a.dtype)


def _tokens(t, rank):
    """The [t, s] token of each position of a chunk, row-wise and column-wise: position s
    belongs to token s // rank (`eta`'s tokens, forward's docstring)."""
    row = jax.lax.broadcasted_iota(jnp.int32, (t, t), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (t, t), 1)
    return (row, col) if rank == 1 else (row // rank, col // rank)


def _chunk_masks(doc_ref, bi, t0, t, rank=1):
    """One chunk's document view: the [t, s] mask (causal by tokens of `rank` positions,
    same document), the documents of its positions [t], of its last position, and of the
    position before it (the document whose state enters the chunk). Without documents only
    the causal mask."""
    row, col = _tokens(t, rank)
    causal = col <= row
    if doc_ref is None:
        return causal, None, None, None
    doc = doc_ref[bi, pl.ds(t0, t)]
    doc_last = doc_ref[bi, t0 + t - 1]
    doc_entry = doc_ref[bi, jnp.maximum(t0 - 1, 0)]  # the initial state belongs to doc 0
    return causal & (doc[:, None] == doc[None, :]), doc, doc_last, doc_entry


def _decays(cs, cs_last, within, doc, doc_last, doc_entry):
    """Decays of one chunk: within [t, s], from entry to t [t], from s to the chunk's end [s],
    and across the whole chunk (a scalar). As powers of two of cs log2(e), scaled once a
    chunk: libdevice's exp2f, which jnp.exp2 lowers to, is the hardware's ex2.approx (about 2
    ulp), where its expf, which jnp.exp lowers to, reduces the argument first (mamba_ssm's
    selective scan scales A by log2(e) for the same reason); a chunk takes t x t of them."""
    cs, cs_last = cs * _LOG2_E, cs_last * _LOG2_E
    within_decay = jnp.exp2(jnp.where(within, cs[:, None] - cs[None, :], -jnp.inf))
    from_entry = jnp.exp2(cs)
    to_end = jnp.exp2(cs_last - cs)
    across = jnp.exp2(cs_last)
    if doc is not None:
        from_entry = jnp.where(doc == doc_entry, from_entry, 0.0)
        to_end = jnp.where(doc == doc_last, to_end, 0.0)
        across = jnp.where(doc_last == doc_entry, across, 0.0)
    return within_decay, from_entry, to_end, across


def _pair_weights(dt, eta, t, rank):
    """The weight of position s in y_t [t, s] (or [1, s] without eta): dt_s, less eta_s where
    s is in t's token."""
    if eta is None:
        return dt[None, :]
    row, col = _tokens(t, rank)
    return dt[None, :] - jnp.where(row == col, eta[None, :], 0.0)


def _cos_sin(theta, n):
    """cos and sin [..., n / 2] of angles theta [..., a] float32, one per adjacent pair of
    B's and C's n entries: pair j turns by theta[.., j / s] where s = n / (2a) divides j and
    stays (cos 1, sin 0) otherwise (the rotation's layout, `_rotation_args`)."""
    cos, sin = cos_and_sin(theta)
    while cos.shape[-1] < n // 2:  # spread: each angle's pair, then an unturned one
        cos = _joined(cos, jnp.ones_like(cos))
        sin = _joined(sin, jnp.zeros_like(sin))
    return cos, sin


# pi / 2 in three parts, the first two of 8 and 11 significant bits, so that q times them is
# exact in float32 for |q| < 2^13, |theta| up to about 1.2e4 (Cody and Waite's reduction;
# Cephes' pi / 4 constants doubled).
_HALF_PI = (1.5703125, 4.837512969970703125e-4, 7.54978995489188216e-8)


def cos_and_sin(theta):
    """cos and sin of float32 angles, together: one reduction by pi / 2 to [-pi / 4, pi / 4]
    and Cephes' single-precision polynomials there (about 1e-7 from float64 for |theta| up
    to 1e4; the kernels' angles are wrapped to [0, 2 pi)). libdevice's cosf and sinf, which
    Pallas lowers jnp.cos and jnp.sin to, each reduce the argument on their own and guard
    a slow path for huge arguments: with them Mamba-3's scan, whose kernels turn B and C by
    each head's angles at every chunk, took longer forward+backward (docs/performance.md)."""
    q = jnp.floor(theta * (2 / math.pi) + 0.5)  # the nearest multiple of pi / 2
    r = ((theta - q * _HALF_PI[0]) - q * _HALF_PI[1]) - q * _HALF_PI[2]
    r2 = r * r
    s = r + r * r2 * (-1.6666654611e-1 + r2 * (8.3321608736e-3 + r2 * -1.9515295891e-4))
    c = 1.0 - 0.5 * r2 + r2 * r2 * (4.166664568298827e-2 + r2 * (-1.388731625493765e-3
                                                                + r2 * 2.443315711809948e-5))
    quadrant = q.astype(jnp.int32)  # theta = r + quadrant pi / 2 (mod 2 pi)
    # Quadrants 0-3 give (cos, sin) = (c, s), (-s, c), (-c, -s), (s, -c): odd ones swap c and
    # s; cos is negated in quadrants 1 and 2, sin in 2 and 3.
    odd = (quadrant & 1) == 1
    cos, sin = jnp.where(odd, s, c), jnp.where(odd, c, s)
    return (jnp.where(((quadrant + 1) & 2) != 0, -cos, cos),
            jnp.where((quadrant & 2) != 0, -sin, sin))


def _token_rows(start, size, rank):
    """The rows of theta (one a token of `rank` positions) of positions [start, start + size),
    both multiples of rank: those rows themselves at rank 1 (SISO's kernels as before)."""
    if rank == 1:
        return pl.ds(start, size)
    return pl.ds(pl.multiple_of(jax.lax.div(start, rank), size // rank), size // rank)


def _per_position(v, rank):
    """A token's row of v [T / rank, w] for each of its rank positions -> [T, w]: the angles'
    cos and sin are computed once a token, not once a position."""
    if rank == 1:
        return v
    tokens, w = v.shape
    return jnp.broadcast_to(v[:, None, :], (tokens, rank, w)).reshape(tokens * rank, w)


def _pairs(v):
    """v [..., n] -> its pairs' first and second entries [..., n / 2] each."""
    return jnp.unstack(v.reshape(*v.shape[:-1], v.shape[-1] // 2, 2), axis=-1)


def _joined(first, second):
    """_pairs' inverse: [..., w] twice -> [..., 2w], interleaved."""
    return jnp.stack([first, second], axis=-1).reshape(*first.shape[:-1], 2 * first.shape[-1])


def _turned(v, bias, cos, sin):
    """B or C [..., n] plus a head's biases (broadcast against it, `_biased`), turned pair
    by pair in float32 (v0 cos - v1 sin, v0 sin + v1 cos; cos, sin from _cos_sin) and
    rounded to v's dtype again. The pairs are split and joined in v's dtype: in a kernel,
    what the layout changes move is half of float32's for bf16."""
    v0, v1 = (u.astype(jnp.float32) for u in _pairs(_biased(v, bias)))
    return _joined((v0 * cos - v1 * sin).astype(v.dtype), (v0 * sin + v1 * cos).astype(v.dtype))


def _biased(v, bias):
    """v plus bias, added in float32 and rounded to v's dtype (as XLA adds two bf16
    arrays): what the kernel's turn turns (`turned` computes the same values)."""
    return (v.astype(jnp.float32) + bias.astype(jnp.float32)).astype(v.dtype)


def turned(B, C, rotation):
    """B and C [b, l, g, n] as `forward` reads them with `rotation` (theta [b, l / k, h, a],
    a row a token of k positions, C_bias, B_bias [h, rank, n]; l a multiple of rank and k),
    in XLA: per head, [b, l, h, n] each in B's dtype. The backward pass's kernels read these
    copies unless they turn B and C themselves (Config.backward_turns); this function's vjp,
    or `turned_back`, turns their per-head gradients back (inside the dB/dC kernel, with the
    angles' gradients, that bound its registers: slower than the copies and the per-head
    kernels; docs/performance.md). The turn as XLA fuses it
    best: each pair's angle on both its entries and the pair's entries swapped (v0 cos - v1
    sin, v1 cos + v0 sin), where the kernels' split and join of the pairs (_turned) became
    concatenations that kept the gradient's per-head copies apart from their sum over the
    group's heads."""
    theta, C_bias, B_bias = rotation
    h, rank, n = C_bias.shape
    a = theta.shape[-1]
    # cos and sin of the a angles (XLA recomputes them in each fusion that reads them: of
    # n entries' angles they were 4x the work at a = n / 4), each pair's (1 and 0 for the
    # spread's unturned pairs) on both of its entries [b, l, h, n].
    theta = jnp.repeat(theta.astype(jnp.float32), B.shape[1] // theta.shape[1], axis=1)
    spread = lambda v, fill: jnp.repeat(jnp.pad(
        v[..., None], [(0, 0)] * theta.ndim + [(0, n // (2 * a) - 1)],
        constant_values=fill).reshape(*theta.shape[:-1], n // 2), 2, axis=-1)
    cos, sin = spread(jnp.cos(theta), 1.0), spread(jnp.sin(theta), 0.0)
    sign = jnp.tile(jnp.asarray([-1.0, 1.0], jnp.float32), n // 2)

    def rounded(v):  # to B's dtype, as the kernel rounds it, passing the gradient as is
        return v + jax.lax.stop_gradient(v.astype(B.dtype).astype(jnp.float32) - v)

    def turn(v, bias):
        # `_biased` in float32 with straight-through roundings: the per-head gradients are
        # summed over the group's heads, and the biases' over the rows, in float32, and
        # rounded once, at the end (not once a head and a row in B's dtype).
        v = jnp.repeat(v.astype(jnp.float32), h // v.shape[2], axis=2)  # each head's group
        bias = jnp.swapaxes(rounded(_bias_rows(bias, v.shape[1], jnp.float32)), 0, 1)
        v = rounded(v + bias)  # [b, l, h, n]
        swapped = jnp.flip(v.reshape(*v.shape[:-1], n // 2, 2), -1).reshape(v.shape) * sign
        return (v * cos + swapped * sin).astype(B.dtype)
    return turn(B, B_bias), turn(C, C_bias)


def _chunk_BC(B_ref, C_ref, rotation, bi, ts, gi, hi):
    """One chunk of B and C [t, n] in the input dtype as head hi reads them: its group's,
    or with `rotation` (the refs of theta, C_bias, B_bias) biased and turned by the head's
    angles at each position's token (theta has a row a token of B's rows / theta's rows
    positions). C_ref None: B only."""
    Bk = B_ref[bi, ts, gi, :]
    Ck = None if C_ref is None else C_ref[bi, ts, gi, :]
    if rotation is None:
        return Bk, Ck
    theta_ref, C_bias_ref, B_bias_ref = rotation
    rank = B_ref.shape[1] // theta_ref.shape[1]
    cos, sin = (_per_position(v, rank) for v in _cos_sin(
        theta_ref[bi, _token_rows(ts.start, ts.size, rank), hi, :], Bk.shape[-1]))
    return (_turned(Bk, B_bias_ref[hi], cos, sin),
            None if Ck is None else _turned(Ck, C_bias_ref[hi], cos, sin))


def _forward_kernel(x_ref, dt_ref, cs_ref, B_ref, C_ref, init_ref, *rest, t, r, bp, bs, rank,
                    has_doc, has_D, has_skip, has_eta, has_rotation, has_states):
    D_ref, rest = split_optional(rest, has_D)
    skip_ref, rest = split_optional(rest, has_skip)
    eta_ref, rest = split_optional(rest, has_eta)
    doc_ref, rest = split_optional(rest, has_doc)
    rotation, (y_ref, final_ref, *states_ref) = _split_rotation(rest, has_rotation)
    _walk_chunks(x_ref, dt_ref, cs_ref, B_ref, init_ref, doc_ref, rotation, final_ref,
                 states_ref[0] if has_states else None, t=t, r=r, bp=bp, bs=bs, rank=rank,
                 read_out=(C_ref, D_ref, skip_ref, eta_ref, y_ref))


def _chunk_states_kernel(x_ref, dt_ref, cs_ref, B_ref, init_ref, *rest, t, r, bp, bs, has_doc,
                         has_rotation):
    doc_ref, rest = split_optional(rest, has_doc)
    rotation, (final_ref, states_ref) = _split_rotation(rest, has_rotation)
    _walk_chunks(x_ref, dt_ref, cs_ref, B_ref, init_ref, doc_ref, rotation, final_ref,
                 states_ref, t=t, r=r, bp=bp, bs=bs, read_out=None)


def _walk_chunks(x_ref, dt_ref, cs_ref, B_ref, init_ref, doc_ref, rotation, final_ref,
                 states_ref, *, t, r, bp, bs, read_out, rank=1):
    """The forward's walk over the chunks of one (batch, head, headdim block) with the state
    [bp, n] in registers (as power-of-two sub-blocks [bs, n]), writing the final state and,
    given states_ref, the state entering each chunk. read_out (C_ref, D_ref or None, skip_ref
    or None, eta_ref or None, y_ref) also computes y, over tokens of `rank` positions; without
    it the walk reads only x and B (the backward's recomputation of the states)."""
    bi, hi, pi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    gi, dtype = hi // r, x_ref.dtype
    cols = _sub_blocks(pi * bp, bp, bs)

    def body(k, states):  # states: per sub-block [bs, n], the state entering chunk k
        t0 = pl.multiple_of(k * t, t)
        ts = pl.ds(t0, t)
        Bk, Ck = _chunk_BC(B_ref, None if read_out is None else read_out[0], rotation, bi, ts,
                           gi, hi)
        dt, cs = dt_ref[bi, hi, ts], cs_ref[bi, hi, ts]
        within, doc, doc_last, doc_entry = _chunk_masks(doc_ref, bi, t0, t, rank)
        within_decay, from_entry, to_end, across = _decays(
            cs, cs_ref[bi, hi, t0 + t - 1], within, doc, doc_last, doc_entry)
        if read_out is not None:  # C B^T once for all of the program's columns
            _, D_ref, skip_ref, eta_ref, y_ref = read_out
            eta = None if eta_ref is None else eta_ref[bi, hi, ts]
            scores = (_dot(Ck, Bk, (1, 1)) * within_decay
                      * _pair_weights(dt, eta, t, rank)).astype(dtype)
            skip = None if skip_ref is None else skip_ref[bi, hi, ts]
        leaving = []
        for ps, state in zip(cols, states):
            x = x_ref[bi, ts, hi, ps]
            if states_ref is not None:
                states_ref[bi, k, hi, ps, :] = state.astype(states_ref.dtype)
            if read_out is not None:
                y = _dot(scores, x)
                y = y + from_entry[:, None] * _dot(Ck, state.astype(dtype), (1, 1))
                if D_ref is not None:  # the skip, here rather than an XLA pass over y and x
                    y = y + D_ref[hi, ps][None, :] * x.astype(jnp.float32)
                if skip is not None:  # the per-position skip, likewise
                    y = y + skip[:, None] * x.astype(jnp.float32)
                y_ref[bi, ts, hi, ps] = y.astype(y_ref.dtype)
            leaving.append(state * across + _dot(_weighted(x, to_end * dt), Bk, (0, 0)))
        return tuple(leaving)

    finals = jax.lax.fori_loop(0, x_ref.shape[1] // t, body,
                               tuple(init_ref[bi, hi, ps, :] for ps in cols))
    for ps, final in zip(cols, finals):
        final_ref[bi, hi, ps, :] = final


def _backward_state_kernel(x_ref, dt_ref, cs_ref, B_ref, C_ref, dy_ref, dfinal_ref, *rest, t,
                           r, bp, bs, rank, has_doc, has_D, has_skip, has_eta, has_rotation):
    D_ref, rest = split_optional(rest, has_D)
    skip_ref, rest = split_optional(rest, has_skip)
    eta_ref, rest = split_optional(rest, has_eta)
    doc_ref, rest = split_optional(rest, has_doc)
    rotation, (dx_ref, ddt_ref, dcs_ref, dstates_ref, dinit_ref, *extra) = _split_rotation(
        rest, has_rotation)
    dD_ref, extra = split_optional(extra, has_D)
    dskip_ref, _ = split_optional(extra, has_skip)
    bi, hi, pi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = _sub_blocks(pi * bp, bp, bs)
    nchunks = x_ref.shape[1] // t
    inputs = (x_ref, dt_ref, cs_ref, B_ref, C_ref, dy_ref, D_ref, skip_ref, eta_ref, doc_ref,
              rotation)
    outputs = (dx_ref, ddt_ref, dcs_ref, dskip_ref)

    def body(i, carry):
        # per sub-block: dstate [bs, n], the gradient of the state leaving chunk k; dD [bs]
        dstates, dDs = carry
        k = nchunks - 1 - i
        for ps, dstate in zip(cols, dstates):
            dstates_ref[bi, k, hi, ps, :] = dstate.astype(dstates_ref.dtype)
        x_dys, dys, Ck, from_entry, across = _chunk_dx(inputs, outputs, bi, hi, pi, k, cols,
                                                       dstates, t=t, r=r, rank=rank)
        entering = tuple(dstate * across + _dot(_weighted(dy, from_entry), Ck, (0, 0))
                         for dstate, dy in zip(dstates, dys))
        return entering, tuple(dD + x_dy for dD, x_dy in zip(dDs, x_dys)) if has_D else dDs

    dinits, dDs = jax.lax.fori_loop(0, nchunks, body, (
        tuple(dfinal_ref[bi, hi, ps, :] for ps in cols),
        tuple(jnp.zeros((bs,), jnp.float32) for _ in cols)))
    for ps, dinit, dD in zip(cols, dinits, dDs):
        dinit_ref[bi, hi, ps, :] = dinit
        if has_D:
            dD_ref[bi, hi, ps] = dD


def _chunk_dx(inputs, outputs, bi, hi, pi, k, cols, dstates, *, t, r, rank):
    """Chunk k of head hi given the gradient of the state leaving it (per sub-block of cols,
    [bs, n]): writes dx (with the D and per-position skips'), the dt-gradient of the x dt
    product, the part of the cumsum gradient that comes through the leaving state, and
    dskip, at headdim block pi. -> (per sub-block sum_t x dy [bs] (D's gradient) or
    nothing without D, per sub-block dy [t, bs], the chunk's C [t, n], its decays from the
    entry [t] and across it), what the walk needs to carry the gradient to the chunk's
    entry."""
    x_ref, dt_ref, cs_ref, B_ref, C_ref, dy_ref, D_ref, skip_ref, eta_ref, doc_ref, rotation = (
        inputs)
    dx_ref, ddt_ref, dcs_ref, dskip_ref = outputs
    dtype = x_ref.dtype
    t0 = pl.multiple_of(k * t, t)
    ts = pl.ds(t0, t)
    Bk, Ck = _chunk_BC(B_ref, C_ref, rotation, bi, ts, hi // r, hi)
    dt, cs = dt_ref[bi, hi, ts], cs_ref[bi, hi, ts]
    within, doc, doc_last, doc_entry = _chunk_masks(doc_ref, bi, t0, t, rank)
    within_decay, from_entry, to_end, across = _decays(
        cs, cs_ref[bi, hi, t0 + t - 1], within, doc, doc_last, doc_entry)
    # y_t = sum_s CB_ts decay_ts (dt_s - eta_s [s in t's token]) x_s + ...; leaving state
    # = sum_s to_end_s dt_s x_s B_s^T
    scores = _dot(Ck, Bk, (1, 1)) * within_decay  # [t, s]
    if eta_ref is not None:  # weighted per pair: dx reads them whole; the intra-chunk
        # gradients of dt and eta are column sums of the dB/dC kernel's products (out of
        # the walk)
        scores = scores * _pair_weights(dt, eta_ref[bi, hi, ts], t, rank)
    scores = scores.astype(dtype)
    skip = None if skip_ref is None else skip_ref[bi, hi, ts]
    ddt, dskip, via_end, x_dys, dys = 0.0, 0.0, 0.0, [], []
    for ps, dstate in zip(cols, dstates):
        x, dy = x_ref[bi, ts, hi, ps], dy_ref[bi, ts, hi, ps]
        dx_state = to_end[:, None] * _dot(Bk, dstate.astype(dtype), (1, 1))  # [s, bs]
        if eta_ref is not None:
            dx = _dot(scores, dy, (0, 0)) + dt[:, None] * dx_state
            dx_dt = dx_state  # dt's gradient through the leaving state only
        else:
            dx_dt = _dot(scores, dy, (0, 0)) + dx_state  # d/d(dt_s x_s)
            dx = dx_dt * dt[:, None]
        xf = x.astype(jnp.float32)
        dyf = dy.astype(jnp.float32)
        x_dy = xf * dyf  # both skips' coefficient gradients sum it
        if D_ref is not None:  # the skip y += D x: dx += D dy, dD += sum_t x dy
            dx = dx + D_ref[hi, ps][None, :] * dyf
            x_dys.append(jnp.sum(x_dy, axis=0))
        if skip is not None:  # the per-position skip y_t += skip_t x_t: dskip_t += sum_p x dy
            dx = dx + skip[:, None] * dyf
            dskip = dskip + jnp.sum(x_dy, axis=1)
        dx_ref[bi, ts, hi, ps] = dx.astype(dx_ref.dtype)
        ddt = ddt + jnp.sum(xf * dx_dt, axis=1)
        via_end = via_end + dt * jnp.sum(xf * dx_state, axis=1)
        dys.append(dy)
    ddt_ref[pi, bi, hi, ts] = ddt
    if skip is not None:
        dskip_ref[pi, bi, hi, ts] = dskip
    # The leaving state's weights exp(cs_last - cs_s): +cs_last, -cs_s.
    last = jax.lax.broadcasted_iota(jnp.int32, (t,), 0) == t - 1
    dcs_ref[pi, bi, hi, ts] = jnp.where(last, jnp.sum(via_end), 0.0) - via_end
    return x_dys, dys, Ck, from_entry, across


def _backward_bc_kernel(x_ref, dt_ref, cs_ref, B_ref, C_ref, dy_ref, states_ref, dstates_ref,
                        *rest, t, r, group_heads, heads, bs, rank, has_eta, has_doc,
                        has_rotation):
    """r: the heads of one dB/dC output, a group's (group_heads), or 1 with `rotation` (the
    turned B and C differ per head, and so do their gradients)."""
    eta_ref, rest = split_optional(rest, has_eta)
    doc_ref, rest = split_optional(rest, has_doc)
    rotation, (dB_ref, dC_ref, dcs_ref, *eta_grads) = _split_rotation(rest, has_rotation)
    bi, k, gq = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q = r // heads  # programs per output
    gi, qi = gq // q, gq % q
    dtype = x_ref.dtype
    t0 = pl.multiple_of(k * t, t)
    ts = pl.ds(t0, t)
    head0 = gi * r + qi * heads  # the program's first head
    Bk, Ck = _chunk_BC(B_ref, C_ref, rotation, bi, ts, head0 // group_heads, head0)
    CB = _dot(Ck, Bk, (1, 1))  # [t, s]
    within, doc, doc_last, doc_entry = _chunk_masks(doc_ref, bi, t0, t, rank)
    last = jax.lax.broadcasted_iota(jnp.int32, (t,), 0) == t - 1
    n = Bk.shape[-1]
    cols = _sub_blocks(0, x_ref.shape[-1], bs)

    def head(j, carry):
        dS, dB, dC = carry
        hi = gi * r + qi * heads + j
        dt, cs = dt_ref[bi, hi, ts], cs_ref[bi, hi, ts]
        within_decay, from_entry, to_end, across = _decays(
            cs, cs_ref[bi, hi, t0 + t - 1], within, doc, doc_last, doc_entry)
        # dscores_ts = d y / d CB_ts, already weighted by decay and dt. The heads of a group
        # share B and C, so their dscores are summed first and meet B and C once, after the
        # loop: dC += dS B, dB += dS^T C. The headdim's sub-blocks each add their share of
        # the contractions over it.
        dy_x, dy_state, state_dstate = 0.0, 0.0, 0.0
        for ps in cols:
            x, dy = x_ref[bi, ts, hi, ps], dy_ref[bi, ts, hi, ps]
            state = states_ref[bi, k, hi, ps, :].astype(jnp.float32)  # entering the chunk
            dstate = dstates_ref[bi, k, hi, ps, :].astype(jnp.float32)  # of the leaving one
            dy_x = dy_x + _dot(dy, x, (1, 1))  # [t, s]
            dy_state = dy_state + _dot(dy, state.astype(dtype))  # [t, n]: sum_p dy state
            dB = dB + _dot(_weighted(x, to_end * dt), dstate.astype(dtype))
            state_dstate = state_dstate + jnp.sum(dstate * state)
        eta = eta_ref[bi, hi, ts] if has_eta else None
        dd = dy_x * within_decay  # d y / d(CB_ts w_ts)
        dscores = dd * _pair_weights(dt, eta, t, rank)
        dC = dC + from_entry[:, None] * dy_state
        # Cumsum gradient: the intra-chunk decay exp(cs_t - cs_s) gives +row sums at t and
        # -column sums at s; the read-out exp(cs_t) gives dy_t . (C_t state) = C_t .
        # dy_state_t; the decay across the chunk gives <dstate, state> at the last position.
        z = CB * dscores
        dcs = (jnp.sum(z, axis=1) - jnp.sum(z, axis=0)
               + from_entry * jnp.sum(Ck.astype(jnp.float32) * dy_state, axis=1)
               + jnp.where(last, across * state_dstate, 0.0))
        dcs_ref[bi, hi, ts] = dcs
        if has_eta:  # the weights' gradients, d/dw_ts = CB_ts dd_ts: dt's over t, -eta's over
            # t's own token (what the state kernel's walk would take a product for)
            ddt_ref, deta_ref = eta_grads
            dw = CB * dd
            row, col = _tokens(t, rank)
            ddt_ref[bi, hi, ts] = jnp.sum(dw, axis=0)
            deta_ref[bi, hi, ts] = -jnp.sum(jnp.where(row == col, dw, 0.0), axis=0)
        return dS + dscores, dB, dC

    zeros = jnp.zeros((t, n), jnp.float32)
    dS, dB, dC = jax.lax.fori_loop(0, heads, head,
                                   (jnp.zeros((t, t), jnp.float32), zeros, zeros))
    dS = dS.astype(dtype)
    dB_ref[qi, bi, ts, gi, :] = (dB + _dot(dS, Ck, (0, 0))).astype(dB_ref.dtype)
    dC_ref[qi, bi, ts, gi, :] = (dC + _dot(dS, Bk)).astype(dC_ref.dtype)


def _weighted_state_kernel(x_ref, B_ref, weights_ref, *rest, t, r, bs, has_rotation):
    rotation, (out_ref,) = _split_rotation(rest, has_rotation)
    bi, hi = pl.program_id(0), pl.program_id(1)
    gi = hi // r
    cols = _sub_blocks(0, x_ref.shape[-1], bs)

    def body(k, accs):  # per sub-block [bs, n]
        ts = pl.ds(pl.multiple_of(k * t, t), t)
        Bk, _ = _chunk_BC(B_ref, None, rotation, bi, ts, gi, hi)
        weights = weights_ref[bi, hi, ts]
        return tuple(acc + _dot(_weighted(x_ref[bi, ts, hi, ps], weights), Bk, (0, 0))
                     for ps, acc in zip(cols, accs))

    zeros = jnp.zeros((bs, B_ref.shape[-1]), jnp.float32)
    accs = jax.lax.fori_loop(0, x_ref.shape[1] // t, body, tuple(zeros for _ in cols))
    for ps, acc in zip(cols, accs):
        out_ref[bi, hi, ps, :] = acc


def _turned_back_kernel(dB_ref, dC_ref, B_ref, C_ref, theta_ref, C_bias_ref, B_bias_ref,
                        dBg_ref, dCg_ref, dtheta_ref, dC_bias_ref, dB_bias_ref, *, r, rank):
    """One group's rows [T] (T = the biases' rows): per head, the gradients of the turned B
    and C turned back, summed over the group's heads and over the rows by rank (the biases'
    partials), and the angles' gradients, summed over each token's positions."""
    bi, li, gi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    T, n = B_bias_ref.shape[1:]
    a = theta_ref.shape[-1]
    ts = pl.ds(pl.multiple_of(li * T, T), T)
    per_token = B_ref.shape[1] // theta_ref.shape[1]
    tokens = _token_rows(li * T, T, per_token)
    Bk, Ck = B_ref[bi, ts, gi, :], C_ref[bi, ts, gi, :]
    row_rank = jax.lax.broadcasted_iota(jnp.int32, (T, n), 0) % rank

    def back(v, bias, d, cos, sin):
        """The gradient of v + bias [T, n] float32 from that of its turn d, and the turn's
        angle's gradient per pair [T, n / 2]: out0 = v0 cos - v1 sin, out1 = v0 sin + v1 cos."""
        v0, v1 = (u.astype(jnp.float32) for u in _pairs(_biased(v, bias)))
        d0, d1 = (u.astype(jnp.float32) for u in _pairs(d))
        dv = _joined(d0 * cos + d1 * sin, d1 * cos - d0 * sin)
        return dv, d1 * (v0 * cos - v1 * sin) - d0 * (v0 * sin + v1 * cos)

    def head(j, sums):
        hi = gi * r + j
        cos, sin = (_per_position(v, per_token)
                    for v in _cos_sin(theta_ref[bi, tokens, hi, :], n))
        dB, dB_angle = back(Bk, B_bias_ref[hi], dB_ref[bi, ts, hi, :], cos, sin)
        dC, dC_angle = back(Ck, C_bias_ref[hi], dC_ref[bi, ts, hi, :], cos, sin)
        dangle = dB_angle + dC_angle
        while dangle.shape[-1] > a:  # the turned pairs' (_cos_sin's spread, undone)
            dangle = _pairs(dangle)[0]
        if per_token > 1:
            dangle = jnp.sum(dangle.reshape(T // per_token, per_token, a), axis=1)
        dtheta_ref[bi, tokens, hi, :] = dangle
        for k in range(rank):  # the biases' rows of rank k
            dB_bias_ref[bi, li, hi, k, :] = jnp.sum(jnp.where(row_rank == k, dB, 0.0), axis=0)
            dC_bias_ref[bi, li, hi, k, :] = jnp.sum(jnp.where(row_rank == k, dC, 0.0), axis=0)
        return sums[0] + dB, sums[1] + dC

    zeros = jnp.zeros((T, n), jnp.float32)
    dB, dC = jax.lax.fori_loop(0, r, head, (zeros, zeros))
    dBg_ref[bi, ts, gi, :] = dB.astype(dBg_ref.dtype)
    dCg_ref[bi, ts, gi, :] = dC.astype(dCg_ref.dtype)


def _sub_blocks(start, width, bs):
    """The headdim columns [start, start + width) as slices of bs (a power of two dividing
    width): a headdim that is no power of two (80, 96, 192) is handled as several
    power-of-two blocks, the block shapes Triton takes, with what they share (C B^T, the
    decays) computed once."""
    return [pl.ds(start + j * bs, bs) for j in range(width // bs)]


def _sub_block(p):
    """The widest power-of-two block of a headdim p: p itself, or its largest power-of-two
    divisor (16 for 80, 32 for 96, 64 for 192)."""
    return p & -p


def _split_rotation(refs, present):
    """((theta, C_bias, B_bias) refs, the rest) where the rotation is given, else (None,
    refs)."""
    return (tuple(refs[:3]), refs[3:]) if present else (None, refs)


def _states_dtype(config, x):
    return x.dtype if config.states_in_input_dtype else jnp.float32


def _states_shape(config, x, n):
    """The per-chunk states [b, c, h, p, n] of x [b, l, h, p]."""
    b, l, h, p = x.shape
    return jax.ShapeDtypeStruct((b, l // config.chunk, h, p, n), _states_dtype(config, x))


def forward(x, dt, cs, B, C, initial_state, doc, *, config, D=None, skip=None, eta=None,
            rank=1, rotation=None, keep_states=False, interpret=False):
    """Chunk-padded inputs (x [b, l, h, p], dt and cs [b, h, l] float32, B, C [b, l, g, n],
    initial_state [b, h, p, n] float32, doc [b, l] int32 or None; D [h, p] float32 or None,
    the skip y += D x; skip [b, h, l] float32 or None, a per-position skip y_t += skip_t x_t)
    -> (y [b, l, h, p] x.dtype, final_state [b, h, p, n] float32), and with keep_states the
    state entering every chunk as `chunk_states` returns it, written by the same walk.

    rank, eta [b, h, l] float32 or None: the positions form tokens of `rank` (dividing the
    chunk; position s is token s // rank's), and y_t reads every position of t's own token,
    those after t too, as it reads those before it, each with the decay exp(cs_t - cs_s)
    (Mamba-3 puts a token's decay on its first position, making it 1 inside a token), and
    with its weight dt_s less eta_s (Mamba-3's trapezoid: its MIMO ranks, and the part of a
    token's weight that belongs to the next token). rank 1 and eta None: the SSD.

    rotation: None, or (theta [b, l / k, h, a] float32, C_bias, B_bias [h, rank, n]) with
    rank and k dividing the chunk: then head i reads at position s C_s + C_bias[i, s % rank]
    (added in C's dtype) turned by theta[s / k, i] (and B alike; a token's k positions share
    its angles), in float32 and rounded to C's dtype (Mamba-3's data-dependent rotary
    embedding: `_rotation_args`' layout)."""
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    bp = _block_p(config, b, h, p)
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct((b, h, p, n), jnp.float32)] + (
        [_states_shape(config, x, n)] if keep_states else [])
    kernel = functools.partial(_forward_kernel, t=config.chunk, r=h // g, bp=bp,
                               bs=_sub_block(bp), rank=rank, has_doc=doc is not None,
                               has_D=D is not None, has_skip=skip is not None,
                               has_eta=eta is not None, has_rotation=rotation is not None,
                               has_states=keep_states)
    args = (x, dt, cs, B, C, initial_state) + present(D, skip, eta, doc) + _rotation_args(
        rotation, config, B)
    stages = config.forward_stages if rotation is None else config.rotation_forward_stages
    return call(kernel, (b, h, p // bp), out_shape, config.forward_warps, stages, interpret,
                "ssd_forward")(*args)


def chunk_states(x, dt, cs, B, initial_state, doc, *, config, rotation=None, interpret=False):
    """The state entering every chunk [b, c, h, p, n] (forward's saved states, in the same
    dtype) from forward's chunk-padded inputs, without y: the backward's recomputation,
    which reads x and B once and skips the intra-chunk scores, instead of keeping the
    states between the passes (at t = 64 and n = 128 they are twice x's bytes). rotation:
    as forward's, B turned as it is loaded."""
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    t = config.chunk
    bp = _block_p(config, b, h, p)
    kernel = functools.partial(_chunk_states_kernel, t=t, r=h // g, bp=bp, bs=_sub_block(bp),
                               has_doc=doc is not None, has_rotation=rotation is not None)
    out_shape = [jax.ShapeDtypeStruct((b, h, p, n), jnp.float32), _states_shape(config, x, n)]
    # forward_stages with or without the turn: without the read-out the walk has registers
    # for a second stage, which the Mamba-3 scan's forward+backward gains a little from
    # (docs/performance.md)
    return call(kernel, (b, h, p // bp), out_shape, config.forward_warps,
                config.forward_stages, interpret, "ssd_chunk_states")(
        x, dt, cs, B, initial_state, *present(doc), *_rotation_args(rotation, config, B))[1]


def backward(x, dt, cs, B, C, doc, states, dy, dfinal, *, config, D=None, skip=None, eta=None,
             rank=1, rotation=None, interpret=False):
    """Gradients of forward's (y, final_state) given the cotangents dy [b, l, h, p] and
    dfinal [b, h, p, n]: (dx, ddt [b, h, l], dcs [b, h, l], dB, dC, dinitial_state, dD [h, p]
    float32 or None for D None, dskip and deta [b, h, l] float32 or None for skip and eta
    None), where ddt is the gradient through dt's direct use only; cs's own gradient is dcs.
    dB and dC are in B's dtype where one program sums a group's heads (the default), float32
    partial sums otherwise, summed here. rotation: as forward's, B and C turned as they are
    loaded; dB and dC are then each head's, of its turned B and C [b, l, h, n]. eta and rank
    as forward's."""
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    t = config.chunk
    r = h // g
    bp = _block_p(config, b, h, p)
    f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    turning = _rotation_args(rotation, config, B)
    flags = dict(rank=rank, has_doc=doc is not None, has_D=D is not None,
                 has_skip=skip is not None, has_eta=eta is not None,
                 has_rotation=rotation is not None)
    dstates_shape = jax.ShapeDtypeStruct(states.shape, _states_dtype(config, x))
    optional = present(D, skip, eta, doc)
    kernel = functools.partial(_backward_state_kernel, t=t, r=r, bp=bp, bs=_sub_block(bp),
                               **flags)
    dx, ddt, dcs_end, dstates, dinit, *extra = call(
        kernel, (b, h, p // bp),
        [jax.ShapeDtypeStruct(x.shape, x.dtype), f32((p // bp, b, h, l)),
         f32((p // bp, b, h, l)), dstates_shape, f32((b, h, p, n))]
        + ([] if D is None else [f32((b, h, p))])
        + ([] if skip is None else [f32((p // bp, b, h, l))]),
        config.backward_state_warps, config.backward_stages, interpret,
        "ssd_backward_state",
    )(x, dt, cs, B, C, dy, dfinal, *optional, *turning)
    dD, extra = split_optional(extra, D is not None)
    dskip, _ = split_optional(extra, skip is not None)
    group_heads = r
    if rotation is not None:  # a dB/dC output a head
        r, g = 1, h
    heads = r if config.backward_bc_heads is None else min(config.backward_bc_heads, r)
    if r % heads:
        raise ValueError(f"ssd: Config.backward_bc_heads={heads} must divide the heads per "
                         f"group, {r}")
    kernel = functools.partial(_backward_bc_kernel, t=t, r=r, group_heads=group_heads,
                               heads=heads, bs=_sub_block(p), rank=rank,
                               has_eta=eta is not None, has_doc=doc is not None,
                               has_rotation=rotation is not None)
    # One program a group: its sum is whole, so it is rounded to B's dtype in the kernel (as
    # the caller would round it after a float32 pass over it: with a head a group, Mamba-3's
    # per-head copies, that pass read 1 GB at 8 x 2048); partial sums stay float32.
    partials = r // heads
    grads = lambda a: jax.ShapeDtypeStruct((partials, b, l, g, n),
                                           a.dtype if partials == 1 else jnp.float32)
    warps = config.one_head_bc_warps if heads == 1 else config.backward_bc_warps
    stages = config.backward_stages if heads == 1 else config.backward_bc_stages
    dB, dC, dcs, *eta_grads = call(
        kernel, (b, l // t, g * partials),
        [grads(B), grads(C)] + [f32((b, h, l))] * (1 if eta is None else 3),
        warps, stages, interpret, "ssd_backward_bc",
    )(x, dt, cs, B, C, dy, states, dstates, *present(eta, doc), *turning)
    ddt = ddt.sum(0)
    deta = None
    if eta is not None:  # the intra-chunk gradients of dt and eta, the dB/dC kernel's
        ddt_own, deta = eta_grads
        ddt = ddt + ddt_own
    summed = lambda d: None if d is None else d.sum(0)
    return (dx, ddt, dcs + dcs_end.sum(0), dB.sum(0), dC.sum(0), dinit, summed(dD),
            summed(dskip), deta)


def weighted_state(x, B, weights, *, config, rotation=None, interpret=False):
    """sum_s weights_s x_s B_s^T over each row's positions, per head: x [rows, l, h, p], B
    [rows, l, g, n], weights [rows, h, l] float32, l a multiple of config.chunk ->
    [rows, h, p, n] float32. reference.weighted_state's arithmetic (x weighted in float32,
    rounded to its dtype, float32 accumulation) in one kernel, grid (rows, h), the weighted x
    never in memory: in XLA it was a pass writing it, then the matmul reading it back.
    rotation: None, or forward's: each head's B biased and turned as forward turns B (for
    the backward's read-out of C, C is passed as B with the biases swapped)."""
    rows, _, h, p = x.shape
    g, n = B.shape[2:]
    kernel = functools.partial(_weighted_state_kernel, t=config.chunk, r=h // g,
                               bs=_sub_block(p), has_rotation=rotation is not None)
    stages = config.forward_stages if rotation is None else config.rotation_forward_stages
    return call(kernel, (rows, h), [jax.ShapeDtypeStruct((rows, h, p, n), jnp.float32)],
                config.forward_warps, stages, interpret,
                "ssd_weighted_state")(x, B, weights, *_rotation_args(rotation, config, B))[0]


def turned_back(grads, B, C, rotation, *, config, interpret=False):
    """`turned`'s vjp in one kernel: grads (dB, dC [b, l, h, n]), the gradients of the per-head
    turned B and C (in B's dtype; l a multiple of config.chunk) -> (dB, dC [b, l, g, n]
    in B's dtype, (dtheta [b, l / k, h, a], dC_bias, dB_bias [h, rank, n]) in theta's and
    the biases' dtypes). The same arithmetic as XLA's vjp of `turned`: float32 from the
    bf16 values on, the turned-back gradients summed over a group's heads and the
    biases' over the rows in float32, rounded once. Grid (b, l / T, g), T =
    config.turned_back_rows: each program loops over a group's heads with that group's
    sums in registers, so each gradient is read once, where XLA's vjp reduced it over
    heads, over rows and over pairs in separate passes."""
    theta, C_bias, B_bias = rotation
    dB, dC = grads
    b, l, h, n = dB.shape
    g = B.shape[2]
    rank, a, T = C_bias.shape[1], theta.shape[-1], config.turned_back_rows
    tokens = theta.shape[1]  # of k = l / tokens positions
    if T is None:  # l is a multiple of the chunk, a power of two that rank and k divide
        T = 16 if max(rank, l // tokens) == 1 else math.gcd(l, max(32, rank, l // tokens))
    if l % T or T % rank or T % (l // tokens):
        raise ValueError(f"ssd: Config.turned_back_rows={T} must divide the rows {l} and be "
                         f"a multiple of the rank {rank} and of a token's {l // tokens} rows")
    kernel = functools.partial(_turned_back_kernel, r=h // g, rank=rank)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    dBg, dCg, dtheta, dC_bias, dB_bias = call(
        kernel, (b, l // T, g),
        [jax.ShapeDtypeStruct(B.shape, B.dtype), jax.ShapeDtypeStruct(C.shape, C.dtype),
         f32(b, tokens, h, a), f32(b, l // T, h, rank, n), f32(b, l // T, h, rank, n)],
        config.forward_warps, 1, interpret, "ssd_turned_back",
    )(dB, dC, B, C, *_rotation_args(rotation, config, B, rows=T))
    return dBg, dCg, (dtheta.astype(theta.dtype), dC_bias.sum((0, 1)).astype(C_bias.dtype),
                      dB_bias.sum((0, 1)).astype(B_bias.dtype))


def _rotation_args(rotation, config, B, rows=None):
    """The kernels' rotation inputs: theta [b, l / k, h, a] float32 (a token's angles, k
    positions a token), and C's and B's biases as the rows [h, rows, n] (default one
    chunk's) in B's dtype (position s has rank s % rank's), or none.

    The turn's layout: B's and C's n entries in adjacent pairs (2j, 2j + 1), pair j turned
    by theta[.., j / s] where s = n / (2a) (a power of two) divides j and not turned
    otherwise; the caller orders the entries so (Mamba-3's rotary over a fraction of n, in
    its pairs: pallas_kernels.mamba3.kernels)."""
    if rotation is None:
        return ()
    theta, C_bias, B_bias = rotation
    h, rank, n = C_bias.shape
    a, t = theta.shape[-1], config.chunk
    if not takes_rotation(n, a, rank, t):
        raise ValueError(f"ssd: a rotation of rank {rank} over {a} angles of d_state {n} "
                         f"needs rank dividing the chunk {t} and n / (2 * angles) a power "
                         "of two")
    rows = t if rows is None else rows
    return (theta.astype(jnp.float32), _bias_rows(C_bias, rows, B.dtype),
            _bias_rows(B_bias, rows, B.dtype))


def takes_rotation(n, a, rank, chunk):
    """Whether the kernels turn B and C of d_state n by a angles (n / (2a) a power of two)
    with a rank's biases dividing their chunk."""
    spread = (n // 2) // a if a and (n // 2) % a == 0 else 0
    return chunk % rank == 0 and spread > 0 and spread & (spread - 1) == 0


def _bias_rows(bias, rows, dtype):
    """bias [h, rank, n] -> [h, rows, n] in dtype, row s rank s % rank's: tiled, not gathered
    (a gather's transpose is a scatter); rank divides rows."""
    return jnp.tile(bias.astype(dtype), (1, rows // bias.shape[1], 1))
