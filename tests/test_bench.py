"""The benchmark package without a GPU or torch: every module imports, every script answers
--help (and runs as `python -m bench.<script>`), and the baseline guard reads mamba_ssm's path from
what its modules bound, refusing a ratio against its slow path unless allowed, then marked.
Mamba-3: our presets as mamba_ssm's config, mamba_ssm's MIMO reference loaded from the copy's
tests, the decoding floor's bytes, and bench.mamba3's checks and row on a tiny MIMO shape.

mamba_ssm's copy is stood in for by a folder of three small modules that bind
causal_conv1d's functions, or None, the way mamba_ssm's Mamba2 and SSD modules do; torch
and causal_conv1d by empty modules where a test needs them present.
"""

import dataclasses
import os
import shutil
import importlib
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from bench import baseline, harness

SCRIPTS = ["generate", "train_step", "ssd", "step", "conv", "norm", "norm_matmul",
           "profile_step", "dispatch", "headdim", "selective_scan", "serve_load", "mamba3",
           "tiles", "init_from", "continued", "fp8_numerics"]
MODULES = ["harness", "baseline", *SCRIPTS]

# mamba_ssm's selection, as its modules make it at import
MAMBA2 = """
try:
    from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
except ImportError:
    causal_conv1d_fn, causal_conv1d_update = None, None
selective_state_update = object()  # its Triton kernel, always there
"""
SSD_COMBINED = """
try:
    from causal_conv1d.cpp_functions import causal_conv1d_fwd_function, causal_conv1d_bwd_function
except ImportError:
    causal_conv1d_fwd_function = causal_conv1d_bwd_function = None
"""


def write(folder, files):
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def copy(tmp_path):
    """A stand-in for mamba_ssm's copy (the folder --baseline names); what a test imports
    from it (or from `extension`) is forgotten after it."""
    write(tmp_path / "copy", {"mamba_ssm/__init__.py": '__version__ = "2.3.2.post1"\n',
                              "mamba_ssm/modules/mamba2.py": MAMBA2,
                              "mamba_ssm/ops/triton/ssd_combined.py": SSD_COMBINED})
    before = set(sys.modules)
    yield str(tmp_path / "copy")
    for name in set(sys.modules) - before:
        del sys.modules[name]


@pytest.fixture
def extension(tmp_path):
    """A folder where torch, causal_conv1d 1.6.1 and its CUDA extension import."""
    write(tmp_path / "site", {
        "torch.py": "", "causal_conv1d_cuda.py": "",
        "causal_conv1d/__init__.py": '__version__ = "1.6.1"\n'
                                     "causal_conv1d_fn = causal_conv1d_update = object()\n",
        "causal_conv1d/cpp_functions.py": "causal_conv1d_fwd_function = object()\n"
                                          "causal_conv1d_bwd_function = object()\n"})
    return str(tmp_path / "site")


