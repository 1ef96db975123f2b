"""An RMSNorm (optionally gated and grouped), or an activation, feeding a matrix product, for
a few rows at a time: the projections of a one-token decoding step, each with its norm or
activation, as one kernel.

    out = rms_norm_matmul(x, weight, w, eps=1e-5)                            # in_proj
    out = rms_norm_matmul(y, weight, w_t, eps=1e-5, z=z, ngroups=g,          # out_proj
                          residual=residual, w_transposed=True)
    out, conv_state = rms_norm_matmul(x, weight, w, eps=1e-5, window=(conv_state, at))
    out = rms_norm_matmul(h, None, w_t, eps=None, activation="relu2",         # MLP down_proj
                          residual=residual, w_transposed=True)

Legend: b rows (a decoding batch), k input features, n output features.

x [b, k], any float dtype. z [b, >= k] or None: the gate, its first k columns (so a fused
projection's output can be passed whole); mamba_ssm's RMSNormGated(norm_before_gate=False).
weight [k]: the norm's scale, or None for no norm. activation: None, "relu2" (squared ReLU),
"gelu" (x * Phi(x), its erf to within 1.5e-7: Triton has no erf) or "gelu_tanh" (the tanh
approximation), applied to x first. w [k, n], or [n, k] with w_transposed (nn.Linear's layout), in
the compute dtype. bias [n] or None. residual [b, n] or None.

In float32: v = x, or its activation (times silu(z)). Without weight: v rounded to w's
dtype, @ w. With weight, for each of ngroups equal groups of v's k columns: v * weight
rounded to w's dtype, @ those rows of w, times the group's rstd (1 / sqrt(mean(v**2) +
eps)); out is the groups' sum. Float32 accumulation, plus bias, rounded to out_dtype
(default w's dtype). With residual: residual + out, in residual's dtype. Returns [b, n] in
out_dtype, or residual's dtype.

That is the model's norm-then-matmul (layers.rms_norm / gated_rms_norm, then layers.matmul,
as mamba_ssm computes it) and the MLP's, except where the norm's operand is rounded: the
model rounds v * rstd * weight, this v * weight. One rounding of each term either way, so the
two products differ by at most 2**-8 of the sum of the terms' magnitudes (tests). Applying
rstd after the product lets the kernel reduce the sum of squares beside the product rather
than before it, for less time a token (docs/performance.md).

window: None, or (conv_state [b, e, k], at) with out's columns [at, at + e) the newest
inputs of a causal conv's e channels (a Mamba block's in_proj output holds xBC there): then
also returns conv_state shifted by one with those columns, rounded to its dtype, appended
(mamba_ssm's causal_conv1d_update's window); the kernel shifts it in place, each program
its own columns' channels.

`implementation`: "xla" (`reference`) or "triton": one Pallas kernel, grid (n / bn,); each
program loads its bn rows of w whole, then reads every row of x whole (a few KB each, from
L2), normalises it and reduces it against them: w read once, the reference's arithmetic
summed in another order. A decode step at batch 1 is bound by its kernel count
(BENCHMARKS.md, Decoding, ours alone): this is one kernel where XLA runs a norm fusion and a
matrix-vector product. The rows are unrolled in the kernel, so it is for a few of them; w
[n, k] (w_transposed) reads contiguous rows of k, where [k, n] reads bn columns at a stride
of n. `blocks` (Blocks) sets its tiles. On a machine without a GPU it runs in Pallas's
interpreter.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import hardware
from pallas_kernels.triton_call import call, off_gpu

IMPLEMENTATIONS = ("xla", "triton")
ACTIVATIONS = (None, "relu2", "gelu", "gelu_tanh")
SLAB_ELEMENTS = 32768  # the most of w a program loads at once (filled_blocks)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The kernel's tiles: output columns per program (block_n), features per load (block_k,
    a power of two: each group's k / ngroups features in loads of block_k, the rest in
    smaller powers of two, `k_tiles`) and warps per program. None: chosen from the shapes
    (`filled_blocks`)."""
    block_n: int | None = None
    block_k: int | None = None
    num_warps: int | None = None


