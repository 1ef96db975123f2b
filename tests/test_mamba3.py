"""Mamba-3: the scan's chunked XLA form equals the token-by-token oracle (values, final
states, gradients, and the state passed between parts of a row as context parallelism
passes it), its Pallas kernels equal the oracle (and the per-head copies their backward
reads round their gradients once), the decoding step kernel equals the XLA step, and the
model equals mamba_ssm's Mamba3 (its torch references' outputs,
tests/fixtures/make_mamba3_fixtures.py) for the mixer, the LM and greedy decoding; its
mamba_ssm checkpoints round-trip. The shared cases (mesh equality, decoding steps against
the forward, int8 states, checkpoint tables) run in tests/test_layer_kinds.py, on MIMO."""

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import mamba_jax
from mamba_jax import Mamba2Config
from mamba_jax.convert import load_config
from pallas_kernels.mamba3 import Mamba3State, mamba3_scan
from pallas_kernels.mamba3.context_parallel import entering_states, zero_state_finals
from pallas_kernels.mamba3.reference import cumulative_angles, mamba3_chunked, mamba3_naive
from seeds import fresh_rng

FIXTURES = Path(__file__).parent / "fixtures"
ARGS = ("C", "B", "x", "adt", "dt", "trap", "angles", "C_bias", "B_bias")
naive = jax.jit(mamba3_naive, static_argnames="rotary")
chunked = jax.jit(mamba3_chunked, static_argnames=("rotary", "chunk_size"))


def make_inputs(seed, b, l, h, p, r, g, n, a, dtype, docs=True, state=True):
    """The scan's inputs: dt after softplus, adt = A dt with A in [-3, -0.5], documents
    starting at random, on a chunk edge (8) and inside one (13); a random initial state."""
    rng = np.random.default_rng(seed)
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    dt = jax.nn.softplus(arr(b, l, h) - 1.0)
    kw = dict(C=arr(b, l, r, g, n), B=arr(b, l, r, g, n), x=arr(b, l, h, p),
              adt=-dt * jnp.asarray(rng.uniform(0.5, 3, (b, l, h)), dtype), dt=dt,
              trap=arr(b, l, h), angles=arr(b, l, a), C_bias=arr(h, r, n), B_bias=arr(h, r, n),
              D=arr(h), mimo_x=arr(h, r, p) if r > 1 else None,
              rotary="halves" if r > 1 else "pairwise")
    if docs:
        starts = rng.random((b, l)) < 0.1
        starts[:, [i for i in (8, 13) if i < l]] = True
        kw["seq_idx"] = jnp.asarray(np.cumsum(starts, axis=1))
    if state:
        kw["initial_state"] = Mamba3State(jnp.asarray(rng.uniform(0, 6, (b, h, a)), dtype),
                                          arr(b, h, p, n), arr(b, r, h, n), arr(b, h, p))
    return kw


CASES = [  # (b, l, h, p, r, g, n, a, docs, state)
    (2, 37, 4, 8, 1, 1, 16, 8, False, False),  # SISO, odd length, rope over all of n, from 0
    (1, 29, 4, 4, 2, 2, 8, 2, True, True),     # MIMO rank 2 over 2 groups, rope over half of
]                                              # n, packed documents, an initial state


@pytest.mark.parametrize("case", CASES)
def test_chunked_equals_the_recurrence_in_float64(case):
    # Chunks of 8 (the angles are summed in blocks of 8 too, so their carry is exercised).
    with jax.enable_x64(True):
        kw = make_inputs(0, *case[:8], jnp.float64, *case[8:])
        y_ref, s_ref = naive(**kw)
        y, s = jax.jit(mamba3_scan, static_argnames=("rotary", "chunk_size"))(**kw, chunk_size=8)
        assert y.dtype == jnp.float64 and y.shape == y_ref.shape
        # float64: only rounding separates the two orders of summation.
        np.testing.assert_allclose(y, y_ref, rtol=1e-10, atol=1e-10)
        for name, got, want in zip(Mamba3State._fields, s, s_ref):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10, err_msg=name)


