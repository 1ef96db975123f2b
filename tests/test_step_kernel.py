"""The one-token Mamba2 step kernel (pallas_kernels.ssd.step) against its plain-JAX reference,
run through Pallas's interpreter on fresh random inputs; the reference itself is checked end
to end by tests/test_model.py (prefill then steps equal the full forward)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import hardware
from pallas_kernels.decode import step_out
from pallas_kernels.decode.step_out import mamba_step_out
from pallas_kernels.ssd.step import (Blocks, Int8State, dequantize, mamba_step,
                                     mamba_step_shifted, quantize, quantized_values)
from seeds import fresh_rng


def _inputs(rng, b, h, p, g, n, k, window_dtype, state_dtype, bias, D_per_channel=False):
    """mamba_step's arguments: zxbcdt the in-projection's output [z, xBC, dt]; D [h], or
    [h, p] (mamba_ssm's D_has_hdim) where D_per_channel."""
    e = h * p + 2 * g * n
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    zxbcdt = jnp.concatenate([arr(b, h * p), arr(b, e), arr(b, h) - 1.0], axis=1)
    return dict(conv_state=arr(b, e, k).astype(window_dtype), zxbcdt=zxbcdt,
                conv_w=0.5 * arr(e, k),
                conv_b=0.1 * arr(e) if bias else None,
                A=-jnp.asarray(rng.uniform(1.0, 16.0, h), jnp.float32),
                D=arr(h, p) if D_per_channel else arr(h),
                dt_bias=0.5 * arr(h), state=arr(b, h, p, n).astype(state_dtype))


# Each dtype of the window and of the state meets each group count and bias/limit setting,
# and D per head channel (D [h, p]: each program reads its rows' D).
@pytest.mark.parametrize("window_dtype,state_dtype,g,bias,dt_limit,D_per_channel", [
    (jnp.float32, jnp.float32, 1, True, (0.0, math.inf), False),
    (jnp.bfloat16, jnp.bfloat16, 1, True, (0.0, math.inf), True),
    (jnp.bfloat16, jnp.float32, 4, False, (0.01, 0.5), False),
    (jnp.float32, jnp.bfloat16, 4, False, (0.5, math.inf), True),  # one bound alone
    (jnp.float32, jnp.float32, 1, False, (0.0, 0.05), False)])
def test_kernel_equals_the_reference(window_dtype, state_dtype, g, bias, dt_limit,
                                     D_per_channel):
    rng = fresh_rng()  # fresh inputs every run (tests/seeds.py)
    # 16 heads' programs: each head's p = 32 is split in two programs of 16 rows.
    args = _inputs(rng, b=2, h=8, p=32, g=g, n=32, k=4, window_dtype=window_dtype,
                   state_dtype=state_dtype, bias=bias, D_per_channel=D_per_channel)
    y_ref, window_ref, state_ref = mamba_step(**args, dt_limit=dt_limit, implementation="xla")
    y, window, state = mamba_step(**args, dt_limit=dt_limit, implementation="triton")
    # The same step over the window already shifted: bit for bit, in the kernel and in the
    # reference.
    b, h, p = args["state"].shape[:3]
    e = args["conv_state"].shape[1]
    z, xBC_in = args["zxbcdt"][:, :h * p], args["zxbcdt"][:, h * p:h * p + e]
    shifted = {k: v for k, v in args.items() if k != "conv_state"}
    for implementation, (y_, state_) in (("triton", (y, state)), ("xla", (y_ref, state_ref))):
        y_shifted, state_shifted = mamba_step_shifted(
            window_ref, **shifted, dt_limit=dt_limit, implementation=implementation)
        np.testing.assert_array_equal(y_shifted, y_)
        np.testing.assert_array_equal(state_shifted, state_)
        # gate: y rounded to y_dtype, times silu(z) in float32 (z: zxbcdt's first h*p).
        y_gated, _ = mamba_step_shifted(window_ref, **shifted, dt_limit=dt_limit,
                                        y_dtype=jnp.bfloat16, gate=True,
                                        implementation=implementation)
        assert y_gated.dtype == jnp.float32
        expected = (y_.astype(jnp.bfloat16).astype(jnp.float32)
                    * jax.nn.silu(z).reshape(b, h, p))
        # y of this compile and y_ are the same float32 arithmetic compiled apart: they may
        # differ in the last bits of the terms y sums (1e-5 of the largest value, as below),
        # and the rounding to bf16 can turn that into one bf16 ulp (at most 2**-7
        # relative); a mismatch beyond one ulp hit about one run in 50 where y is small.
        np.testing.assert_allclose(y_gated, expected, rtol=2.0 ** -7,
                                   atol=1e-5 * float(jnp.max(jnp.abs(expected))))
    assert y.dtype == jnp.float32 and state.dtype == state_dtype
    # The shifted window: the newest input appended in the window's dtype, bit for bit.
    assert window.dtype == window_dtype
    np.testing.assert_array_equal(window, window_ref)
    np.testing.assert_array_equal(window[:, :, :-1], args["conv_state"][:, :, 1:])
    np.testing.assert_array_equal(window[:, :, -1], xBC_in.astype(window_dtype))
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(state.astype(jnp.float32)))
    # The same float32 arithmetic in another order: 1e-5 relative to the largest value. But
    # x, B and C leave the conv rounded to the window's dtype, and where the two float32 convs
    # differ in the last bit a bf16 value may round to its neighbour (one ulp, at most 2**-7
    # of it; one element of x in one run of several hundred), which moves y and the state by
    # up to that share of their largest values.
    rounding = 2.0 ** -7 if window_dtype == jnp.bfloat16 else 1e-5
    scale = float(jnp.max(jnp.abs(y_ref)))
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=rounding * scale)
    # A bf16 state may round to the neighbouring bf16 value: one ulp (2**-8 relative).
    tol = max(rounding, 1e-5 if state_dtype == jnp.float32 else 2.0 ** -8)
    np.testing.assert_allclose(state.astype(jnp.float32), state_ref.astype(jnp.float32),
                               rtol=tol, atol=tol * float(jnp.max(jnp.abs(
                                   state_ref.astype(jnp.float32)))))


