"""Training checkpoints through Orbax: async, atomic, restorable onto any mesh.

    ckpt = Checkpointer("runs/x/checkpoints", keep=3)
    ckpt.save(step, {"params": params, "opt_state": opt_state}, meta={"data_step": ...})
    restored = ckpt.restore_latest(abstract_state)    # None when there is no checkpoint
    ckpt.close()

Each checkpoint is a step directory holding the train state (an Orbax PyTree checkpoint) and
a JSON `meta` item (the step, the data position, the effective config, ...). Orbax writes to
a temporary directory and renames it when complete, so a crash mid-save leaves the previous
checkpoints untouched and the partial one invisible. The state is restored straight into the
shardings of `abstract_state` (jax.ShapeDtypeStruct leaves with `sharding`), so a run saved
on one mesh resumes on another with no conversion step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """A CheckpointManager keeping the newest `keep` checkpoints under `directory`."""

    def __init__(self, directory, keep: int = 3, async_save: bool = True):
        if keep < 1:
            raise ValueError(f"--keep={keep} must be >= 1")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "meta"))

    def save(self, step: int, state, meta: dict) -> None:
        """Start saving `state` (a pytree of arrays) and `meta` (JSON) as checkpoint `step`;
        returns once the arrays are copied off the devices, the write goes on behind."""
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore_latest(self, abstract_state, check_meta=None, log=None):
        """(step, state, meta) of the newest checkpoint that restores, or None if there is
        no checkpoint.

        check_meta(step, meta) runs on each candidate's meta before its arrays are read and
        may raise (a checkpoint of another model is an error, not a reason to go back). A
        checkpoint that fails to read (corrupt or truncated files) is reported and the one
        before it is tried; when none restores, that is an error too: starting over would
        write over them.
        """
        steps = self.steps()
        for step in reversed(steps):
            try:
                meta = self.manager.restore(step, args=ocp.args.Composite(
                    meta=ocp.args.JsonRestore())).meta
            except Exception as error:  # noqa: BLE001 - Orbax and TensorStore raise many kinds
                self._report(step, error, log)
                continue
            if check_meta is not None:
                check_meta(step, meta)
            try:
                state = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state))).state
            except Exception as error:  # noqa: BLE001
                self._report(step, error, log)
                continue
            return step, state, meta
        if steps:
            raise RuntimeError(f"none of the checkpoints {steps} in {self.directory} could be "
                               "restored (see above); move them away to start over")
        return None

    def _report(self, step, error, log):
        print(f"checkpoint {self.directory / str(step)} cannot be restored "
              f"({type(error).__name__}: {str(error)[:200]}); trying the one before",
              file=log or sys.stderr)

    def wait(self) -> None:
        """Block until every save in flight is committed."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(tree, shardings=None):
    """ShapeDtypeStructs of `tree` placed on `shardings` (a matching pytree), or on each
    array's current sharding when None: the target that restore_latest fills."""
    if shardings is None:
        shardings = jax.tree.map(lambda x: x.sharding, tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)