def test_chunked_gradients_equal_the_recurrence_gradients():
    # Every input's gradient (angles, trap, biases, mimo_x and the initial state included),
    # through y and the final state, float32: within float32 sums in another order.
    kw = make_inputs(1, *CASES[1][:-2], jnp.float32)
    seq_idx, rotary = kw.pop("seq_idx"), kw.pop("rotary")
    rng = np.random.default_rng(2)
    y_cot = jnp.asarray(rng.standard_normal((1, 29, 2, 4, 4)), jnp.float32)

    def loss(scan, kw):
        y, s = scan(**kw, rotary=rotary, seq_idx=seq_idx)
        return jnp.sum(y * y_cot) + jnp.sum(s.ssm ** 2) + jnp.sum(s.k) + jnp.sum(jnp.sin(s.angle))
    ref = jax.jit(jax.grad(lambda kw: loss(mamba3_naive, kw)))(kw)
    got = jax.jit(jax.grad(lambda kw: loss(lambda **a: mamba3_chunked(**a, chunk_size=8),
                                           kw)))(kw)
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        want = dict(jax.tree_util.tree_leaves_with_path(ref))[path]
        assert np.all(np.isfinite(want))
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4,
                                   err_msg=jax.tree_util.keystr(path))


def test_one_document_rows_take_the_angles_gradient_without_a_scatter():
    # Without seq_idx the angle sums look up no document start: a gather with constant
    # indices there made the backward a scatter that XLA folded at compile time (minutes at
    # 8 x 2048). The angles' gradient still equals the recurrence's (float64).
    with jax.enable_x64(True):
        kw = make_inputs(3, *CASES[0][:-2], jnp.float64, docs=False, state=False)
        rotary = kw.pop("rotary")
        y_cot = jnp.asarray(np.random.default_rng(4).standard_normal((2, 37, 1, 4, 8)))

        def grad(scan):
            return jax.grad(lambda angles: jnp.sum(
                scan(**dict(kw, angles=angles), rotary=rotary)[0] * y_cot))
        chunked_grad = grad(lambda **a: mamba3_chunked(**a, chunk_size=8))
        assert "scatter" not in str(jax.make_jaxpr(chunked_grad)(kw["angles"]))
        got = jax.jit(chunked_grad)(kw["angles"])
        want = jax.jit(grad(mamba3_naive))(kw["angles"])
    assert want.dtype == jnp.float64 and np.all(np.isfinite(want))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("packed", [False, True])
def test_the_angle_state_stays_exact_over_long_rows(packed):
    # 16384 tokens in float32 (increments up to 0.3 rad, pi tanh(angle) dt at dt <= 0.1),
    # one document a row or documents starting at random tokens, an initial angle: each
    # token's angle against the float64 sum from its document's start (from the initial
    # angle in the first), mod 2 pi. Blocks of 64 composed in a log-depth scan, each partial
    # sum wrapped: within 2e-4 rad, where a float32 sum over the row was off by 1e-2.
    rng = fresh_rng()
    b, l, h, a = 2, 16384, 2, 3
    inc = rng.uniform(0, 0.3, (b, l, h, a)).astype(np.float32)
    starts = rng.random((b, l)) < (1e-3 if packed else 0.0)
    initial = rng.uniform(0, 2 * np.pi, (b, h, a)).astype(np.float32)
    theta = np.asarray(jax.jit(cumulative_angles)(jnp.asarray(inc), jnp.asarray(starts)
                                                  if packed else None, jnp.asarray(initial)))
    expected = np.empty(inc.shape)
    for row in range(b):
        doc = np.cumsum(starts[row])
        for d in np.unique(doc):
            at = doc == d
            expected[row, at] = np.cumsum(inc[row, at].astype(np.float64), axis=0) + (
                initial[row] if d == 0 else 0.0)
    diff = np.angle(np.exp(1j * (theta - expected)))  # the difference mod 2 pi
    assert np.all((theta >= 0) & (theta < 2 * np.pi))
    assert np.abs(diff).max() < 2e-4