@pytest.mark.parametrize("g,y_dtype", [(1, jnp.bfloat16), (4, jnp.float32)])
def test_kernel_gates_and_weighs_y_for_the_norm_after_the_product(g, y_dtype):
    """norm_weight: y rounded to y_dtype, times silu(z), times the norm's weight, stored
    [b, h*p] in y_dtype, and the squares of y * silu(z) summed per head; with each head's
    headdim split over two programs (their partial sums added), kernel against reference."""
    rng = fresh_rng()  # fresh inputs every run (tests/seeds.py)
    args = _inputs(rng, b=2, h=8, p=32, g=g, n=32, k=4, window_dtype=jnp.float32,
                   state_dtype=jnp.float32, bias=True)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, 8 * 32), jnp.float32)
    ref, _, state_ref = mamba_step(**args, y_dtype=y_dtype, norm_weight=weight,
                                   implementation="xla")
    got, _, state = mamba_step(**args, y_dtype=y_dtype, norm_weight=weight,
                               implementation="triton")
    assert got.y.shape == (2, 8 * 32) and got.y.dtype == y_dtype
    assert got.sum_sq.shape == (2, 8) and got.sum_sq.dtype == jnp.float32
    # The unnormed step's y, gated by hand: the reference's definition, in float32.
    y, _, _ = mamba_step(**args, y_dtype=y_dtype, implementation="xla")
    z = args["zxbcdt"][:, :8 * 32].reshape(2, 8, 32)
    gated = np.asarray(y.astype(jnp.float32) * jax.nn.silu(z), np.float64)
    np.testing.assert_allclose(ref.sum_sq, np.sum(gated ** 2, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(ref.y.astype(jnp.float32),
                               gated.reshape(2, -1) * np.asarray(weight),
                               rtol=2.0 ** -8 if y_dtype == jnp.bfloat16 else 1e-6, atol=1e-6)
    # Kernel against reference: float32 sums in another order, then (bf16) one rounding that
    # may land on the neighbouring value (2**-7 relative), as for the ungated y above.
    rounding = 2.0 ** -7 if y_dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(got.y.astype(jnp.float32), ref.y.astype(jnp.float32), rtol=0,
                               atol=rounding * float(jnp.max(jnp.abs(ref.y.astype(
                                   jnp.float32)))))
    # A y rounded to its neighbour moves its head's sum by up to twice that share; and the
    # gated y's tolerated float32 difference (eps, as y's check above allows) moves a head's
    # sum by up to 2 eps sum|gated| + p eps^2, a large share of a head whose y cancel to small
    # values (a sum of 3e-4 among others of 1e2: 3e-5 relative, 1e-8 absolute).
    eps = 1e-5 * np.max(np.abs(gated))
    bound = (2 * rounding * np.asarray(ref.sum_sq) + 2 * eps * np.sum(np.abs(gated), axis=-1)
             + gated.shape[-1] * eps ** 2)
    assert np.all(np.abs(np.asarray(got.sum_sq) - np.asarray(ref.sum_sq)) <= bound)
    np.testing.assert_allclose(state, state_ref, rtol=1e-5,
                               atol=1e-5 * float(jnp.max(jnp.abs(state_ref))))


def test_int8_round_trip_is_within_half_a_step_of_each_row():
    """quantize: per (row, head, headdim channel) a scale max|state| / 127 over d_state, the
    values integers in [-127, 127] each within half a step of the state; a row's largest
    value is exact, an all-zero row stays zero (scale 0), and a decay of the whole row (a
    head's, at every token) moves the scale, not the values."""
    rng = fresh_rng()  # fresh inputs every run (tests/seeds.py)
    # rows of magnitudes 1e-6 to 1e3: each row's step is its own
    state = rng.standard_normal((2, 4, 16, 32)) * 10.0 ** rng.uniform(-6, 3, (2, 4, 16, 1))
    state[1, 2, 3] = 0.0
    state = jnp.asarray(state, jnp.float32)
    q = quantize(state)
    assert q.values.dtype == jnp.int8 and q.scale.dtype == jnp.float32
    assert q.shape == (2, 4, 16, 32) and q.scale.shape == (2, 4, 16)
    values = np.asarray(q.values, np.int32)
    assert values.min() >= -127 and values.max() <= 127
    np.testing.assert_allclose(q.scale, jnp.max(jnp.abs(state), axis=-1) / 127, rtol=1e-6)
    back = np.asarray(dequantize(q))
    # half a step, and the float32 rounding of the product and of the scale's division
    bound = np.asarray(q.scale)[..., None] * (0.5 + 1e-5)
    assert np.all(np.abs(back - np.asarray(state)) <= bound)
    peak = np.argmax(np.abs(np.asarray(state)), axis=-1)[..., None]
    assert np.all(np.abs(np.take_along_axis(values, peak, -1)[np.asarray(q.scale) > 0]) == 127)
    assert float(q.scale[1, 2, 3]) == 0.0 and not values[1, 2, 3].any()
    decayed = quantize(state * 0.93)
    np.testing.assert_allclose(decayed.scale, q.scale * 0.93, rtol=1e-6)
    # a value within float32's rounding of a half step may round the other way: rarely
    moved = np.abs(np.asarray(decayed.values, np.int32) - values)
    assert moved.max() <= 1 and moved.mean() < 1e-3


def test_int8_values_round_to_the_nearest_integer_half_to_even():
    """quantized_values rounds state * 127 / peak by adding 1.5 * 2**23 in float32: over the
    whole range, at and between the half steps, numpy's rint (half to even) of the same
    float32 product; and the extremes stay within [-127, 127]."""
    rng = fresh_rng()  # fresh inputs every run (tests/seeds.py)
    steps = np.arange(-127.0, 127.25, 0.25, dtype=np.float32)  # ties at every .5
    noise = rng.uniform(-127.0, 127.0, 4096).astype(np.float32)
    for v in (steps, noise):
        got = np.asarray(quantized_values(jnp.asarray(v)[None], jnp.float32(127.0)[None]))
        np.testing.assert_array_equal(got[0], np.rint(v).astype(np.int8))
    # peak 254: the product is half the value, exactly
    row = jnp.asarray([[-254.0, 254.0, 0.0, 1.0, 3.0, -5.0]])
    got = np.asarray(quantized_values(row, jnp.float32(254.0)[None]))
    np.testing.assert_array_equal(got[0], [-127, 127, 0, 0, 2, -2])


def test_int8_states_step_in_the_kernel_as_in_the_reference():
    """The step over an Int8State: the kernel (each program scales its rows' read-out and
    decay and quantises them before the store, values and scale updated in place) against the
    reference, with each head's headdim split over two programs. y and the scales are the
    same float32 arithmetic (1e-5 of the largest value); a value within float32's rounding
    of a half step may round to its neighbour, one step of its row."""
    rng = fresh_rng()  # fresh inputs every run (tests/seeds.py)
    args = _inputs(rng, b=2, h=8, p=32, g=4, n=32, k=4, window_dtype=jnp.float32,
                   state_dtype=jnp.float32, bias=True)
    args["state"] = quantize(args["state"].at[0, 3].set(0.0))  # a head with zero state
    y_ref, window_ref, state_ref = mamba_step(**args, implementation="xla")
    y, window, state = mamba_step(**args, implementation="triton")
    for s in (state, state_ref):
        assert isinstance(s, Int8State) and s.values.dtype == jnp.int8
        assert s.values.shape == (2, 8, 32, 32) and s.scale.shape == (2, 8, 32)
        assert s.scale.dtype == jnp.float32 and np.all(np.isfinite(s.scale))
    np.testing.assert_array_equal(window, window_ref)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(y_ref))))
    np.testing.assert_allclose(state.scale, state_ref.scale, rtol=1e-5,
                               atol=1e-5 * float(jnp.max(state_ref.scale)))
    moved = np.abs(np.asarray(state.values, np.int32) - np.asarray(state_ref.values, np.int32))
    assert moved.max() <= 1 and moved.mean() < 1e-3
    # And the float32 step's state, quantised, is what the int8 step stores.
    dense = dict(args, state=dequantize(args["state"]))
    y32, _, state32 = mamba_step(**dense, implementation="xla")
    np.testing.assert_allclose(y_ref, y32, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(y32))))
    np.testing.assert_allclose(dequantize(state_ref), state32, rtol=0,
                               atol=float(jnp.max(state_ref.scale)) * (0.5 + 1e-5))
    # The fused block step takes float states only (the decode plan never fuses int8's).
    with pytest.raises(ValueError, match="an int8 state"):
        mamba_step_out(window_ref, **{k: v for k, v in args.items() if k != "conv_state"},
                       residual=None, norm_weight=None, w_out=None, eps=1e-5, ngroups=4)


