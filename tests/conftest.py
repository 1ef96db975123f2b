"""Test set-up: 8 fake CPU devices for the mesh tests, and XLA:CPU's quickest compiles; one
worker process per core where pytest-xdist runs the tests; the layer_scans fixture.

XLA reads XLA_FLAGS when jax initialises its backends, so this runs before any test module
imports jax. Compiling dominates the suite's time and optimization level 0 about halves it;
every side of every comparison is compiled the same way. Subprocesses inherit both flags.
A test runs a model or a kernel's values and gradients under jax.jit (nnx.jit): run
operation by operation, each operation compiles a program of its own, which took a kernel
test about twice as long.
"""

import os
import tempfile

import pytest

import seeds

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8"
                           + " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the test processes and the trainers they start: the
# CLI tests compile the same tiny programs in many processes.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"mamba-jax-tests-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


# The modules that take longest, run first: each module runs whole in one worker (its
# fixtures and compiled programs made once), and two workers end together only where the
# last modules handed out are short ones.
LONGEST_FIRST = ("test_train_resume", "test_layer_kinds", "test_adapters", "test_parallel",
                 "test_context_parallel", "test_generate", "test_train", "test_kernel_path",
                 "test_mamba3", "test_docs_commands", "test_init_from", "test_mamba2_mixer",
                 "test_engine", "test_states", "test_hybrid_parallel", "test_finetuning_docs")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads -n
def pytest_cmdline_main(config):
    """`-n auto --maxprocesses 4 --dist loadscope` where pytest-xdist is loaded and the
    command line names no workers (-n, --tx, --dist): one worker per core, at most 4 (each
    worker is a JAX process with 8 fake devices; compiling is mostly single-threaded), each
    module whole in one worker, in LONGEST_FIRST's order. Handed out test by test, a
    module's tests traced and compiled the same programs in each worker: the suite took
    half as long again. Here rather than in pyproject's addopts, whose -n `pytest -p
    no:xdist` refused as an unknown option. Not in a worker: it would start workers of its
    own."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    if config.option.numprocesses is None and not config.option.tx \
            and config.option.dist == "no":
        config.option.numprocesses = "auto"
        config.option.maxprocesses = config.option.maxprocesses or 4
        config.option.dist = "loadscope"
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """LONGEST_FIRST's modules first, the others after them in their own order."""
    def rank(item):
        name = item.module.__name__.rpartition(".")[2]
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # stable: a module's tests keep their order


@pytest.fixture
def layer_scans(monkeypatch):
    """A list that gains an entry at each call of layer_scan.scan (a run of layers traced as
    one scan): a test of the unscanned path asserts it stays empty."""
    from mamba_jax import layer_scan

    calls = []
    scan = layer_scan.scan
    monkeypatch.setattr(layer_scan, "scan", lambda *args: calls.append(1) or scan(*args))
    return calls


@pytest.fixture(autouse=True)
def _seeds():
    """Each test's fresh_rng seeds from none (tests/seeds.py)."""
    seeds.start()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that drew random inputs names their seeds, to run it again on them."""
    report = yield
    if report.failed and seeds.drawn:
        report.sections.append(("random inputs", "MAMBA_JAX_TEST_SEEDS="
                                + ",".join(map(str, seeds.drawn)) + f" pytest {item.nodeid}"))
    return report
