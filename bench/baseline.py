"""mamba_ssm, the baseline: its import, the code path it runs here, and the ratio guard.

    python3 -m bench.baseline [--baseline .baseline]

prints what mamba_ssm runs here (a `RESULT {json}` line, read back by probe_in_child) and,
for each kind of table, the guard's verdict: a check of the install before a device run.

mamba_ssm is imported from a git-ignored copy of its Python (`--baseline`, the folder that
holds mamba_ssm v2.3.2.post1's package), never a dependency of mamba_jax. Its __init__ is
bypassed and the compiled `selective_scan_cuda` (Mamba1 only, never called here) stubbed,
so its Triton kernels and torch code run without its own CUDA extension. Its Mamba2 runs as
its users run it only with the `causal_conv1d` extension: training takes
use_mem_eff_path=True (mamba_split_conv1d_scan_combined, whose conv is causal_conv1d's) and
decoding causal_conv1d_fn in the prefill and causal_conv1d_update in each step. Without it
mamba_ssm falls back to torch code nobody runs for speed, so a ratio against it is not a
result: comparison() refuses one unless --allow-slow-baseline, and then marks it.

Where that extension comes from (a build for the GPU machine; measurement only):
    here:   mkdir -p .baseline && cp ../shared/baseline/* .baseline/
    device: sh .baseline/install.sh && export PYTHONPATH=/tmp/site:$PYTHONPATH
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import re
import sys
import types

from bench import harness

INSTALL = ("mkdir -p .baseline && cp ../shared/baseline/* .baseline/ here, then on the GPU "
           "machine: sh .baseline/install.sh && export PYTHONPATH=/tmp/site:$PYTHONPATH")
SLOW = " (slow baseline)"

# What each table times of mamba_ssm: the names its modules bind to causal_conv1d's (or, for
# the step's SSM update, its own Triton) functions, which must not be None for its fast
# path; that path; and the path it falls back to without them.
USES = {
    "train": (("ssd_combined.causal_conv1d_fwd_function",
               "ssd_combined.causal_conv1d_bwd_function"),
              "Mamba2 training: use_mem_eff_path=True (mamba_split_conv1d_scan_combined)",
              "Mamba2 training: use_mem_eff_path=False (a torch conv1d, then "
              "mamba_chunk_scan_combined)"),
    "decode": (("mamba2.causal_conv1d_fn", "mamba2.causal_conv1d_update",
                "mamba2.selective_state_update"),
               "Mamba2 generate(cg=True): causal_conv1d_fn in the prefill, "
               "causal_conv1d_update and selective_state_update in each step",
               "Mamba2 generate(cg=True) on its torch fallbacks"),
    # The SSD op alone calls no conv: the same Triton kernels as both training paths.
    "scan": ((), "mamba_chunk_scan_combined (its Triton SSD kernels, which both Mamba2 "
                 "training paths run; it calls no causal_conv1d)", None),
    # The conv alone: causal_conv1d's CUDA kernels, which the fused training path calls
    # (bench.conv stops where the extension does not import).
    "conv": ((), "causal_conv1d_fn (causal_conv1d's CUDA kernels, which "
                 "mamba_split_conv1d_scan_combined calls)", None),
    # The gated norm alone: the Triton kernels its fused training path calls after the scan.
    "norm": ((), "rmsnorm_fn (its Triton gated RMSNorm, ops/triton/layernorm_gated.py, which "
                 "mamba_split_conv1d_scan_combined calls)", None),
    # Mamba3 has no short conv: its training calls no causal_conv1d. SISO only: its MIMO
    # layers need TileLang (bench.mamba3).
    "train-mamba3": ((), "Mamba3 training: MambaLMHeadModel with Mamba3 layers, SISO "
                         "(mamba3_siso_combined, its Triton kernels; no causal_conv1d)", None),
    "mamba3": ((), "mamba3_siso_combined (its Triton Mamba-3 SISO kernels; Mamba3 has no "
                   "short conv, so calls no causal_conv1d)", None),
}
# mamba_ssm's MIMO torch reference, in its tests (a path under the copy).
MIMO_REFERENCE = "tests/ops/tilelang/test_mamba3_mimo.py"
MODULES = {"mamba2": "mamba_ssm.modules.mamba2",
           "ssd_combined": "mamba_ssm.ops.triton.ssd_combined"}


def _use_copy(baseline):
    """Make `mamba_ssm` the package folder at `baseline`, its __init__ not run."""
    package = types.ModuleType("mamba_ssm")
    package.__path__ = [os.path.join(baseline, "mamba_ssm")]
    sys.modules["mamba_ssm"] = package
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))


def import_mamba_chunk_scan(baseline):
    """mamba_ssm's mamba_chunk_scan_combined (its SSD Triton kernels) from the copy."""
    _use_copy(baseline)
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    return mamba_chunk_scan_combined


