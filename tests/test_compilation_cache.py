"""--compilation-cache: a second trainer process over the same programs loads the first's
compiled step from the directory instead of compiling it; 'off' keeps none; a directory
that cannot be written stops the command with a message when the user named it, and is
skipped with a note when it is the default."""

import os
import subprocess
import sys

import pytest

from bench.harness import ROOT
from mamba_jax import compilation_cache
from mamba_jax.cli import UserExit

TRAIN = ["--steps", "1", "--batch-size", "8", "--seq-len", "16", "--eval-every", "100",
         "--set", "n_layer=1", "--out", "none"]


def train_in_a_process(*args):
    """The trainer's CLI in a fresh process, jax logging each compile and each cache hit ->
    (exit status, stderr)."""
    env = {**os.environ, "JAX_LOG_COMPILES": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the tests' shared cache (conftest)
    done = subprocess.run([sys.executable, "-m", "mamba_jax.train", *TRAIN, *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr


def test_a_second_run_loads_the_first_runs_step(tmp_path):
    cache = tmp_path / "cache"
    status, log = train_in_a_process("--compilation-cache", str(cache))
    assert status == 0, log
    assert "Persistent compilation cache hit for 'jit_step'" not in log
    kept = sorted(p.name for p in cache.iterdir())
    assert any(name.startswith("jit_step-") for name in kept), kept
    status, log = train_in_a_process("--compilation-cache", str(cache))
    assert status == 0, log
    assert "Persistent compilation cache hit for 'jit_step'" in log


def test_off_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    status, log = train_in_a_process("--compilation-cache", "off")
    assert status == 0, log
    assert list(tmp_path.iterdir()) == []
    assert "Persistent compilation cache hit" not in log


def test_the_default_is_jaxs_variable_else_the_users_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert compilation_cache.default_dir() == tmp_path / "jax"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    assert compilation_cache.default_dir() == tmp_path / "home" / "mamba_jax" / "jax"


@pytest.fixture
def restore_cache_dir():
    import jax

    before = jax.config.jax_compilation_cache_dir
    yield
    compilation_cache._set(before)


def test_a_named_directory_that_cannot_be_written_stops_the_trainer(tmp_path, capsys,
                                                                     restore_cache_dir):
    from mamba_jax.train import main

    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with pytest.raises(UserExit):
        main([*TRAIN, "--compilation-cache", str(blocked / "cache")])
    err = capsys.readouterr().err
    assert err.startswith(f"python -m mamba_jax.train: --compilation-cache {blocked / 'cache'}: "
                          "cannot keep compiled programs there")
    assert "or off" in err and "Traceback" not in err


def test_a_default_that_cannot_be_written_is_skipped_with_a_note(tmp_path, monkeypatch, capsys,
                                                                 restore_cache_dir):
    import jax

    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    assert compilation_cache.use(None) is None
    assert jax.config.jax_compilation_cache_dir is None
    assert "compiling without it" in capsys.readouterr().err
