"""Mamba-1's selective scan (pallas_kernels.selective_scan): the recurrence oracle, the XLA
form (xla.py) and the Pallas kernels in Pallas's interpreter, forward and gradients, on odd
lengths, packed documents, initial/final states, bfloat16 inputs and the sequence split
over two devices (context parallelism) in float64. (The layer under cp=2 is
tests/test_layer_kinds.py's.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import PartitionSpec as P

from pallas_kernels.selective_scan import kernel_scan, reference, selective_scan, triton
from pallas_kernels.selective_scan.xla import selective_scan_xla

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
    w = jnp.cos(jnp.arange(y.size)).astype(y.dtype).reshape(y.shape)  # (bf16 counts badly)
    return jnp.sum(y * w) + jnp.sum(final * final)


def grads(scan, args, seq_idx):
    return jax.grad(loss, argnums=tuple(range(1, 8)))(scan, *args, seq_idx)


def outputs(scan, args, seq_idx, initial_state=True):
    """((y, final_state), the gradients of loss for every float input) in one jit; without
    initial_state the scan starts from zero (no dinitial_state)."""
    if not initial_state:
        scan = lambda *a, initial_state, scan=scan, **k: scan(*a, **k)

    @jax.jit
    def run(args, seq_idx):
        out = scan(*args[:5], D=args[5], initial_state=args[6], seq_idx=seq_idx)
        g = grads(scan, args, seq_idx)
        return out, g if initial_state else g[:6]
    return run(args, seq_idx)


@pytest.fixture(scope="module")
def oracle64():
    """The recurrence in float64: outputs and gradients of every input."""
    with jax.enable_x64():
        return jax.tree.map(np.asarray, outputs(reference.selective_scan_naive,
                                                *inputs(jnp.float64)))


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


def assert_all_close(got, want, tolerance):
    """Every output and gradient within tolerance times its largest entry; NaN fails."""
    names = ["y", "final_state", "dx", "ddt", "dA", "dB", "dC", "dD", "dinitial_state"]
    for name, g, w in zip(names, jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape and np.all(np.isfinite(g)), name
        np.testing.assert_allclose(g, w, rtol=0, atol=tolerance * np.abs(w).max(),
                                   err_msg=name)


def test_xla_form_equals_the_oracle_in_float64(oracle64):
    # Exact but for float64 rounding (1e-12 of the largest): 8 tokens a loop step over 19
    # pads the last step; documents restart inside steps (7, 15) and the initial state
    # enters row 1's one document.
    with jax.enable_x64():
        got = outputs(lambda *a, **k: selective_scan_xla(*a, chunk_size=8, **k),
                      *inputs(jnp.float64))
    assert_all_close(got, oracle64, 1e-12)


def test_xla_form_without_documents_or_initial_state_equals_the_oracle_in_float64():
    # The path without document restarts; 4 tokens a step: five steps, the last padded.
    with jax.enable_x64():
        args, _ = inputs(jnp.float64, seed=1)
        results = [outputs(scan, args, None, initial_state=False)
                   for scan in (reference.selective_scan_naive,
                                lambda *a, **k: selective_scan_xla(*a, chunk_size=4, **k))]
    assert_all_close(*results, 1e-12)


def test_xla_form_takes_bfloat16_inputs():
    # bf16 x, B, C (the layer's bf16 compute) against the float64 oracle on the same
    # rounded inputs: y and dx, dB, dC come back in bf16 (one rounding each, 2^-8 relative
    # to the largest, and float32 sums), the rest float32 within 1e-5.
    args, seq_idx = inputs(jnp.float32)
    half = lambda a: a.astype(jnp.bfloat16)
    args = (half(args[0]), *args[1:3], half(args[3]), half(args[4]), *args[5:])
    out, g = outputs(lambda *a, **k: selective_scan_xla(*a, chunk_size=8, **k), args, seq_idx)
    assert [a.dtype for a in (*out, *g)] == [jnp.bfloat16, jnp.float32, jnp.bfloat16,
                                              jnp.float32, jnp.float32, jnp.bfloat16,
                                              jnp.bfloat16, jnp.float32, jnp.float32]
    with jax.enable_x64():
        wide = tuple(jnp.asarray(np.asarray(a, np.float64)) for a in args)
        want_out, want_g = outputs(reference.selective_scan_naive, wide, seq_idx)
    assert_all_close(out, want_out, 2.0 ** -8)
    # loss's cotangent of y is y's own dtype: bf16 rounds dy, so gradients within 2^-7
    assert_all_close((out, g), (want_out, want_g), 2.0 ** -7)


def test_xla_form_split_over_two_devices_equals_the_oracle_in_float64():
    # Context parallelism: the first 18 tokens split in two parts of 9 over a cp mesh (4
    # tokens a step: each part padded to 12), each part's final state passed to the next;
    # row 0's second document starts in part 0 and runs into part 1 (7..15), its third
    # starts in part 1; the initial state enters part 0. Values and every gradient, through
    # the fold and the all-gather, against the oracle on the whole 18: within 1e-6 of the
    # largest, float32 rounding, as the fold is float32 (ssd.context_parallel's
    # entering_states), the scans float64.
    l = 18
    mesh = jax.make_mesh((2,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    seq = P(None, "cp")

    def part(x, dt, A, B, C, D, h0, seq_idx):
        y, final = selective_scan(x, dt, A, B, C, D=D, initial_state=h0, seq_idx=seq_idx,
                                  return_final_state=True, sequence_axis="cp",
                                  implementation="xla", chunk_size=4)
        return y, final[None]
    split = jax.shard_map(part, mesh=mesh, in_specs=(seq, seq, P(), seq, seq, P(), P(), seq),
                          out_specs=(seq, P("cp")), check_vma=False)

    def split_scan(x, dt, A, B, C, *, D, initial_state, seq_idx):
        y, finals = split(x, dt, A, B, C, D, initial_state, seq_idx)
        return y, finals[-1]  # the state after the last part's last token

    with jax.enable_x64():
        args, seq_idx = inputs(jnp.float64)
        args = tuple(a[:, :l] if a.ndim == 3 and a.shape[1] == L else a for a in args)
        seq_idx = seq_idx[:, :l]
        results = [outputs(scan, args, seq_idx)
                   for scan in (reference.selective_scan_naive, split_scan)]
    assert_all_close(*results, 1e-6)


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