@pytest.mark.parametrize("block_p", [8, 32])
def test_tiles_split_or_join_the_headdim_to_the_same_values(block_p):
    # The default splits each head's p = 32 in two programs here; 8 rows a program and the
    # whole head are the same arithmetic per row: bit for bit.
    args = _inputs(fresh_rng(), b=2, h=8, p=32, g=4, n=32, k=4,
                   window_dtype=jnp.bfloat16, state_dtype=jnp.bfloat16, bias=True)
    default = mamba_step(**args, implementation="triton")
    tiled = mamba_step(**args, implementation="triton", blocks=Blocks(block_p, num_warps=2))
    for got, want in zip(tiled, default):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("p", [80, 96, 192])
def test_headdims_that_are_no_power_of_two_run_in_power_of_two_blocks(p):
    """80 (Nemotron Nano 2's), 96 and 192: each head's rows in programs of 16, 32 and 64
    (the largest power of two dividing p), with D per head channel (each program reads its
    rows'); the step, then (at 80) the rest of the block after it as the fused step runs it
    (the step kernel and the norm-matmul kernel over out_proj's k = h * p inputs), against
    the reference: the same float32 arithmetic, 1e-5 of the largest value."""
    rng = fresh_rng()  # fresh inputs every run (tests/seeds.py)
    b = h = 2 if p == 80 else 1  # fewer programs where only the tiling differs
    args = _inputs(rng, b=b, h=h, p=p, g=1, n=16, k=4, window_dtype=jnp.float32,
                   state_dtype=jnp.float32, bias=True, D_per_channel=True)
    got, want = (mamba_step(**args, implementation=i) for i in ("triton", "xla"))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(b))))
    if p != 80:
        return
    window = args.pop("conv_state")
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    out_args = dict(residual=arr(2, 8), norm_weight=arr(2 * p), w_out=arr(8, 2 * p) / p)
    got, want = (mamba_step_out(window, **args, **out_args, eps=1e-5, ngroups=1,
                                implementation=i)[:2] for i in ("triton", "xla"))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(b))))


