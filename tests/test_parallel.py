"""The sharded model equals the single-device one, on 8 fake CPU devices (conftest.py):
logits, loss and every gradient (tests/mesh_check.py states the tolerances), and the
trainer's first steps."""

import os
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mamba_jax import parallel
from mesh_check import (BATCH, FAST_COMPILE, GRAD_ATOL, GRAD_RTOL, LOSS_RTOL, SEQ,
                        assert_matches_single_device, mamba_config, model_and_batch,
                        single_device_train_losses, tiny_config, train_losses, xla_flags)

# ngroups=1 (the published checkpoints): B, C replicated, the norm group spans all ranks;
# tp over 2 ranks with and without sequence parallelism, over 8, and with fsdp (tp=4 is the
# training tests' mesh, test_five_training_steps_give_the_single_device_losses; fsdp without
# sequence parallelism: the ngroups=2 case below; a spec's axes in another order:
# test_mesh_spec_errors_name_the_sizes_and_the_devices).
@pytest.mark.parametrize("spec,sp", [("tp=2,dp=4", True), ("tp=2,dp=4", False),
                                     ("tp=8", True), ("fsdp=2,tp=2,dp=2", True)])
def test_ngroups1_logits_loss_and_gradients_match_single_device(spec, sp):
    assert_matches_single_device(mamba_config(ngroups=1), spec, sp)


def one_layer(ngroups, nheads=8):
    """A one-layer model: how heads and groups split over the tp ranks is each layer's own
    matter (two layers, one scan, on a mesh: the ngroups=1 tests above and the training
    tests)."""
    return mamba_config(ngroups=ngroups, nheads=nheads).replace(n_layer=1)


@pytest.mark.parametrize("spec,sp,ngroups", [
    ("tp=4,dp=2", True, 2),          # two ranks per group: each reads one group
    ("fsdp=2,tp=2,dp=2", False, 2),  # one group per rank
    ("tp=8", True, 8),               # one group per rank
    ("fsdp=2,tp=2,dp=2", True, 8),
    ("dp=2,tp=4", False, 8),
])
def test_ngroups2_and_8_logits_loss_and_gradients_match_single_device(spec, sp, ngroups):
    assert_matches_single_device(one_layer(ngroups), spec, sp)


def test_loss_in_sequence_chunks_matches_single_device():
    # 32 positions in pieces of 8 (the logits recomputed per piece in the backward pass).
    assert_matches_single_device(mamba_config(), "tp=2,dp=4", True, loss_chunk=8)


def test_groups_that_straddle_ranks_match_single_device():
    # nheads 6, ngroups 3, tp 2: rank 0 holds heads 0-2, which read groups 0, 0, 1.
    assert_matches_single_device(one_layer(ngroups=3, nheads=6), "tp=2,dp=4", True)


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
    cfg = mamba_config()
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
    with pytest.raises(ValueError, match="gives dp twice"):  # the last one was taken
        parallel.make_mesh("dp=4,dp=2,tp=4")


def test_the_mesh_functions_refuse_a_sequence_the_mesh_cannot_split():
    """Two tokens a device under cp=4, fewer than the conv's halo: make_hidden_fn and
    make_loss_fn returned other numbers than one device's, without an error."""
    graphdef, params, _ = model_and_batch(mamba_config())  # the tests' above
    mesh = parallel.make_mesh("dp=2,cp=4")
    specs = parallel.param_specs(params, mesh)
    params = jax.device_put(params, parallel.shardings(mesh, specs))
    ids = jax.device_put(np.zeros((2, 8), np.int32), NamedSharding(mesh, parallel.TOKENS))
    halo = r"sequence length 8 over cp=4 leaves 2 tokens per device, fewer than the conv's halo"
    with pytest.raises(ValueError, match=halo):
        parallel.make_hidden_fn(graphdef, specs, mesh)(params, ids)
    with pytest.raises(ValueError, match=halo):
        parallel.make_loss_fn(graphdef, specs, mesh)(params, ids, ids)
    # targets of another shape are named by the arrays' shapes, not a device's parts'
    with pytest.raises(ValueError, match=r"make_loss_fn: targets has shape \(2, 4\); it takes "
                                         r"one value per token, the inputs' \[batch, seqlen\] "
                                         r"= \(2, 8\)"):
        parallel.make_loss_fn(graphdef, specs, mesh)(params, ids, jax.device_put(
            np.zeros((2, 4), np.int32), NamedSharding(mesh, parallel.TOKENS)))


@pytest.fixture(scope="module")
def one_device_hidden():
    """(graphdef, params, ids [4, 32], one device's hidden states of ids, and of ids again
    continued from the states after ids): one program for both meshes."""
    import jax.numpy as jnp
    from flax import nnx

    from mamba_jax import Mamba2LM

    graphdef, params = nnx.split(Mamba2LM(tiny_config(), rngs=nnx.Rngs(0)))
    ids = np.random.default_rng(0).integers(0, 100, (4, 32)).astype(np.int32)

    @jax.jit
    def hidden(params, ids):
        model = nnx.merge(graphdef, params)
        _, states = model.hidden(ids, return_states=True)
        return model.hidden(ids), model.hidden(ids, initial_states=states)
    return graphdef, params, ids, *hidden(params, jnp.asarray(ids))


@pytest.mark.parametrize("shape,axes", [((2, 4), ("data", "model")),
                                        ((2, 1, 2, 2), ("data", "shard", "seq", "model"))])
