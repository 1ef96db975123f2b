"""The conv kernels (pallas_kernels.conv, triton.py) compute the causal depthwise conv and
SiLU: values and every gradient (x, weight, bias) against the reference's float64 run on the
same dtype-rounded inputs.

The kernels run in Pallas's interpreter on CPU, with their default tiles and with short runs
and narrow channel blocks (so that rows cross from one program's run to the next and
channels span several blocks), several rows a loop step. Cases: odd lengths and channel
counts that no tile divides, packed documents, a conv input that holds the rows before the
first output (`length`, as under context parallelism or a continued sequence), a conv input
without them (zeros), no bias, 3 taps, the output written as parts (Mamba2's x, B, C:
`parts`, the gradient read from the parts' cotangents). Errors are the largest difference
over the largest value: float32 inputs below 1e-5 (seen ~3e-7); bfloat16 inputs below 1e-2
(the kernels round y and dx to bf16 once; seen ~2e-5). NaN fails every comparison.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.conv as conv
from pallas_kernels import fallback, hardware
from pallas_kernels.conv import triton

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}

CASES = {  # name: (b, rows, channels, k, length, documents, bias, parts)
    "odd_length_and_channels": (2, 53, (3, 8), 4, 53, False, True, None),
    "documents_rows_before": (2, 70, (40,), 4, 67, True, True, None),
    "documents_no_rows_before": (1, 97, (2, 72), 4, 97, True, True, None),
    "three_taps_no_bias": (2, 37, (24,), 3, 37, False, False, None),
    "parts_documents_rows_before": (2, 70, (96,), 4, 67, True, True, (64, 16, 16)),
    "parts_no_bias": (1, 45, (160,), 4, 45, False, False, (96, 32, 32)),
}
# 4 rows a step over runs of 16: the backward's walk of run + 3 rows ends in a step of which
# one row is the next run's (at the defaults, 8 a step over 128, five rows are)
CONFIGS = {"default": triton.Config(),
           "short_runs": triton.Config(run=16, block_e=16, step_rows=4)}


def inputs(b, rows, channels, k, length, documents, bias, parts, dtype, seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(keys[0], (b, rows, *channels)).astype(dtype)
    w = jax.random.normal(keys[1], (k, *channels)) * 0.5
    bb = jax.random.normal(keys[2], channels) * 0.5 if bias else None
    doc = None
    if documents:  # about one document start in 12 tokens, at least one in each row
        starts = jax.random.uniform(keys[3], (b, rows)) < 1 / 12
        doc = jnp.cumsum(starts.at[:, rows // 2].set(True), axis=1).astype(jnp.int32)
    dy = jax.random.normal(keys[4], (b, length, *channels)).astype(dtype)
    if parts is not None:  # the cotangent of each part
        dy = tuple(jnp.split(dy, np.cumsum(parts)[:-1], axis=-1))
    return x, w, bb, doc, dy


def values_and_gradients(implementation, x, w, bb, doc, dy, length, parts, config=None):
    """The conv's last `length` outputs (parts: a tuple of its parts) and the gradients of
    <y, dy> for x, w and bb: through the dispatch ("xla"), or the kernels with `config`
    ("triton", channels flattened)."""
    def f(x, w, bb):
        if implementation == "xla":
            return conv.causal_conv1d(x, w, bb, doc, length=length, parts=parts,
                                      implementation="xla")
        b, rows, k = x.shape[0], x.shape[1], w.shape[0]
        flat = lambda a, *lead: None if a is None else a.reshape(*lead, -1)
        y = triton.conv1d(flat(x, b, rows), flat(w, k), flat(bb), doc, length,
                          parts or (flat(x, b, rows).shape[-1],), config, True)
        return y if parts else y[0].reshape(b, length, *x.shape[2:])
    @jax.jit  # one compile, not one an operation
    def run(x, w, bb, dy):
        y, vjp = jax.vjp(f, x, w, bb)
        return (y,) + vjp(dy)
    return run(x, w, bb, dy)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_kernels_match_the_float64_reference(case, dtype):
    # Each of CONFIGS on the same inputs against one float64 run of the reference.
    b, rows, channels, k, length, documents, bias, parts = CASES[case]
    seed = np.random.SeedSequence().entropy % 2**31  # fresh inputs each run
    x, w, bb, doc, dy = inputs(b, rows, channels, k, length, documents, bias, parts, dtype,
                               seed)
    with jax.enable_x64(True):
        up = lambda a: None if a is None else jax.tree.map(
            lambda t: jnp.asarray(t, jnp.float64), a)
        reference = values_and_gradients("xla", up(x), up(w), up(bb), doc, up(dy), length,
                                         parts)
    for config in CONFIGS:
        ours = values_and_gradients("triton", x, w, bb, doc, dy, length, parts,
                                    CONFIGS[config])
        for name, o, r in zip(("y", "dx", "dweight", "dbias"), ours, reference):
            if r is None:
                assert o is None
                continue
            if name == "y" and parts is not None:  # each part its own array, of its size
                assert [a.shape[-1] for a in o] == list(parts)
                o, r = jnp.concatenate(o, -1), jnp.concatenate(r, -1)
            o, r = np.asarray(o, np.float64), np.asarray(r, np.float64)
            assert o.shape == r.shape, (config, name)
            error = np.abs(o - r).max() / np.abs(r).max()
            assert error < TOLERANCE[dtype], f"{config} {name}: {error:.2e} (seed {seed})"


def test_rows_before_the_first_as_an_operand_of_their_own():
    """`before` (the previous device's or a continued window's last inputs, not copied in
    front of x): the outputs and every gradient, dbefore too, of the conv over x with them in
    front, float32, a document starting inside them and one after them; short runs, so that
    only the first run's walk writes dbefore (the default tiles: tests/test_mamba2_mixer.py)."""
    config = "short_runs"
    b, rows, k, parts = 2, 45, 4, (64, 16, 16)
    seed = np.random.SeedSequence().entropy % 2**31
    x, w, bb, _, dy = inputs(b, rows, (96,), k, rows - (k - 1), False, True, parts,
                             jnp.float32, seed)
    doc = jnp.zeros((b, rows), jnp.int32).at[:, 1:].add(1).at[1, 9:].add(1)

    @jax.jit  # the kernels: the forward, and the backward with dbefore from its walk
    def kernels(before, x, w, bb, dy):
        options = dict(config=CONFIGS[config], interpret=True, before=before)
        y = triton.forward(x, w, bb, doc, x.shape[1], parts, **options)
        dx, dw, dbias, dbefore = triton.backward(x, w, bb, doc, dy, **options)
        return y, dbefore, dx, dw, dbias
    ours = kernels(x[:, :k - 1], x[:, k - 1:], w, bb, dy)
    with jax.enable_x64(True):
        up = lambda a: jax.tree.map(lambda t: jnp.asarray(t, jnp.float64), a)
        reference = values_and_gradients("xla", up(x), up(w), up(bb), doc, up(dy),
                                         rows - (k - 1), parts)
    want = (jnp.concatenate(reference[0], -1), reference[1][:, :k - 1],
            reference[1][:, k - 1:], *reference[2:])
    for name, o, r in zip(("y", "dbefore", "dx", "dweight", "dbias"),
                          (jnp.concatenate(ours[0], -1), *ours[1:]), want):
        o, r = np.asarray(o, np.float64), np.asarray(r, np.float64)
        assert o.shape == r.shape, name
        error = np.abs(o - r).max() / np.abs(r).max()
        assert error < TOLERANCE[jnp.float32], f"{name}: {error:.2e} (seed {seed})"