def rms_norm_matmul(x, weight, w, *, eps, z=None, ngroups=1, bias=None, residual=None,
                    w_transposed=False, window=None, out_dtype=None, activation=None,
                    implementation="xla", blocks=Blocks()):
    """See the module docstring for shapes and dtypes."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"rms_norm_matmul: implementation={implementation!r} is not one of "
                         f"{IMPLEMENTATIONS}")
    k = x.shape[1]
    n = w.shape[0] if w_transposed else w.shape[1]
    out_dtype = jnp.dtype(w.dtype if out_dtype is None else out_dtype)
    if activation not in ACTIVATIONS:
        raise ValueError(f"rms_norm_matmul: activation={activation!r} is not one of "
                         f"{ACTIVATIONS}")
    if (w.shape[1] if w_transposed else w.shape[0]) != k or k % ngroups:
        raise ValueError(f"rms_norm_matmul: x {x.shape} does not match w {w.shape} "
                         f"(w_transposed={w_transposed}) or ngroups={ngroups}")
    if window is not None and not (window[0].shape[0] == x.shape[0]
                                   and 0 <= window[1] <= n - window[0].shape[1]):
        raise ValueError(f"rms_norm_matmul: window {window[0].shape} at column {window[1]} "
                         f"does not fit out [{x.shape[0]}, {n}]")
    if implementation == "triton":
        return _triton(x, weight, w, eps=eps, z=z, ngroups=ngroups, bias=bias,
                       residual=residual, w_transposed=w_transposed, window=window,
                       out_dtype=out_dtype, activation=activation, blocks=blocks)
    out = reference(x, weight, w, eps=eps, z=z, ngroups=ngroups, bias=bias, residual=residual,
                    w_transposed=w_transposed, out_dtype=out_dtype, activation=activation)
    if window is None:
        return out
    conv_state, at = window
    return out, shift_window(conv_state, out[:, at:at + conv_state.shape[1]])


def shift_window(conv_state, newest):
    """conv_state [b, e, k] shifted by one, newest [b, e] appended in its dtype: a causal
    conv's window after one more input (`window=`)."""
    return jnp.concatenate([conv_state[:, :, 1:], newest[:, :, None].astype(conv_state.dtype)],
                           axis=-1)


def reference(x, weight, w, *, eps, z, ngroups, bias, residual, w_transposed,
              out_dtype=None, activation=None):
    """rms_norm_matmul in plain JAX, without a window: the kernel's arithmetic, rstd applied
    after the product."""
    b, k = x.shape
    n = w.shape[0] if w_transposed else w.shape[1]
    v = _activate(x.astype(jnp.float32), activation)
    if z is not None:
        v = v * jax.nn.silu(z[:, :k].astype(jnp.float32))
    if weight is None:
        out = jnp.einsum("bk,nk->bn" if w_transposed else "bk,kn->bn", v.astype(w.dtype), w,
                         preferred_element_type=jnp.float32)
    else:
        grouped = (b, ngroups, k // ngroups)
        rstd = jax.lax.rsqrt(jnp.mean(jnp.square(v.reshape(grouped)), axis=-1) + eps)  # [b, g]
        u = (v * weight.astype(jnp.float32)).astype(w.dtype).reshape(grouped)
        products = jnp.einsum("bgk,ngk->bgn" if w_transposed else "bgk,gkn->bgn", u,
                              w.reshape((n,) + grouped[1:] if w_transposed
                                        else grouped[1:] + (n,)),
                              preferred_element_type=jnp.float32)
        out = jnp.sum(products * rstd[:, :, None], axis=1)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    out = out.astype(w.dtype if out_dtype is None else out_dtype)
    return out if residual is None else residual + out.astype(residual.dtype)


def _activate(v, activation):
    """v float32 -> its activation (ACTIVATIONS)."""
    if activation is None:
        return v
    if activation == "relu2":
        return jnp.square(jnp.maximum(v, 0.0))
    if activation == "gelu_tanh":  # jax.nn.gelu(approximate=True), Megatron's openai_gelu
        return 0.5 * v * (1.0 + jnp.tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))
    return 0.5 * v * (1.0 + _erf(v * 0.7071067811865476))


def _erf(x):
    """erf of float32 x from exp alone (Pallas's Triton lowering has no erf): Abramowitz and
    Stegun's 7.1.26, |error| < 1.5e-7, about an ulp of float32 near 1."""
    t = 1.0 / (1.0 + 0.3275911 * jnp.abs(x))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (
        -1.453152027 + t * 1.061405429))))
    y = 1.0 - poly * jnp.exp(-x * x)
    return jnp.where(x < 0, -y, y)


def largest_power_of_two_dividing(v, at_most):
    """The largest power of two that divides v and is at most at_most (1 if at_most < 1)."""
    return min(1 << (max(at_most, 1).bit_length() - 1), v & -v)


