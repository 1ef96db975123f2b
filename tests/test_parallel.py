"""The sharded model equals the single-device one, on 8 fake CPU devices (conftest.py).

Tolerances (float32 throughout): logits and loss within 1e-5 absolute (they are O(1)-O(10));
every gradient within 1e-5 absolute + 1e-4 relative of the single-device gradient (a psum
or reduce-scatter adds the same terms in another order, nothing more); training losses
within 1e-5 relative. NaN fails every comparison (assert_allclose treats it as unequal
unless both sides are NaN, and the single-device side is checked finite).
"""

import functools
import os
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mamba_jax import Mamba2Config, Mamba2LM, parallel
from mamba_jax.optim import make_optimizer, make_train_step
from mamba_jax.parallel import global_array

# Opt level 0 halves XLA:CPU compile time (the budget here is compiles); every side of each
# comparison is compiled the same way.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
LOGIT_ATOL, GRAD_ATOL, GRAD_RTOL, LOSS_RTOL = 1e-5, 1e-5, 1e-4, 1e-5
BATCH, SEQ = 4, 32


def tiny_config(**changes):
    # nheads = 2*64/16 = 8 (tp up to 8), padded vocab 112 = 8*14 (a size no other axis has,
    # so the HLO test can look for it).
    base = dict(d_model=64, n_layer=2, vocab_size=100, d_state=16, headdim=16, chunk_size=16)
    return Mamba2Config(**{**base, **changes})


def packed_seq_idx(seq_len):
    """[BATCH, seq_len] document ids whose boundaries fall inside and exactly on the edges of
    the halves, quarters and eighths of the sequence (the parts of cp = 2, 4, 8)."""
    starts = np.random.default_rng(3).random((BATCH, seq_len)) < 0.06
    starts[0, seq_len // 2] = starts[1, seq_len // 4] = starts[2, 3 * seq_len // 8] = True
    starts[3] = False  # one document through every part: the state crosses them all
    return np.cumsum(starts, axis=1).astype(np.int32)


@functools.cache
def model_and_batch(ngroups=1, nheads=8, seq_len=SEQ, packed=False):
    """(cfg, graphdef, params, batch): batch = (inputs, targets), plus seq_idx if packed."""
    cfg = tiny_config(ngroups=ngroups, d_model=8 * nheads)
    graphdef, params = nnx.split(Mamba2LM(cfg, rngs=nnx.Rngs(0)))
    ids = np.random.default_rng(ngroups).integers(0, cfg.vocab_size, (BATCH, seq_len + 1))
    batch = (ids[:, :-1].astype(np.int32), ids[:, 1:].astype(np.int32))
    return cfg, graphdef, params, batch + ((packed_seq_idx(seq_len),) if packed else ())


def reference_loss(graphdef):
    def loss(params, inputs, targets, seq_idx=None):
        logits = nnx.merge(graphdef, params)(inputs, seq_idx)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss


@functools.cache
def single_device(ngroups=1, nheads=8, seq_len=SEQ, packed=False):
    """((loss, gradients), logits) of one device; the logits without seq_idx."""
    cfg, graphdef, params, batch = model_and_batch(ngroups, nheads, seq_len, packed)
    loss = reference_loss(graphdef)

    def run(params, batch):
        return jax.value_and_grad(loss)(params, *batch), nnx.merge(graphdef, params)(batch[0])
    (value, grads), logits = jax.jit(run, compiler_options=FAST_COMPILE)(params, batch)
    assert np.isfinite(float(value)) and np.all(np.isfinite(logits))
    return (value, grads), logits


def sharded(spec, sp, ngroups=1, nheads=8, seq_len=SEQ, packed=False, loss_chunk=None):
    cfg, graphdef, params, batch = model_and_batch(ngroups, nheads, seq_len, packed)
    mesh = parallel.make_mesh(spec)
    specs = parallel.param_specs(params, cfg, mesh)
    params = jax.device_put(params, parallel.shardings(mesh, specs))
    batch = jax.device_put(batch, NamedSharding(mesh, parallel.TOKENS))
    loss = parallel.make_loss_fn(graphdef, specs, mesh, sequence_parallel=sp,
                                 loss_chunk=loss_chunk)
    logits = parallel.make_logits_fn(graphdef, specs, mesh, sequence_parallel=sp)

    def run(params, batch):
        return jax.value_and_grad(loss)(params, *batch), logits(params, batch[0])
    return jax.jit(run, compiler_options=FAST_COMPILE)(params, batch), specs


def assert_matches_single_device(spec, sp, ngroups=1, nheads=8, seq_len=SEQ, packed=False,
                                 loss_chunk=None):
    """Logits, loss and every gradient of `spec` equal one device's (module tolerances);
    packed: the loss and gradients over packed documents (seq_idx); loss_chunk: the loss
    computed that many positions at a time."""
    ((value, grads), logits), specs = sharded(spec, sp, ngroups, nheads, seq_len, packed,
                                              loss_chunk)
    (ref_value, ref_grads), ref_logits = single_device(ngroups, nheads, seq_len, packed)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGIT_ATOL)
    np.testing.assert_allclose(value, ref_value, rtol=0, atol=LOGIT_ATOL)
    flat = jax.tree_util.tree_leaves_with_path(grads)
    ref = dict(jax.tree_util.tree_leaves_with_path(ref_grads))
    assert len(flat) == len(ref)
    for path, g in flat:
        np.testing.assert_allclose(g, ref[path], rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   err_msg=jax.tree_util.keystr(path))
    # The gradients come back sharded as the parameters are (ready for the update).
    for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(specs)):
        assert g.sharding.spec == s


