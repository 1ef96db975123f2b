"""The gated grouped RMSNorm's kernels compute the reference: values and every gradient.

On CPU the Pallas kernels run in Pallas's interpreter (the kernels' own code, not the
reference). Each case draws fresh random inputs, runs the kernels (implementation="triton")
and pallas_kernels.norm.reference in float64 on the same (dtype-rounded) inputs, and
compares the output and the gradients dy, dz, dweight of <out, dout> (jax.vjp, a random
cotangent dout in y's dtype) by the largest error relative to the largest value:
- float32 results (every output for float32 inputs; dweight, float32 like weight, for
  bfloat16 inputs too): below 1e-5 (float32 arithmetic; seen ~2e-7);
- bfloat16 results: below 2**-7, twice bf16's unit roundoff 2**-8 (each result is rounded
  to bf16 once from float32 arithmetic on exact inputs, an error of at most 2**-8 of its
  value).
NaN fails every comparison. Cases: one group and two, an odd row count (3 x 37 rows, a
ragged last block), a group of 24 entries (no power of two: masked 32-wide blocks, the
last group's block reaching past the row's end), with the default tiles and with small
ones that make every backward program loop over several blocks; the backward's recomputed
output (with_out). Then the dispatch: "auto"
is the XLA path on a CPU, the kernels on a patched-in Hopper GPU, where an unsupported case
is logged once; and the comparison does fail for a wrong result.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fallback, hardware
from pallas_kernels.norm import add_rms_norm, gated_rms_norm, triton
from pallas_kernels.norm.reference import add_rms_norm_reference, gated_rms_norm_reference
from seeds import fresh_rng

EPS = 1e-5
TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2.0 ** -7}

CASES = {  # name: (leading axes, h, p, ngroups)
    "one_group_odd_rows": ((3, 37), 4, 16, 1),
    "two_groups": ((3, 37), 4, 16, 2),
    "group_of_24_not_a_power_of_two": ((3, 37), 6, 8, 2),
}
SMALL_TILES = triton.Config(block_elements=64, backward_programs=7)
# The backward's loop without its loads a block ahead.
SMALL_TILES_UNFETCHED = triton.Config(block_elements=64, backward_programs=7,
                                      backward_prefetch=False)


def make_inputs(rng, lead, h, p, dtype):
    """y, z, dout [*lead, h, p] in dtype and weight [h, p] float32; z spread wider than a
    unit normal so that silu's saturated ends are exercised."""
    arr = lambda *shape, scale=1.0, dt=dtype: jnp.asarray(
        scale * rng.standard_normal(shape), dt)
    return (arr(*lead, h, p), arr(*lead, h, p, scale=4.0),
            arr(h, p, scale=0.5, dt=jnp.float32) + 1.0, arr(*lead, h, p))


def values_and_grads(fn, y, z, weight, dout):
    @jax.jit  # one compile, not one an operation
    def run(y, z, weight, dout):
        out, vjp = jax.vjp(fn, y, z, weight)
        return out, *vjp(dout)
    return dict(zip(("out", "dy", "dz", "dweight"), run(y, z, weight, dout)))


def reference_float64(y, z, weight, dout, ngroups):
    with jax.enable_x64(True):
        up = [jnp.asarray(np.asarray(a, np.float64)) for a in (y, z, weight, dout)]
        ref = values_and_grads(
            lambda y, z, w: gated_rms_norm_reference(y, z, w, EPS, ngroups), *up[:3], up[3])
        return {k: np.asarray(v) for k, v in ref.items()}


def errors_over_tolerance(ours, reference):
    """{name: (error relative to the largest reference value, tolerance)} of the results
    whose error is not below their dtype's tolerance (NaN included)."""
    bad = {}
    for k, ref in reference.items():
        a = np.asarray(ours[k], np.float64)
        error = np.max(np.abs(a - ref)) / np.max(np.abs(ref))
        if not error < TOLERANCE[jnp.dtype(ours[k].dtype)]:
            bad[k] = (float(error), TOLERANCE[jnp.dtype(ours[k].dtype)])
    return bad