@pytest.mark.parametrize("norm_groups,bias", [(1, False), (2, True)])
def test_cooperative_kernel_computes_the_two_kernels_values(norm_groups, bias):
    """mamba_step_out's cooperative kernel (the step, a grid-wide barrier, then out_proj, per
    program) at one program: the interpreter runs programs one at a time, so one that waited
    for another would never return; one program runs the same code as each of the GPU's.
    Its residual and state equal the two kernels' (the step kernel, then the norm-matmul
    kernel) bit for bit, and it adds one arrival to the counter from where it was. With a
    bias, D per head channel too."""
    rng = fresh_rng()  # fresh inputs every run (tests/seeds.py)
    h, p, n, d = 1, 32, 16, 8  # one head, one program of its 32 rows
    args = _inputs(rng, b=1, h=h, p=p, g=1, n=n, k=4, window_dtype=jnp.bfloat16,
                   state_dtype=jnp.float32, bias=bias, D_per_channel=bias)
    window = args.pop("conv_state")
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    out_args = dict(residual=arr(1, d), norm_weight=arr(h * p),
                    w_out=(arr(d, h * p) / (h * p) ** 0.5).astype(jnp.bfloat16))
    kw = dict(eps=1e-5, ngroups=norm_groups, bias=0.1 * arr(d) if bias else None,
              dt_limit=(0.0, math.inf), y_dtype=jnp.bfloat16)
    two = mamba_step_out(window, **args, **out_args, **kw, implementation="triton")
    assert two[2] is None  # no counter: the two kernels
    for start in (0, 7):
        sync = jnp.full((1,), start, jnp.int32)
        residual, state, sync = step_out._cooperative(window, **args, **out_args, **kw,
                                                      sync=sync, plan=(32, d, 1))
        np.testing.assert_array_equal(residual, two[0])
        np.testing.assert_array_equal(state, two[1])
        assert int(sync[0]) == start + 1
    assert np.all(np.isfinite(residual))


