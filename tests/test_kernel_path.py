"""The Mamba2 layer's training path on the kernels equals the XLA path (the conv, then the
chunked scan, the norm and out_proj, differentiated by JAX): logits, loss and every gradient
of a float32 model, on one device and under tp and tp x cp meshes (8 fake CPU devices), on
an odd length over packed documents, and continued from the states of the sequence before it
(the conv's window and the SSM's state, gradients into both) under each --remat choice;
and a prefill's returned states. The residual stream's add and norm run on their kernels
too (pallas_kernels.norm.add_rms_norm, every layer's norm and norm_f). On
the kernels the layer runs as one custom_vjp (pallas_kernels.mamba2_mixer) on every mesh:
each rank's whole groups, or every group's B and C on each rank where tp does not divide
them (its heads reading theirs, the norm's groups spanning ranks), and under cp (the conv's
halo from the previous device, the scan's state across devices). The kernels run in
Pallas's interpreter.

Tolerances: logits and loss within 1e-5 absolute; every gradient within 1e-5 absolute +
1e-4 relative (the kernels sum the same float32 products in another order; seen ~1e-6).
"""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from mamba_jax import parallel
from mamba_jax.sharding import param_name
from mesh_check import (FAST_COMPILE, GRAD_ATOL, GRAD_RTOL, LOGIT_ATOL, mamba_config,
                        model_and_batch, reference_loss, take_the_kernels)

SEQ = 44  # cp parts of 22, tp shards of 11: no multiple of the kernels' chunk


def loss_and_grads(cfg, mesh_spec=None):
    """(loss, gradients) of the packed batch: one device's or the sharded loss's."""
    graphdef, params, batch = model_and_batch(cfg, seq_len=SEQ, packed=True)
    if mesh_spec is None:
        loss = reference_loss(graphdef)
    else:
        mesh = parallel.make_mesh(mesh_spec)
        specs = parallel.param_specs(params, mesh)
        params = jax.device_put(params, parallel.shardings(mesh, specs))
        batch = jax.device_put(batch, NamedSharding(mesh, parallel.TOKENS))
        loss = parallel.make_loss_fn(graphdef, specs, mesh, sequence_parallel=True)
    return jax.jit(jax.value_and_grad(loss), compiler_options=FAST_COMPILE)(params, *batch)


@pytest.mark.parametrize("ngroups,mesh_specs,D_has_hdim", [
    (8, ["tp=4,dp=2"], False),     # each rank's heads and groups (one device at 8 groups:
                                   # test_kernel_path_continues_from_states)
    (2, ["tp=4,dp=2"], False),     # each rank's heads read one of 2 groups, which spans 2
                                   # ranks
    (1, [None,                     # pallas_kernels.mamba2_mixer; D [h, p]
         "cp=2,tp=2,dp=2"], True), # the conv's halo and the scan's state cross devices; the
                                   # one group spans the tp ranks; D split by heads
], ids=["g8-tp4", "g2-tp4", "g1-one_device-cp2-tp2-D_has_hdim"])
def test_kernel_path_equals_the_xla_path(monkeypatch, ngroups, mesh_specs, D_has_hdim):
    # Each mesh (None: one device) on the kernels against the one XLA reference.
    cfg = mamba_config(ngroups=ngroups).replace(n_layer=1,
                                                **{"mamba2.D_has_hdim": D_has_hdim})
    value, grads = loss_and_grads(cfg)
    assert np.isfinite(float(value))
    reference = dict(jax.tree_util.tree_leaves_with_path(grads))
    calls = take_the_kernels(monkeypatch)
    for mesh_spec in mesh_specs:
        calls.clear()
        kernel_value, kernel_grads = loss_and_grads(cfg, mesh_spec)
        assert calls, mesh_spec  # one custom_vjp on the kernels
        np.testing.assert_allclose(kernel_value, value, rtol=0, atol=LOGIT_ATOL,
                                   err_msg=str(mesh_spec))
        for path, g in jax.tree_util.tree_leaves_with_path(kernel_grads):
            np.testing.assert_allclose(g, reference[path], rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                       err_msg=f"{mesh_spec}: {param_name(path)}")