@pytest.mark.parametrize("b, l, h, a, block, docs, state", [
    (2, 150, 3, 3, 16, True, True),     # odd length over several blocks, angles padded to 16
    (1, 96, 2, 32, 32, False, False),   # whole blocks, mamba3-1.3b's 32 angles, from zero
    (2, 37, 2, 16, 64, True, False),    # one padded block
])
def test_the_angle_kernel_equals_the_angle_sums_in_float64(b, l, h, a, block, docs, state):
    # angles.angle_sums (in the interpreter without a GPU) against cumulative_angles of
    # angle_increments in float64 and its automatic gradient, on documents starting at
    # random and at a block's first token (16), from an initial angle or zero: each angle
    # within 2e-5 rad mod 2 pi and in [0, 2 pi), the gradients of the angles, dt and the
    # initial angle within 1e-5 of the largest.
    from pallas_kernels.mamba3.angles import angle_sums
    from pallas_kernels.mamba3.reference import angle_increments
    rng = fresh_rng()
    angles = jnp.asarray(rng.standard_normal((b, l, a)), jnp.float32)
    dt = jnp.asarray(rng.uniform(0, 2, (b, l, h)), jnp.float32)
    starts = rng.random((b, l)) < 0.1
    starts[:, [16, l - 1]], starts[:, 0] = True, False
    starts = jnp.asarray(starts) if docs else None
    initial = jnp.asarray(rng.uniform(0, 2 * np.pi, (b, h, a)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((b, l, h, a)), jnp.float32)

    def ref(angles, dt, initial):
        return cumulative_angles(angle_increments(angles, dt), starts, initial, 16)

    def kernel(angles, dt, initial):
        return angle_sums(angles, dt, starts, initial, block=block)
    args = (angles, dt) + ((initial,) if state else ())
    loss = lambda sums: lambda *a: jnp.sum(sums(*a[:2], a[2] if state else None) * cot)
    wide = [x.astype(jnp.float64) for x in args]
    with jax.enable_x64(True):
        want = np.asarray(jax.jit(ref)(*wide[:2], wide[2] if state else None))
        want_grads = jax.jit(jax.grad(loss(ref), argnums=tuple(range(len(args)))))(*wide)
        want_grads = [np.asarray(g) for g in want_grads]
    got = np.asarray(jax.jit(kernel)(*args[:2], initial if state else None))
    assert np.all((got >= 0) & (got < 2 * np.pi))
    assert np.abs(np.angle(np.exp(1j * (got - want)))).max() < 2e-5
    got_grads = jax.jit(jax.grad(loss(kernel), argnums=tuple(range(len(args)))))(*args)
    for name, g, w in zip(("angles", "dt", "initial"), got_grads, want_grads):
        assert np.all(np.isfinite(g)), name
        assert relative(np.asarray(g, np.float64), w) < 1e-5, name


def test_the_angle_kernel_takes_rows_with_two_waves_of_programs():
    # Each of angle_sums' programs walks one (row, head) through the row: it is taken where
    # there are two waves of them on an H200's 132 multiprocessors (the CPU's stand-in), so
    # mamba3-1.3b's 64 heads take it from 5 rows on and a single long row keeps XLA's sums.
    from pallas_kernels.mamba3.angles import takes
    assert [takes(b, 64) for b in (1, 4, 5, 8)] == [False, False, True, True]


def test_parts_entered_by_the_passed_state_scan_the_whole_row():
    # Context parallelism's fold (context_parallel.py), the parts of a row side by side as
    # devices hold them: 3 parts of 12 tokens, documents starting inside and on their edges
    # (12, 24), the angle, SSM state and the trapezoid's k and x crossing every edge.
    b, _, *shape, docs, state = CASES[1]  # MIMO, packed documents, an initial state
    with jax.enable_x64(True):
        kw = make_inputs(3, b, 36, *shape, jnp.float64, docs, state)
        if docs:
            starts = np.diff(np.asarray(kw["seq_idx"]), prepend=0, axis=1) > 0
            starts[0, 24] = True
            kw["seq_idx"] = jnp.asarray(np.cumsum(starts, axis=1))
        y_ref, s_ref = naive(**kw)
        init, seq_idx = kw.pop("initial_state"), kw.pop("seq_idx")
        D, mimo_x, rotary = kw.pop("D"), kw.pop("mimo_x"), kw.pop("rotary")
        parts = [{k: (v[:, 12 * i:12 * (i + 1)] if k in ARGS[:7] else v) for k, v in kw.items()}
                 for i in range(3)]
        docs = [seq_idx[:, 12 * i:12 * (i + 1)] for i in range(3)]

        @jax.jit
        def scan_parts(parts, docs, init, D, mimo_x):
            finals = [zero_state_finals(**part, mimo_x=mimo_x, rotary=rotary, seq_idx=d)
                      for part, d in zip(parts, docs)]
            entering = entering_states(*jax.tree.map(lambda *t: jnp.stack(t), *finals), init,
                                       mimo_x, rotary)
            return [mamba3_scan(**part, chunk_size=8, D=D, mimo_x=mimo_x, rotary=rotary,
                                seq_idx=d, initial_state=Mamba3State(*(e[i] for e in entering)))
                    for i, (part, d) in enumerate(zip(parts, docs))]
        outs = scan_parts(parts, docs, init, D, mimo_x)
        ys, s = [y for y, _ in outs], outs[-1][1]
        np.testing.assert_allclose(jnp.concatenate(ys, axis=1), y_ref, rtol=1e-10, atol=1e-10)
        for name, got, want in zip(Mamba3State._fields, s, s_ref):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10, err_msg=name)