def test_cooperative_kernel_runs_only_where_its_programs_fit(monkeypatch):
    """The cooperative kernel's plan: mamba2-1.3b's shapes (64 heads of 64 rows, d_state 128,
    out_proj [2048, 4096]) take 256 programs, each the step kernel's 16 rows of a head and 8
    of out_proj's columns, on a GPU that holds 264 of them (an H200's 132 SMs, two each);
    not on one that holds fewer, nor without a counter, nor at batch 2, nor where the
    columns do not split evenly."""
    state = jax.ShapeDtypeStruct((1, 64, 64, 128), jnp.float32)
    w_out = jax.ShapeDtypeStruct((2048, 4096), jnp.bfloat16)
    sync = jnp.zeros((1,), jnp.int32)
    monkeypatch.setattr(hardware, "cooperative_programs", lambda: 264)
    assert step_out._cooperative_plan(state, w_out, sync) == (16, 8, 256)
    assert step_out._cooperative_plan(state, w_out, None) is None
    assert step_out._cooperative_plan(jax.ShapeDtypeStruct((2, 64, 64, 128), jnp.float32),
                                      w_out, sync) is None
    assert step_out._cooperative_plan(state, jax.ShapeDtypeStruct((2000, 4096), jnp.bfloat16),
                                      sync) is None
    monkeypatch.setattr(hardware, "cooperative_programs", lambda: 255)
    assert step_out._cooperative_plan(state, w_out, sync) is None


def test_unsupported_shapes_and_names_are_refused():
    rng = np.random.default_rng(0)
    args = _inputs(rng, b=1, h=2, p=12, g=1, n=16, k=4, window_dtype=jnp.float32,
                   state_dtype=jnp.float32, bias=True)
    with pytest.raises(ValueError, match="headdim divisible by 16 and d_state, d_conv powers"):
        mamba_step(**args, implementation="triton")
    with pytest.raises(ValueError, match="implementation='cuda'"):
        mamba_step(**args, implementation="cuda")
    args = _inputs(rng, b=1, h=2, p=32, g=1, n=16, k=4, window_dtype=jnp.float32,
                   state_dtype=jnp.float32, bias=True)
    with pytest.raises(ValueError, match=r"Blocks\(block_p=12\) must be a power of two"):
        mamba_step(**args, implementation="triton", blocks=Blocks(block_p=12))
