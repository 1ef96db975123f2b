"""Context parallelism (the sequence split over `cp`) equals one device, on 8 fake CPU devices.

The model-level cases use tests/mesh_check.py's comparison and tolerances (float32:
logits and loss within 1e-5 absolute, gradients within 1e-5 + 1e-4 relative), on 64 tokens
of packed documents whose boundaries fall inside parts and exactly on part edges. The
scan-level case holds the split scan to the naive recurrence within 2e-5 (float32, O(1)
values: the parts' states are summed by an einsum, in another order) and its
gradients to the unsplit scan's within 1e-4 absolute + 1e-4 relative (each a sum over up to
64 tokens of O(1) terms).
"""

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mamba_jax import parallel
from mamba_jax.layers import mamba2
from mamba_jax.train import main
from mesh_check import (FAST_COMPILE, LOSS_RTOL, assert_matches_single_device, mamba_config,
                        model_and_batch, packed_seq_idx, single_device_train_losses,
                        tiny_config, train_losses)
from pallas_kernels.ssd import auto_segments, ssd
from pallas_kernels.ssd.reference import ssd_naive

SEQ_CP = 64
# The model-level cases on one layer: what crosses the cp devices (the conv's halo, the
# scan's state, the documents' boundaries) is each layer's own; two layers, one scan, under
# cp: the training test here and tests/test_parallel.py's unrolled layers.
ONE_LAYER = mamba_config().replace(n_layer=1)
SCAN_ATOL, SCAN_GRAD_TOL = 2e-5, 1e-4


def scan_inputs(seq_len=64, b=4, h=4, p=8, g=2, n=16):
    keys = iter(jax.random.split(jax.random.key(0), 8))
    normal = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32)
    return dict(x=normal(b, seq_len, h, p), dt=normal(b, seq_len, h), A=-jnp.exp(normal(h)),
                B=normal(b, seq_len, g, n), C=normal(b, seq_len, g, n), D=normal(h),
                dt_bias=normal(h), initial_state=normal(b, h, p, n),
                seq_idx=jnp.asarray(packed_seq_idx(seq_len)))


SCAN_OPTIONS = dict(dt_softplus=True, dt_limit=(0.0, 0.5), chunk_size=8)
# The fixed projection of (y, final state) the scan-level gradients are taken of.
WEIGHTS = (jax.random.normal(jax.random.key(1), (4, 64, 4, 8)),
           jax.random.normal(jax.random.key(2), (4, 4, 8, 16)))


def objective(y, final):
    return jnp.sum(y * WEIGHTS[0]) + jnp.sum(final * WEIGHTS[1])


@functools.cache
def whole_sequence(implementation, packed):
    """scan_inputs' whole sequence in one piece (no segments, no devices), packed or one
    document a row: (the naive recurrence's y and final state, the gradients of `objective`
    of `implementation`'s scan with respect to every float input). Shared by the tests
    that split the sequence."""
    args = scan_inputs()
    seq_idx = args.pop("seq_idx")
    if not packed:
        seq_idx = None
    y_ref, final_ref = ssd_naive(**args, seq_idx=seq_idx, dt_softplus=True,
                                 dt_limit=(0.0, 0.5))
    grads = jax.jit(jax.grad(lambda floats: objective(*ssd(
        **floats, **SCAN_OPTIONS, implementation=implementation, seq_idx=seq_idx,
        return_final_state=True))))(args)
    return (y_ref, final_ref), grads


