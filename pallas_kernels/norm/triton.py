"""The norms' forward and backward kernels in Pallas, lowered through Triton
(`pl.pallas_call`), and the custom_vjps that join them: the gated grouped RMSNorm, and the
residual stream's add and RMSNorm (`add_rms_norm`, at the end of this docstring).

Legend: N rows (the product of the leading axes), D = h * p entries a row, ngroups groups a
row of G = D / ngroups contiguous entries, br rows a block, bg = G rounded up to a power of
two (Triton's block widths are powers of two: the entries past G are masked off, 1280 is
loaded as 2048 of which 768 are masked).

The kernels see y, z and the cotangent flattened to [N, D] (a free reshape) and weight as
[D]; both compute in float32 and read and write each array once:
- `_forward_kernel`, grid (N / br, ngroups): one block of br rows of one group; out = x *
  rstd * weight in y's dtype, where x = y * silu(z) and rstd = rsqrt(mean_G(x**2) + eps).
- `_backward_kernel`, grid (programs, ngroups): each program walks its share of the blocks
  of one group, recomputing x and rstd from y and z (nothing of the forward is kept: the
  residuals are y, z and weight), writes dy and dz, and sums dout * x * rstd over its rows
  into one float32 partial of dweight [D]; the partials [programs, D] are summed after
  the kernel. About two waves of programs (hardware.two_waves) keep every multiprocessor
  busy while the partials stay small (264 x D floats). Where a thread's share of a block
  is small enough, the walk loads each block a step ahead (Config.backward_prefetch).

With w = weight, r = rstd, x = gated, dx = r * (dout*w - x * r**2 * mean_G(dout*w*x)), dy =
dx * silu(z), dz = dx * y * sigmoid(z) * (1 + z * (1 - sigmoid(z))), dweight = sum_rows dout
* x * r.

add_rms_norm's kernels, on residual and delta flattened to [N, d] (one group of d entries
a row, the same blocks):
- `_add_forward_kernel`, grid (N / br, 1): summed = residual + delta (rounded to residual's
  dtype, as stored), normed = summed * rstd * weight; reads two arrays and writes two.
- `_add_backward_kernel`, grid (programs, 1): as the gated backward, recomputing rstd from
  summed; the gradient of summed, dsummed + dx (dx as above with x = summed), written in
  summed's dtype and, where delta's differs, in delta's: the previous layer's out_proj
  reads that one. XLA's same backward took three passes (the norm's statistics, the
  bfloat16 cotangent made float32, then the sums).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import hardware
from pallas_kernels.triton_call import call

DTYPES = (jnp.float32, jnp.bfloat16)
# The widest group the kernels take: a block of one row of a group holds bg floats per live
# array in registers (bg / 256 each a thread at 8 warps); 8192 covers mamba2-2.7b's G 5120.
# Wider groups (untried) take the XLA path.
MAX_GROUP = 8192


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles and launch shapes. `block_elements` (a power of two): the entries of one block,
    br * bg, br = block_elements / bg rows (at least one, at most the rows' next power of
    two); mamba_ssm's norms take one row of 4096 a program. `num_warps` None: block /
    256 entries a warp, 1 to 8 (mamba_ssm's choice), the forward's. `backward_programs`
    None: about hardware.two_waves() programs, split over the groups.

    `backward_prefetch`: the backward's loop loads the next block before it computes this
    one (carried in registers in the arrays' dtype), so that a program's loads overlap its
    arithmetic; taken where a thread's share of a block is at most PREFETCH_BYTES of each
    array. The gated norm's backward as the Mamba2 mixer calls it (timed as bench.tiles
    times them) was fastest at 8 warps with it, and slowest at 4 warps with it, 64 bytes a
    thread, where the carried loads spill; the add-and-norm backward was fastest with it
    over blocks of one row (8 warps, 32 bytes a thread), and its forward over blocks of one
    row: ADD_CONFIG (docs/performance.md). `backward_warps` None: 8 where the backward
    prefetches, else 4."""
    block_elements: int = 4096
    num_warps: int | None = None
    backward_warps: int | None = None
    backward_programs: int | None = None
    # Software-pipelining stages of the backward's loop over its blocks (Triton's pipeliner).
    backward_stages: int = 2
    backward_prefetch: bool = True


