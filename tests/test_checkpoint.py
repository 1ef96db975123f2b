import shutil

import jax
import pytest
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mamba_jax.checkpoint import Checkpointer, abstract_like


def state(seed):
    rng = np.random.default_rng(seed)
    return {"params": {"w": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
                       "b": jnp.asarray(rng.standard_normal(4), jnp.float32)},
            "opt_state": (jnp.int32(seed), jnp.asarray(rng.standard_normal((8, 4)), jnp.float32))}


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_restores_the_newest_checkpoint_and_keeps_only_keep(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (10, 20, 30):
        ckpt.save(step, state(step), {"data_step": step, "config": {"d_model": 8}})
    ckpt.wait()
    assert ckpt.steps() == [20, 30]
    step, restored, meta = ckpt.restore_latest(abstract_like(state(0)))
    assert step == 30 and meta == {"data_step": 30, "config": {"d_model": 8}}
    assert_same(restored, state(30))
    ckpt.close()


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    ckpt = Checkpointer(tmp_path, keep=3)
    ckpt.save(1, state(1), {"data_step": 1})
    ckpt.save(2, state(2), {"data_step": 2})
    ckpt.close()
    shutil.rmtree(tmp_path / "2" / "state" / "d")  # the array data lost
    step, restored, _ = Checkpointer(tmp_path).restore_latest(abstract_like(state(0)))
    assert step == 1
    assert_same(restored, state(1))
    assert "cannot be restored" in capsys.readouterr().err


def test_when_no_checkpoint_restores_it_is_an_error_not_a_fresh_start(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, state(1), {})
    ckpt.close()
    shutil.rmtree(tmp_path / "1" / "state" / "d")
    with pytest.raises(RuntimeError, match=r"none of the checkpoints \[1\].*could be restored"):
        Checkpointer(tmp_path).restore_latest(abstract_like(state(0)))


def test_an_unfinished_save_is_invisible(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, state(1), {})
    ckpt.close()
    # What a save killed mid-write leaves: Orbax's temporary directory, never renamed.
    (tmp_path / "2.orbax-checkpoint-tmp-123").mkdir()
    assert Checkpointer(tmp_path).steps() == [1]


def test_restore_onto_another_mesh(tmp_path):
    devices = jax.devices()[:4]
    one = state(5)
    writer = Checkpointer(tmp_path)
    writer.save(5, one, {})
    writer.close()
    ckpt = Checkpointer(tmp_path)
    mesh = jax.sharding.Mesh(np.asarray(devices).reshape(2, 2), ("dp", "tp"))
    sharded = jax.tree.map(lambda x: NamedSharding(mesh, P("tp") if x.ndim == 2 else P()),
                           one)
    _, restored, _ = ckpt.restore_latest(abstract_like(one, sharded))
    assert restored["params"]["w"].sharding == sharded["params"]["w"]
    assert_same(restored, one)