@pytest.mark.parametrize("implementation,segments", [("auto", "auto"), ("triton", 2)])
def test_scan_split_over_8_devices_equals_the_whole_sequence_and_its_gradients(
        implementation, segments):
    # "triton", 2: each device's part scanned in 2 segments by the kernels (their
    # custom_vjp's join, packed documents), in Pallas's interpreter, inside the state passing
    # across devices.
    args = scan_inputs()
    options = dict(SCAN_OPTIONS, implementation=implementation, segments=segments)
    # Auto axes: jit moves the unplaced inputs where the in_specs want them.
    mesh = jax.make_mesh((8,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    split = {"x": P(None, "cp"), "dt": P(None, "cp"), "B": P(None, "cp"), "C": P(None, "cp"),
             "seq_idx": P(None, "cp"), "A": P(), "D": P(), "dt_bias": P(),
             "initial_state": P()}

    def local(kw):
        y, final = ssd(**kw, **options, return_final_state=True, sequence_axis="cp")
        return y, final[None]
    split_scan = jax.shard_map(local, mesh=mesh, in_specs=(split,),
                               out_specs=(P(None, "cp"), P("cp")), check_vma=False)

    def outputs(kw):
        y, finals = split_scan(kw)
        return y, finals[-1]  # the state after the last part's last token

    # Gradients of every input, through the scan's initial state, the fold, the all-gather
    # and the parts' states, against the whole sequence's on one device ("auto" is XLA's
    # on the CPU).
    floats = {k: v for k, v in args.items() if k != "seq_idx"}

    @jax.jit
    def run(floats):
        (y, final), vjp = jax.vjp(lambda floats: outputs({**floats, "seq_idx": args["seq_idx"]}),
                                  floats)
        return y, final, vjp(WEIGHTS)[0]
    y, final, got = run(floats)
    (y_ref, final_ref), want = whole_sequence(
        "xla" if implementation == "auto" else implementation, packed=True)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=SCAN_ATOL)
    np.testing.assert_allclose(final, final_ref, rtol=0, atol=SCAN_ATOL)
    for name in floats:
        np.testing.assert_allclose(got[name], want[name], rtol=SCAN_GRAD_TOL, atol=SCAN_GRAD_TOL,
                                   err_msg=name)


def test_auto_segments_split_only_long_rows_of_few_heads_for_the_kernels():
    assert auto_segments(1, 65536, 64, "triton") == 8  # the measured shape
    assert auto_segments(1, 131072, 32, "triton") == 8
    assert auto_segments(8, 65536, 64, "triton") == 1  # 4096 programs: enough rows
    assert auto_segments(1, 32768, 64, "triton") == 1  # parts under 8192 tokens
    assert auto_segments(1, 65536, 64, "xla") == 1
    with pytest.raises(ValueError, match="segments='many' must be a positive int or 'auto'"):
        ssd(**scan_inputs(), chunk_size=8, segments="many")


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one_document"])
@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_scan_in_segments_equals_the_whole_sequence_and_its_gradients(implementation, packed):
    # 4 rows of 64 tokens in 4 segments of 16 with an initial state; packed: documents start
    # inside segments and on their edges, else one document per row, whose state crosses
    # every segment edge. XLA joins the parts in context_parallel.ssd_segmented, the kernels
    # in their custom_vjp (vjp.py), run in Pallas's interpreter on the CPU.
    args = scan_inputs()
    seq_idx = args.pop("seq_idx")
    if not packed:
        seq_idx = None
    options = dict(SCAN_OPTIONS, implementation=implementation, return_final_state=True,
                   seq_idx=seq_idx)

    @jax.jit
    def run(floats):
        (y, final), vjp = jax.vjp(lambda floats: ssd(**floats, segments=4, **options), floats)
        return y, final, vjp(WEIGHTS)[0]
    y, final, got = run(args)
    (y_ref, final_ref), want = whole_sequence(implementation, packed)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=SCAN_ATOL)
    np.testing.assert_allclose(final, final_ref, rtol=0, atol=SCAN_ATOL)
    for name in args:
        np.testing.assert_allclose(got[name], want[name], rtol=SCAN_GRAD_TOL, atol=SCAN_GRAD_TOL,
                                   err_msg=name)
    with pytest.raises(ValueError, match="segments=3 must divide the sequence length 64"):
        ssd(**args, segments=3, **options)


@pytest.mark.parametrize("spec,sp", [
    ("cp=2,dp=4", True),             # two chunks a device (cp=4: one)
    ("cp=8", True),                  # half a chunk a device
    ("dp=2,cp=2,tp=2", True),        # context x tensor x data, sequence parallel inside cp
    ("dp=2,cp=2,tp=2", False),
])
def test_cp_logits_loss_and_gradients_over_packed_documents_match_single_device(spec, sp):
    assert_matches_single_device(ONE_LAYER, spec, sp, seq_len=SEQ_CP, packed=True)


def test_fsdp2_cp2_tp2_five_training_steps_with_grad_accum_give_the_single_device_losses():
    losses, *_ = train_losses("fsdp=2,cp=2,tp=2", True, 2)
    np.testing.assert_allclose(losses, single_device_train_losses(), rtol=LOSS_RTOL)