def test_a_step_of_rows_must_divide_the_run():
    with pytest.raises(ValueError, match="step_rows 3 must divide run 64"):
        triton.Config(run=64, step_rows=3)


def test_documents_cut_the_taps():
    """A token right after a document start reads no earlier token: changing the previous
    document's last input leaves it alone, and moves the next token of that document."""
    x, w, bb, _, _ = inputs(1, 32, (16,), 4, 32, False, True, None, jnp.float32, 0)
    doc = jnp.zeros((1, 32), jnp.int32).at[:, 20:].set(1)
    run = lambda x: conv.causal_conv1d(x, w, bb, doc, implementation="triton")
    moved = run(x.at[:, 19].add(1.0)) - run(x)
    assert np.abs(moved[:, 20:]).max() == 0
    assert np.abs(moved[:, 19]).min() > 0


def test_auto_uses_xla_without_a_gpu_and_logs_a_centred_conv_on_hopper(monkeypatch, caplog):
    x = jnp.zeros((1, 32, 16))
    w = jnp.zeros((4, 16))
    assert hardware.compute_capability() is None
    assert not conv.kernels_run(x, w, 3, 32)
    monkeypatch.setattr(hardware, "compute_capability", lambda: 9.0)
    assert conv.kernels_run(x, w, 3, 32)
    monkeypatch.setattr(fallback, "_said", set())
    with caplog.at_level("WARNING", logger=fallback.logger.name):
        assert not conv.kernels_run(x, w, 1, 32)
    assert "causal_conv1d: the XLA path, not the kernels: left 1 of 4 taps" in caplog.text


def test_the_kernels_refuse_a_centred_conv():
    with pytest.raises(ValueError, match="left=1"):
        conv.causal_conv1d(jnp.zeros((1, 32, 16)), jnp.zeros((4, 16)), left=1,
                           implementation="triton")


def test_parts_that_no_power_of_two_of_16_divides_take_xla(monkeypatch):
    x, w = jnp.zeros((1, 32, 72)), jnp.zeros((4, 72))
    monkeypatch.setattr(hardware, "compute_capability", lambda: 9.0)
    assert conv.kernels_run(x, w, 3, 32, (48, 16, 8)) is False
    assert conv.kernels_run(x, w, 3, 32, (40, 16, 16)) is False
    assert conv.kernels_run(jnp.zeros((1, 32, 96)), jnp.zeros((4, 96)), 3, 32, (64, 16, 16))
    with pytest.raises(ValueError, match="do not sum"):
        conv.causal_conv1d(x, w, parts=(64, 16))


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_inputs_of_other_shapes_than_x_asks_are_named(implementation):
    # A length past the rows gave 7 outputs from XLA and 20 from the kernels; the others
    # failed inside, a broadcast or a reshape
    x = jnp.zeros((2, 13, 32))
    for kwargs, match in [(dict(length=20), r"length=20 outputs of x's 13 rows; give 1 to 13"),
                          (dict(weight=jnp.zeros((4, 16))), r"weight has shape \(4, 16\); x "
                                                            r"\(2, 13, 32\) needs \(4, 32\)"),
                          (dict(bias=jnp.zeros(16)), r"bias has shape \(16,\)"),
                          (dict(doc=jnp.zeros((2, 5), jnp.int32)), r"doc has shape \(2, 5\)")]:
        with pytest.raises(ValueError, match=match):
            conv.causal_conv1d(x, **{"weight": jnp.zeros((4, 32)), **kwargs},
                               implementation=implementation)
