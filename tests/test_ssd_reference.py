"""The chunked XLA form of the SSD scan equals the naive recurrence, values and gradients."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ssd import ssd
from pallas_kernels.ssd.reference import ssd_naive


def make_inputs(seed, b, l, h, p, g, n, dtype, with_state=False, docs=False):
    rng = np.random.default_rng(seed)
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    inputs = dict(x=arr(b, l, h, p), dt=arr(b, l, h), A=-jnp.asarray(rng.uniform(0.5, 4, h),
                                                                    dtype),
                  B=arr(b, l, g, n), C=arr(b, l, g, n))
    options = dict(D=arr(h), dt_bias=arr(h), dt_softplus=True)
    if with_state:
        options["initial_state"] = arr(b, h, p, n)
    if docs:  # random starts, and one exactly on a chunk edge (16) and one inside (23)
        starts = rng.random((b, l)) < 0.08
        starts[:, [i for i in (16, 23) if i < l]] = True
        options["seq_idx"] = jnp.asarray(np.cumsum(starts, axis=1))
    return inputs, options


CASES = [  # (b, l, h, p, g, n, chunk, with_state, docs)
    (2, 37, 4, 8, 1, 16, 8, False, False),   # seqlen not a multiple of the chunk
    (1, 64, 8, 4, 2, 8, 16, True, False),    # ngroups > 1, initial state
    (2, 50, 4, 4, 4, 8, 16, True, True),     # ngroups == nheads, packed documents
    (1, 64, 2, 4, 1, 8, 8, True, True),      # chunk 8: documents start on an edge and inside
    (1, 5, 2, 4, 1, 4, 16, False, True),     # shorter than one chunk
]


@pytest.mark.parametrize("case", CASES)
def test_chunked_equals_naive_in_float64(case):
    *shape, chunk, with_state, docs = case
    with jax.enable_x64(True):
        inputs, options = make_inputs(0, *shape, jnp.float64, with_state, docs)
        y_ref, s_ref = ssd_naive(**inputs, **options)
        y, s = ssd(**inputs, **options, chunk_size=chunk, return_final_state=True)
        assert y.dtype == jnp.float64
        # float64 arithmetic: only rounding separates the two orders of summation.
        np.testing.assert_allclose(y, y_ref, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(s, s_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", CASES[:3])
def test_chunked_gradients_equal_naive_gradients(case):
    *shape, chunk, with_state, docs = case
    inputs, options = make_inputs(1, *shape, jnp.float32, with_state, docs)
    seq_idx = options.pop("seq_idx", None)
    cotangent = jnp.asarray(np.random.default_rng(2).standard_normal(inputs["x"].shape),
                            jnp.float32)
    state_cot = jnp.asarray(np.random.default_rng(3).standard_normal(
        inputs["x"].shape[:1] + inputs["x"].shape[2:] + inputs["B"].shape[-1:]), jnp.float32)

    def loss(fn, args):
        y, s = fn(**args, seq_idx=seq_idx)
        return jnp.sum(y * cotangent) + jnp.sum(s * state_cot)

    naive = lambda **kw: ssd_naive(**kw)
    chunked = lambda **kw: ssd(**kw, chunk_size=chunk, return_final_state=True)
    args = {**inputs, **{k: v for k, v in options.items() if k != "dt_softplus"}}
    fixed = {"dt_softplus": True}
    g_ref = jax.jit(jax.grad(lambda a: loss(naive, {**a, **fixed})))(args)
    g = jax.jit(jax.grad(lambda a: loss(chunked, {**a, **fixed})))(args)
    for name in args:
        assert np.all(np.isfinite(g[name])), name
        # float32: relative to the largest entry, well under float32 accumulation error.
        scale = np.abs(g_ref[name]).max()
        np.testing.assert_allclose(g[name], g_ref[name], atol=2e-4 * scale, rtol=0,
                                   err_msg=name)


def test_bfloat16_inputs_stay_close_to_float32():
    inputs, options = make_inputs(4, 2, 64, 4, 8, 2, 16, jnp.float32, True, True)
    y32 = ssd(**inputs, **options, chunk_size=16)
    lowered = {k: (v.astype(jnp.bfloat16) if k in ("x", "B", "C") else v)
               for k, v in inputs.items()}
    y16 = ssd(**lowered, **options, chunk_size=16)
    assert y16.dtype == jnp.bfloat16
    err = np.linalg.norm(np.asarray(y16, np.float32) - y32) / np.linalg.norm(y32)
    assert err < 2e-2  # bf16 operands, float32 accumulation


# Both bounds, and each alone (NemotronH checkpoints clamp below only: (time_step_min, inf)).
@pytest.mark.parametrize("limit", [(0.05, 0.2), (0.5, math.inf), (0.0, 0.05)])
@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_dt_limit_clamps_dt(limit, implementation):
    inputs, options = make_inputs(5, 1, 16, 2, 16, 1, 16, jnp.float32)
    dt = jax.nn.softplus(inputs["dt"] + options["dt_bias"])
    assert float(dt.min()) < 0.5 and float(dt.max()) > 0.2  # every bound bites
    limited = ssd(**inputs, **options, dt_limit=limit, chunk_size=8,
                  implementation=implementation)
    by_hand = ssd_naive(**{**inputs, "dt": jnp.clip(dt, *limit)}, D=options["D"])[0]
    np.testing.assert_allclose(limited, by_hand, rtol=1e-5, atol=1e-5)


def test_documents_do_not_see_each_other():
    # Row with two documents == each document scanned alone (the second from a zero state).
    inputs, options = make_inputs(6, 1, 40, 4, 4, 2, 8, jnp.float32, with_state=True)
    seq_idx = jnp.asarray([[3] * 25 + [7] * 15])
    y = ssd(**inputs, **options, seq_idx=seq_idx, chunk_size=16)
    first = ssd(**{k: v[:, :25] if k != "A" else v for k, v in inputs.items()}, **options,
                chunk_size=16)
    second = ssd(**{k: v[:, 25:] if k != "A" else v for k, v in inputs.items()},
                 **{**options, "initial_state": None}, chunk_size=16)
    np.testing.assert_allclose(y, jnp.concatenate([first, second], axis=1), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("bad,match", [
    (dict(A=jnp.zeros(3)), r"A must have shape \(4,\)"),
    (dict(B=jnp.zeros((1, 8, 3, 2))), "nheads=4 is not divisible by ngroups=3"),
    (dict(chunk_size=0), "chunk_size must be a positive int"),
    (dict(implementation="cuda"), "implementation='cuda' is not one of"),
    # an integer D (or A, dt) was cast without a word
    (dict(D=jnp.ones(4, jnp.int32)), r"D of dtype int32; give it in a floating-point dtype"),
    (dict(dt=jnp.zeros((1, 8, 4), bool)), r"dt of dtype bool"),
])
def test_bad_shapes_are_named(bad, match):
    args = dict(x=jnp.zeros((1, 8, 4, 2)), dt=jnp.zeros((1, 8, 4)), A=jnp.zeros(4),
                B=jnp.zeros((1, 8, 1, 2)), C=jnp.zeros((1, 8, 1, 2)), chunk_size=4)
    args.update(bad)
    if "B" in bad:
        args["C"] = bad["B"]
    with pytest.raises(ValueError, match=match):
        ssd(**args)


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_bf16_backward_keeps_no_float32_copy_of_x(implementation, capsys):
    # The D skip widens x to float32; differentiating must not keep that copy (a float32
    # [b, l, h, p] per layer) but widen the bf16 x it keeps anyway again.
    from jax.ad_checkpoint import print_saved_residuals  # one "dtype[shape] ..." per line
    b, l, h, p, g, n = 2, 64, 4, 16, 1, 16
    keys = iter(jax.random.split(jax.random.key(0), 4))
    x = jax.random.normal(next(keys), (b, l, h, p)).astype(jnp.bfloat16)
    B = jax.random.normal(next(keys), (b, l, g, n)).astype(jnp.bfloat16)
    dt = jax.random.normal(next(keys), (b, l, h))

    def loss(x, D):
        return ssd(x, dt, -jnp.ones(h), B, B, chunk_size=16, D=D, dt_softplus=True,
                   implementation=implementation).astype(jnp.float32).sum()
    print_saved_residuals(loss, x, jnp.ones(h))
    kept = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line]
    shape = "[" + ",".join(map(str, x.shape)) + "]"
    assert "bf16" + shape in kept and "f32" + shape not in kept, kept
