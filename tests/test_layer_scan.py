"""mamba_jax.layer_scan.scan against lax.scan: the carry, the stacked outputs and every
gradient equal (the same operations in the same order, so bit for bit) for a step with
stacked outputs, an integer and a None leaf among its inputs, with and without a
jax.checkpoint policy; the residual stacks are uninitialised allocations when lowered for a
GPU; and a residual that is a slice of xs is read from xs, not stacked again."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from mamba_jax import layer_scan


def step(c, x):
    h = jnp.tanh(c @ x["w"] + x["b"]) + c * x["k"].astype(c.dtype)
    return h, {"y": (h * h).sum(-1), "none": None}


def inputs(seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    xs = {"w": jax.random.normal(keys[0], (5, 8, 8)) * 0.3,
          "b": jax.random.normal(keys[1], (5, 8)), "k": jnp.arange(5, dtype=jnp.int32),
          "none": None}
    return jax.random.normal(keys[2], (3, 8)), xs


def loss_and_gradients(scan, step, c, xs):
    def loss(c, w, b):
        c, ys = scan(step, c, dict(xs, w=w, b=b))
        return (c ** 2).sum() + (ys["y"] ** 3).sum()
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(c, xs["w"], xs["b"])


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.nothing_saveable],
                         ids=["no_remat", "remat"])
def test_scan_matches_lax_scan(policy):
    c, xs = inputs(np.random.SeedSequence().entropy % 2**31)
    f = step if policy is None else jax.checkpoint(step, policy=policy)
    ours_c, ours_ys = jax.jit(lambda c, xs: layer_scan.scan(f, c, xs))(c, xs)
    theirs_c, theirs_ys = jax.jit(lambda c, xs: lax.scan(f, c, xs))(c, xs)
    np.testing.assert_array_equal(ours_c, theirs_c)
    np.testing.assert_array_equal(ours_ys["y"], theirs_ys["y"])
    assert ours_ys["none"] is None
    ours = loss_and_gradients(layer_scan.scan, f, c, xs)
    theirs = loss_and_gradients(lax.scan, f, c, xs)
    assert np.isfinite(float(ours[0]))
    np.testing.assert_array_equal(ours[0], theirs[0])
    for o, t in zip(ours[1], theirs[1]):
        np.testing.assert_array_equal(o, t)


def test_an_integer_input_gets_a_float0_gradient():
    c, xs = inputs(0)
    grads = jax.grad(lambda c, xs: layer_scan.scan(step, c, xs)[0].sum(), argnums=1,
                     allow_int=True)(c, xs)
    assert grads["k"].dtype == jax.dtypes.float0 and grads["k"].shape == (5,)
    assert grads["none"] is None


def test_the_stacks_are_not_filled_on_a_gpu():
    # Lowered for a GPU, the residual and output stacks are XLA's AllocateBuffer (allocated,
    # never written) rather than a broadcast of zeros.
    c, xs = inputs(0)
    lowered = jax.jit(lambda c, w, b: jax.grad(
        lambda c, w, b: layer_scan.scan(step, c, dict(xs, w=w, b=b))[0].sum(),
        (0, 1, 2))(c, w, b)).trace(c, xs["w"], xs["b"]).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("AllocateBuffer") >= 3


def allocations(f, c, xs):
    """The shapes of the stacks (`lax.empty`) that the gradient of a scan of f makes."""
    def eqns(jaxpr):
        for e in jaxpr.eqns:
            yield e
            for p in e.params.values():
                inner = getattr(p, "jaxpr", p)
                if hasattr(inner, "eqns"):
                    yield from eqns(inner)
    grad = jax.grad(lambda c, w, b: layer_scan.scan(f, c, dict(xs, w=w, b=b))[0].sum(),
                    (0, 1, 2))
    jaxpr = jax.make_jaxpr(grad)(c, xs["w"], xs["b"]).jaxpr
    return [e.outvars[0].aval.shape for e in eqns(jaxpr) if e.primitive.name == "empty"]


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.nothing_saveable],
                         ids=["no_remat", "remat"])
def test_a_weight_the_backward_reads_is_not_stacked_again(policy):
    # step's backward reads w (the carry's gradient is d @ w.T; under the policy, the step's
    # inputs are what it keeps): the only stack of w's shape is w's gradient.
    c, xs = inputs(0)
    f = step if policy is None else jax.checkpoint(step, policy=policy)
    shapes = allocations(f, c, xs)
    assert shapes.count(xs["w"].shape) == 1, shapes