@pytest.mark.parametrize("module", MODULES)
def test_every_bench_module_imports(module):
    assert importlib.import_module(f"bench.{module}").__doc__


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_answers_help(script, capsys):
    with pytest.raises(SystemExit) as done:
        importlib.import_module(f"bench.{script}").main(["--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out
    assert usage.startswith("usage:")
    # The scripts that time mamba_ssm's Mamba2 take the guard's option.
    assert ("--allow-slow-baseline" in usage) == (script in ("generate", "train_step",
                                                             "profile_step"))


@pytest.mark.subprocess
def test_a_script_runs_as_a_module():
    run = subprocess.run([sys.executable, "-m", "bench.dispatch", "--help"],
                         capture_output=True, text=True, cwd=harness.ROOT, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("usage:"), run.stderr


@pytest.mark.subprocess
def test_serve_load_times_the_engine_before_and_after_and_a_shared_prefix(tmp_path, capsys):
    """bench.serve_load on the tiny preset: "before" (here a copy of this code, run from its
    folder) and "after" in server children of their own, 2 clients for at most 4 requests
    each, the ratios, then prompts after a shared prefix, with the prefix cache (which the
    warm-up filled: every timed prompt hits) and without."""
    from bench import serve_load

    for package in ("mamba_jax", "pallas_kernels", "bench"):
        shutil.copytree(os.path.join(harness.ROOT, package), tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    serve_load.main(["--preset", "tiny", "--dtype", "float32", "--before", str(tmp_path),
                     "--concurrency", "2", "--seconds", "60", "--warmup-seconds", "0",
                     "--max-requests", "4", "--prompt-tokens", "8", "--new-tokens", "4",
                     "--shared-prefix-tokens", "32", "--shared-concurrency", "2",
                     "--slots", "2", "--prefill-chunk", "16", "--start-timeout", "120"])
    lines = capsys.readouterr().out.splitlines()
    assert "cpu, jax " in lines[0] and "tiny (random weights)" in lines[0]
    assert lines[1].startswith("| engine | clients | requests | seconds | requests/s |")
    table = lambda at, n: [[c.strip() for c in line.strip("|").split("|")]
                           for line in lines[at:at + n]]
    for engine, clients, requests, seconds, rate, _, *ms, failed in table(3, 2):
        assert engine in ("before", "after") and clients == "2" and failed == "0"
        assert 4 <= int(requests) <= 5 and float(seconds) > 0 and float(rate) > 0
        ttft_p50, ttft_p99, p50, p99 = map(float, ms)
        assert 0 < ttft_p50 <= ttft_p99 <= p99 and 0 < p50 <= p99
    assert lines[5].startswith("| clients | requests/s after/before |")
    assert table(7, 1)[0][0] == "2" and all(r.endswith("x") for r in table(7, 1)[0][1:])
    assert lines[8].startswith("shared prefix: 32 tokens")
    cached, uncached = table(11, 2)
    assert (cached[0], uncached[0]) == ("after, prefix cache", "after, no prefix cache")
    hits, lookups = map(int, cached[-1].split("/"))
    assert hits == lookups >= 4 and uncached[-1] == "0/0"


def test_guard_refuses_a_ratio_without_causal_conv1d(copy, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)  # an import of it fails
    install = baseline.probe(copy)
    assert install.causal_conv1d == "" and "causal_conv1d" in install.missing
    assert not any(install.bound[name] for name in baseline.USES["train"][0])
    for use in ("train", "decode"):
        with pytest.raises(SystemExit) as refused:
            baseline.guard(install, use, allow_slow=False)
        message = str(refused.value)
        assert "\n" not in message
        assert "no ours/theirs ratio" in message
        assert "sh .baseline/install.sh" in message and "--allow-slow-baseline" in message


def test_allowed_slow_baseline_marks_every_ratio(copy, monkeypatch):
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)
    install = baseline.probe(copy)
    for use in ("train", "decode"):
        compared = baseline.guard(install, use, allow_slow=True)
        assert "without causal_conv1d" in compared.line and "(slow baseline)" in compared.line
        assert compared.ratio(1.0, 2.0) == "0.50x (slow baseline)"
        assert compared.ratio(1.0, 3.0, ".3f") == "0.333x (slow baseline)"
    assert "use_mem_eff_path=False" in baseline.guard(install, "train", True).line


def test_fast_path_prints_its_ratios_unmarked_and_names_the_path(copy, extension,
                                                                 monkeypatch):
    monkeypatch.syspath_prepend(extension)
    install = baseline.probe(copy)
    assert install.causal_conv1d == "1.6.1" and all(install.bound.values())
    train = baseline.guard(install, "train", allow_slow=False)
    assert train.line == ("mamba_ssm 2.3.2.post1 Mamba2 training: use_mem_eff_path=True "
                          "(mamba_split_conv1d_scan_combined), causal_conv1d 1.6.1 (fast path)")
    assert train.ratio(1.0, 2.0) == "0.50x"
    assert "causal_conv1d_update" in baseline.guard(install, "decode", False).line


def test_a_causal_conv1d_that_mamba_ssm_did_not_bind_is_refused(copy, extension,
                                                                monkeypatch):
    monkeypatch.syspath_prepend(extension)
    monkeypatch.setitem(sys.modules, "causal_conv1d.cpp_functions", None)
    install = baseline.probe(copy)
    assert install.causal_conv1d == "1.6.1"
    with pytest.raises(SystemExit, match="ssd_combined.causal_conv1d_fwd_function"):
        baseline.guard(install, "train", allow_slow=False)
    assert baseline.guard(install, "decode", allow_slow=False).marker == ""


def test_the_ssd_scan_alone_needs_no_causal_conv1d(copy, monkeypatch):
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)
    scan = baseline.guard(baseline.probe(copy), "scan", allow_slow=False)
    assert "(fast path)" in scan.line and scan.ratio(1.0, 4.0, ".2f", "") == "0.25"


def test_probe_in_child_reports_the_childs_install(copy, extension, monkeypatch):
    assert baseline.probe_in_child(copy).causal_conv1d == ""  # no torch here
    monkeypatch.setenv("PYTHONPATH", extension)
    assert baseline.probe_in_child(copy).causal_conv1d == "1.6.1"


def test_our_config_becomes_mamba_ssms_for_every_preset():
    # mamba_ssm's MambaConfig takes keyword arguments: a dict stands in for it.
    from mamba_jax import Mamba2Config
    theirs = baseline.mamba_config(Mamba2Config.preset("mamba2-1.3b"), dict,
                                   use_mem_eff_path=True)
    assert theirs["d_model"] == 2048 and theirs["n_layer"] == 48
    assert theirs["ssm_cfg"] == {"layer": "Mamba2", "d_state": 128, "headdim": 64,
                                 "ngroups": 1, "chunk_size": 256, "use_mem_eff_path": True}


def test_mamba3_presets_become_mamba_ssms_mamba3_layers():
    from mamba_jax import Mamba2Config
    from mamba_jax.layers.mamba3 import Mamba3Section
    cfg = Mamba2Config.preset("mamba3-1.3b")
    theirs = baseline.mamba_config(cfg, dict)
    assert baseline.ssm_layer(cfg) == "Mamba3" and theirs["d_model"] == 2048
    # The config our mamba_ssm checkpoints carry: every field of our section, by name one of
    # Mamba3's arguments (mamba_ssm e9594ce).
    assert theirs["ssm_cfg"] == {"layer": "Mamba3", "d_state": 128, "expand": 2, "headdim": 64,
                                 "ngroups": 1, "rope_fraction": 0.5, "dt_min": 0.001,
                                 "dt_max": 0.1, "dt_init_floor": 1e-4, "A_floor": 1e-4,
                                 "is_outproj_norm": False, "is_mimo": False, "mimo_rank": 4,
                                 "chunk_size": 64}
    assert set(theirs["ssm_cfg"]) - {"layer"} == {f.name for f in
                                                  dataclasses.fields(Mamba3Section)}
    assert baseline.ssm_layer(Mamba2Config.preset("megatron-hybrid-800m")) is None


def test_versus_names_why_mamba_ssm_cannot_train_or_decode_a_preset(copy, tmp_path):
    """A copy from before Mamba3 in MambaLMHeadModel (v2.3.2.post1's, which raises "Invalid
    ssm_layer" in its child process) is named, with the copy to pass instead."""
    from bench.generate import _theirs_not_run
    from bench.train_step import not_comparable
    from mamba_jax import Mamba2Config
    old = {"mamba_ssm/models/mixer_seq_simple.py": 'ssm_layer_map = {"Mamba1": 1, "Mamba2": 2}'}
    new = {"mamba_ssm/models/mixer_seq_simple.py": 'ssm_layer_map = {"Mamba3": 3}'}
    write(tmp_path / "main", new)
    write(tmp_path / "copy", old)
    mamba3, mamba2 = Mamba2Config.preset("mamba3-tiny"), Mamba2Config.preset("tiny")
    for why in (not_comparable, _theirs_not_run):
        assert why(mamba3, str(tmp_path / "main")) == "" and why(mamba2, copy) == ""
        assert "no Mamba3 layer in MambaLMHeadModel" in why(mamba3, copy)
        assert ".baseline/e9594ce" in why(mamba3, copy)
    mimo = mamba3.replace(mamba3=dict(d_state=32, headdim=32, is_mimo=True, mimo_rank=2))
    assert "TileLang" in not_comparable(mimo, copy)
    assert "cannot spell" in not_comparable(Mamba2Config.preset("megatron-hybrid-800m"), copy)


def test_generate_only_ours_times_our_rows_without_a_mamba_ssm_copy(monkeypatch, capsys):
    """bench.generate --only-ours: no copy at --baseline, and none is asked for (the guard
    and their run would raise); a row per preset, batch and dtype, theirs NaN. The timing
    itself (bench.generate.ours, tested above) is stubbed."""
    from bench import generate as script

    def refuse(*args, **kwargs):
        raise AssertionError("mamba_ssm was asked for under --only-ours")
    monkeypatch.setattr(script.baseline, "comparison", refuse)
    monkeypatch.setattr(script, "theirs_in_child", refuse)
    monkeypatch.setattr(script, "copy_bandwidth", lambda *args: 1e12)
    monkeypatch.setattr(script, "check_streaming", lambda: None)
    tokens = np.zeros((2, 3), np.int32)
    monkeypatch.setattr(script, "ours", lambda *args: (1e-3, 2e-3, tokens))
    script.main(["--presets", "tiny", "--batches", "2", "--new", "3", "--ssm-state-dtypes",
                 "float32,bfloat16", "--only-ours", "--baseline", "/no/such/copy"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 2 and all("| nan |" in row for row in rows)
    assert "mamba_ssm not run (--only-ours)" in out
    # --gemms: a row per setting, named in its column, each timed with that setting
    asked = []

    def ours(*args):  # its last argument: the --gemms setting
        asked.append(args[-1])
        return 1e-3, 2e-3, tokens
    monkeypatch.setattr(script, "ours", ours)
    script.main(["--presets", "tiny", "--batches", "2", "--new", "3", "--ssm-state-dtypes",
                 "float32", "--gemms", "xla,cublaslt", "--only-ours"])
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| tiny |")]
    assert asked == ["xla", "cublaslt"]
    assert len(rows) == 2 and "| on | xla |" in rows[0] and "| on | cublaslt |" in rows[1]
    with pytest.raises(SystemExit):
        script.main(["--presets", "tiny", "--gemms", "cublas", "--only-ours"])


def test_mamba3_training_needs_no_causal_conv1d(copy, monkeypatch):
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)
    compared = baseline.guard(baseline.probe(copy), "train-mamba3", allow_slow=False)
    assert "Mamba3 layers" in compared.line and "mamba3_siso_combined" in compared.line
    assert compared.marker == ""


def test_the_mamba3_scan_names_its_one_path_without_causal_conv1d(copy, monkeypatch):
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)
    line = baseline.mamba3_siso_path(copy)
    assert "mamba3_siso_combined" in line and "calls no causal_conv1d" in line


MIMO_TEST_MODULE = """
import pytest

CASES = [pytest.param(16, 64, id="N16")]


@pytest.fixture(scope="module")
def mods():
    pytest.importorskip("tilelang")


@pytest.mark.parametrize("n,p", CASES)
def test_kernel(n, p):
    pass


def mamba3_MIMO_chunk_ref(*args, **kwargs):
    return "their reference"
"""


@pytest.mark.parametrize("pytest_present", [True, False])
def test_mimo_reference_loads_from_the_copys_tests(copy, monkeypatch, pytest_present):
    with pytest.raises(SystemExit, match="tests/ops | tar -x -C"):
        baseline.import_mamba3_mimo_reference(copy)
    write(Path(copy), {baseline.MIMO_REFERENCE: MIMO_TEST_MODULE})
    if not pytest_present:  # its declarations go to the stand-in
        monkeypatch.setitem(sys.modules, "pytest", None)
    reference = baseline.import_mamba3_mimo_reference(copy)
    assert reference.mamba3_MIMO_chunk_ref() == "their reference"
    assert (reference.pytest is pytest) == pytest_present


@pytest.mark.parametrize("failure", ["raise ImportError('no tilelang')",
                                     "raise AttributeError('tvm_ffi registry')"])
def test_mimo_kernels_that_do_not_import_are_named_not_raised(copy, monkeypatch, failure):
    # A TileLang that is absent, or does not match its apache-tvm-ffi (an AttributeError at
    # import), leaves our MIMO timed alone with the reason in the table's header.
    monkeypatch.delitem(sys.modules, "mamba_ssm.ops.tilelang.mamba3.mamba3_mimo",
                        raising=False)
    write(Path(copy), {"mamba_ssm/ops/tilelang/mamba3/mamba3_mimo.py": failure + "\n"})
    kernels, why = baseline.import_mamba3_mimo(copy)
    assert kernels is None and why.startswith(failure.split()[1].split("(")[0])


def test_mamba3_floor_counts_each_parameter_once_and_the_state_per_row():
    # Weights: in_proj and out_proj in bf16, the rest float32; per row the cache's four
    # states read and written, the SSM state in the given bytes an element, the rest float32.
    import jax
    from flax import nnx

    from bench.generate import mamba3_bytes
    from mamba_jax import Mamba2Config, Mamba2LM
    tiny = Mamba2Config.preset("mamba3-tiny")
    mimo = tiny.replace(mamba3=dict(d_state=32, headdim=32, is_mimo=True, mimo_rank=2,
                                    is_outproj_norm=True))
    for cfg in (tiny, mimo):
        model = nnx.eval_shape(lambda cfg=cfg: Mamba2LM(cfg, rngs=nnx.Rngs(0)))
        layer = model.layers[0]
        params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
        bf16 = {"z_proj", "x_proj", "B_proj", "C_proj", "dt_proj", "A_proj", "trap_proj",
                "angle_proj", "out_proj"}
        weights = sum((2 if name in bf16 else 4) * leaf.size for path, leaf in
                      jax.tree_util.tree_leaves_with_path(params)
                      for name in [path[-1].key])
        cache = layer.mixer.init_cache(1)
        state = 4 * (cache.angle.size + cache.k.size + cache.x.size) + 2 * cache.ssm.size
        assert mamba3_bytes(cfg, 0, 2) == weights
        assert mamba3_bytes(cfg, 3, 2) == weights + 3 * 2 * state


def test_mamba3_bench_checks_and_times_our_mimo_scan_on_a_cpu(capsys):
    """bench.mamba3 --only-ours at a tiny MIMO shape: the float64 recurrence check, the kernels
    (Pallas interpreter) against the XLA form at 8 rows and 1, values and every gradient,
    then a row of times; --mimo-rank alone is mamba_ssm's default rank. A fixed seed: at
    shapes this small, bf16 roundings in another order reach 3.5e-2 of the largest gradient
    for some seeds (dD, over 2 heads), over the bench's 3e-2."""
    from bench import mamba3
    assert mamba3.parse_args(["--mimo-rank"]).mimo_rank == 4
    assert mamba3.parse_args([]).mimo_rank is None
    mamba3.main(["--only-ours", "--mimo-rank", "2", "--shapes", "1x16", "--heads", "2",
                 "--headdim", "8", "--d-state", "8", "--chunk", "8", "--check-len", "16",
                 "--warmup", "0", "--reps", "1", "--seed", "0"])
    lines = capsys.readouterr().out.splitlines()
    assert "MIMO rank 2" in lines[0] and lines[0].endswith("seed 0")
    assert lines[1].startswith("check ours (XLA form) against the recurrence, float64: y ")
    for line, rows in zip(lines[2:4], (8, 1)):
        assert line.startswith(f"check b={rows} l=16: kernels against the XLA form: y ")
        assert "dmimo_x" in line and "dangles" in line and "dtrap" in line
    assert lines[4] == "| b x l | triton fwd ms | triton fwd+bwd ms |"
    cells = [c.strip() for c in lines[6].strip("|").split("|")]
    assert cells[0] == "1x16" and all(float(c) > 0 for c in cells[1:]) and len(cells) == 3


def test_tiles_times_each_config_of_the_conv_and_the_norm_on_a_cpu(capsys):
    """bench.tiles at the tiny preset in Pallas's interpreter: a row per Config given (none
    for a kernel given none), each kernel's results within float32 roundings of its first
    Config's (the conv's weight gradient sums its runs' partials in another order at other
    runs); a field the Config lacks is named with the fields it has, a value that is no
    integer or that the Config refuses is named with the reason."""
    from bench import tiles
    tiles.main(["--preset", "tiny", "--shape", "1x40", "--conv", "run=16,step_rows=4",
                "run=32,step_rows=2", "--norm", "backward_warps=4", "--add-norm", "",
                "--calls", "1", "--rounds", "1"])
    table = capsys.readouterr().out.split("| kernel | tiles |")[1].splitlines()[2:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    assert [row[:2] for row in rows] == [
        ["conv", "run=16,step_rows=4"], ["conv", "run=32,step_rows=2"],
        ["norm", "backward_warps=4"], ["add-norm", "defaults"]]
    for row in rows:
        assert float(row[2]) > 0 and float(row[3]) > 0 and row[4:7] == ["", "", ""]
        # float32 partial sums in another order, over a leaf's largest value (dbias, sums of
        # 40 rows that nearly cancel: seen up to 1.7e-4 of its largest on fresh inputs; a
        # wrong tile's result is off by its whole size); NaN fails
        assert float(row[7]) < 1e-3
    norm, conv = tiles.norm, tiles.conv
    config = tiles.parse_config(norm.Config(), "backward_prefetch=0,backward_programs=none")
    assert config == norm.Config(backward_prefetch=False, backward_programs=None)
    assert tiles.parse_config(norm.ADD_CONFIG, "") == norm.ADD_CONFIG != norm.Config()
    with pytest.raises(SystemExit, match="has no field 'rows'.*step_rows"):
        tiles.parse_config(conv.Config(), "rows=4")
    with pytest.raises(SystemExit, match="'run=many'.*invalid literal"):
        tiles.parse_config(conv.Config(), "run=many")
    with pytest.raises(SystemExit, match="step_rows 8 must divide run 12"):
        tiles.parse_config(conv.Config(), "run=12")


def test_continued_refuses_to_time_a_fused_side_that_is_not_fused():
    """bench.continued off the kernels (no Hopper GPU): its fused side traces the composed
    mixer, which it says before compiling anything rather than time the composed one twice
    (its rows, run on the CPU with the kernels taken in Pallas's interpreter: about a minute
    of compiles, left out of the suite)."""
    from bench import continued
    with pytest.raises(SystemExit, match="tiny: the fused side traced the fused mixer: False"):
        continued.main(["--presets", "tiny", "--layers", "1", "--batch", "1", "--seq-len",
                        "24", "--prefix", "9", "--warmup", "0", "--reps", "1"])


def test_forward_and_backward_computes_the_output_with_the_gradients():
    # A scan's timed forward+backward returns its output, so the forward's kernels run (with
    # the gradients alone, XLA dropped a custom_vjp's forward kernel whose output nothing
    # read), and its gradients are those of <f(x), dy> for the given dy.
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def square(x):
        return x * x
    square.defvjp(lambda x: (x * x, x), lambda x, g: (2 * x * g,))
    x, dy = jnp.arange(4.0), jnp.asarray([1.0, -1.0, 2.0, 0.5])
    y, (dx,) = harness.forward_and_backward(square)(x, dy)
    assert jnp.array_equal(y, x * x)
    assert jnp.array_equal(dx, 2 * x * dy)


def test_the_scan_benchmark_runs_cublas_gemms_unless_the_flags_name_triton_gemms():
    assert harness.with_cublas_gemms("") == "--xla_gpu_enable_triton_gemm=false"
    assert (harness.with_cublas_gemms("--xla_gpu_enable_cublaslt=false")
            == "--xla_gpu_enable_cublaslt=false --xla_gpu_enable_triton_gemm=false")
    chosen = "--xla_gpu_enable_triton_gemm=true"
    assert harness.with_cublas_gemms(chosen) == chosen


def test_a_benchmarks_child_compiles_cold(monkeypatch):
    # A compilation cache would make the child's compile and first-step times a load's.
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/tmp/some-cache")
    environ = harness.child_environment({"XLA_FLAGS": "--x"})
    assert "JAX_COMPILATION_CACHE_DIR" not in environ
    assert environ["XLA_FLAGS"] == "--x" and environ["PYTHONPATH"].startswith(harness.ROOT)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_our_training_child_runs_the_layers_as_asked(scan_layers):
    import argparse

    from bench.train_step import child_argv, layers_note
    args = argparse.Namespace(preset="mamba2-370m", batch=8, seq_len=2048, remat="none",
                              steps=3, granule=4, layers=None, limit_gib=None, breakdown=False,
                              loss_chunk=None, scan_layers=scan_layers, lora_rank=16,
                              base_dtype="bfloat16")
    argv = child_argv(args, "measure", "dp=1")
    assert ("--scan-layers" in argv) == scan_layers
    assert ("--scan-layers" in layers_note(args)) == scan_layers
    # bench.train_step lora's two children: LoRA over a bfloat16 base, and full training
    assert {"--lora-rank=16", "--base-dtype=bfloat16"} <= set(argv)
    full = child_argv(args, "measure", "dp=1", lora_rank=None)
    assert not any(a.startswith(("--lora-rank", "--base-dtype")) for a in full)


def test_our_decode_timing_compiles_one_decode_loop():
    # bench.generate's `ours` times `new` tokens and one token from one compiled program.
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from bench.generate import GEMM_OPTIONS, ours
    from mamba_jax import Mamba2Config, Mamba2LM
    from mamba_jax.generate import DECODE_COMPILER_OPTIONS, _jit_decode

    loop = _jit_decode(tuple(sorted(DECODE_COMPILER_OPTIONS.items())))
    before = loop._cache_size()
    model = Mamba2LM(Mamba2Config.preset("tiny"), rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    t_prefill, t_decode, tokens = ours(model, 2, 8, 16, 2, "float32", True, "auto")
    assert loop._cache_size() == before + 1
    # --gemms cublaslt: the loop compiled with its options over the command buffers'
    lt = _jit_decode(tuple(sorted({**DECODE_COMPILER_OPTIONS,
                                   **GEMM_OPTIONS["cublaslt"]}.items())))
    before_lt = lt._cache_size()
    _, _, tokens_lt = ours(model, 2, 8, 16, 2, "float32", True, "auto", "cublaslt")
    assert lt._cache_size() == before_lt + 1 and tokens_lt.shape == (2, 16)
    # The decode time is the difference of two medians: for the tiny model on a CPU it is
    # within the noise of zero, and either sign.
    assert t_prefill > 0 and np.isfinite(t_decode) and tokens.shape == (2, 16)


def test_the_decode_profile_keeps_the_decode_loops_hlo(tmp_path):
    """bench.profile_step --decode reads what each fusion computes from the decode loop's HLO
    that XLA dumps: decode_hlo keeps the last one written, removes the dump, and says so when
    there is none."""
    from bench.profile_step import decode_hlo
    dump = tmp_path / "xla_dump"
    dump.mkdir()
    (dump / "module_0001.jit_prefill.after_optimizations.txt").write_text("prefill")
    older = dump / "module_0002.jit__decode_loop.after_optimizations.txt"
    older.write_text("older")
    os.utime(older, (1, 1))
    (dump / "module_0003.jit__decode_loop.after_optimizations.txt").write_text("loop")
    (dump / "module_0003.jit__decode_loop.before_optimizations.txt").write_text("before")
    keep = tmp_path / "decode.hlo.txt"
    assert decode_hlo(str(dump), str(keep)) == "loop"
    assert keep.read_text() == "loop" and not dump.exists()
    dump.mkdir()
    with pytest.raises(SystemExit, match="no optimised HLO of the decode loop"):
        decode_hlo(str(dump), str(keep))


def test_the_profile_says_what_each_fusion_computes(capsys):
    """bench.profile_step.fusion_contents reads a compiled program's HLO: each fusion, by the
    kernel name the profiler gives it, with its output's and operands' shapes, its
    operations and the JAX operation it came from; summarize prints it beside the kernel."""
    import jax
    import jax.numpy as jnp

    from bench.profile_step import fusion_contents, summarize
    program = jax.jit(lambda x, y: jnp.exp(x) * y).lower(
        jnp.ones((64, 128)), jnp.ones((64, 128), jnp.bfloat16)).compile()
    contents = fusion_contents(program.as_text())
    [(name, what)] = [(k, v) for k, v in contents.items() if "exponential" in v]
    assert what.startswith("f32[64,128] <- ") and "bf16[64,128]" in what
    assert "multiply" in what and "(from jit(<lambda>)/mul)" in what
    assert "." not in name and all(k.isidentifier() for k in contents)
    events = [{"name": name, "dur": 1000.0, "ts": 0.0, "args": {"hlo_op": "command_buffer"}},
              {"name": "ssd_forward", "dur": 500.0, "ts": 1000.0, "args": {}}]
    summarize(events, 1, 2e-3, 5, contents=contents)
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ")}
    assert rows[name].rstrip().endswith(f"| {what} |")
    assert rows["ssd_forward"].rstrip().endswith("|  |")


def test_profile_step_profiles_their_mamba3_scan_only(tmp_path):
    """--theirs with --scan traces mamba_ssm's Mamba-3 SISO scan; another scan stops with
    one line saying where else to look, before anything is imported or run."""
    from bench import profile_step
    with pytest.raises(SystemExit, match=r"--theirs --scan ssd: only --scan mamba3 .* "
                                         r"bench.ssd times"):
        profile_step.main(["--theirs", "--scan", "ssd", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"--scan mamba3-mimo: .* TileLang"):
        profile_step.main(["--theirs", "--scan", "mamba3-mimo", "--out", str(tmp_path)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_the_step_benchmark_stores_its_states_as_generate_does(dtype):
    # bench.step times the step kernel on states stored as a decoding cache stores them: an
    # int8 cache as its values and per-row float32 scales, each within half a step of the
    # float32 state it was made of.
    import jax
    import numpy as np

    from bench.step import step_inputs
    from mamba_jax import Mamba2Config
    from pallas_kernels.ssd.step import INT8_LEVELS, Int8State, load_state
    cfg = Mamba2Config.preset("tiny")
    states = step_inputs(cfg, 2, dtype, 2, np.random.default_rng(0))["state"]
    exact = step_inputs(cfg, 2, "float32", 2, np.random.default_rng(0))["state"]
    assert len(states) == 2
    for state, want in zip(states, exact):
        assert isinstance(state, Int8State) == (dtype == "int8")
        assert jax.tree.leaves(state)[0].dtype == {"int8": np.int8}.get(dtype, dtype)
        step = (np.abs(np.asarray(want)).max(-1, keepdims=True) / INT8_LEVELS if dtype == "int8"
                else np.abs(np.asarray(want)) * 2.0 ** -8)
        assert np.all(np.abs(np.asarray(load_state(state)) - np.asarray(want))
                      <= {"float32": 0, "bfloat16": 1, "int8": 0.5}[dtype] * step * 1.0001)


def test_ssd_variants_trace_under_their_config_and_take_turns_over_one_state(monkeypatch,
                                                                             capsys):
    import argparse
    import json

    from bench import train_step
    from bench.ssd import default_config
    from pallas_kernels.ssd import triton

    original = triton.Config
    with default_config("keep_states=True,chunk=32"):
        assert triton.Config().keep_states and triton.Config().chunk == 32
        assert triton.Config(chunk=128) == triton.Config(keep_states=True, chunk=128)
    assert triton.Config is original and not triton.Config().keep_states

    calls = []

    class Steps:  # the state a measure hands on, and which config measured it
        def __init__(self, *args, fp8_skip_layers):
            self.ssd_config, self.state = args[-1], None

        def measure(self, batch, seq_len, steps, breakdown):
            calls.append((self.ssd_config, self.state))
            self.state = len(calls)
            return {"step_s": 1.0}

    monkeypatch.setattr(train_step, "Steps", Steps)
    train_step.variants(argparse.Namespace(
        preset="tiny", mesh="dp=1", remat="none", loss_chunk=None, layers=None,
        scan_layers=False, ssd_variants=["", "keep_states=True"], rounds=2, batch=2, seq_len=8,
        steps=1, breakdown=False, fp8=False, fp8_skip_layers=1))
    assert calls == [("", None), ("keep_states=True", 1), ("", 2), ("keep_states=True", 3)]
    reported = [json.loads(line[7:]) for line in capsys.readouterr().out.splitlines()]
    assert [(r["ssd"], r["round"]) for r in reported] == [("", 1), ("keep_states=True", 1),
                                                          ("", 2), ("keep_states=True", 2)]


def test_ssd_variants_rows_compare_within_their_round(monkeypatch, capsys):
    from bench import train_step

    def measured(ssd, round_, step_s):
        return dict(ssd=ssd, round=round_, step_s=step_s, devices=1, batch=2, seq_len=8,
                    compile_s=1.0, tokens_s=16 / step_s, mfu=0.1, peak_gib=1.0, loss=1.0,
                    finite=True)

    argvs = []
    monkeypatch.setattr(train_step, "in_process", lambda gpus, argv, timeout, xla_flags: (
        argvs.append(argv) or [measured("", 1, 1.0), measured("keep_states=True", 1, 0.9),
                               measured("", 2, 2.0), measured("keep_states=True", 2, 1.0)]))
    train_step.main(["throughput", "--preset", "tiny", "--ssd-variants", "", "keep_states=True",
                     "--rounds", "2", "--steps", "1"])
    assert argvs[0][:2] == ["_child", "variants"]
    assert argvs[0][-5:] == ["--rounds", "2", "--ssd-variants", "", "keep_states=True"]
    rows = capsys.readouterr().out.splitlines()
    assert [line.split("|")[1].strip() for line in rows if "ssd" in line] == [
        "dp=1 ssd default round 1", "dp=1 ssd keep_states=True round 1",
        "dp=1 ssd default round 2", "dp=1 ssd keep_states=True round 2"]
    assert [line.split("|")[5].strip() for line in rows if "vs first row" in line] == [
        "1.000x step time", "0.900x step time", "1.000x step time", "0.500x step time"]


def _measured(step_s, **extra):
    return dict(step_s=step_s, devices=1, batch=2, seq_len=8, compile_s=1.0,
                tokens_s=16 / step_s, mfu=0.1, peak_gib=1.0, loss=1.0, finite=True, **extra)


def test_throughput_with_fp8_runs_our_fp8_step_after_the_bf16_one(monkeypatch, capsys):
    from bench import train_step

    argvs = []
    monkeypatch.setattr(train_step, "in_process", lambda gpus, argv, timeout, xla_flags: (
        argvs.append(argv) or [_measured(0.8 if "--fp8" in argv else 1.0, fp8_gemms=12)]))
    train_step.main(["throughput", "--preset", "tiny", "--steps", "1", "--fp8"])
    assert ["--fp8" in argv for argv in argvs] == [False, True]
    assert "--fp8-skip-layers=1" in argvs[1]
    out = capsys.readouterr().out
    assert "| dp=1 --fp8 |" in out
    assert "1.250x our bf16 tokens/s, 12 FP8 GEMMs (cuBLASLt) in the step" in out


def test_versus_jobs_run_each_on_a_gpu_of_its_own(monkeypatch):
    from bench import train_step

    seen = []
    monkeypatch.setattr(train_step, "gpu_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.setattr(train_step, "in_process", lambda gpus, argv, timeout: (
        seen.append((gpus, argv[0])) or [{"ran": argv[0]}]))
    done = train_step.apart({False: ["ours"], True: ["ours fp8"], "theirs": ["theirs"]}, 1)
    assert done == {False: {"ran": "ours"}, True: {"ran": "ours fp8"},
                    "theirs": {"ran": "theirs"}}
    assert {gpus for gpus, _ in seen} == {"4", "5"}  # one GPU each, two at a time


def test_fp8_numerics_compares_the_last_held_out_losses(tmp_path):
    from bench import fp8_numerics

    def records(eval_loss):
        return [{"step": 1, "loss": 3.0, "tokens_per_s": 10.0},
                {"step": 2, "loss": 2.5, "tokens_per_s": 12.0, "eval_loss": eval_loss}]
    within = fp8_numerics.summary({"bf16": records(2.0), "fp8": records(2.01)})
    assert "--fp8's last held-out loss +0.50% of bf16's: within the 1% target" in within
    assert "| --fp8 | 2 | 2.0100 (2) | 2.5000 | 12 |" in within
    beyond = fp8_numerics.summary({"bf16": records(2.0), "fp8": records(2.03)})
    assert "+1.50% of bf16's: NOT within" in beyond
    fp8_numerics.write_csv({"bf16": records(2.0), "fp8": records(2.03)}, tmp_path / "c.csv")
    assert (tmp_path / "c.csv").read_text().splitlines() == [
        "step,bf16_loss,bf16_eval_loss,fp8_loss,fp8_eval_loss", "1,3.0,,3.0,",
        "2,2.5,2.0,2.5,2.03"]