CUT = 13  # the first piece: states of a document that goes on past it in some rows


def second_piece(remat, params, states):
    """(value, (d params, d states)) of a fixed projection of the second piece's hidden
    states, continued from `states` (2 layers)."""
    cfg = mamba_config(ngroups=8).replace(n_layer=2)
    graphdef, _, (ids, _, seq_idx) = model_and_batch(cfg, seq_len=SEQ, packed=True)
    weight = np.random.default_rng(4).standard_normal(ids[:, CUT:].shape + (cfg.d_model,))

    def objective(params, states):
        return (nnx.merge(graphdef, params).hidden(ids[:, CUT:], seq_idx[:, CUT:],
                                                   initial_states=states, remat=remat)
                * weight).sum()
    return jax.jit(jax.value_and_grad(objective, (0, 1)),
                   compiler_options=FAST_COMPILE)(params, states)


@pytest.fixture(scope="module")
def continued():
    """(params, the first piece's states, the XLA path's value and gradients without
    remat): the reference each --remat choice on the kernels is compared with."""
    cfg = mamba_config(ngroups=8).replace(n_layer=2)
    graphdef, params, (ids, _, seq_idx) = model_and_batch(cfg, seq_len=SEQ, packed=True)
    _, states = jax.jit(lambda p: nnx.merge(graphdef, p).hidden(
        ids[:, :CUT], seq_idx[:, :CUT], return_states=True))(params)
    return params, states, second_piece("none", params, states)


@pytest.mark.parametrize("remat", ["none", "block", "full"])
def test_kernel_path_continues_from_states(monkeypatch, continued, remat):
    # The kernel path under each --remat choice against the XLA path without remat.
    params, states, (value, grads) = continued
    calls = take_the_kernels(monkeypatch)
    kernel_value, kernel_grads = second_piece(remat, params, states)
    assert calls  # the conv window before the first token read by the fused mixer
    assert np.isfinite(float(value))
    np.testing.assert_allclose(kernel_value, value, rtol=0, atol=LOGIT_ATOL * abs(float(value)))
    reference = dict(jax.tree_util.tree_leaves_with_path(grads))
    assert any(np.abs(g).max() > 0 for g in jax.tree.leaves(grads[1]))  # states matter
    for path, g in jax.tree_util.tree_leaves_with_path(kernel_grads):
        # Against the parameter's largest gradient (this objective sums ~1e3 terms, so
        # gradients reach ~1e2): D's, a sum of x * dy over every position, differs by up to
        # 6e-5 of its largest entry with or without states (float32 sums in another order).
        r = reference[path]
        np.testing.assert_allclose(g, r, rtol=GRAD_RTOL, atol=1e-4 * np.abs(r).max(),
                                   err_msg=jax.tree_util.keystr(path))


def test_kernel_path_returns_the_states_of_the_xla_path(monkeypatch):
    # A prefill's states (return_states: the conv's last inputs and the SSM state) from the
    # one custom_vjp on the kernels equal the XLA path's, over packed documents.
    cfg = mamba_config(ngroups=8).replace(n_layer=1)
    graphdef, params, (ids, _, seq_idx) = model_and_batch(cfg, seq_len=SEQ, packed=True)
    hidden = lambda p: nnx.merge(graphdef, p).hidden(ids, seq_idx, return_states=True)
    value, states = jax.jit(hidden)(params)
    calls = take_the_kernels(monkeypatch)
    # a new function, so that jit traces it anew rather than reuse the XLA path's trace
    kernel_value, kernel_states = jax.jit(lambda p: hidden(p))(params)
    assert calls
    np.testing.assert_allclose(kernel_value, value, rtol=0, atol=LOGIT_ATOL)
    leaves = jax.tree_util.tree_leaves_with_path(states)
    assert leaves and all(np.abs(s).max() > 0 for _, s in leaves)
    for (path, s), k in zip(leaves, jax.tree.leaves(kernel_states)):
        np.testing.assert_allclose(k, s, rtol=0, atol=1e-5 * np.abs(s).max(),
                                   err_msg=jax.tree_util.keystr(path))
