"""Mamba-1's selective scan (pallas_kernels.selective_scan): the recurrence oracle, the
chunked XLA form and the Pallas kernels in Pallas's interpreter, forward and gradients, on
odd lengths, packed documents and initial/final states. (Its state passing across devices
is tested through the layer, tests/test_layer_kinds.py, under cp=2.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.selective_scan import kernel_scan, reference, selective_scan, triton

B, L, D, N = 2, 19, 32, 8  # L odd: padded to every chunk


def inputs(dtype, seed=0):
    """Fresh random (x, dt (processed), A, B, C, D, initial_state) and a packed seq_idx."""
    r = np.random.default_rng(seed)
    arrays = (r.normal(size=(B, L, D)), np.log1p(np.exp(r.normal(size=(B, L, D)) - 1)),
              -np.exp(r.normal(size=(D, N))), r.normal(size=(B, L, N)),
              r.normal(size=(B, L, N)), r.normal(size=(D,)), r.normal(size=(B, D, N)))
    seq_idx = np.zeros((B, L), np.int32)
    seq_idx[0, 7:] = 1  # row 0: two documents; row 1: one (the initial state reaches its end)
    seq_idx[0, 15:] = 5
    return tuple(jnp.asarray(a, dtype) for a in arrays), jnp.asarray(seq_idx)


def loss(scan, x, dt, A, B, C, D, h0, seq_idx):
    """A scalar of y and the final state, weighted so that every output counts."""
    y, final = scan(x, dt, A, B, C, D=D, initial_state=h0, seq_idx=seq_idx)
    w = jnp.cos(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape)
    return jnp.sum(y * w) + jnp.sum(final * final)


def grads(scan, args, seq_idx):
    return jax.grad(loss, argnums=tuple(range(1, 8)))(scan, *args, seq_idx)


@pytest.fixture(scope="module")
def oracle64():
    """The recurrence in float64: outputs and gradients of every input."""
    with jax.enable_x64():
        args, seq_idx = inputs(jnp.float64)
        out = reference.selective_scan_naive(*args[:5], D=args[5], initial_state=args[6],
                                             seq_idx=seq_idx)
        g = grads(reference.selective_scan_naive, args, seq_idx)
        return jax.tree.map(np.asarray, (out, g))


def test_the_oracle_restarts_at_each_document():
    # A packed row scanned at once equals its documents scanned alone, the first entered by
    # the initial state, the later ones from zero.
    with jax.enable_x64():
        (x, dt, A, Bm, C, Dv, h0), seq_idx = inputs(jnp.float64)
        y, _ = reference.selective_scan_naive(x, dt, A, Bm, C, D=Dv, initial_state=h0,
                                              seq_idx=seq_idx)
        for lo, hi, h in ((0, 7, h0[:1]), (7, 15, None), (15, L, None)):
            alone, _ = reference.selective_scan_naive(
                x[:1, lo:hi], dt[:1, lo:hi], A, Bm[:1, lo:hi], C[:1, lo:hi], D=Dv,
                initial_state=h)
            np.testing.assert_allclose(y[:1, lo:hi], alone, rtol=1e-12, atol=1e-12)


def test_chunked_xla_form_equals_the_oracle_in_float64(oracle64):
    # Exact but for float64 rounding (1e-10): chunk 8 over 19 tokens pads the last chunk.
    with jax.enable_x64():
        args, seq_idx = inputs(jnp.float64)
        chunked = lambda *a, **k: reference.selective_scan_chunked(*a, chunk_size=8, **k)
        out = chunked(*args[:5], D=args[5], initial_state=args[6], seq_idx=seq_idx)
        g = grads(chunked, args, seq_idx)
    for got, want in zip(jax.tree.leaves((out, g)), jax.tree.leaves(oracle64)):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_pallas_kernels_match_the_oracle_forward_and_backward(oracle64):
    # float32 kernels in the interpreter against the float64 oracle: every output and every
    # gradient within 2e-5 of its largest entry (float32 sums over 19 tokens and 8 states).
    # Chunk 2: the backward's unrolled chunk stays small for the interpreter; 10 chunks
    # over the padded 20 tokens walk every chunk boundary.
    args, seq_idx = inputs(jnp.float32)
    scan = lambda *a, **k: kernel_scan(*a, config=triton.Config(chunk=2, block_d=16), **k)
    out = scan(*args[:5], D=args[5], initial_state=args[6], seq_idx=seq_idx)
    g = grads(scan, args, seq_idx)
    names = ["y", "final_state", "dx", "ddt", "dA", "dB", "dC", "dD", "dinitial_state"]
    for name, got, want in zip(names, jax.tree.leaves((out, g)), jax.tree.leaves(oracle64)):
        assert np.all(np.isfinite(got)), name
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max(),
                                   err_msg=name)


def test_bad_shapes_are_named():
    (x, dt, A, Bm, C, Dv, h0), _ = inputs(jnp.float32)
    with pytest.raises(ValueError, match=r"B must have shape \(2, 19, 8\)"):
        selective_scan(x, dt, A, Bm[:, :, :4], C)
    with pytest.raises(ValueError, match="A must be"):
        selective_scan(x, dt, A.T, Bm, C)
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got 0"):
        selective_scan(x, dt, A, Bm, C, chunk_size=0, implementation="xla")
