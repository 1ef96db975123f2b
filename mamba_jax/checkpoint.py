"""Training checkpoints through Orbax: async, atomic, restorable onto any mesh.

    ckpt = Checkpointer("runs/x/checkpoints", keep=3)
    ckpt.save(step, {"params": params, "opt_state": opt_state}, meta={"data_step": ...})
    ckpt.check()                                      # raises if a background save failed
    restored = ckpt.restore_latest(abstract_state)    # None when there is no checkpoint
    ckpt.close()

Each checkpoint is a step directory holding the train state (an Orbax PyTree checkpoint) and
a JSON `meta` item (the step, the data position, the effective config, ...). Orbax writes to
a temporary directory and renames it when complete, so a crash mid-save leaves the previous
checkpoints untouched and the partial one invisible. The state is restored straight into the
shardings of `abstract_state` (jax.ShapeDtypeStruct leaves with `sharding`), so a run saved
on one mesh resumes on another with no conversion step.

Each checkpoint's meta records a checksum of every array it holds (`checksums`), computed on
the devices as it is saved and again after a restore: Orbax reads bytes changed on disk
without complaint (a flipped byte is a wrong weight), so a checkpoint whose arrays differ from
what was saved counts as one that cannot be read.

A save that fails (a full disk, a lost mount) is a CheckpointSaveError of one line, raised by
the next check / save / wait / close, with Orbax's partial directory of that step removed;
the checkpoints before it stay as they were. A checkpoint that cannot be read is set aside
(renamed `<step>.corrupt-<time>`, never deleted) once an older one has restored, so that the
next save of that step is not refused and later resumes do not trip over it again.
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import sys
import time
import traceback
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils


class CheckpointSaveError(OSError):
    """A checkpoint could not be written: the run must stop (its message says which)."""


class ChangedArrays(ValueError):
    """A restored checkpoint's arrays are not those that were saved (bytes changed on disk)."""


_CHECKSUMS = "array_checksums"  # meta's key for them; read_meta returns meta without it
# A state's parts as the commands name them; unread_damage reads at most this many bytes
# at a time.
_PART_NAMES = {"opt_state": "optimizer state", "params": "weights"}
_CHECK_BYTES = 1 << 30


@jax.jit
def _checksum(x: jax.Array) -> jax.Array:
    """uint32: the sum, wrapping, of x's bits as 32-bit words, each times an odd weight of
    its position (2i + 1). Integer sums do not depend on their order, so the value is the
    same on any mesh; a changed word (odd weight) or two swapped ones change it."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if x.dtype.itemsize == 8:
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
    else:
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    index = jnp.zeros(words.shape, jnp.uint32)
    for axis in range(words.ndim):  # the row-major position, wrapping past 2^32 words
        index = index * words.shape[axis] + jax.lax.broadcasted_iota(jnp.uint32, words.shape,
                                                                     axis)
    return jnp.sum(words * (2 * index + 1), dtype=jnp.uint32)


def checksums(tree) -> dict[str, int]:
    """{path: checksum} of every array in `tree` (jax.tree_util.keystr paths). A program a
    shape, not one for the tree: a model's layers share a few shapes, so the first call
    compiles a few small programs rather than one large one, in less time."""
    sums = jax.device_get(jax.tree.map(_checksum, tree))
    return {jax.tree_util.keystr(path): int(value)
            for path, value in jax.tree_util.tree_leaves_with_path(sums)}


def _path_key(path: str) -> tuple[str, ...]:
    """A keystr path as its keys alone: "['opt_state'][1][0].mu['layers'][0]" and the
    same tree read back from Orbax's metadata, "['opt_state'][1][0]['mu']['layers']['0']",
    are both ('opt_state', '1', '0', 'mu', 'layers', '0')."""
    return tuple(a or b or c for a, b, c in re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)", path))


def _check_checksums(tree, saved: dict | None) -> None:
    """ChangedArrays where an array of `tree` (restored; Orbax's PLACEHOLDER leaves, not
    read, are skipped) has another checksum than `saved` (a checkpoint's record, None in
    those written before it); paths it lacks are not checked."""
    if saved is None:
        return
    saved = {_path_key(path): value for path, value in saved.items()}
    read = jax.tree.map(lambda x: None if x is ocp.PLACEHOLDER else x, tree)
    changed = [path for path, value in checksums(read).items()
               if saved.get(_path_key(path), value) != value]
    if changed:
        raise ChangedArrays(f"{len(changed)} of its arrays differ from what was saved "
                            f"({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}): "
                            "its files were changed or damaged")


class _WithoutOrbaxTracebacks(logging.Filter):
    """Drops the tracebacks Orbax logs (through absl) from its background threads when a
    save fails: that failure reaches the caller as one CheckpointSaveError line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and "orbax" in record.pathname)


