"""The persistent compilation cache of the commands that compile (train, generate, serve).

jax keeps each compiled program (on a GPU with XLA's autotuning results beside it) in a
directory, keyed by the program, the jax and XLA versions, the flags and the devices; a
later run that compiles the same program loads it instead: a repeated training run of
mamba2-1.3b ends its first step in a fraction of the time after its launch (BENCHMARKS.md,
rows T9 and T10),
and a restarted server skips compiling its batch buckets. Any change to the model, the batch,
the mesh or the code gives new programs, which compile and are added.

    compilation_cache.add_argument(parser)       # --compilation-cache DIR | off
    compilation_cache.use(args.compilation_cache)

The default directory is jax's own JAX_COMPILATION_CACHE_DIR where that is set, else
$XDG_CACHE_HOME/mamba_jax/jax (~/.cache/mamba_jax/jax). A directory given on the command
line that cannot be written is a mistake and stops the command; the default one that
cannot be written is skipped with a note.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

OFF = "off"


def default_dir() -> Path:
    """JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME (or ~/.cache) / mamba_jax / jax."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "mamba_jax" / "jax"


def add_argument(parser) -> None:
    parser.add_argument("--compilation-cache", default=None, metavar="DIR|off",
                        help="keep compiled programs in DIR, so that a later run of the same "
                             "programs skips compiling them; 'off' compiles every run "
                             "(default: $JAX_COMPILATION_CACHE_DIR, else "
                             "$XDG_CACHE_HOME/mamba_jax/jax, else ~/.cache/mamba_jax/jax)")


def use(value: str | None) -> Path | None:
    """Point jax's persistent cache at value (a directory, "off", or None for default_dir())
    before anything compiles -> the directory in use, or None. SystemExit where a directory
    given by the user cannot be written."""
    if value is not None and value.lower() == OFF:
        _set(None)
        return None
    directory = Path(value).expanduser() if value is not None else default_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(f"no permission to write in {directory}")
    except OSError as error:
        if value is not None:
            raise SystemExit(f"--compilation-cache {value}: cannot keep compiled programs "
                             f"there ({error}); give a directory you can write to, or "
                             "off") from None
        print(f"compilation cache {directory} cannot be written ({error}): compiling "
              "without it (--compilation-cache DIR chooses another)", file=sys.stderr)
        _set(None)
        return None
    _set(str(directory))
    return directory


def _set(directory: str | None) -> None:
    """jax's cache directory; the cache is reset where it changes, since jax opens it once,
    at the first compile."""
    if jax.config.jax_compilation_cache_dir != directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        compilation_cache.reset_cache()
