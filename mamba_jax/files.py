"""Writing files that users keep: an exclusive lock on a directory, and replacing a file so
that a crash leaves the old version or the new one, never half of one."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

LOCK_NAME = ".lock"


@contextlib.contextmanager
def locked(directory, user: str):
    """Hold `directory`/.lock exclusively for the block (created with the directory if
    missing). A second holder, in this process or another, gets a BlockingIOError naming the
    directory and `user` (what holds it, e.g. "training run") at once. The lock is flock's:
    the system drops it when the holder exits, however it exits, so no stale lock remains.
    """
    directory = Path(directory)
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
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def replace_text(path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