def collective_bytes_over_cp(seq_len):
    """Bytes of the collectives over cp in the compiled cp=2 loss+gradient step, by kind
    (the all-gathers, all-reduces and reduce-scatters whose replica groups include cp, and
    every collective-permute: on this mesh only the conv halo permutes)."""
    graphdef, params, batch = model_and_batch(ONE_LAYER, seq_len=seq_len, packed=True)
    mesh = parallel.make_mesh("cp=2,dp=4")
    specs = parallel.param_specs(params, mesh)
    params = jax.device_put(params, parallel.shardings(mesh, specs))
    batch = jax.device_put(batch, NamedSharding(mesh, parallel.TOKENS))
    loss = parallel.make_loss_fn(graphdef, specs, mesh)
    hlo = jax.jit(jax.value_and_grad(loss)).lower(params, *batch).compile(
        FAST_COMPILE).as_text()
    totals = {}
    for line in hlo.splitlines():
        op = re.search(r"= (.*?) (all-gather|all-reduce|reduce-scatter|collective-permute)"
                       r"(?:-start)?\(", line)
        if not op or (op[2] != "collective-permute"
                      and not re.search(r"replica_groups=mesh\[.*?\] \{[^}]*'cp'", line)):
            continue
        for dtype, dims in re.findall(r"([a-z]+\d+)\[([\d,]*)\]", op[1]):
            size = np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)
            totals[op[2]] = totals.get(op[2], 0) + size * int(re.sub(r"\D", "", dtype)) // 8
    return totals


def test_cp_bytes_per_step_do_not_grow_with_the_sequence():
    short, long = collective_bytes_over_cp(SEQ_CP), collective_bytes_over_cp(2 * SEQ_CP)
    assert short == long
    # The exchange is there: the scan's state all-gather (forward) and the conv halo.
    assert short["collective-permute"] > 0 and short["all-gather"] > 0
    # Per Mamba layer the all-gathered states are [cp, b/dp, h, p, n] floats: 16 KiB here.
    d = mamba2.dims(ONE_LAYER)
    state = 2 * 1 * d.h * d.p * d.n * 4
    assert short["all-gather"] >= state


def test_cp_layout_errors_name_the_lengths_and_the_fix():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="sequence length 30 is not divisible by cp=4"):
        parallel.check_layout(cfg, parallel.make_mesh("cp=4,dp=2"), seq_len=30)
    with pytest.raises(ValueError, match=r"leaves 2 tokens per device, fewer than the "
                                         r"conv's halo d_conv-1 = 3"):
        parallel.check_layout(cfg, parallel.make_mesh("cp=8"), seq_len=16)
    with pytest.raises(ValueError, match=r"not divisible by cp\*tp = 2\*2"):
        parallel.check_layout(cfg, parallel.make_mesh("dp=2,cp=2,tp=2"), seq_len=34)
    with pytest.raises(ValueError, match=r"--loss-chunk 24 does not divide the 32 positions "
                                         r"each device holds"):
        parallel.check_layout(cfg, parallel.make_mesh("cp=2,dp=4"), seq_len=64, loss_chunk=24)


def test_trainer_with_cp_and_packed_documents_gives_the_data_parallel_losses(tmp_path):
    args = ["--steps", "2", "--batch-size", "8", "--seq-len", "64", "--eval-every", "2",
            "--no-cross-document-state", "--out", "none", "--set", "d_model=64",
            "--set", "d_state=16", "--set", "headdim=16", "--set", "chunk_size=16",
            "--set", "n_layer=1"]
    losses = {}
    for mesh in ("dp=8", "dp=2,cp=2,tp=2"):
        metrics = tmp_path / f"{mesh}.jsonl"
        # The cp run also computes its loss in pieces of 16 of its 32 positions.
        chunk = ["--loss-chunk", "16"] if "cp" in mesh else []
        main([*args, *chunk, "--mesh", mesh, "--metrics-file", str(metrics)])
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        losses[mesh] = [r["loss"] for r in records] + [records[-1]["eval_loss"]]
    assert np.all(np.isfinite(losses["dp=8"]))
    np.testing.assert_allclose(losses["dp=2,cp=2,tp=2"], losses["dp=8"], rtol=LOSS_RTOL)


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_segments_of_a_long_row_keep_float32_precision(implementation):
    # 16,384 tokens in 4 segments; the faster head's cumulative dt*A reaches about -6,600
    # within a segment. Each segment's state comes from decays summed over the tokens after
    # each one, not from a difference of two long cumulative sums (that was 7.7e-6 off
    # here; this is about 1e-7).
    keys = iter(jax.random.split(jax.random.key(3), 5))
    b, l, h, p, g, n = 1, 16384, 2, 8, 1, 8
    normal = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32)
    args = dict(x=normal(b, l, h, p), dt=normal(b, l, h), A=-jnp.asarray([0.5, 2.0]),
                B=normal(b, l, g, n), C=normal(b, l, g, n))
    options = dict(dt_softplus=True, chunk_size=64, return_final_state=True,
                   implementation=implementation)
    whole = jax.jit(lambda args: ssd(**args, **options))(args)
    split = jax.jit(lambda args: ssd(**args, segments=4, **options))(args)
    for got, want in zip(split, whole):
        assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) < 1e-6
