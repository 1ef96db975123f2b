import errno
import io
import os
import shutil
import time

import jax
import pytest
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import orbax.checkpoint as ocp

from mamba_jax.checkpoint import (ChangedArrays, CheckpointSaveError, Checkpointer,
                                  abstract_like, checksums)


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


_RESTORE = """
import gc, sys
import jax, jax.numpy as jnp
from mamba_jax.checkpoint import Checkpointer, abstract_like
state = {f"w{i}": jax.random.normal(jax.random.key(i), (64, 32)) for i in range(40)}
if sys.argv[2] == "save":
    ckpt = Checkpointer(sys.argv[1])
    for step in (1, 2):
        ckpt.save(step, state, {})
    ckpt.close()
else:
    step, _, _ = Checkpointer(sys.argv[1]).restore_latest(abstract_like(state))
    gc.collect()
    print("restored", step)
"""


def test_a_corrupt_checkpoint_is_one_line_not_its_reads_tracebacks(tmp_path):
    """Orbax gives up a restore at its first failed read while the others finish: their
    failures (unraisable exceptions, asyncio's unretrieved ones, TensorStore's callbacks
    into the closed event loop) printed thousands of lines of tracebacks beside the one
    line that says the checkpoint cannot be restored. In a process of its own, as the
    trainer's: they come while the process collects them."""
    import subprocess
    import sys

    run = lambda what: subprocess.run([sys.executable, "-c", _RESTORE, str(tmp_path), what],
                                      capture_output=True, text=True, timeout=300,
                                      env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run("save").returncode == 0
    rng = np.random.default_rng(0)
    for shard in (tmp_path / "2" / "state").glob("ocdbt.process_*/d/*"):
        shard.write_bytes(rng.bytes(shard.stat().st_size))  # every read of step 2 fails
    restored = run("restore")
    assert restored.stdout == "restored 1\n"
    err = restored.stderr.splitlines()
    assert len(err) == 2, restored.stderr[:3000]
    assert err[0].startswith(f"checkpoint {tmp_path / '2'} cannot be restored (")
    assert "See full TensorStore details" not in err[0]
    assert err[1].startswith("checkpoint 2 set aside as ")


def _change_a_byte(step_dir):
    """Flip one byte amid a checkpoint's largest array data file, where a random float32
    array's bytes are stored as they are (they do not compress): Orbax reads it back
    without complaint."""
    data = max(step_dir.glob("state/**/d/*"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(raw)


def big_state(seed):
    return {"params": {"w": jax.random.normal(jax.random.key(seed), (256, 256))},
            "opt_state": (jnp.int32(seed),)}


def test_arrays_changed_on_disk_are_caught_by_their_checksums(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, big_state(1), {"data_step": 1})
    ckpt.save(2, big_state(2), {"data_step": 2})
    ckpt.close()
    _change_a_byte(tmp_path / "2")
    # What Orbax alone reads: a changed weight, no error.
    manager = ocp.CheckpointManager(tmp_path, item_names=("state", "meta"))
    read = manager.restore(2, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_like(big_state(0))))).state
    assert not np.array_equal(np.asarray(read["params"]["w"]),
                              np.asarray(big_state(2)["params"]["w"]))
    manager.close()
    with pytest.raises(ChangedArrays, match=r"1 of its arrays differ from what was saved "
                                            r"\(\['params'\]\['w'\]\): its files were "
                                            r"changed or damaged"):
        Checkpointer(tmp_path, read_only=True).restore_part(
            2, {"params": abstract_like(big_state(0))["params"]})
    log = io.StringIO()
    ckpt = Checkpointer(tmp_path)
    step, restored, meta = ckpt.restore_latest(abstract_like(big_state(0)), log=log)
    assert step == 1 and meta == {"data_step": 1}  # the checksums are not the caller's meta
    assert_same(restored, big_state(1))
    assert "checkpoint 2 set aside as " in log.getvalue()
    ckpt.close()


def test_checksums_are_the_same_on_any_mesh_and_old_checkpoints_still_restore(tmp_path):
    one = big_state(3)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
    sharded = jax.device_put(one, jax.tree.map(
        lambda x: NamedSharding(mesh, P("dp", "tp") if x.ndim == 2 else P()), one))
    assert checksums(sharded) == checksums(one)
    w = one["params"]["w"]
    swapped = {**one, "params": {"w": w.at[0, :2].set(w[0, 1::-1])}}  # two entries swapped
    assert checksums(swapped)["['params']['w']"] != checksums(one)["['params']['w']"]
    # A checkpoint written before the checksums (meta without them) restores.
    manager = ocp.CheckpointManager(tmp_path, item_names=("state", "meta"))
    manager.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(one),
                                            meta=ocp.args.JsonSave({"data_step": 3})))
    manager.close()
    step, restored, _ = Checkpointer(tmp_path).restore_latest(abstract_like(one))
    assert step == 3
    assert_same(restored, one)


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


def _truncate_array_data(step_dir):
    """Cut every array data file of a checkpoint's state to half its size."""
    for data in step_dir.glob("state/**/d/*"):
        os.truncate(data, data.stat().st_size // 2)


def test_an_unreadable_newest_checkpoint_is_set_aside_and_its_step_saved_again(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=3)
    ckpt.save(1, state(1), {"data_step": 1})
    ckpt.save(2, state(2), {"data_step": 2})
    ckpt.close()
    _truncate_array_data(tmp_path / "2")
    log = io.StringIO()
    ckpt = Checkpointer(tmp_path)
    step, restored, _ = ckpt.restore_latest(abstract_like(state(0)), log=log)
    assert step == 1
    assert_same(restored, state(1))
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("2.corrupt-")]
    assert len(aside) == 1 and (aside[0] / "state").is_dir()  # kept, not deleted
    assert f"checkpoint 2 set aside as {aside[0]}" in log.getvalue()
    assert ckpt.steps() == [1]
    ckpt.save(2, state(22), {"data_step": 2})  # the resumed run reaches step 2 again
    ckpt.close()
    step, restored, _ = Checkpointer(tmp_path).restore_latest(abstract_like(state(0)))
    assert step == 2
    assert_same(restored, state(22))


def test_a_save_that_fails_is_one_error_and_keeps_the_previous_checkpoint(
        tmp_path, monkeypatch, caplog):
    from orbax.checkpoint._src.serialization import serialization

    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, state(1), {})
    ckpt.wait()

    async def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(serialization, "async_serialize_from_host", disk_full)
    ckpt.save(2, state(2), {})  # the arrays are written in the background
    deadline = time.monotonic() + 30
    with pytest.raises(CheckpointSaveError) as failed:
        while time.monotonic() < deadline:
            ckpt.check()
            time.sleep(0.01)
    message = str(failed.value)
    assert "checkpoint 2 could not be written" in message and "No space left" in message
    assert "the newest complete checkpoint is step 1, untouched" in message
    assert len(message.splitlines()) == 1
    ckpt.close()  # the failure was reported once: closing does not raise it again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]  # no partial directory
    assert not [r for r in caplog.records if r.exc_info]  # Orbax's tracebacks held back
    monkeypatch.undo()
    step, restored, _ = Checkpointer(tmp_path).restore_latest(abstract_like(state(0)))
    assert step == 1
    assert_same(restored, state(1))