MESHES = ["tp=2,dp=4", "tp=4,dp=2", "tp=8", "dp=2,tp=4", "fsdp=2,tp=2,dp=2"]


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no_sp"])
@pytest.mark.parametrize("spec", MESHES)
def test_ngroups1_logits_loss_and_gradients_match_single_device(spec, sp):
    # ngroups=1 (the published checkpoints): B, C replicated, the norm group spans all ranks.
    assert_matches_single_device(spec, sp, ngroups=1)


@pytest.mark.parametrize("spec,sp,ngroups", [
    ("tp=2,dp=4", True, 2),          # groups split over tp
    ("tp=4,dp=2", True, 2),          # two ranks per group: each reads one group
    ("fsdp=2,tp=2,dp=2", False, 2),
    ("tp=8", True, 8),               # one group per rank
    ("fsdp=2,tp=2,dp=2", True, 8),
    ("dp=2,tp=4", False, 8),
])
def test_ngroups2_and_8_logits_loss_and_gradients_match_single_device(spec, sp, ngroups):
    assert_matches_single_device(spec, sp, ngroups=ngroups)


def test_loss_in_sequence_chunks_matches_single_device():
    # 32 positions in pieces of 8 (the logits recomputed per piece in the backward pass).
    assert_matches_single_device("tp=2,dp=4", True, loss_chunk=8)


def test_groups_that_straddle_ranks_match_single_device():
    # nheads 6, ngroups 3, tp 2: rank 0 holds heads 0-2, which read groups 0, 0, 1.
    assert_matches_single_device("tp=2,dp=4", True, ngroups=3, nheads=6)


@functools.cache
def train_losses(spec, sp, grad_accum):
    """Five steps of the trainer's jitted step on a mesh -> (losses, the compiled step,
    the final params and optimizer state)."""
    cfg, graphdef, params, _ = model_and_batch()
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, (5, 2 * BATCH, SEQ + 1))
    tx, _ = make_optimizer(params, 1e-2, 5, 1, 0.1, 1.0)
    mesh = parallel.make_mesh(spec)
    specs = parallel.param_specs(params, cfg, mesh)
    # A copy: the step donates its params, and device_put may reuse the cached buffers.
    params = jax.device_put(jax.tree.map(jnp.copy, params), parallel.shardings(mesh, specs))
    opt_state = jax.jit(tx.init)(params)
    step = make_train_step(parallel.make_loss_fn(graphdef, specs, mesh, sequence_parallel=sp),
                           tx)
    rows = NamedSharding(mesh, P(None, *parallel.TOKENS))
    batches = [tuple(global_array(a.reshape(grad_accum, -1, SEQ).astype(np.int32), rows)
                     for a in (window[:, :-1], window[:, 1:])) for window in ids]
    step = step.lower(params, opt_state, batches[0]).compile(FAST_COMPILE)
    losses = []
    for batch in batches:
        params, opt_state, loss, _ = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses, step, params, opt_state


@functools.cache
def single_device_train_losses():
    cfg, graphdef, params, _ = model_and_batch()
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, (5, 2 * BATCH, SEQ + 1))
    tx, _ = make_optimizer(params, 1e-2, 5, 1, 0.1, 1.0)
    params = jax.tree.map(jnp.copy, params)  # the step donates them; the cached ones stay
    opt_state, losses = tx.init(params), []
    batches = [(w[None, :, :-1].astype(np.int32), w[None, :, 1:].astype(np.int32)) for w in ids]
    step = make_train_step(reference_loss(graphdef), tx).lower(
        params, opt_state, batches[0]).compile(FAST_COMPILE)
    for batch in batches:
        params, opt_state, loss, _ = step(params, opt_state, batch)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    return losses


@pytest.mark.parametrize("spec,sp,grad_accum", [("tp=4,dp=2", True, 1),
                                                 ("fsdp=2,tp=2,dp=2", False, 2)])
def test_five_training_steps_give_the_single_device_losses(spec, sp, grad_accum):
    losses, *_ = train_losses(spec, sp, grad_accum)
    np.testing.assert_allclose(losses, single_device_train_losses(), rtol=LOSS_RTOL)