def import_gated_rmsnorm(baseline):
    """mamba_ssm's rmsnorm_fn (its gated RMSNorm's Triton kernels) from the copy."""
    _use_copy(baseline)
    from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn
    return rmsnorm_fn


def import_mamba3_siso(baseline):
    """mamba_ssm's mamba3_siso_combined (its Mamba-3 SISO Triton kernels) from the copy."""
    _use_copy(baseline)
    from mamba_ssm.ops.triton.mamba3.mamba3_siso_combined import mamba3_siso_combined
    return mamba3_siso_combined


def mamba3_siso_path(baseline) -> str:
    """The line that names the path mamba_ssm's Mamba-3 SISO scan runs: its one path (its
    kernels call no causal_conv1d), with the versions of the copy and of causal_conv1d."""
    install = Install(version(baseline), *causal_conv1d_version(), bound={})
    return guard(install, "mamba3", allow_slow=False).line


def import_inference_params(baseline):
    """mamba_ssm's InferenceParams (its decoding cache's bookkeeping) from the copy."""
    _use_copy(baseline)
    from mamba_ssm.utils.generation import InferenceParams
    return InferenceParams


def use_mamba3_triton_step(baseline):
    """Makes mamba_ssm's Mamba3 (from the copy) decode a SISO token with its Triton step
    kernel (ops/triton/mamba3/mamba3_siso_step.py, as its tests/ops/triton/test_mamba3_siso.py
    runs it) in place of Mamba3.step's CuTe-DSL kernel, which needs nvidia-cutlass-dsl and
    quack (not on the GPU machine): its in_proj, its B/C norms, dt and A as its forward makes
    them, then the one kernel that turns B and C by the angles, updates the state and reads
    it out (with the gate where its Mamba3 has no out-projection norm), its norm and
    out_proj, and the cache's states updated in place."""
    _use_copy(baseline)
    import torch
    import torch.nn.functional as F
    from mamba_ssm.modules import mamba3 as module
    from mamba_ssm.ops.triton.mamba3.mamba3_siso_step import mamba3_siso_step

    def step(self, u, angle_state, ssm_state, k_state, v_state, **kwargs):
        # u [b, 1, d] from its forward (its blocks keep the token axis), or [b, d]
        one_token = u.dim() == 3
        u = u[:, 0] if one_token else u
        bc = self.d_state * self.num_bc_heads
        z, x, B, C, dd_dt, dd_A, trap, angles = torch.split(
            self.in_proj(u), [self.d_inner, self.d_inner, bc, bc, self.nheads, self.nheads,
                              self.nheads, self.num_rope_angles], dim=-1)
        A = torch.clamp(-module.heavy_tail_activation(dd_A.float()), max=-self.A_floor)
        DT = F.softplus(dd_dt + self.dt_bias)
        B, C = (norm(t.unflatten(-1, (self.num_bc_heads, self.d_state)))
                for norm, t in ((self.B_norm, B), (self.C_norm, C)))
        x, z = (t.unflatten(-1, (self.nheads, self.headdim)) for t in (x, z))
        y, (angle, ssm, k, v) = mamba3_siso_step(
            C, B, x, A * DT, DT, trap, self.C_bias.squeeze(1), self.B_bias.squeeze(1),
            angles.float().unsqueeze(1).expand(-1, self.nheads, -1), self.D,
            None if self.is_outproj_norm else z,
            (angle_state, ssm_state, k_state.squeeze(1), v_state))
        y = y.flatten(1)
        if self.is_outproj_norm:
            y = self.norm(y, z.flatten(1))
        out = self.out_proj(y.to(x.dtype))
        out = out[:, None] if one_token else out
        for state, new in ((angle_state, angle), (ssm_state, ssm), (k_state, k.unsqueeze(1)),
                           (v_state, v)):
            state.copy_(new)
        return out, angle_state, ssm_state, k_state, v_state
    module.Mamba3.step = step


def import_mamba3_mimo(baseline):
    """(mamba_ssm's mamba3_mimo, its Mamba-3 MIMO TileLang kernels, from the copy, '') where
    TileLang imports, else (None, why not)."""
    _use_copy(baseline)
    # OSError: a TileLang library that does not load; AttributeError: a TileLang that does
    # not match its apache-tvm-ffi (tilelang 0.1.8 on 0.1.12, in tvm_ffi's registry)
    try:
        from mamba_ssm.ops.tilelang.mamba3.mamba3_mimo import mamba3_mimo
    except (ImportError, OSError, AttributeError) as error:
        return None, f"{type(error).__name__}: {error}"
    return mamba3_mimo, ""