def assert_matches_reference(fn, case, dtype):
    """fn(y, z, weight, ngroups) -> out: values and gradients against the float64 reference
    on fresh inputs of case's shapes (CASES' tuples)."""
    lead, h, p, ngroups = case
    y, z, weight, dout = make_inputs(fresh_rng(), lead, h, p, dtype)
    ours = values_and_grads(lambda y, z, w: fn(y, z, w, ngroups), y, z, weight, dout)
    for k, v in ours.items():
        assert v.shape == {"dweight": weight}.get(k, y).shape
        assert v.dtype == {"dz": z, "dweight": weight}.get(k, y).dtype, k
        assert np.all(np.isfinite(np.asarray(v, np.float32))), k
    bad = errors_over_tolerance(ours, reference_float64(y, z, weight, dout, ngroups))
    assert not bad, bad


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_kernels_match_the_float64_reference(case, dtype):
    assert_matches_reference(
        lambda y, z, w, g: gated_rms_norm(y, z, w, EPS, g, implementation="triton"),
        CASES[case], dtype)


@pytest.mark.parametrize("config", [SMALL_TILES, SMALL_TILES_UNFETCHED],
                         ids=["prefetch", "no_prefetch"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_backward_programs_loop_over_several_blocks(case, config):
    """Blocks of 64 entries (2 or 4 rows) and 7 backward programs: each program walks
    several blocks, the last one past the rows' end, and dweight sums 7 partials; with the
    next block's loads issued before this one's arithmetic and without."""
    assert_matches_reference(
        lambda y, z, w, g: triton.gated_rms_norm(y, z, w, EPS, g, config, True),
        CASES[case], jnp.float32)


def test_the_backward_prefetches_where_a_block_ahead_fits():
    """(warps, prefetch) of a backward: 8 warps and a block ahead where a thread's share is
    at most 32 bytes of each array there, else the former 4 warps without."""
    bf16, f32 = jnp.zeros((1,), jnp.bfloat16), jnp.zeros((1,), jnp.float32)
    launch = triton._backward_launch
    assert launch(triton.Config(), 1, 4096, bf16, bf16) == (8, True)  # mamba2-1.3b's rows
    assert launch(triton.Config(), 4, 1024, bf16) == (8, True)  # 4 rows of a group of 1024
    assert launch(triton.Config(), 1, 4096, bf16, f32) == (4, False)  # 64 bytes of float32
    assert launch(triton.Config(), 1, 8192, bf16) == (4, False)  # mamba2-2.7b's 5120
    assert launch(triton.Config(backward_warps=4), 1, 4096, bf16) == (4, False)
    assert launch(triton.Config(backward_warps=16), 1, 8192, bf16) == (16, True)
    assert launch(triton.ADD_CONFIG, 1, 2048, bf16, f32) == (8, True)  # a float32 residual
    assert launch(triton.ADD_CONFIG, 1, 4096, bf16, f32) == (4, False)  # 2560 in 4096


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_the_backward_recomputes_the_output_on_request(dtype):
    """backward(with_out=True), as the fused mixer calls it for out_proj's weight gradient:
    the forward's output from the same pass, beside the same gradients, over blocks that
    each program loops over (the last past the rows' end)."""
    lead, h, p, ngroups = CASES["group_of_24_not_a_power_of_two"]
    y, z, weight, dout = make_inputs(fresh_rng(), lead, h, p, dtype)
    ours = dict(zip(("dy", "dz", "dweight", "out"), triton.backward(
        y, z, weight, dout, EPS, ngroups, config=SMALL_TILES, interpret=True, with_out=True)))
    assert ours["out"].dtype == y.dtype and ours["out"].shape == y.shape
    assert not errors_over_tolerance(ours, reference_float64(y, z, weight, dout, ngroups))
    assert len(triton.backward(y, z, weight, dout, EPS, ngroups, config=SMALL_TILES,
                               interpret=True)) == 3


def test_the_comparison_fails_for_a_wrong_result():
    """The check is not vacuous: the reference's output is not the input, and results of a
    slightly different norm (one group for two, eps 1e-2, dy and dz swapped) fail it."""
    lead, h, p, ngroups = CASES["two_groups"]
    y, z, weight, dout = make_inputs(fresh_rng(), lead, h, p, jnp.float32)
    reference = reference_float64(y, z, weight, dout, ngroups)
    assert not np.allclose(reference["out"], np.asarray(y), atol=1e-2)
    kernels = lambda groups, eps: lambda y, z, w: gated_rms_norm(
        y, z, w, eps, groups, implementation="triton")
    right = values_and_grads(kernels(ngroups, EPS), y, z, weight, dout)
    assert not errors_over_tolerance(right, reference)
    one_group = values_and_grads(kernels(1, EPS), y, z, weight, dout)
    assert set(errors_over_tolerance(one_group, reference)) == {"out", "dy", "dz", "dweight"}
    big_eps = values_and_grads(kernels(ngroups, 1e-2), y, z, weight, dout)
    assert "out" in errors_over_tolerance(big_eps, reference)
    swapped = {**right, "dy": right["dz"], "dz": right["dy"]}
    assert set(errors_over_tolerance(swapped, reference)) == {"dy", "dz"}


def test_auto_uses_xla_without_a_gpu():
    y, z, weight, _ = make_inputs(fresh_rng(), (2, 3), 4, 16, jnp.bfloat16)
    auto = jax.make_jaxpr(lambda y, z, w: gated_rms_norm(y, z, w, EPS, 2))(y, z, weight)
    assert "pallas_call" not in str(auto)


def test_auto_on_hopper_takes_the_kernels_and_says_when_it_does_not(monkeypatch, caplog):
    """On an H200 (compute capability 9.0, patched in) "auto" runs the kernels for bf16 and
    a group of 24; float16, which they do not take, the XLA path, logged once."""
    monkeypatch.setattr(hardware, "compute_capability", lambda: 9.0)
    traced = lambda dtype: str(jax.make_jaxpr(lambda y, z, w: gated_rms_norm(y, z, w, EPS, 2))(
        *make_inputs(fresh_rng(), (2, 3), 6, 8, dtype)[:3]))
    assert "pallas_call" in traced(jnp.bfloat16)
    monkeypatch.setattr(fallback, "_said", set())  # what earlier tests had said
    with caplog.at_level("WARNING", logger="pallas_kernels.fallback"):
        assert "pallas_call" not in traced(jnp.float16)
        assert "pallas_call" not in traced(jnp.float16)
    said = [r.getMessage() for r in caplog.records if r.name == "pallas_kernels.fallback"]
    assert len(said) == 1 and "float16" in said[0], said


def test_supports():
    assert triton.supports((20, 2048, 64, 64), jnp.bfloat16, 1)  # mamba2-1.3b, G 4096
    assert triton.supports((2, 8, 128, 80), jnp.bfloat16, 8)  # G 1280, masked to 2048
    assert triton.supports((2, 8, 160, 64), jnp.float32, 1) is False  # G 10240
    assert triton.supports((2, 8, 4, 16), jnp.float16, 1) is False
    assert triton.supports((0, 4, 16), jnp.float32, 1) is False


# ---- add_rms_norm: the residual stream's add and RMSNorm at each layer's start ----

ADD_CASES = {  # name: (leading axes, d)
    "odd_rows_d_40_not_a_power_of_two": ((3, 37), 40),
    "d_64": ((2, 16), 64),
}
ADD_NAMES = ("summed", "normed", "dresidual", "ddelta", "dweight")


def add_inputs(rng, lead, d, residual_dtype, delta_dtype):
    """residual, delta, weight, dsummed, dnormed: the cotangents in summed's and normed's
    dtypes (residual's and delta's)."""
    arr = lambda dtype, *shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape), dtype)
    return (arr(residual_dtype, *lead, d, scale=3.0), arr(delta_dtype, *lead, d),
            arr(jnp.float32, d, scale=0.5) + 1.0, arr(residual_dtype, *lead, d),
            arr(delta_dtype, *lead, d))