# ------------------------------------------------------------------ against mamba_ssm

CHECKPOINTS = ["mamba_ssm_mamba3_siso", "mamba_ssm_mamba3_mimo"]


@pytest.fixture(scope="module", params=CHECKPOINTS)
def checkpoint(request):
    return request.param, mamba_jax.from_pretrained(FIXTURES / request.param)


def relative(got, want):
    return np.abs(np.asarray(got) - want).max() / np.abs(want).max()


def test_mixer_lm_and_greedy_tokens_match_mamba_ssm(checkpoint):
    # float32 against mamba_ssm's float32 torch references: 1e-4 of the largest value.
    case, model = checkpoint
    assert model.config.layers == {"mamba_ssm_mamba3_siso": "33",
                                   "mamba_ssm_mamba3_mimo": "3-3-"}[case]
    mixer_in, mixer_out = (np.load(FIXTURES / case / f"mixer_{io}.npy") for io in ("in", "out"))
    out, _ = nnx.jit(lambda mixer, u: mixer(u))(model.layers[0].mixer, jnp.asarray(mixer_in))
    assert relative(out, mixer_out) < 1e-4
    ids, logits = (np.load(FIXTURES / case / f"{name}.npy") for name in ("input_ids", "logits"))
    ours = nnx.jit(lambda model, ids: model(ids))(model, jnp.asarray(ids))
    assert relative(np.asarray(ours)[..., :logits.shape[-1]], logits) < 1e-4
    # The prefill, then the compiled decode loop of one-token steps.
    greedy = np.load(FIXTURES / case / "greedy.npy")  # 10 prompt tokens + 12 new
    tokens = mamba_jax.generate(model, jnp.asarray(greedy[:, :10]), max_new_tokens=12)
    np.testing.assert_array_equal(np.asarray(tokens), greedy)


def test_mamba_ssm_checkpoints_round_trip_their_tensors_and_config(tmp_path, checkpoint):
    case, model = checkpoint
    mamba_jax.save_pretrained(model, tmp_path, format="mamba_ssm")
    cfg, fmt = load_config(tmp_path)
    assert fmt == "mamba_ssm" and cfg == model.config
    ours, theirs = (load_file(d / "model.safetensors") for d in (tmp_path, FIXTURES / case))
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    # mamba_ssm's Mamba3 accepts dropout=0.0 (and uses none): so does its config here
    written = json.loads((tmp_path / "config.json").read_text())
    for dropout, refused in ((0.0, False), (0.1, True)):
        written["ssm_cfg"]["dropout"] = dropout
        (tmp_path / "config.json").write_text(json.dumps(written))
        if refused:
            with pytest.raises(ValueError, match=r"ssm_cfg.dropout must be 0.0"):
                load_config(tmp_path)
        else:
            assert load_config(tmp_path)[0] == model.config


def test_a_bad_mamba3_section_is_named():
    with pytest.raises(ValueError, match=r"mamba3.rope_fraction=0.25.*0.5 or 1.0"):
        Mamba2Config.preset("mamba3-tiny", **{"mamba3.rope_fraction": 0.25})
    with pytest.raises(ValueError, match=r"mix Mamba kinds \['3', 'M'\]"):
        mamba_jax.formats.mamba_ssm_blocks(
            Mamba2Config.preset("mamba3-tiny", layer_pattern="3M"))