def test_fsdp_shards_parameters_and_optimizer_state():
    *_, params, opt_state = train_losses("fsdp=2,tp=2,dp=2", False, 2)
    x_proj = params["layers"][0]["mixer"]["x_proj"][...]      # [d, h, p]
    assert x_proj.sharding.spec == P("fsdp", "tp", None)
    assert x_proj.addressable_shards[0].data.shape == (32, 4, 16)
    mu = opt_state[1][0].mu["layers"][0]["mixer"]["x_proj"][...]
    assert mu.sharding.spec == P("fsdp", "tp", None)


def test_tp4_sp_step_hlo_has_sequence_collectives_and_no_full_vocab_logits():
    hlo = train_losses("tp=4,dp=2", True, 1)[1].as_text()
    cfg = model_and_batch()[0]
    assert re.search(r"= \S+ all-gather(-start)?\(", hlo), "no all-gather"
    assert re.search(r"= \S+ reduce-scatter\(", hlo), "no reduce-scatter"
    # Under SP the activations cross tp by all-gather / reduce-scatter only: every
    # all-reduce over tp is of replicated parameters' gradients (the largest, B_proj's, is
    # [d, n] = 1024 floats) or of per-token statistics (softmax, the norm of a group that
    # spans ranks), smaller than one device's residual shard [b/dp, l/tp, d] = [4, 8, 64].
    residual_shard = (2 * BATCH // 2) * (SEQ // 4) * cfg.d_model
    over_tp = re.findall(r"= (.*?) all-reduce(?:-start)?\(.*replica_groups=mesh\[.*?\] "
                         r"\{([^}]*'tp'[^}]*)\}", hlo)
    assert over_tp
    for shapes, _ in over_tp:
        for dims in re.findall(r"\[([\d,]*)\]", shapes):
            assert np.prod([int(d) for d in dims.split(",") if d]) < residual_shard, shapes
    # No buffer has the full (padded) vocabulary as an axis: logits, their gradient and the
    # embedding exist only as [.., v/tp] shards.
    shapes = re.findall(r"\[([\d,]+)\]", hlo)
    assert not [s for s in shapes if str(cfg.padded_vocab_size) in s.split(",")]
    assert [s for s in shapes if str(cfg.padded_vocab_size // 4) in s.split(",")]


def test_mesh_spec_errors_name_the_sizes_and_the_devices():
    assert dict(parallel.make_mesh("dp=2,tp=4").shape) == {"dp": 2, "fsdp": 1, "cp": 1,
                                                           "tp": 4}
    assert dict(parallel.make_mesh(None).shape) == {"dp": 8, "fsdp": 1, "cp": 1, "tp": 1}
    mesh = parallel.make_mesh("tp=8")
    assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    with pytest.raises(ValueError, match=r"dp\*fsdp\*cp\*tp = 1\*1\*1\*4 = 4, but there "
                                         r"are 8 devices \(cpu:cpu\)"):
        parallel.make_mesh("tp=4")
    with pytest.raises(ValueError, match="'pp=2' should be AXIS=SIZE"):
        parallel.make_mesh("pp=2,tp=4")


def test_nheads_not_divisible_by_tp_names_both_and_the_sizes_that_work():
    cfg = tiny_config(d_model=48)  # nheads 6
    with pytest.raises(ValueError, match=r"tp=4 does not divide nheads=6 .* use tp in "
                                         r"\[1, 2, 3, 6\]"):
        parallel.check_layout(cfg, parallel.make_mesh("dp=2,tp=4"))
    with pytest.raises(ValueError, match=r"sequence length 30 is not divisible by cp\*tp = "
                                         r"1\*4"):
        parallel.check_layout(tiny_config(), parallel.make_mesh("dp=2,tp=4"), seq_len=30)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_of_four_devices_get_the_single_process_losses(tmp_path):
    args = ["--steps", "3", "--batch-size", "4", "--seq-len", "32", "--mesh", "dp=2,tp=4",
            "--eval-every", "1000", "--set", "d_model=64", "--set", "d_state=16",
            "--set", "headdim=16", "--set", "chunk_size=16"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "mamba_jax.train", *args, "--out", str(tmp_path / "ck"),
         "--metrics-file", str(tmp_path / "multi.jsonl"),
         "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
         "--process-id", str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for i in range(2)]
    from mamba_jax.train import main
    main([*args, "--out", "none", "--metrics-file", str(tmp_path / "single.jsonl")])
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out.decode()[-3000:]
    read = lambda name: [float(re.search(r'"loss": ([\d.e+-]+)', line)[1])
                         for line in (tmp_path / name).read_text().splitlines()]
    single = read("single.jsonl")
    assert len(single) == 3 and np.all(np.isfinite(single))
    np.testing.assert_allclose(read("multi.jsonl"), single, rtol=LOSS_RTOL)
    assert (tmp_path / "ck" / "model.safetensors").is_file()