def add_values_and_grads(fn, residual, delta, weight, dsummed, dnormed):
    @jax.jit  # one compile, not one an operation
    def run(residual, delta, weight, dsummed, dnormed):
        out, vjp = jax.vjp(fn, residual, delta, weight)
        return *out, *vjp((dsummed, dnormed))
    return dict(zip(ADD_NAMES, run(residual, delta, weight, dsummed, dnormed)))


def add_reference_float64(residual, delta, weight, dsummed, dnormed):
    with jax.enable_x64(True):
        up = [jnp.asarray(np.asarray(a, np.float64))
              for a in (residual, delta, weight, dsummed, dnormed)]
        ref = add_values_and_grads(lambda r, x, w: add_rms_norm_reference(r, x, w, EPS), *up)
        return {k: np.asarray(v) for k, v in ref.items()}


@pytest.mark.parametrize("delta_dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", [triton.ADD_CONFIG, SMALL_TILES, SMALL_TILES_UNFETCHED],
                         ids=["default", "small", "small_no_prefetch"])
@pytest.mark.parametrize("case", ADD_CASES, ids=list(ADD_CASES))
def test_add_kernels_match_the_float64_reference(case, config, delta_dtype):
    """A float32 residual (residual_in_fp32) and delta in the compute dtype: summed, normed
    and the gradients of <summed, dsummed> + <normed, dnormed> (dresidual float32, ddelta in
    delta's dtype, both the gradient of summed) against the float64 reference, with the
    default tiles and with blocks of 64 entries and 7 backward programs (each walks several
    blocks, the last past the rows' end, and dweight sums 7 partials)."""
    lead, d = ADD_CASES[case]
    inputs = add_inputs(fresh_rng(), lead, d, jnp.float32, delta_dtype)
    ours = add_values_and_grads(
        lambda r, x, w: triton.add_rms_norm(r, x, w, EPS, config, True), *inputs)
    residual, delta, weight = inputs[:3]
    for k, like in zip(ADD_NAMES, (residual, delta, residual, delta, weight)):
        assert ours[k].shape == like.shape and ours[k].dtype == like.dtype, k
        assert np.all(np.isfinite(np.asarray(ours[k], np.float32))), k
    bad = errors_over_tolerance(ours, add_reference_float64(*inputs))
    assert not bad, bad


