"""The SSD kernel backends compute the naive recurrence: values and every gradient.

On CPU the Pallas kernels run in Pallas's interpreter (the kernels' own code, not the
reference). Each case draws fresh random inputs, runs the backend and the float64 naive
recurrence on the same (dtype-rounded) inputs, and compares y, final_state and the
gradients of <y, wy> + <final_state, ws> with respect to x, dt, A, B, C, D, dt_bias and
initial_state by relative Frobenius error. wy is rounded to y's dtype too: the backend
receives y's cotangent in that dtype, so the reference gets the same one.
- float32 inputs: below 1e-4 (float32 arithmetic with IEEE float32 dots; seen ~2e-6),
  except dA below 1e-3: the kernels give A its gradient through the transpose of the
  cumulative log decay's sum, a reverse cumulative sum of terms of both signs, whose
  cancellation amplifies float32 rounding (over 58 seeds each of ngroups_2_initial_state and
  packed_documents_with_state it reached 3e-5, median 2e-6; once in CI, 1.3e-4);
- bfloat16 inputs: below 3e-2 (bf16 matmul operands, float32 accumulation, as the XLA path;
  seen up to 3e-3, dA up to 4e-3).
The gradients of A and dt_bias are h sums, each of b * l positions' terms. A sum of terms of
both signs can cancel toward zero while its terms' rounding does not, so their error is
taken relative to the larger of their norm and their terms' norm (summed_terms). Relative
to their own norm alone, over 163 seeds of seqlen_not_a_chunk_multiple_g1 in bf16 ddt_bias
read up to 1.6e-2 (median 1.7e-3). D's gradient sums x dy in float32, products of bf16
values: exact but for the sum's rounding, now that wy is rounded as the backend rounds it
(an unrounded wy put dD's error above 3e-2 in CI runs).
NaN fails every comparison.

A new backend subclasses `BackendCases` with its module and a small config.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fallback, hardware
from pallas_kernels.ssd import ssd, triton, vjp
from pallas_kernels.ssd.reference import process_dt, ssd_naive, weighted_state
from seeds import fresh_rng

TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}
DA_TOLERANCE = {jnp.float32: 1e-3, jnp.bfloat16: 3e-2}  # see the module docstring

CASES = {  # name: (b, l, h, p, g, n, with_state, docs)
    "seqlen_not_a_chunk_multiple_g1": (2, 45, 4, 16, 1, 16, False, False),
    "ngroups_2_initial_state": (1, 64, 4, 16, 2, 32, True, False),
    "packed_documents_with_state": (2, 50, 4, 16, 4, 16, True, True),
    "shorter_than_one_chunk_documents": (1, 7, 8, 16, 1, 16, False, True),
}


def make_inputs(rng, b, l, h, p, g, n, dtype, with_state, docs):
    arr = lambda *shape, dt=jnp.float32: jnp.asarray(rng.standard_normal(shape), dt)
    args = dict(x=arr(b, l, h, p, dt=dtype), dt=arr(b, l, h),
                A=-jnp.asarray(rng.uniform(0.5, 4, h), jnp.float32),
                B=arr(b, l, g, n, dt=dtype), C=arr(b, l, g, n, dt=dtype), D=arr(h),
                dt_bias=arr(h))
    if with_state:
        args["initial_state"] = arr(b, h, p, n)
    if docs:  # ids that repeat an earlier id too: only changes start a document
        args["seq_idx"] = jnp.asarray(np.cumsum(document_starts(rng, b, l), axis=1) % 2)
    return args


def document_starts(rng, b, l):
    """[b, l] bool: random document starts, and in every row one exactly on a chunk edge
    (16, the kernel chunk of the test configs) and one inside a chunk (23), where the row is
    that long: an off-by-one at a chunk edge fails every run, not only those whose random
    starts happen to fall there."""
    starts = rng.random((b, l)) < 0.1
    starts[:, [i for i in (16, 23) if i < l]] = True
    return starts


def values_and_grads(fn, args, wy, ws):
    diff = {k: v for k, v in args.items() if k != "seq_idx"}

    def loss(diff):
        y, s = fn(**{**args, **diff})
        return jnp.vdot(y.astype(wy.dtype), wy) + jnp.vdot(s.astype(ws.dtype), ws), (y, s)

    # jitted: one compile, where run operation by operation each would compile on its own
    (_, (y, s)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(diff)
    return {"y": y, "final_state": s, **{f"d{k}": v for k, v in grads.items()}}


def relative_errors(ours, reference, scales=None):
    """{name: ||ours - reference|| / max(||reference||, scales[name])} (scales default 0)."""
    out = {}
    for k, ref in reference.items():
        a, r = np.asarray(ours[k], np.float64), np.asarray(ref, np.float64)
        scale = max(np.linalg.norm(r), (scales or {}).get(k, 0.0))
        out[k] = float(np.linalg.norm(a - r) / scale)
    return out


def summed_terms(args, wy, ws, reference):
    """{"dA": norm, "ddt_bias": norm} of the [b, l, h] terms whose sums over b and l are
    those gradients of reference (values_and_grads'), from float64 args. dt_bias meets dt
    before the softplus, so ddt_bias's terms are ddt itself. A meets dt only in the decay
    exp(A dt), so dA's terms are dt times the gradient with respect to the log decay
    a = A dt: the recurrence run on s = -a with A = -1 and input x dt / s, in which only the
    decay depends on s (s cancels from the input dt x). Checked: they sum to reference's dA."""
    dt = process_dt(args["dt"], args["dt_bias"], dt_softplus=True)
    u = dt[..., None] * args["x"]
    rest = {k: args[k] for k in ("B", "C", "initial_state", "seq_idx") if k in args}

    def loss(s):
        y, final = ssd_naive(u / s[..., None], s, -jnp.ones_like(args["A"]), **rest)
        return jnp.vdot(y, wy) + jnp.vdot(final, ws)

    dA_terms = -dt * jax.jit(jax.grad(loss))(-args["A"] * dt)
    np.testing.assert_allclose(dA_terms.sum((0, 1)), reference["dA"], rtol=1e-9, atol=1e-12)
    return {"dA": float(jnp.linalg.norm(dA_terms)),
            "ddt_bias": float(jnp.linalg.norm(reference["ddt"]))}


class BackendCases:
    backend = None
    config = None
    D_per_channel = False  # D [h, p] (mamba_ssm's D_has_hdim) instead of [h]

    def run_backend(self, **args):
        return vjp.ssd(**args, dt_softplus=True, backend=self.backend, config=self.config)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize("case", CASES, ids=list(CASES))
    def test_values_and_gradients_match_naive_recurrence(self, case, dtype):
        assert_matches_naive(self.run_backend, CASES[case], dtype, self.D_per_channel)


def assert_matches_naive(run, case, dtype, D_per_channel=False):
    """run(**inputs) -> (y, final_state): values and gradients against the float64 naive
    recurrence on fresh inputs of case's shapes (CASES' tuples)."""
    b, l, h, p, g, n, with_state, docs = case
    rng = fresh_rng()
    args = make_inputs(rng, b, l, h, p, g, n, dtype, with_state, docs)
    if D_per_channel:
        args["D"] = jnp.asarray(rng.standard_normal((h, p)), jnp.float32)
    wy = np.asarray(jnp.asarray(rng.standard_normal((b, l, h, p)), dtype), np.float64)
    ws = rng.standard_normal((b, h, p, n))
    ours = values_and_grads(run, args, jnp.asarray(wy, jnp.float32),
                            jnp.asarray(ws, jnp.float32))
    with jax.enable_x64(True):
        up = {k: v.astype(jnp.float64) if jnp.issubdtype(v.dtype, jnp.floating) else v
              for k, v in args.items()}
        reference = values_and_grads(
            lambda **a: ssd_naive(**a, dt_softplus=True), up, jnp.asarray(wy),
            jnp.asarray(ws))
        scales = summed_terms(up, jnp.asarray(wy), jnp.asarray(ws), reference)
    errors = relative_errors(ours, reference, scales)
    dA = errors.pop("dA")
    assert dA < DA_TOLERANCE[dtype], (dA, errors)
    assert all(e < TOLERANCE[dtype] for e in errors.values()), errors  # NaN fails too


class TestTriton(BackendCases):
    backend = triton
    # A 16-position kernel chunk: every case spans several chunks and a partial one. The
    # recomputed states and their gradients in x's dtype (the default): the same tolerances
    # (bf16 rounding of the states is within the bf16 bound; float32 inputs are unchanged).
    config = triton.Config(chunk=16, block_p=8)


class TestTritonOtherOptions(BackendCases):
    backend = triton
    # The non-default options, together: recomputed states in float32 (which changes only bf16
    # inputs: float32 inputs keep float32 states either way), one head per dB/dC program
    # (every group's dB and dC summed from r partials) and the states kept from the forward
    # kernel; and D per channel, [h, p].
    config = triton.Config(chunk=16, block_p=8, states_in_input_dtype=False,
                           backward_bc_heads=1, keep_states=True)
    D_per_channel = True


def test_headdim_80_runs_in_power_of_two_blocks():
    """Nemotron Nano 2's headdim, 80: the forward and both backward kernels walk it in 5
    blocks of 16 that share one C B^T; values and gradients (the parts' join: below). An initial state, 2 heads in 1 group, 2 kernel chunks."""
    def run(**args):
        return vjp.ssd(**args, dt_softplus=True, backend=triton,
                       config=triton.Config(chunk=16))
    assert triton.supports(jnp.zeros((1, 1, 2, 80)), jnp.zeros((1, 1, 1, 16)))
    assert_matches_naive(run, (1, 32, 2, 80, 1, 16, True, False), jnp.float32)


@pytest.mark.parametrize("p", [96, 192])
def test_headdims_96_and_192_run_in_power_of_two_blocks(p):
    """96 and 192 (3 blocks of 32 and of 64): the forward's y and final state against the
    naive recurrence, with documents and an initial state (the backward kernels walk the
    blocks as at headdim 80, above)."""
    rng = fresh_rng()
    args = make_inputs(rng, 1, 32, 1, p, 1, 16, jnp.float32, True, True)
    y, s = vjp.ssd(**args, dt_softplus=True, backend=triton, config=triton.Config(chunk=16))
    with jax.enable_x64(True):
        up = {k: v.astype(jnp.float64) if jnp.issubdtype(v.dtype, jnp.floating) else v
              for k, v in args.items()}
        y_ref, s_ref = ssd_naive(**up, dt_softplus=True)
    errors = relative_errors({"y": y, "s": s}, {"y": y_ref, "s": s_ref})
    assert all(e < TOLERANCE[jnp.float32] for e in errors.values()), errors


def test_public_ssd_runs_the_triton_kernels_with_their_default_config():
    rng = fresh_rng()
    args = make_inputs(rng, 2, 150, 4, 16, 2, 16, jnp.float32, True, True)
    y, s = ssd(**args, chunk_size=32, dt_softplus=True, return_final_state=True,
               implementation="triton")
    y_ref, s_ref = ssd(**args, chunk_size=32, dt_softplus=True, return_final_state=True,
                       implementation="xla")
    errors = relative_errors({"y": y, "s": s}, {"y": y_ref, "s": s_ref})
    assert all(e < 1e-5 for e in errors.values()), errors


def test_auto_uses_xla_without_a_gpu():
    args = make_inputs(fresh_rng(), 1, 8, 2, 16, 1, 16, jnp.float32, False,
                       False)
    auto = jax.make_jaxpr(lambda a: ssd(**a, chunk_size=8, implementation="auto"))(args)
    assert "pallas_call" not in str(auto)


def test_auto_on_hopper_takes_the_kernels_at_headdim_80_and_says_when_it_does_not(
        monkeypatch, caplog):
    """On an H200 (compute capability 9.0, patched in) "auto" runs the kernels at headdim 80;
    at headdim 24, which they do not take, the XLA path, logged once for that reason."""
    monkeypatch.setattr(hardware, "compute_capability", lambda: 9.0)
    traced = lambda p: str(jax.make_jaxpr(lambda a: ssd(**a, chunk_size=16))(make_inputs(
        fresh_rng(), 1, 16, 1, p, 1, 16, jnp.float32, False, False)))
    assert "pallas_call" in traced(80)
    monkeypatch.setattr(fallback, "_said", set())  # what earlier tests had said
    with caplog.at_level("WARNING", logger="pallas_kernels.fallback"):
        assert "pallas_call" not in traced(24)
        assert "pallas_call" not in traced(24)
    said = [r.getMessage() for r in caplog.records if r.name == "pallas_kernels.fallback"]
    assert len(said) == 1 and all("headdim 24" in m for m in said)


@pytest.mark.parametrize("dtype,p", [(jnp.float32, 16), (jnp.bfloat16, 16), (jnp.float32, 80)],
                         ids=["fp32", "bf16", "fp32-headdim80"])
def test_weighted_state_kernel_matches_the_reference(dtype, p):
    # The join of a row's parts (vjp.py): 2 rows of 48 positions (3 kernel chunks of 16), 4
    # heads in 2 groups; the same rounding of the weighted x as reference.weighted_state.
    # Headdim 80: 5 blocks of 16.
    rng = fresh_rng()
    rows, l, h, g, n = 2, 48, 4, 2, 32
    x = jnp.asarray(rng.standard_normal((rows, l, h, p)), dtype)
    B = jnp.asarray(rng.standard_normal((rows, l, g, n)), dtype)
    weights = jnp.asarray(rng.uniform(0, 1, (rows, h, l)), jnp.float32)
    got = triton.weighted_state(x, B, weights, config=triton.Config(chunk=16), interpret=True)
    by_head = jnp.swapaxes(weights, 1, 2).reshape(rows, l, g, h // g)
    want = weighted_state(x.reshape(rows, l, g, h // g, p), B, by_head, jnp.float32)
    errors = relative_errors({"state": got}, {"state": want.reshape(rows, h, p, n)})
    assert errors["state"] < 1e-5, errors  # the same products, summed in another order


def test_a_per_token_skip_adds_skip_times_x_and_its_gradients():
    # ssd_weighted's `skip` (Mamba-3 SISO's own-token term, applied in the forward kernel
    # and the backward's state kernel) against the same scan without it plus skip_t x_t in
    # XLA: 2 rows of 48 positions (3 kernel chunks of 16), 4 heads in 2 groups, documents,
    # an initial state, D, the row whole and in 3 parts (each against the row whole without
    # skip); values, the final state and every input's gradient, skip's own included, within
    # float32 sums in another order.
    rng = fresh_rng()
    b, l, h, p, g, n = 2, 48, 4, 16, 2, 16
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    weights = jax.nn.softplus(arr(b, l, h))
    args = dict(x=arr(b, l, h, p), weights=weights, log_decay=-weights * rng.uniform(0.5, 2),
                B=arr(b, l, g, n), C=arr(b, l, g, n), D=arr(h), initial_state=arr(b, h, p, n))
    skip, seq_idx = arr(b, l, h), jnp.asarray(np.cumsum(document_starts(rng, b, l), axis=1))
    wy, ws = arr(b, l, h, p), arr(b, h, p, n)
    scan = functools.partial(vjp.ssd_weighted, backend=triton, seq_idx=seq_idx,
                             config=triton.Config(chunk=16, block_p=8))

    def loss(diff, with_skip, segments):
        kw = {k: v for k, v in diff.items() if k != "skip"}
        if with_skip:
            y, s = scan(**kw, skip=diff["skip"], segments=segments)
        else:
            y, s = scan(**kw, segments=segments)
            y = y + diff["skip"][..., None] * kw["x"]
        return jnp.vdot(y, wy) + jnp.vdot(s, ws), (y, s)

    def run(with_skip, segments):
        (_, (y, s)), grads = jax.jit(jax.value_and_grad(
            functools.partial(loss, with_skip=with_skip, segments=segments), has_aux=True))(
            {**args, "skip": skip})
        return {"y": y, "final_state": s, **{f"d{k}": v for k, v in grads.items()}}
    reference = run(False, 1)
    for segments in (1, 3):
        errors = relative_errors(run(True, segments), reference)
        assert all(e < 1e-5 for e in errors.values()), (segments, errors)  # NaN fails too


@pytest.mark.parametrize("rank", [1, 4], ids=["rank1", "rank4"])
def test_tokens_of_rank_positions_read_their_whole_token_weighted_less_eta(rank):
    # ssd_weighted's `rank` and `eta` (Mamba-3's own-token terms, inside the kernels) against
    # the same scan without them plus, in XLA, what they add to y at position (t, R) of token
    # t: sum_{r > R} weights_t,r (C_t,R . B_t,r) x_t,r - sum_r eta_t,r (C_t,R . B_t,r) x_t,r
    # (the decay on each token's first position, so none inside a token). 2 rows of 12
    # tokens (48 positions, 3 kernel chunks of 16), 4 heads in 2 groups, documents that
    # start at tokens, an initial state, D, the row whole and in 3 parts (each against the
    # row whole without them); values, the final state and every input's gradient, eta's
    # included, within float32 sums in another order.
    rng = fresh_rng()
    b, tokens, h, p, g, n = 2, 48 // rank, 4, 16, 2, 16
    l = tokens * rank
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    positions = lambda a: a.reshape(b, l, *a.shape[3:])  # [b, tokens, rank, ...] -> [b, l, ...]
    per_rank = lambda a: jnp.repeat(a, rank, axis=1)  # [b, tokens, ...] -> [b, l, ...]
    first = (jnp.arange(rank) == 0)[None, None, :, None]
    args = dict(x=arr(b, l, h, p), weights=jax.nn.softplus(arr(b, l, h)),
                token_decay=-jax.nn.softplus(arr(b, tokens, h)), B=arr(b, l, g, n),
                C=arr(b, l, g, n), D=arr(h), initial_state=arr(b, h, p, n),
                eta=jax.nn.softplus(arr(b, l, h)))
    seq_idx = per_rank(jnp.asarray(np.cumsum(document_starts(rng, b, tokens), axis=1)))
    wy, ws = arr(b, l, h, p), arr(b, h, p, n)
    scan = functools.partial(vjp.ssd_weighted, backend=triton, seq_idx=seq_idx,
                             config=triton.Config(chunk=16, block_p=8))

    def own_token_terms(x, weights, B, C, eta):
        by_token = lambda a: a.reshape(b, tokens, rank, *a.shape[2:])
        by_head = lambda a: jnp.repeat(by_token(a), h // g, axis=3)  # [b, T, r, h, n]
        CB = jnp.einsum("bTRhn,bTrhn->bTRrh", by_head(C), by_head(B),
                        precision=jax.lax.Precision.HIGHEST)
        later = jnp.triu(jnp.ones((rank, rank)), 1)[None, None, :, :, None]  # [R, r]: r > R
        coefficient = CB * (later * by_token(weights)[:, :, None] - by_token(eta)[:, :, None])
        return positions(jnp.einsum("bTRrh,bTrhp->bTRhp", coefficient, by_token(x),
                                    precision=jax.lax.Precision.HIGHEST))

    def loss(diff, in_kernels, segments):
        kw = {k: v for k, v in diff.items() if k not in ("eta", "token_decay")}
        log_decay = positions(first * diff["token_decay"][:, :, None])
        if in_kernels:
            y, s = scan(**kw, log_decay=log_decay, rank=rank, eta=diff["eta"],
                        segments=segments)
        else:
            y, s = scan(**kw, log_decay=log_decay, segments=segments)
            y = y + own_token_terms(kw["x"], kw["weights"], kw["B"], kw["C"], diff["eta"])
        return jnp.vdot(y, wy) + jnp.vdot(s, ws), (y, s)

    def run(in_kernels, segments):
        (_, (y, s)), grads = jax.jit(jax.value_and_grad(
            functools.partial(loss, in_kernels=in_kernels, segments=segments),
            has_aux=True))(args)
        return {"y": y, "final_state": s, **{f"d{k}": v for k, v in grads.items()}}
    reference = run(False, 1)
    for segments in (1, 3):
        errors = relative_errors(run(True, segments), reference)
        assert all(e < 1e-5 for e in errors.values()), (segments, errors)  # NaN fails too


def test_tokens_must_divide_the_chunk():
    # a token straddling two kernel chunks would be split between their products
    x = jnp.zeros((1, 24, 2, 16))
    B = jnp.zeros((1, 24, 1, 16))
    with pytest.raises(ValueError, match="rank 3 must divide the kernels' chunk 16"):
        vjp.ssd_weighted(x, jnp.ones((1, 24, 2)), jnp.zeros((1, 24, 2)), B, B, backend=triton,
                         config=triton.Config(chunk=16), rank=3, eta=jnp.zeros((1, 24, 2)))


@pytest.mark.parametrize("bc_heads", [None, 1])
def test_the_dbdc_kernel_pipelines_its_loop_over_heads_alone(bc_heads, monkeypatch):
    """The dB/dC kernel launches with backward_bc_stages where its programs loop over a
    group's heads, and with backward_stages where each takes one head (no loop to
    pipeline); the state kernel with backward_stages either way. Pallas's interpreter does
    not pipeline, so the launches are read off `call`."""
    launched = {}
    call = triton.call

    def recording(kernel, grid, out_shape, warps, stages, interpret, name, aliases=None):
        launched[name] = stages
        return call(kernel, grid, out_shape, warps, stages, interpret, name, aliases)
    monkeypatch.setattr(triton, "call", recording)
    config = triton.Config(chunk=16, backward_stages=1, backward_bc_stages=3,
                           backward_bc_heads=bc_heads)
    args = make_inputs(np.random.default_rng(0), *CASES["seqlen_not_a_chunk_multiple_g1"][:6],
                       jnp.float32, False, False)
    jax.grad(lambda x: vjp.ssd(**{**args, "x": x}, dt_softplus=True, backend=triton,
                               config=config)[0].sum())(args["x"])
    assert launched["ssd_backward_bc"] == (3 if bc_heads is None else 1)
    assert launched["ssd_backward_state"] == 1