_restore_failed = False  # whether a restore has failed in this process (_report)


def _from_a_failed_restore(error: BaseException | None, tb) -> bool:
    """Whether an exception nothing retrieved is a straggler of a failed restore: an Orbax
    read's failure, TensorStore calling back into Orbax's closed event loop, or, once a
    restore has failed, a read's failure that TensorStore set on its future (no Python
    frames)."""
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    frames = traceback.extract_tb(tb)
    return (any("/orbax/" in frame.filename for frame in frames)
            or _restore_failed and error is not None and not frames)


class _WithoutFailedRestoreReads(logging.Filter):
    """Drops asyncio's "... exception was never retrieved" logs (of tasks, futures and
    gatherings) of a failed restore's reads (_quiet_failed_restores)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error, tb = record.exc_info[1:] if record.exc_info else (None, None)
        return not ("exception was never retrieved" in record.getMessage()
                    and _from_a_failed_restore(error, tb))


def _quiet_failed_restores() -> None:
    """When one read of a checkpoint fails, Orbax gives the restore up (reported in one
    line, _report) while its other reads still finish: their failures surface as
    unraisable exceptions (in Orbax's coroutines, and in TensorStore's callbacks into the
    closed event loop) and as asyncio's logs of unretrieved failures, each with its
    traceback: thousands of lines for a model's state, some before the restore's own
    error reaches us, some through the rest of the run. Those alone are dropped; any other
    unraisable exception still reaches the hook before."""
    if getattr(sys.unraisablehook, "quiets_failed_restores", False):
        return
    before = sys.unraisablehook

    def hook(unraisable):
        if not _from_a_failed_restore(unraisable.exc_value, unraisable.exc_traceback):
            before(unraisable)
    hook.quiets_failed_restores = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_WithoutFailedRestoreReads())
    # a read that the failure left unstarted, collected
    warnings.filterwarnings("ignore", category=RuntimeWarning, message=(
        "coroutine '_read_array_index_and_device_put' was never awaited"))


def _reason(error: Exception) -> str:
    """A failed read in one line: TensorStore's errors end in a dump of the store's spec,
    which says nothing more."""
    return f"{type(error).__name__}: " + str(error).split(" See full TensorStore details")[0][:200]


class Checkpointer:
    """A CheckpointManager keeping the newest `keep` checkpoints under `directory`.

    `read_only`: for reading the checkpoints of a run (that may still be writing): the
    directory is neither created nor pruned. (Orbax's own read_only option says so in four
    log lines each time.)
    """

    def __init__(self, directory, keep: int = 3, async_save: bool = True,
                 read_only: bool = False):
        if keep < 1:
            raise ValueError(f"--keep={keep} must be >= 1")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=None if read_only else keep,
                                               create=not read_only,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "meta"))
        self.in_flight = None  # the step being written in the background
        self.failure = None  # the CheckpointSaveError raised, once one was
        self.closed = False
        self._quiet = _WithoutOrbaxTracebacks()
        logging.getLogger("absl").addFilter(self._quiet)

    def save(self, step: int, state, meta: dict) -> None:
        """Start saving `state` (a pytree of arrays) and `meta` (JSON) as checkpoint `step`;
        returns once the arrays are copied off the devices, the write goes on behind."""
        self.wait()  # a failure of the previous save is reported as that step's
        meta = {**meta, _CHECKSUMS: checksums(state)}
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        except Exception as error:  # noqa: BLE001 - Orbax and TensorStore raise many kinds
            raise self._failed(step, error) from None
        self.in_flight = step

    def check(self) -> None:
        """Raise the CheckpointSaveError of a background save that has failed; return at once
        while it is still running (call it every step to stop as soon as a save fails)."""
        if self.in_flight is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Block until every save in flight is committed; CheckpointSaveError if one failed."""
        step, self.in_flight = self.in_flight, None
        if step is None:
            return
        try:
            self.manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001
            raise self._failed(step, error) from None

    def _failed(self, step: int, error: Exception) -> CheckpointSaveError:
        """Remove the partial directory of `step` and say what is left."""
        if jax.process_index() == 0:
            for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
        self.manager.reload()
        kept = self.steps()
        reason = (str(error).splitlines() or [""])[0][:300]
        self.failure = CheckpointSaveError(
            f"checkpoint {step} could not be written to {self.directory} "
            f"({type(error).__name__}: {reason}); "
            + (f"the newest complete checkpoint is step {kept[-1]}, untouched"
               if kept else "no complete checkpoint was written")
            + ". Free space (or fix the directory), then resume")
        return self.failure

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore_latest(self, abstract_state, check_meta=None, log=None):
        """(step, state, meta) of the newest checkpoint that restores, or None if there is
        no checkpoint.

        check_meta(step, meta) runs on each candidate's meta before its arrays are read and
        may raise (a checkpoint of another model is an error, not a reason to go back). A
        checkpoint that fails to read (corrupt or truncated files, or arrays other than
        their checksums say) is reported and the one before it is tried; once one
        restores, the unreadable newer ones are set aside (renamed <step>.corrupt-<time>).
        When none restores, that is an error: starting over would write over them.
        """
        log = log or sys.stderr
        _quiet_failed_restores()
        steps, unreadable = self.steps(), []
        for step in reversed(steps):
            try:
                meta = dict(self._meta(step))  # one read: the caller's meta, the sums
                saved = meta.pop(_CHECKSUMS, None)
            except Exception as error:  # noqa: BLE001 - Orbax and TensorStore raise many kinds
                unreadable.append(self._report(step, error, log))
                continue
            if check_meta is not None:
                check_meta(step, meta)
            try:
                state = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state))).state
                _check_checksums(state, saved)
            except Exception as error:  # noqa: BLE001
                unreadable.append(self._report(step, error, log))
                continue
            self._set_aside(unreadable, step, log)
            return step, state, meta
        if steps:
            raise RuntimeError(f"none of the checkpoints {steps} in {self.directory} could be "
                               "restored (see above); move them away to start over")
        return None

    def read_newest(self, read, step: int | None = None, log=None):
        """(step, read(step)) of the newest checkpoint that `read` succeeds on, or of `step`
        alone where given: for the commands that only read a run's checkpoints (generate,
        serve, convert), while the run may still write and prune them. One that cannot be
        read (corrupt, or removed by the run's --keep meanwhile) is said in one line, naming
        the step read instead, and the one before it tried; nothing is set aside.
        ValueError when none can be read."""
        global _restore_failed
        log = log or sys.stderr
        _quiet_failed_restores()
        steps, unreadable = self.steps(), []
        for candidate in reversed(steps) if step is None else [step]:
            try:
                result = read(candidate)
            except Exception as error:  # noqa: BLE001 - Orbax and TensorStore raise many kinds
                _restore_failed = True  # its reads' stragglers are quieted too
                if step is not None:
                    raise ValueError(f"checkpoint {self.directory / str(step)} cannot be read "
                                     f"({_reason(error)})") from None
                unreadable.append((candidate, _reason(error)))
                continue
            for bad, why in unreadable:
                print(f"checkpoint {self.directory / str(bad)} cannot be read ({why}): read "
                      f"step {candidate} instead (train --resume would set step {bad} aside)",
                      file=log)
            return candidate, result
        for bad, why in unreadable:
            print(f"checkpoint {self.directory / str(bad)} cannot be read ({why})", file=log)
        raise ValueError(f"none of the checkpoints {steps} in {self.directory} can be read "
                         "(see above)")

    def unread_damage(self, step: int, read: str = "params") -> str | None:
        """What of checkpoint `step`'s state other than its part `read` cannot be restored
        (unreadable, or its arrays not those saved), in a phrase naming the parts (the
        optimizer state, ...) and the first failure; None where all of it restores. For
        the commands that read the weights alone, to say what train --resume would refuse.
        Read onto one device (the CPU's where jax has one) at most _CHECK_BYTES at a time,
        each piece dropped once its checksums are compared."""
        global _restore_failed
        _quiet_failed_restores()
        try:
            tree = ocp.PyTreeCheckpointHandler().metadata(self.directory / str(step) / "state")
            tree = {key: part for key, part in getattr(tree, "tree", tree).items()
                    if key != read}
        except Exception as error:  # noqa: BLE001
            return f"its state's metadata cannot be read ({_reason(error)})"
        names = ", ".join(_PART_NAMES.get(key, key) for key in tree)
        try:
            device = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        except RuntimeError:  # a jax without its CPU backend (JAX_PLATFORMS=cuda)
            device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        size = lambda leaf: math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
        start, saved = 0, self.saved_checksums(step)
        while start < len(leaves):
            end, total = start + 1, size(leaves[start])
            while end < len(leaves) and total + size(leaves[end]) <= _CHECK_BYTES:
                total, end = total + size(leaves[end]), end + 1
            piece = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device)
                     if start <= i < end else ocp.PLACEHOLDER for i, leaf in enumerate(leaves)]
            try:
                self.restore_part(step, jax.tree_util.tree_unflatten(treedef, piece), saved)
            except Exception as error:  # noqa: BLE001
                _restore_failed = True
                return f"its {names} cannot be read ({_reason(error)})"
            start = end
        return None

    def _report(self, step: int, error: Exception, log) -> int:
        global _restore_failed
        _restore_failed = True
        print(f"checkpoint {self.directory / str(step)} cannot be restored ({_reason(error)}); "
              "trying the one before", file=log)
        return step

    def _meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore())).meta

    def read_meta(self, step: int) -> dict:
        """The JSON meta saved with checkpoint `step` (as given to save)."""
        meta = dict(self._meta(step))
        meta.pop(_CHECKSUMS, None)
        return meta

    def saved_checksums(self, step: int) -> dict | None:
        """{path: checksum} of the arrays checkpoint `step` holds, as recorded when it was
        saved (None for a checkpoint written before they were)."""
        return self._meta(step).get(_CHECKSUMS)

    def restore_part(self, step: int, abstract_part, checksums: dict | None = None):
        """The subtree of checkpoint `step`'s state that `abstract_part` describes (e.g.
        {"params": ...} without the optimizer state; a leaf Orbax's PLACEHOLDER is not
        read), read into its shardings; ChangedArrays where its arrays are not those that
        were saved (`checksums`: the step's record, read here where not given)."""
        part = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item=abstract_part,
                restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_part),
                partial_restore=True))).state
        _check_checksums(part, self.saved_checksums(step) if checksums is None else checksums)
        return part

    def _set_aside(self, steps: list[int], restored: int, log) -> None:
        """Rename the unreadable checkpoints `steps` to <step>.corrupt-<time> (on process 0,
        the others waiting), so that Orbax no longer counts them."""
        if not steps:
            return
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for step in steps:
            target = self.directory / f"{step}.corrupt-{stamp}"
            if jax.process_index() == 0:
                (self.directory / str(step)).rename(target)
            print(f"checkpoint {step} set aside as {target}: it cannot be restored, and the "
                  f"run goes on from step {restored}", file=log)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("mamba_jax checkpoints set aside")
        self.manager.reload()

    def close(self) -> None:
        """Wait for the saves in flight (CheckpointSaveError if one failed) and release;
        closing again does nothing."""
        if self.closed:
            return
        self.closed = True
        try:
            self.wait()
            try:
                self.manager.close()
            except Exception:  # noqa: BLE001
                if self.failure is None:
                    raise
                # else Orbax raises the failed save once more: it has been reported.
        finally:
            logging.getLogger("absl").removeFilter(self._quiet)


def abstract_like(tree, shardings=None):
    """ShapeDtypeStructs of `tree` placed on `shardings` (a matching pytree), or on each
    array's current sharding when None: the target that restore_latest fills."""
    if shardings is None:
        shardings = jax.tree.map(lambda x: x.sharding, tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)
