"""Writing files that users keep: a path checked before the work that will write it, an
exclusive lock on a directory, and replacing a file so that a crash leaves the old version
or the new one, never half of one."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

LOCK_NAME = ".lock"


def check_writable(name: str, path, folder: bool) -> None:
    """Refuse (ValueError naming `name`, the input, and `path`) a path that could not be
    written when the work comes to it (an export after training, a first checkpoint): a file
    where a folder is asked for or the reverse, a file on the way to it, or a folder this
    user may not write in. Checked before the work, so that none is lost to it."""
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        found, asked = ("a file", "a folder") if folder else ("a folder", "a file")
        raise ValueError(f"{name} {path}: {found}, not {asked}; give another path")
    nearest = next(p for p in (path, *path.parents) if p.exists())
    if nearest != path and not nearest.is_dir():
        raise ValueError(f"{name} {path}: {nearest} is a file, not a folder; give another path")
    # Written to rather than asked (os.access): root passes that check where writing fails
    # (a read-only or virtual file system, a root-squashed NFS mount). An existing file is
    # opened to append, writing nothing; in a folder a file is made and dropped at once.
    try:
        if nearest.is_dir():
            with tempfile.TemporaryFile(dir=nearest):
                pass
        else:
            with open(nearest, "a"):
                pass
    except OSError as error:
        raise ValueError(f"{name} {path}: {nearest} is not writable by this user "
                         f"({error.strerror}); give a path you can write to") from None


@contextlib.contextmanager
def locked(directory, user: str):
    """Hold `directory`/.lock exclusively for the block (created with the directory if
    missing; a directory it made that a failed block left holding the lock alone is removed
    again). A second holder, in this process or another, gets a BlockingIOError naming the
    directory and `user` (what holds it, e.g. "training run") at once. The lock is flock's:
    the system drops it when the holder exits, however it exits, so no stale lock remains.
    """
    directory = Path(directory)
    made = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK_NAME, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BlockingIOError(f"{directory} is in use by another {user} (which holds "
                                  f"{directory / LOCK_NAME}); wait for it to end or choose "
                                  "another directory") from None
        try:
            yield
        except BaseException:
            if made and [p.name for p in directory.iterdir()] == [LOCK_NAME]:
                shutil.rmtree(directory)
            raise
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def replace_text(path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


# A model's files, any of which an export there would replace: its config.json, or weights
# whose config.json is gone.
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json",
               "pytorch_model.bin")
# A PEFT adapter's (mamba_jax.adapters.save_peft_adapter writes them)
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def model_file(path) -> str | None:
    """The first of MODEL_FILES in `path`, or None: what says it holds a model."""
    return next((name for name in MODEL_FILES if (Path(path) / name).exists()), None)


def holds_model(path) -> bool:
    """Whether `path` holds a model that an export there would replace (model_file)."""
    return model_file(path) is not None


def holds_steps(path) -> bool:
    """Whether `path` holds Orbax step folders (numbered, with Orbax's _CHECKPOINT_METADATA):
    checkpoints a trainer can resume."""
    path = Path(path)
    try:
        return path.is_dir() and any(child.name.isdigit()
                                     and (child / "_CHECKPOINT_METADATA").exists()
                                     for child in path.iterdir())
    except OSError:  # a folder this user may not list holds none of ours
        return False


def holds_checkpoints(path) -> bool:
    """Whether `path` is a trainer's --checkpoint-dir: Orbax step folders, or the run's
    train_config.json without a model's config.json or a PEFT adapter's files, which the
    trainer's exports write it beside (written as a run starts, before its first
    checkpoint)."""
    path = Path(path)
    exported = holds_model(path) or any((path / name).exists() for name in ADAPTER_FILES)
    return (path / "train_config.json").exists() and not exported or holds_steps(path)


def checkpoints_above(path) -> Path | None:
    """The nearest folder above `path` that holds Orbax steps (holds_steps), or None: a
    path inside a trainer's checkpoints (a train_config.json alone above may be a user's
    copy, so only steps say so)."""
    return next((p for p in Path(path).resolve().parents if holds_steps(p)), None)


def check_outside_checkpoints(name: str, path) -> None:
    """Refuse (ValueError) a `path` to write other files to that is a trainer's
    --checkpoint-dir or inside one: a model or dataset there would hide the checkpoints
    from the commands that read the folder, replace the run's tokenizer and train_config.json
    copies, and a numbered folder would be taken for a corrupt checkpoint."""
    path = Path(path).resolve()
    folder = path if holds_checkpoints(path) else checkpoints_above(path)
    if folder is not None:
        where = "is" if folder == path else "is inside"
        raise ValueError(f"{name} {path} {where} the training checkpoints folder {folder}, "
                         "whose files are the run's: give a folder outside it")