def filled_blocks(blocks, k, k_group, n, columns_divisor):
    """(bn, bk, warps): Blocks with its Nones filled. A matrix-vector product is bound by the
    bytes of w in flight, and each program loads its whole [bn, k] slab of w at once. So bn
    keeps that slab within SLAB_ELEMENTS (128 registers a thread at 4 warps, for bf16) and
    gives at least two waves of programs over the SMs (hardware.two_waves), except that a
    long row (k >= 4096) takes 8 rows: every program also reads all of x, so fewer programs read
    less of it (mamba2-1.3b's out_proj, k 4096: 8 rows and 4 warps beat 4 rows and 8 warps;
    docs/performance.md). bk is at most
    2048. bn divides columns_divisor (n, or where a window's columns start and end)."""
    bn = blocks.block_n or (min(8, SLAB_ELEMENTS // k) if k >= 4096
                            else min(4, n // hardware.two_waves()))
    bn = largest_power_of_two_dividing(columns_divisor, bn)
    bk = 1 << (min(blocks.block_k or 2048, k_group).bit_length() - 1)
    return bn, bk, blocks.num_warps or 4


def k_tiles(k_group, ngroups, bk):
    """The static loads along k, per group its list of (first feature, width): the group's
    k_group features in loads of bk, then what is left in the powers of two of its binary
    form. Triton takes only power-of-two block widths, and tiles of k_group's largest
    power-of-two divisor alone can be many: nemotron-nano-9b-v2's MLP, k 15680 = 245 x 64,
    unrolled 245 loads a row (351 KB of Triton IR a kernel, 25 of them in a batch-1 decode
    loop that did not finish compiling); in these tiles it takes 10."""
    tiles = []
    for group in range(ngroups):
        first, end, width = group * k_group, (group + 1) * k_group, bk
        group_tiles = []
        while first < end:
            while width > end - first:
                width //= 2
            group_tiles.append((first, width))
            first += width
        tiles.append(group_tiles)
    return tiles


def _kernel(x_ref, *refs, bn, **kw):
    compute_columns(x_ref, *refs, start=pl.multiple_of(pl.program_id(0) * bn, bn), bn=bn, **kw)


def compute_columns(x_ref, *refs, eps, ngroups, bk, bn, has_weight, has_z, has_bias,
                    has_residual, w_transposed, window_at, out_dtype, activation, start,
                    after_load=None):
    """The kernel's work for output columns [start, start + bn); after_load() (if given) runs
    once the loads of the slab of w are issued, while they are in flight."""
    refs = list(refs)
    weight_ref = refs.pop(0) if has_weight else None
    w_ref = refs.pop(0)
    z_ref = refs.pop(0) if has_z else None
    bias_ref = refs.pop(0) if has_bias else None
    residual_ref = refs.pop(0) if has_residual else None
    if window_at is not None:
        _, out_ref, window_ref = refs  # the window's input and output are one buffer
    else:
        (out_ref,) = refs
    columns = pl.ds(start, bn)
    rows, k = x_ref.shape
    groups = k_tiles(k // ngroups, ngroups, bk)  # static: a few tiles a group
    tiles = [pl.ds(first, width) for group in groups for first, width in group]
    ends = list(itertools.accumulate(len(group) for group in groups))

    # The program's whole slab of w is loaded first, so that its loads are in flight while
    # the rows' norms are computed (a pass over the rows before w can be used: a latency,
    # which bounds a decoding step's projection more than its bytes do).
    w = [w_ref[columns, tile] if w_transposed  # [bn, bk], rows contiguous in k
         else w_ref[tile, columns].T for tile in tiles]
    scale = [weight_ref[tile].astype(jnp.float32) for tile in tiles] if has_weight else None
    # The window's kept columns too: loaded here, they arrive with w, where loaded after the
    # product they would add their latency to the program's.
    kept = (None if window_at is None
            else [_window_kept(window_ref, row, start - window_at, bn) for row in range(rows)])
    if after_load is not None:
        after_load()
    for row in range(rows):  # static, as the tiles: a few
        v = []  # [bk] float32 each: the row activated and gated, not yet normalised
        for tile in tiles:
            vt = _activate(x_ref[row, tile].astype(jnp.float32), activation)
            if has_z:
                vt = vt * jax.nn.silu(z_ref[row, tile].astype(jnp.float32))
            v.append(vt)
        # Each group's product is taken with v * weight and scaled by the group's rstd after
        # (the module docstring): the sum of squares then reduces beside the product, where
        # normalising v first put that reduction, its rsqrt and the scaling before it.
        products = []
        for group in (range(end - len(g), end) for g, end in zip(groups, ends)):
            product = sum(jnp.sum(w[ti].astype(jnp.float32) * (
                v[ti] * scale[ti] if has_weight else v[ti]).astype(w_ref.dtype)
                .astype(jnp.float32)[None, :], axis=1) for ti in group)
            if has_weight:
                product = product * jax.lax.rsqrt(
                    sum(jnp.sum(v[ti] * v[ti]) for ti in group) / (k // ngroups) + eps)
            products.append(product)
        acc = sum(products)
        if has_bias:
            acc = acc + bias_ref[columns].astype(jnp.float32)
        out = acc.astype(out_dtype)
        if has_residual:
            out = residual_ref[row, columns] + out.astype(residual_ref.dtype)
        out = out.astype(out_ref.dtype)
        out_ref[row, columns] = out
        if window_at is not None:
            _shift_in(window_ref, row, kept[row], out)


def _window_kept(window_ref, row, channel, bn):
    """(whether channels [channel, channel + bn) of `row` are the window's, the channels
    loaded, the window's last k - 1 columns [bn] of them). Each program owns its columns'
    channels, so nothing races; a program that owns none loads channels clamped into the
    window (a few bytes from L2) and stores nothing. The columns are loaded one at a time:
    k - 1 of them is no block size Triton takes."""
    e, k = window_ref.shape[1:]
    channels = pl.ds(pl.multiple_of(jnp.clip(channel, 0, e - bn), bn), bn)
    return ((channel >= 0) & (channel < e), channels,
            [window_ref[row, channels, j] for j in range(1, k)])


def _shift_in(window_ref, row, kept, newest):
    """Shift the window of `row` by one over the channels of `kept` (_window_kept) and store
    `newest` [bn] as its last column, where those channels are the window's."""
    owned, channels, columns = kept

    @pl.when(owned)
    def _():
        for j, column in enumerate(columns + [newest.astype(window_ref.dtype)]):
            window_ref[row, channels, j] = column


def kernel_call(weight, w, *, eps, z, ngroups, bias, residual, w_transposed, window,
                out_dtype, activation, blocks):
    """(the static options of the kernel's code, `compute_columns`, all but start; its operands
    after x, in order; its warps) for rms_norm_matmul's arguments: what _triton launches, and
    what a kernel that runs `compute_columns` inside its own (ssd.step's cooperative kernel) passes
    it."""
    k, n = (w.shape[1], w.shape[0]) if w_transposed else w.shape
    window_at = None if window is None else window[1]
    columns_divisor = n if window is None else math.gcd(n, window_at, window[0].shape[1])
    bn, bk, warps = filled_blocks(blocks, k, k // ngroups, n, columns_divisor)
    options = dict(eps=eps, ngroups=ngroups, bk=bk, bn=bn, has_weight=weight is not None,
                   has_z=z is not None, has_bias=bias is not None,
                   has_residual=residual is not None, w_transposed=w_transposed,
                   window_at=window_at, out_dtype=out_dtype, activation=activation)
    operands = [a for a in (weight, w, z, bias, residual) if a is not None]
    if window is not None:  # updated in place: the last operand
        operands.append(window[0])
    return options, operands, warps


def _triton(x, weight, w, *, eps, z, ngroups, bias, residual, w_transposed, window, out_dtype,
            activation, blocks):
    b = x.shape[0]
    options, operands, warps = kernel_call(
        weight, w, eps=eps, z=z, ngroups=ngroups, bias=bias, residual=residual,
        w_transposed=w_transposed, window=window, out_dtype=out_dtype, activation=activation,
        blocks=blocks)
    n = w.shape[0] if w_transposed else w.shape[1]
    args = [x, *operands]
    out_shape = jax.ShapeDtypeStruct((b, n), out_dtype if residual is None else residual.dtype)
    if window is not None:
        out_shape = [out_shape, jax.ShapeDtypeStruct(window[0].shape, window[0].dtype)]
    return call(functools.partial(_kernel, **options), (n // options["bn"],), out_shape, warps,
                None, off_gpu(), "rms_norm_matmul",
                None if window is None else {len(args) - 1: 1})(*args)