KERNEL_CASES = [  # (b, l, h, p, r, g, n, a, docs, state): each over several kernel chunks
    (1, 70, 4, 4, 2, 2, 8, 2, True, True),     # MIMO rank 2, "halves", rope over half of n
    (2, 150, 4, 8, 1, 2, 16, 4, True, True),   # SISO, "pairwise", rope over half of n
    (1, 100, 2, 8, 1, 1, 16, 8, False, False),  # SISO, rope over all of n, from zero
]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernels_values_states_and_every_gradient_match_the_recurrence(case, monkeypatch):
    # The SSD's Pallas kernels (in the interpreter without a GPU), turning each head's B and
    # C by its angles as they load them, with the work around them (kernels.py) and the
    # angle state summed by its kernel (angles.py) or by XLA, the per-chunk states
    # recomputed in the backward (the default) or kept from the forward, over odd lengths
    # of several kernel chunks (64 positions), packed documents, from an initial state:
    # values and final states within 1e-5 of the largest, and every input's gradient (the
    # angles', trap's, the biases', mimo_x's and the initial state's included) within
    # float32 sums in another order. Both options against one run of the recurrence.
    from pallas_kernels.mamba3 import kernels
    from pallas_kernels.ssd import triton
    kw = make_inputs(4, *case[:8], jnp.float32, *case[8:])
    seq_idx, rotary = kw.pop("seq_idx", None), kw.pop("rotary")
    y_cot = jnp.asarray(np.random.default_rng(5).standard_normal(
        kw["x"].shape[:2] + (case[4],) + kw["x"].shape[2:]), jnp.float32)

    def loss(scan, kw):
        y, s = scan(**kw, rotary=rotary, seq_idx=seq_idx)
        return (jnp.sum(y * y_cot) + jnp.sum(s.ssm ** 2) + jnp.sum(s.k)
                + jnp.sum(jnp.sin(s.angle))), (y, s)
    scan = lambda **a: mamba3_scan(**a, chunk_size=8, implementation="triton")
    (_, (y_ref, s_ref)), ref = jax.jit(jax.value_and_grad(
        lambda kw: loss(mamba3_naive, kw), has_aux=True))(kw)
    ref = dict(jax.tree_util.tree_leaves_with_path(ref))
    for angle_kernel in (True, False):  # states recomputed with the angle kernel, else kept
        monkeypatch.setattr(kernels, "angles_take", lambda b, h: angle_kernel)
        monkeypatch.setattr(kernels, "CONFIG", triton.Config(keep_states=not angle_kernel))
        (_, (y, s)), got = jax.jit(jax.value_and_grad(lambda kw: loss(scan, kw),
                                                      has_aux=True))(kw)
        assert relative(y, y_ref) < 1e-5, angle_kernel
        for name, a, b in zip(Mamba3State._fields, s, s_ref):
            assert relative(a, b) < 1e-5, (angle_kernel, name)
        for path, g in jax.tree_util.tree_leaves_with_path(got):
            assert np.all(np.isfinite(ref[path]))
            np.testing.assert_allclose(g, ref[path], rtol=1e-4, atol=1e-4,
                                       err_msg=f"{angle_kernel}: {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("case", [KERNEL_CASES[1], KERNEL_CASES[0]], ids=["siso", "mimo"])
def test_a_row_in_parts_equals_it_whole(case, monkeypatch):
    # The kernels scanning each row as 4 parts at once (kernels.mamba3_kernels' segments,
    # joined in the turned values: ssd.vjp's weighted_state with a rotation), against the
    # row whole, over 96 tokens with documents starting at random, inside a part and
    # exactly at two parts' boundaries (24, 48), from an initial state, with the backward's
    # kernels turning B and C and with them reading per-head copies (each against the whole
    # row's copies, which test_backward_turning_gives_the_turned_copies_gradients checks
    # against the turning): values, final states and every gradient within float32 sums in
    # another order.
    from pallas_kernels.mamba3.kernels import mamba3_kernels
    from pallas_kernels.ssd import triton
    b, _, *shape, docs, state = case
    kw = make_inputs(6, b, 96, *shape, jnp.float32, docs, state)
    starts = np.diff(np.asarray(kw["seq_idx"]), prepend=0, axis=1) > 0
    starts[:, [24, 48]] = True
    kw["seq_idx"] = jnp.asarray(np.cumsum(starts, axis=1))
    y_cot = jnp.asarray(np.random.default_rng(7).standard_normal(
        kw["x"].shape[:2] + (case[4],) + kw["x"].shape[2:]), jnp.float32)

    def run(segments, turns):
        monkeypatch.setattr(triton.Config, "turns_in_backward", lambda self, b, h: turns)

        def loss(kw):
            y, s = mamba3_kernels(**kw, segments=segments)
            return (jnp.sum(y * y_cot) + jnp.sum(s.ssm ** 2) + jnp.sum(s.k)
                    + jnp.sum(jnp.sin(s.angle))), (y, s)
        differentiable = {k: v for k, v in kw.items() if k not in ("seq_idx", "rotary")}
        fixed = {k: kw[k] for k in ("seq_idx", "rotary")}
        return jax.jit(jax.value_and_grad(lambda d: loss({**d, **fixed}), has_aux=True))(
            differentiable)
    (_, (y_ref, s_ref)), ref = run(1, False)
    ref = dict(jax.tree_util.tree_leaves_with_path(ref))
    for turns in (True, False):
        (_, (y, s)), got = run(4, turns)
        assert relative(y, y_ref) < 1e-5, turns
        for name, a, b in zip(Mamba3State._fields, s, s_ref):
            assert relative(a, b) < 1e-5, (turns, name)
        for path, g in jax.tree_util.tree_leaves_with_path(got):
            assert np.all(np.isfinite(ref[path])), jax.tree_util.keystr(path)
            assert relative(g, ref[path]) < 1e-5, (turns, jax.tree_util.keystr(path))


@pytest.mark.parametrize("token", [1, 2], ids=["positions", "tokens"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_backward_turning_gives_the_turned_copies_gradients(dtype, token):
    # The SSD's backward with a rotation (Mamba-3's), the kernels turning the group's B and
    # C as they load them and a kernel turning their gradients back (triton.turned_back,
    # over two programs' rows of 16), against the kernels reading XLA's per-head turned
    # copies and XLA's vjp of that turn (which the kernel test above checks against the
    # recurrence: the CPU's default at these few heads), on fresh inputs over three kernel
    # chunks of 16 with packed documents, an initial state, D, rank-2 biases, 2 heads a
    # group and 2 groups, the angles one a position or one a token of 2 (MIMO's, with
    # `rank` 2: each read for both positions, its gradient their sum; documents start at
    # tokens): every input's gradient within 1e-5 of its largest in float32 and within 1e-2
    # in bf16 (seen at most 2e-7 in either: float32 turns and sums in another order; a
    # value whose two float32 computations round to different bf16 values would move a
    # gradient by a bf16 rounding of one term).
    from pallas_kernels.ssd import triton
    from pallas_kernels.ssd.vjp import ssd_weighted
    b, l, h, p, g, n, a, rank = 2, 40, 4, 16, 2, 16, 4, 2
    rng = fresh_rng()
    arr = lambda *shape, dt=jnp.float32: jnp.asarray(rng.standard_normal(shape), dt)
    args = dict(x=arr(b, l, h, p, dt=dtype), B=arr(b, l, g, n, dt=dtype),
                C=arr(b, l, g, n, dt=dtype),
                weights=jnp.asarray(rng.uniform(0, 1, (b, l, h)), jnp.float32),
                log_decay=-jnp.asarray(rng.uniform(0, 1, (b, l, h)), jnp.float32),
                theta=jnp.asarray(rng.uniform(-3, 3, (b, l // token, h, a)), jnp.float32),
                C_bias=arr(h, rank, n), B_bias=arr(h, rank, n), D=arr(h),
                initial_state=arr(b, h, p, n))
    seq_idx = jnp.asarray(np.repeat(np.cumsum(rng.random((b, l // token)) < 0.1, axis=1),
                                    token, axis=1))
    wy, ws = arr(b, l, h, p), arr(b, h, p, n)

    def gradients(backward_turns):
        config = triton.Config(chunk=16, backward_turns=backward_turns, turned_back_rows=16)

        def loss(a):
            y, s = ssd_weighted(a["x"], a["weights"], a["log_decay"], a["B"], a["C"],
                                backend=triton, config=config, D=a["D"],
                                initial_state=a["initial_state"], seq_idx=seq_idx, rank=token,
                                rotation=(a["theta"], a["C_bias"], a["B_bias"]))
            return jnp.vdot(y.astype(jnp.float32), wy) + jnp.vdot(s, ws)
        return jax.jit(jax.grad(loss))(args)

    got, want = gradients(True), gradients(False)
    for name in args:
        w = np.asarray(want[name], np.float64)
        assert got[name].dtype == want[name].dtype, name
        assert np.all(np.isfinite(w)), name
        assert relative(np.asarray(got[name], np.float64), w) < (
            1e-5 if dtype == jnp.float32 else 1e-2), name


def test_the_kernels_cos_and_sin_meet_float64():
    # The kernels' joint cos and sin (one reduction by pi / 2, polynomials on [-pi/4, pi/4],
    # where libdevice's cosf and sinf each reduce on their own) on fresh float32 angles, in
    # the wrapped range the kernels see and out to 1e4, with the quadrants' edges: within
    # 2e-7 of float64 (about 1.5 float32 roundings of a value near 1; seen 9.3e-8, as
    # numpy's float32 cos and sin are within 7e-8).
    from pallas_kernels.ssd.triton import cos_and_sin
    rng = fresh_rng()
    edges = np.arange(-64, 65) * (np.pi / 4)
    theta = np.concatenate([rng.uniform(0, 2 * np.pi, 200_000), rng.uniform(-1e4, 1e4, 200_000),
                            edges, np.nextafter(edges.astype(np.float32), np.inf)])
    theta = theta.astype(np.float32)
    cos, sin = (np.asarray(v, np.float64) for v in jax.jit(cos_and_sin)(jnp.asarray(theta)))
    exact = theta.astype(np.float64)
    assert np.all(np.isfinite(cos)) and np.all(np.isfinite(sin))
    assert np.max(np.abs(cos - np.cos(exact))) < 2e-7
    assert np.max(np.abs(sin - np.sin(exact))) < 2e-7


def test_the_backward_turns_where_the_chunk_walks_have_two_waves_of_programs():
    # Config.backward_turns=None decides by the walking kernels' (batch, head) programs
    # against two waves of an H200's 132 multiprocessors (the CPU's stand-in): mamba3-1.3b's
    # 64 heads turn from batch 5 on; an explicit True or False holds at any batch.
    from pallas_kernels.ssd import triton
    assert [triton.Config().turns_in_backward(b, 64) for b in (1, 4, 5, 8)] == [
        False, False, True, True]
    assert triton.Config(backward_turns=True).turns_in_backward(1, 64)
    assert not triton.Config(backward_turns=False).turns_in_backward(8, 64)


def test_the_backward_copies_gradients_are_rounded_once():
    # The per-head turned B and C the backward kernels read (pallas_kernels.ssd.triton.
    # turned), from bf16 B and C, against the same turn in float64 on the same values:
    # values within a bf16 rounding, and gradients. Summed over a group's
    # heads and the biases' over the rows in float32, B's and C's are rounded once to bf16
    # (within 2^-8 of the largest; a bf16 rounding a head made dB 8.6e-3 here) and the
    # biases' stay float32 sums (1e-5; a bf16 rounding a row made them 1.5e-2 at 64 heads).
    from pallas_kernels.ssd.triton import turned
    b, l, g, h, n, a, rank = 2, 256, 2, 32, 32, 8, 2
    rng = np.random.default_rng(11)
    arr = lambda dtype, *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    B, C, dB, dC = (arr(jnp.bfloat16, b, l, *s) for s in ((g, n), (g, n), (h, n), (h, n)))
    theta = jnp.asarray(rng.uniform(-20, 20, (b, l, h, a)), jnp.float32)
    C_bias, B_bias = arr(jnp.float32, h, rank, n), arr(jnp.float32, h, rank, n)

    def turned64(B, C, theta, C_bias, B_bias):
        # pair j (entries 2j, 2j + 1) turns by angle j // k where k = n / 2a divides j,
        # else stays; a head reads its group's values plus its bias of rank s % rank
        k = n // (2 * a)
        pairs = jnp.zeros(theta.shape[:-1] + (n // 2,), theta.dtype).at[..., ::k].set(theta)
        cos, sin = jnp.cos(pairs), jnp.sin(pairs)

        def turn(v, bias):
            rounded = lambda x: x + jax.lax.stop_gradient(  # bf16 values, as the kernel
                x.astype(jnp.bfloat16).astype(x.dtype) - x)
            bias = rounded(jnp.tile(bias, (1, l // rank, 1)).swapaxes(0, 1))
            v = rounded(jnp.repeat(v, h // g, axis=2) + bias).reshape(b, l, h, n // 2, 2)
            return jnp.stack([v[..., 0] * cos - v[..., 1] * sin,
                              v[..., 1] * cos + v[..., 0] * sin], -1).reshape(b, l, h, n)
        return turn(B, B_bias), turn(C, C_bias)

    @functools.partial(jax.jit, static_argnums=0)  # one compile, not one an operation
    def values_and_gradients(f, inputs, cotangents):
        values, vjp = jax.vjp(f, *inputs)
        return values, vjp(cotangents)

    inputs = (B, C, theta, C_bias, B_bias)
    with jax.enable_x64(True):
        want, want_grads = values_and_gradients(
            turned64, tuple(jnp.asarray(x, jnp.float64) for x in inputs),
            (jnp.asarray(dB, jnp.float64), jnp.asarray(dC, jnp.float64)))
        want, want_grads = ([np.asarray(w) for w in ws] for ws in (want, want_grads))
    got, got_grads = values_and_gradients(lambda *x: turned(x[0], x[1], x[2:]), inputs,
                                          (dB, dC))
    for v, w in zip(got, want):
        assert v.dtype == jnp.bfloat16
        assert relative(np.asarray(v, np.float64), w) < 2 ** -8
    tolerances = {"B": 2 ** -8, "C": 2 ** -8, "theta": 2e-2, "C_bias": 1e-5, "B_bias": 1e-5}
    for name, v, w in zip(tolerances, got_grads, want_grads):
        assert np.all(np.isfinite(np.asarray(v, np.float64))), name
        assert relative(np.asarray(v, np.float64), w) < tolerances[name], name


STEP_CASES = [  # (b, h, p, r, g, n, a, rotary, ssm_state dtype, out-projection norm)
    (2, 4, 32, 1, 1, 32, 8, "pairwise", "float32", False),  # rope over half of n
    (1, 4, 32, 2, 2, 16, 8, "halves", "float32", True),     # MIMO over 2 groups, rope over n
    (2, 4, 32, 1, 1, 32, 8, "halves", "bfloat16", False),
    (2, 2, 32, 2, 1, 32, 8, "pairwise", "int8", True),
]


@pytest.mark.parametrize("case", STEP_CASES)
def test_the_step_kernel_equals_the_xla_step(case):
    # pallas_kernels.mamba3.step (in the interpreter without a GPU) against its XLA form
    # (reference.projected, mamba3_step and gate) from the same in-projection row and the
    # same float32 state: the angle, k and x within float32 sums in another order (1e-5 of
    # the largest), the SSM state too where it is float32, and where it is stored as bf16 or
    # int8, what the kernel stores is the reference's new state rounded to it (within one
    # bf16 rounding; within one int8 level, scale / 2 ... 1 step, of each row); the gated y,
    # rounded to bf16 after the step and after the gate, within two bf16 roundings of the
    # largest. Headdim split over two programs (block_p 16) without the out-projection norm:
    # every program of a head reads the old k and angle that its first program replaces;
    # with it, one program a head (its RMS spans the headdim).
    from pallas_kernels.mamba3.step import StepParams, decode_step
    from pallas_kernels.ssd.step import Blocks, dequantize, state_in
    b, h, p, r, g, n, a, rotary, dtype, norm = case
    rng = np.random.default_rng(8)
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    zxbcdt = jnp.asarray(rng.standard_normal((b, 2 * h * p + 2 * r * g * n + 3 * h + a)),
                         jnp.bfloat16)
    mimo = [arr(h, r, p) for _ in range(3)] if r > 1 else [None] * 3
    params = StepParams(arr(h), 1 + arr(n) / 4, 1 + arr(n) / 4, arr(h, r, n), arr(h, r, n),
                        arr(h), *mimo, 1 + arr(h, p) / 4 if norm else None)
    state = Mamba3State(jnp.asarray(rng.uniform(0, 6, (b, h, a)), jnp.float32),
                        state_in(arr(b, h, p, n), dtype), arr(b, r, h, n), arr(b, h, p))
    stored = dequantize(state.ssm) if dtype == "int8" else state.ssm.astype(jnp.float32)
    step = lambda state, implementation, **kw: jax.jit(lambda s, zx, params: decode_step(
        s, zx, params, A_floor=1e-4, rotary=rotary, implementation=implementation, **kw))(
        state, zxbcdt, params)
    y_ref, ref = step(state._replace(ssm=stored), "xla")
    y, got = step(state, "triton", blocks=Blocks(block_p=16))
    assert y.dtype == y_ref.dtype == jnp.bfloat16 and y.shape == (b, h, p)
    assert relative(np.asarray(y, np.float32), np.asarray(y_ref, np.float32)) < 2 ** -7
    for name in ("angle", "k", "x"):
        assert relative(getattr(got, name), getattr(ref, name)) < 1e-5, name
    if dtype == "float32":
        assert relative(got.ssm, ref.ssm) < 1e-5
    elif dtype == "bfloat16":
        assert got.ssm.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got.ssm, np.float32), ref.ssm, rtol=2 ** -8,
                                   atol=1e-6)
    else:
        want = state_in(ref.ssm, "int8")
        np.testing.assert_allclose(got.ssm.scale, want.scale, rtol=1e-6)
        assert np.abs(got.ssm.values.astype(int) - want.values.astype(int)).max() <= 1