def import_mamba3_mimo_reference(baseline):
    """mamba_ssm's MIMO torch reference (mamba3_MIMO_chunk_ref, apply_angle_dt_reference):
    its tests/ops/tilelang/test_mamba3_mimo.py in the copy at `baseline`, loaded as a module.
    That file imports pytest for its test declarations only; where pytest is absent a
    stand-in takes them. Exits saying how to add the file where the copy lacks it."""
    path = os.path.join(baseline, *MIMO_REFERENCE.split("/"))
    if not os.path.exists(path):
        raise SystemExit(f"mamba_ssm's MIMO reference is not at {path}: add its tests to the "
                         f"copy, e.g. git --git-dir=<mamba_ssm repository> archive <commit> "
                         f"tests/ops | tar -x -C {baseline}")
    _use_copy(baseline)
    try:
        import pytest  # noqa: F401
    except ImportError:
        sys.modules["pytest"] = _pytest_stand_in()
    spec = importlib.util.spec_from_file_location("mamba_ssm_mimo_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pytest_stand_in():
    """What a test module's declarations use of pytest: param, fixture(...) and
    mark.<anything>(...) as decorators that return the function."""
    class Marks:
        def __getattr__(self, name):
            return lambda *args, **kwargs: (lambda f: f)
    stand_in = types.ModuleType("pytest")
    stand_in.param = lambda *values, **kwargs: values
    stand_in.fixture = lambda *args, **kwargs: (lambda f: f)
    stand_in.mark = Marks()
    return stand_in


def import_mamba_lm(baseline):
    """(MambaConfig, MambaLMHeadModel) from the copy at `baseline`."""
    _use_copy(baseline)
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
    return MambaConfig, MambaLMHeadModel


def lacks_mamba3(baseline) -> str:
    """Why the copy at `baseline` cannot build a MambaLMHeadModel of Mamba3 layers ('' where
    it can): its ssm_cfg layer "Mamba3" came after v2.3.2.post1, on mamba_ssm's main."""
    path = os.path.join(baseline, "mamba_ssm", "models", "mixer_seq_simple.py")
    if not os.path.isfile(path):
        return f"no mamba_ssm copy at {baseline} ({path} is missing)"
    with open(path) as f:
        if '"Mamba3"' in f.read():
            return ""
    return (f"the mamba_ssm copy at {baseline} has no Mamba3 layer in MambaLMHeadModel "
            "(mamba_ssm's main has, from b3cae1b: pass --baseline with a copy of it, e.g. "
            ".baseline/e9594ce)")


def ssm_layer(cfg) -> str | None:
    """mamba_ssm's ssm_cfg layer for a config of one Mamba kind: "Mamba2" (layers M),
    "Mamba3" (layers 3); None for a layer pattern its MambaLMHeadModel, a Mamba mixer and an
    optional MLP in every block, cannot spell (attention, MLP layers of their own, Mamba-1
    without its CUDA extension, mixed kinds)."""
    return {frozenset("M"): "Mamba2", frozenset("3"): "Mamba3"}.get(frozenset(cfg.layers))


def mamba_config(cfg, MambaConfig, **ssm_cfg):
    """Our config as mamba_ssm's MambaConfig (extra ssm_cfg entries passed through): for
    Mamba-3 layers the config our mamba_ssm checkpoints carry
    (mamba_jax.formats.mamba_ssm_config_dict), else Mamba2 layers of our mamba2 section's
    sizes."""
    if ssm_layer(cfg) == "Mamba3":
        from mamba_jax.formats import mamba_ssm_config_dict
        config = mamba_ssm_config_dict(cfg)
        return MambaConfig(**dict(config, ssm_cfg={**config["ssm_cfg"], **ssm_cfg}))
    m = cfg.mamba2
    return MambaConfig(d_model=cfg.d_model, n_layer=cfg.n_layer, vocab_size=cfg.vocab_size,
                       ssm_cfg={"layer": "Mamba2", "d_state": m.d_state, "headdim": m.headdim,
                                "ngroups": m.ngroups, "chunk_size": m.chunk_size, **ssm_cfg},
                       rms_norm=True, residual_in_fp32=True, fused_add_norm=True,
                       pad_vocab_size_multiple=cfg.pad_vocab_size_multiple,
                       tie_embeddings=cfg.tie_embeddings)


# ---- which path runs ----

def causal_conv1d_version() -> tuple[str, str]:
    """(causal_conv1d's version, '') where it and its CUDA extension import, else ('', why
    not). torch first: the extension links against its libraries."""
    try:
        import torch  # noqa: F401
        import causal_conv1d
        import causal_conv1d_cuda  # noqa: F401
    except (ImportError, OSError) as error:
        return "", f"{type(error).__name__}: {error}"
    return causal_conv1d.__version__, ""


@dataclasses.dataclass(frozen=True)
class Install:
    """What decides mamba_ssm's path here: its version, causal_conv1d's ('' where it does not
    import, and why in `missing`), and for each name in USES whether mamba_ssm's module
    bound it."""

    mamba_ssm: str
    causal_conv1d: str
    missing: str
    bound: dict[str, bool]

    def slow(self, use: str) -> str:
        """Why `use` (a key of USES) of mamba_ssm runs a slow path here, or '' where it
        runs the fast one."""
        names = USES[use][0]
        if names and not self.causal_conv1d:
            return f"without causal_conv1d ({self.missing})"
        unbound = [name for name in names if not self.bound.get(name)]
        return (f"causal_conv1d {self.causal_conv1d} imports, but mamba_ssm bound None to "
                f"{', '.join(unbound)}" if unbound else "")


def version(baseline) -> str:
    """The version of the mamba_ssm copy at `baseline`, read from its __init__."""
    with open(os.path.join(baseline, "mamba_ssm", "__init__.py")) as f:
        return re.search(r'__version__ = "([^"]+)"', f.read()).group(1)


def probe(baseline) -> Install:
    """The Install of the copy at `baseline`, read in this process: it imports torch, triton and
    mamba_ssm's Mamba2 and SSD modules, and reads what they bound at import."""
    _use_copy(baseline)
    conv, missing = causal_conv1d_version()
    modules = {short: importlib.import_module(name) for short, name in MODULES.items()}

    def is_bound(name):  # "mamba2.causal_conv1d_update": that module's global
        module, attribute = name.split(".")
        return getattr(modules[module], attribute) is not None
    bound = {name: is_bound(name) for names, _, _ in USES.values() for name in names}
    return Install(version(baseline), conv, missing, bound)


def probe_in_child(baseline) -> Install:
    """probe() in a child process (`python -m bench.baseline`), so that this one does not
    load torch beside its JAX."""
    reported = harness.run_module("baseline", ["--baseline", baseline])[-1]
    if "error" in reported:
        raise SystemExit(f"mamba_ssm from {baseline!r} did not import: {reported['error']}")
    return Install(**reported)


# ---- the guard ----

@dataclasses.dataclass(frozen=True)
class Comparison:
    """How a table speaks of mamba_ssm: `line`, its header line (the path that runs), and
    ratio(), ours/theirs marked SLOW where that path is mamba_ssm's slow one."""

    line: str
    marker: str = ""

    def ratio(self, ours, theirs, spec=".2f", unit="x") -> str:
        return f"{ours / theirs:{spec}}{unit}{self.marker}"


def guard(install: Install, use: str, allow_slow: bool) -> Comparison:
    """What a table that times `use` (a key of USES) of mamba_ssm may print. On its fast
    path, its ratios; on a slow one, none (SystemExit, saying how to install
    causal_conv1d) unless allow_slow, and then every ratio marked SLOW."""
    _, fast, fallback = USES[use]
    why = install.slow(use)
    release = install.mamba_ssm
    if not why:
        conv = (f"causal_conv1d {install.causal_conv1d}" if install.causal_conv1d
                else "causal_conv1d absent")
        return Comparison(f"mamba_ssm {release} {fast}, {conv} (fast path)")
    if not allow_slow:
        raise SystemExit(f"mamba_ssm {release} would run its slow path, {why}: no ours/theirs "
                         f"ratio against it. Install causal_conv1d: {INSTALL}; or pass "
                         f"--allow-slow-baseline to mark every such ratio{SLOW}.")
    return Comparison(f"mamba_ssm {release} {fallback}, {why}: every ratio against it is "
                      f"marked{SLOW}", SLOW)


def comparison(baseline, use: str, allow_slow: bool, in_child: bool = True) -> Comparison:
    """guard() for `use` of the copy at `baseline`, probed in a child process (in this one
    where in_child is False: a script that loads torch anyway). Called before any timing, so
    that a refusal costs none; the script prints its line in the table's header."""
    install = probe_in_child(baseline) if in_child else probe(baseline)
    return guard(install, use, allow_slow)


def add_arguments(parser, use: str):
    """The options of a script that times `use` (a key of USES) of mamba_ssm: where its
    copy is, and where that use has a slow path, the guard's."""
    parser.add_argument("--baseline", default=".baseline",
                        help="the folder holding mamba_ssm's Python package (mamba_ssm/)")
    if USES[use][0]:
        parser.add_argument("--allow-slow-baseline", action="store_true",
                            help="without causal_conv1d, run mamba_ssm's slow path anyway and "
                                 f"mark every ratio against it{SLOW}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default=".baseline")
    args = parser.parse_args(argv)
    install = probe(args.baseline)
    harness.result(dataclasses.asdict(install))
    for use in USES:
        try:
            print(f"{use}: {guard(install, use, allow_slow=False).line}")
        except SystemExit as refused:
            print(f"{use}: {refused}")


if __name__ == "__main__":
    main()