# The add-and-norm kernels' default: blocks of 2048 entries, so that a float32 row of 2048
# prefetches at 8 warps (Config's measurements).
ADD_CONFIG = Config(block_elements=2048)
# The most bytes of each array's block a thread may hold for the backward to load a block
# ahead: 16 bf16 entries, the measured case that gained.
PREFETCH_BYTES = 32


def supports(shape, dtype, ngroups) -> bool:
    """Whether the kernels take y of this shape [..., h, p] and dtype with ngroups groups:
    float32 or bfloat16, at least one row, h divisible by ngroups and groups of at most
    MAX_GROUP entries."""
    if len(shape) < 2 or jnp.dtype(dtype) not in DTYPES or ngroups < 1:
        return False
    *lead, h, p = shape
    return math.prod(lead) > 0 and h % ngroups == 0 and (h // ngroups) * p <= MAX_GROUP


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def gated_rms_norm(y, z, weight, eps, ngroups, config=Config(), interpret=False):
    """y, z [..., h, p] (float32 or bfloat16, `supports`), weight [h, p] -> [..., h, p] in y's
    dtype: reference.gated_rms_norm_reference by the kernels. Its VJP keeps y, z and weight
    only and returns dy, dz and dweight in their dtypes."""
    return forward(y, z, weight, eps, ngroups, config=config, interpret=interpret)


def _gated_rms_norm_fwd(y, z, weight, eps, ngroups, config, interpret):
    out = forward(y, z, weight, eps, ngroups, config=config, interpret=interpret)
    return out, (y, z, weight)


def _gated_rms_norm_bwd(eps, ngroups, config, interpret, residuals, dout):
    y, z, weight = residuals
    return backward(y, z, weight, dout, eps, ngroups, config=config, interpret=interpret)


gated_rms_norm.defvjp(_gated_rms_norm_fwd, _gated_rms_norm_bwd)


def forward(y, z, weight, eps, ngroups, *, config, interpret=False):
    """The forward kernel: y, z [..., h, p], weight [h, p] -> [..., h, p] in y's dtype. z may
    be wider: [..., W] rows whose first h * p entries are z (read in place, as from Mamba2's
    in-projection output)."""
    rows, width, group = _sizes(y, ngroups)
    br, bg = _tiles(config, rows, group)
    blocks = pl.cdiv(rows, br)
    kernel = functools.partial(_forward_kernel, eps=eps, rows=rows, group=group, br=br, bg=bg,
                               ragged_rows=blocks * br != rows)
    out = call(kernel, (blocks, ngroups), [jax.ShapeDtypeStruct((rows, width), y.dtype)],
               _warps(config, br, bg), 1, interpret, "gated_rms_norm_forward")(
        y.reshape(rows, width), z.reshape(rows, -1), weight.reshape(width))[0]
    return out.reshape(y.shape)


def backward(y, z, weight, dout, eps, ngroups, *, config, interpret=False, with_out=False):
    """The backward kernel: forward's inputs and the cotangent dout (y's shape) -> (dy, dz,
    dweight) in y's, z's and weight's dtypes; dweight summed here from the kernel's float32
    partials [programs, h * p]. With a wider z (forward), dz has z's shape and only its
    first h * p entries a row are written: the caller writes the rest. with_out: also the
    forward's output, recomputed in the same pass (y's shape and dtype, appended), for a
    following matmul's weight gradient (mamba_ssm's recompute_output): y and z are read
    once for both."""
    rows, width, group = _sizes(y, ngroups)
    br, bg = _tiles(config, rows, group)
    programs, per_program = _programs(config, pl.cdiv(rows, br), ngroups)
    warps, prefetch = _backward_launch(config, br, bg, y, z, dout)
    kernel = functools.partial(_backward_kernel, eps=eps, rows=rows, group=group, br=br, bg=bg,
                               per_program=per_program,
                               ragged_rows=programs * per_program * br != rows,
                               prefetch=prefetch)
    flat = lambda a: a.reshape(rows, -1)
    dy, dz, dweight, *out = call(
        kernel, (programs, ngroups),
        [jax.ShapeDtypeStruct((rows, width), y.dtype),
         jax.ShapeDtypeStruct((rows, math.prod(z.shape) // rows), z.dtype),
         jax.ShapeDtypeStruct((programs, width), jnp.float32)]
        + [jax.ShapeDtypeStruct((rows, width), y.dtype)] * with_out,
        warps, config.backward_stages, interpret, "gated_rms_norm_backward",
    )(flat(y), flat(z), weight.reshape(width), flat(dout))
    return (dy.reshape(y.shape), dz.reshape(z.shape),
            dweight.sum(0).reshape(weight.shape).astype(weight.dtype),
            *(o.reshape(y.shape) for o in out))


def _forward_kernel(y_ref, z_ref, w_ref, out_ref, *, eps, rows, group, br, bg, ragged_rows):
    r0 = pl.multiple_of(pl.program_id(0) * br, br)
    c0 = pl.program_id(1) * group
    block, mask, col_mask = _block(r0, c0, rows=rows, group=group, br=br, bg=bg,
                                   ragged_rows=ragged_rows)
    w = _load(w_ref, pl.ds(c0, bg), col_mask)
    y, z = _load(y_ref, block, mask), _load(z_ref, block, mask)
    x = y * (z * jax.nn.sigmoid(z))
    rstd = _rstd(x, group, eps)
    # The reference's order of products: (x * rstd) * weight.
    plgpu.store(out_ref.at[block], (x * rstd * w[None, :]).astype(out_ref.dtype), mask=mask)


def _backward_kernel(y_ref, z_ref, w_ref, dout_ref, dy_ref, dz_ref, dw_ref, *out_ref, eps, rows,
                     group, br, bg, per_program, ragged_rows, prefetch):
    def step(block, mask, w, y, z, dout):
        sig = jax.nn.sigmoid(z)
        silu = z * sig
        x = y * silu
        rstd = _rstd(x, group, eps)
        xhat = x * rstd
        if out_ref:  # the forward's product order: (x * rstd) * weight
            plgpu.store(out_ref[0].at[block], (xhat * w).astype(out_ref[0].dtype), mask=mask)
        dx = _dx(xhat, rstd, dout * w, group)
        plgpu.store(dy_ref.at[block], (dx * silu).astype(dy_ref.dtype), mask=mask)
        dz = dx * y * sig * (1.0 + z * (1.0 - sig))
        plgpu.store(dz_ref.at[block], dz.astype(dz_ref.dtype), mask=mask)
        return dout * xhat

    _backward_loop(step, (y_ref, z_ref, dout_ref), w_ref, dw_ref, c0=pl.program_id(1) * group,
                   rows=rows, group=group, br=br, bg=bg, per_program=per_program,
                   ragged_rows=ragged_rows, prefetch=prefetch)


def _backward_loop(step, in_refs, w_ref, dw_ref, *, c0, rows, group, br, bg, per_program,
                   ragged_rows, prefetch):
    """A backward program's walk over its share of the blocks of the group at entry c0:
    step(block, mask, weight [1, bg], *the block of each of in_refs in float32) -> dout * x *
    rstd [br, bg] for one block, summed over the blocks into the program's float32 partial of
    dweight, dw_ref[program]. prefetch: each block's loads are issued a step ahead, before
    the block before it is computed (the last step reloads its own block, unused)."""
    pi = pl.program_id(0)
    col_mask = _block(0, c0, rows=rows, group=group, br=br, bg=bg, ragged_rows=False)[2]
    w = _load(w_ref, pl.ds(c0, bg), col_mask)[None, :]

    def block_of(j):
        r0 = pl.multiple_of((pi * per_program + j) * br, br)
        return _block(r0, c0, rows=rows, group=group, br=br, bg=bg,
                      ragged_rows=ragged_rows)[:2]

    def load(block, mask):  # in the arrays' dtypes: half the registers of float32 for bf16
        return tuple(_load_raw(ref, block, mask) for ref in in_refs)

    def body(j, carry):  # dw [br, bg]: the sum so far, by row slot
        dw, loaded = carry
        block, mask = block_of(j)
        current = loaded if prefetch else load(block, mask)
        upcoming = load(*block_of(jnp.minimum(j + 1, per_program - 1))) if prefetch else ()
        # masked entries are zeros: they add nothing
        dw = dw + step(block, mask, w, *(a.astype(jnp.float32) for a in current))
        return dw, upcoming

    dw, _ = jax.lax.fori_loop(0, per_program, body, (jnp.zeros((br, bg), jnp.float32),
                                                     load(*block_of(0)) if prefetch else ()))
    plgpu.store(dw_ref.at[pi, pl.ds(c0, bg)], jnp.sum(dw, axis=0), mask=col_mask)


def _dx(xhat, rstd, wdout, group):
    """The norm's input gradient [br, bg] from xhat = x * rstd and wdout = dout * weight:
    rstd * (wdout - xhat * mean_G(xhat * wdout))."""
    return (wdout - xhat * (jnp.sum(xhat * wdout, axis=1, keepdims=True) / group)) * rstd


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def add_rms_norm(residual, delta, weight, eps, config=ADD_CONFIG, interpret=False):
    """residual, delta [..., d] (float32 or bfloat16, `supports_add`), weight [d] -> (summed,
    normed): reference.add_rms_norm_reference by the kernels. Its VJP keeps summed (an output
    the caller keeps anyway: the next layer's residual) and weight, and returns dresidual,
    ddelta and dweight in their dtypes."""
    return add_forward(residual, delta, weight, eps, config=config, interpret=interpret)


def _add_rms_norm_fwd(residual, delta, weight, eps, config, interpret):
    summed, normed = add_forward(residual, delta, weight, eps, config=config,
                                 interpret=interpret)
    return (summed, normed), (summed, weight)


def _add_rms_norm_bwd(eps, config, interpret, residuals, cotangents):
    summed, weight = residuals
    dsummed, dnormed = cotangents
    return add_backward(summed, weight, dsummed, dnormed, eps, config=config,
                        interpret=interpret)


add_rms_norm.defvjp(_add_rms_norm_fwd, _add_rms_norm_bwd)


def add_forward(residual, delta, weight, eps, *, config, interpret=False):
    """The forward kernel: residual, delta [..., d], weight [d] -> (summed in residual's
    dtype, normed in delta's dtype), each [..., d]."""
    d = residual.shape[-1]
    rows = math.prod(residual.shape[:-1])
    br, bg = _tiles(config, rows, d)
    blocks = pl.cdiv(rows, br)
    kernel = functools.partial(_add_forward_kernel, eps=eps, rows=rows, width=d, br=br, bg=bg,
                               ragged_rows=blocks * br != rows)
    summed, normed = call(
        kernel, (blocks, 1), [jax.ShapeDtypeStruct((rows, d), residual.dtype),
                            jax.ShapeDtypeStruct((rows, d), delta.dtype)],
        _warps(config, br, bg), 1, interpret, "add_rms_norm_forward")(
        residual.reshape(rows, d), delta.reshape(rows, d), weight)
    return summed.reshape(residual.shape), normed.reshape(residual.shape)


def add_backward(summed, weight, dsummed, dnormed, eps, *, config, interpret=False):
    """The backward kernel: the forward's summed and weight, the cotangents of summed and
    normed -> (dresidual in summed's dtype, ddelta in dnormed's, dweight in weight's), both
    the gradient of summed (dsummed plus the norm's part): written once a dtype. dweight is
    summed here from the kernel's float32 partials [programs, d]."""
    d = summed.shape[-1]
    rows = math.prod(summed.shape[:-1])
    br, bg = _tiles(config, rows, d)
    programs, per_program = _programs(config, pl.cdiv(rows, br), 1)
    warps, prefetch = _backward_launch(config, br, bg, summed, dsummed, dnormed)
    kernel = functools.partial(_add_backward_kernel, eps=eps, rows=rows, width=d, br=br, bg=bg,
                               per_program=per_program,
                               ragged_rows=programs * per_program * br != rows,
                               prefetch=prefetch)
    one = jnp.dtype(dnormed.dtype) == jnp.dtype(summed.dtype)
    flat = lambda a: a.reshape(rows, d)
    dresidual, dweight, *ddelta = call(
        kernel, (programs, 1),
        [jax.ShapeDtypeStruct((rows, d), summed.dtype),
         jax.ShapeDtypeStruct((programs, d), jnp.float32)]
        + [jax.ShapeDtypeStruct((rows, d), dnormed.dtype)] * (not one),
        warps, config.backward_stages, interpret, "add_rms_norm_backward",
    )(flat(summed), weight, flat(dsummed), flat(dnormed))
    dresidual = dresidual.reshape(summed.shape)
    ddelta = dresidual if one else ddelta[0].reshape(summed.shape)
    return dresidual, ddelta, dweight.sum(0).astype(weight.dtype)


def _add_forward_kernel(res_ref, delta_ref, w_ref, sum_ref, out_ref, *, eps, rows, width, br,
                        bg, ragged_rows):
    r0 = pl.multiple_of(pl.program_id(0) * br, br)
    c0 = _first_entry(width)
    block, mask, col_mask = _block(r0, c0, rows=rows, group=width, br=br, bg=bg,
                                   ragged_rows=ragged_rows)
    w = _load(w_ref, pl.ds(c0, bg), col_mask)
    summed = (_load(res_ref, block, mask) + _load(delta_ref, block, mask)).astype(sum_ref.dtype)
    plgpu.store(sum_ref.at[block], summed, mask=mask)
    x = summed.astype(jnp.float32)  # the stored sum, rounded to the residual's dtype
    # The reference's order of products: (x * rstd) * weight.
    plgpu.store(out_ref.at[block], (x * _rstd(x, width, eps) * w[None, :]).astype(out_ref.dtype),
                mask=mask)


def _add_backward_kernel(sum_ref, w_ref, dsum_ref, dout_ref, dres_ref, dw_ref, *ddelta_ref, eps,
                         rows, width, br, bg, per_program, ragged_rows, prefetch):
    def step(block, mask, w, x, dout, dsum):
        rstd = _rstd(x, width, eps)
        xhat = x * rstd
        dsummed = _dx(xhat, rstd, dout * w, width) + dsum
        plgpu.store(dres_ref.at[block], dsummed.astype(dres_ref.dtype), mask=mask)
        if ddelta_ref:
            plgpu.store(ddelta_ref[0].at[block], dsummed.astype(ddelta_ref[0].dtype), mask=mask)
        return dout * xhat

    _backward_loop(step, (sum_ref, dout_ref, dsum_ref), w_ref, dw_ref, c0=_first_entry(width),
                   rows=rows, group=width, br=br, bg=bg, per_program=per_program,
                   ragged_rows=ragged_rows, prefetch=prefetch)


def _backward_launch(config, br, bg, *arrays):
    """(warps, prefetch) of a backward kernel whose loop loads blocks [br, bg] of arrays:
    config.backward_warps, or 8 where a block ahead fits (PREFETCH_BYTES a thread of each
    array at 8 warps) and 4 where it does not; prefetch where asked for and it fits."""
    size = max(jnp.dtype(a.dtype).itemsize for a in arrays)
    fits = lambda warps: br * bg * size <= PREFETCH_BYTES * 32 * warps
    if config.backward_warps is not None:
        return config.backward_warps, config.backward_prefetch and fits(config.backward_warps)
    if config.backward_prefetch and fits(8):
        return 8, True
    return 4, False


def _first_entry(width):
    """0, the first entry of a row, from the grid's axis of one group (the add kernels'
    grids end in 1): a traced start, which Pallas does not check against the row's end
    where a block of bg entries is wider than the row's d (masked off past it)."""
    return pl.program_id(1) * width


def _programs(config, blocks, ngroups):
    """(programs, blocks a program) of a backward kernel over `blocks` blocks of each of
    ngroups groups: about config.backward_programs (default hardware.two_waves()) programs in
    all, none left with no block of its own."""
    target = config.backward_programs or hardware.two_waves()
    per_program = pl.cdiv(blocks, max(1, min(target // ngroups, blocks)))
    return pl.cdiv(blocks, per_program), per_program


def _rstd(x, group, eps):
    """x [br, bg] float32 (zeros past the group's G entries) -> rsqrt(mean_G(x**2) + eps)
    [br, 1]: the mean over the group's G entries, not the block's bg."""
    return jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / group + eps)


def _block(r0, c0, *, rows, group, br, bg, ragged_rows):
    """The block of rows [r0, r0 + br) and entries [c0, c0 + bg) of a [N, D] array: (its
    index, its mask [br, bg], the entries' mask [bg]); a mask is None where it would be all
    true (rows a multiple of br, G a power of two), so those loads go unmasked."""
    col_mask = jax.lax.broadcasted_iota(jnp.int32, (bg,), 0) < group if bg != group else None
    mask = None if col_mask is None else col_mask[None, :]
    if ragged_rows:
        row_mask = (r0 + jax.lax.broadcasted_iota(jnp.int32, (br,), 0) < rows)[:, None]
        mask = row_mask if mask is None else row_mask & mask
    if mask is not None:
        mask = jnp.broadcast_to(mask, (br, bg))
    return (pl.ds(r0, br), pl.ds(c0, bg)), mask, col_mask


def _load(ref, index, mask):
    """ref[index] in float32; zeros where mask (None: all true) is false."""
    return _load_raw(ref, index, mask).astype(jnp.float32)


def _load_raw(ref, index, mask):
    """ref[index] in ref's dtype; zeros where mask (None: all true) is false."""
    return plgpu.load(ref.at[index], mask=mask, other=None if mask is None else 0)


def supports_add(shape, residual_dtype, delta_dtype) -> bool:
    """Whether the add-and-norm kernels take residual and delta of this shape [..., d] and
    these dtypes: float32 or bfloat16, at least one row, d at most MAX_GROUP."""
    return (len(shape) >= 1 and math.prod(shape[:-1]) > 0 and 0 < shape[-1] <= MAX_GROUP
            and jnp.dtype(residual_dtype) in DTYPES and jnp.dtype(delta_dtype) in DTYPES)


def _sizes(y, ngroups):
    """(N rows, D entries a row, G entries a group) of y [..., h, p]."""
    *lead, h, p = y.shape
    return math.prod(lead), h * p, h * p // ngroups


def _tiles(config, rows, group):
    """(br, bg): rows a block and the group's padded width (powers of two)."""
    bg = _next_power_of_two(group)
    return max(1, min(config.block_elements // bg, _next_power_of_two(rows))), bg


def _next_power_of_two(n):
    return 1 << (n - 1).bit_length()


def _warps(config, br, bg):
    return config.num_warps or min(max(br * bg // 256, 1), 8)