def test_hidden_states_on_a_mesh_of_the_users_names_equal_one_devices(shape, axes,
                                                                        one_device_hidden):
    """README's Research use: a mesh named as the user likes, lacking roles or not (the
    specs named fsdp and cp, which a two-axis mesh lacks: a device_put error); its states
    continue a sequence as one device's do."""
    from mamba_jax.sharding import AxisNames

    graphdef, params, ids, want, want_after = one_device_hidden
    mesh = jax.make_mesh(shape, axes)
    names = AxisNames(dp="data", fsdp="shard", cp="seq", tp="model")
    specs = parallel.param_specs(params, mesh, names)
    params = jax.device_put(params, parallel.shardings(mesh, specs))
    placed = jax.device_put(ids, NamedSharding(mesh, parallel.token_spec(names, mesh)))
    hidden, states = parallel.make_hidden_fn(graphdef, specs, mesh, axis_names=names,
                                             return_states=True)(params, placed)
    np.testing.assert_allclose(hidden, want, atol=2e-5)
    after = parallel.make_hidden_fn(graphdef, specs, mesh, axis_names=names)(
        params, placed, initial_states=states)
    np.testing.assert_allclose(after, want_after, atol=2e-5)


def test_nheads_not_divisible_by_tp_names_both_and_the_sizes_that_work():
    cfg = tiny_config(d_model=48)  # nheads 6
    # 3 and 6 divide the heads, not the 8 devices
    with pytest.raises(ValueError, match=r"tp=4 does not divide the 6 heads of "
                                         r"layers\.0\.mixer\..* use tp in \[1, 2\]"):
        parallel.check_layout(cfg, parallel.make_mesh("dp=2,tp=4"))
    with pytest.raises(ValueError, match=r"sequence length 30 is not divisible by cp\*tp = "
                                         r"1\*4"):
        parallel.check_layout(tiny_config(), parallel.make_mesh("dp=2,tp=4"), seq_len=30)
    # a length it suggests is one the mesh splits (it said 12, which cp*tp = 8 does not divide)
    with pytest.raises(ValueError, match=r"fewer than the conv's halo d_conv-1 = 3; use a "
                                         r"sequence of at least 16 tokens"):
        parallel.check_layout(tiny_config(), parallel.make_mesh("cp=4,tp=2"), seq_len=4)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.subprocess
def test_two_processes_of_four_devices_get_the_single_process_losses(tmp_path):
    # One layer: what crosses the processes (the batch's rows, the parameters and their
    # gradients, the checkpoint) is each layer's alike; each process compiles the step.
    args = ["--steps", "3", "--batch-size", "4", "--seq-len", "32", "--mesh", "dp=2,tp=4",
            "--eval-every", "1000", "--set", "d_model=64", "--set", "d_state=16",
            "--set", "headdim=16", "--set", "chunk_size=16", "--set", "n_layer=1"]
    env = dict(os.environ, XLA_FLAGS=xla_flags(4), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.getcwd())  # four devices a process
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "mamba_jax.train", *args, "--out", str(tmp_path / "ck"),
         "--metrics-file", str(tmp_path / "multi.jsonl"),
         "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
         "--process-id", str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for i in range(2)]
    from mamba_jax.train import main
    main([*args, "--out", "none", "--eval-every", "0",  # its evaluation: test_train.py's
          "--metrics-file", str(tmp_path / "single.jsonl")])
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out.decode()[-3000:]
    read = lambda name: [float(re.search(r'"loss": ([\d.e+-]+)', line)[1])
                         for line in (tmp_path / name).read_text().splitlines()]
    single = read("single.jsonl")
    assert len(single) == 3 and np.all(np.isfinite(single))
    np.testing.assert_allclose(read("multi.jsonl"), single, rtol=LOSS_RTOL)
    assert (tmp_path / "ck" / "model.safetensors").is_file()


def test_layers_one_after_the_other_give_the_scans_loss_and_gradients(layer_scans):
    # scan_layers=False (the trainer's default) under fsdp x cp x tp over packed
    # documents, without and with remat "full": no layer scan (so no weight, gradient or
    # residual stack), the same loss and every gradient as the scan without remat (remat
    # changes no value).
    cfg = tiny_config(ngroups=2)
    graphdef, params, batch = model_and_batch(cfg, packed=True)
    mesh = parallel.make_mesh("fsdp=2,cp=2,tp=2")
    specs = parallel.param_specs(params, mesh)
    params = jax.device_put(params, parallel.shardings(mesh, specs))
    batch = jax.device_put(batch, NamedSharding(mesh, parallel.TOKENS))

    def value_and_grads(scan_layers, remat):
        loss = parallel.make_loss_fn(graphdef, specs, mesh, remat=remat,
                                     scan_layers=scan_layers)
        return jax.jit(jax.value_and_grad(loss), compiler_options=FAST_COMPILE)(params, *batch)
    unscanned = {remat: value_and_grads(False, remat) for remat in ("none", "full")}
    assert not layer_scans
    ref_value, ref_grads = value_and_grads(True, "none")
    assert layer_scans
    for remat, (value, grads) in unscanned.items():
        assert np.isfinite(float(value))
        np.testing.assert_allclose(value, ref_value, rtol=LOSS_RTOL, err_msg=remat)
        for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads),
                                jax.tree.leaves(ref_grads)):
            np.testing.assert_allclose(g, r, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                       err_msg=f"{remat} {jax.tree_util.keystr(path)}")