def test_add_kernels_with_a_bfloat16_residual_match_the_xla_path():
    """residual_in_fp32=False: residual and delta in bf16. Both paths round summed to bf16
    once (the same value), then compute in float32; the XLA path rounds the norm's dx to
    bf16 before adding dsummed where the kernel adds in float32: the gradients differ by up
    to two bf16 roundings, 2**-7 of a value, so the bound is 2**-6 of the largest."""
    lead, d = ADD_CASES["odd_rows_d_40_not_a_power_of_two"]
    inputs = add_inputs(fresh_rng(), lead, d, jnp.bfloat16, jnp.bfloat16)
    ours = add_values_and_grads(
        lambda r, x, w: add_rms_norm(r, x, w, EPS, implementation="triton"), *inputs)
    xla = add_values_and_grads(
        lambda r, x, w: add_rms_norm(r, x, w, EPS, implementation="xla"), *inputs)
    np.testing.assert_array_equal(ours["summed"], xla["summed"])
    for k in ADD_NAMES:
        a, b = (np.asarray(v[k], np.float64) for v in (ours, xla))
        assert ours[k].dtype == xla[k].dtype and np.all(np.isfinite(a)), k
        assert np.max(np.abs(a - b)) < 2.0 ** -6 * np.max(np.abs(b)), k


def test_the_add_comparison_fails_for_a_wrong_result():
    """The check is not vacuous: a norm of the residual alone (delta not added) and the two
    input gradients each other's fail it."""
    lead, d = ADD_CASES["d_64"]
    inputs = add_inputs(fresh_rng(), lead, d, jnp.float32, jnp.float32)
    reference = add_reference_float64(*inputs)
    kernels = lambda r, x, w: triton.add_rms_norm(r, x, w, EPS, triton.ADD_CONFIG, True)
    right = add_values_and_grads(kernels, *inputs)
    assert not errors_over_tolerance(right, reference)
    no_delta = add_values_and_grads(lambda r, x, w: kernels(r, 0 * x, w), *inputs)
    assert {"summed", "normed"} <= set(errors_over_tolerance(no_delta, reference))
    # dsummed and dnormed swapped: the gradients of summed take the other cotangent.
    swapped = add_values_and_grads(kernels, *inputs[:3], inputs[4], inputs[3])
    assert {"dresidual", "ddelta", "dweight"} <= set(errors_over_tolerance(swapped, reference))


def test_add_auto_on_hopper_takes_the_kernels_and_says_when_it_does_not(monkeypatch, caplog):
    """"auto": the XLA path on a CPU; on an H200 (patched in) the kernels for a float32
    residual and bf16 delta, the XLA path for float16, logged once."""
    residual, delta, weight = add_inputs(fresh_rng(), (2, 3), 40, jnp.float32,
                                         jnp.bfloat16)[:3]
    traced = lambda delta: str(jax.make_jaxpr(
        lambda r, x, w: add_rms_norm(r, x, w, EPS))(residual, delta, weight))
    assert "pallas_call" not in traced(delta)
    monkeypatch.setattr(hardware, "compute_capability", lambda: 9.0)
    assert "pallas_call" in traced(delta)
    monkeypatch.setattr(fallback, "_said", set())
    with caplog.at_level("WARNING", logger="pallas_kernels.fallback"):
        assert "pallas_call" not in traced(delta.astype(jnp.float16))
        assert "pallas_call" not in traced(delta.astype(jnp.float16))
    said = [r.getMessage() for r in caplog.records if r.name == "pallas_kernels.fallback"]
    assert len(said) == 1 and "float16" in said[0], said
    assert triton.supports_add((20, 2048, 2048), jnp.float32, jnp.bfloat16)
    assert not triton.supports_add((2, 8, 10240), jnp.float32, jnp.bfloat16)
    assert not triton.supports_add((0, 64), jnp.float32, jnp.float32)
