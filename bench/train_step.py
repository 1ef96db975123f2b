"""The trainer's sharded step on GPUs: float32 agreement between meshes, throughput per mesh,
the longest sequence that trains, and mamba_ssm's training step beside ours.

    python3 -m bench.train_step tiny --meshes dp=1 tp=2 cp=2 [--set FIELD=VALUE ...]
    python3 -m bench.train_step throughput --preset mamba2-1.3b --seq-len 4096 --batch 4 \\
        --meshes dp=1 tp=2 dp=2
    python3 -m bench.train_step longest --preset mamba2-1.3b --meshes dp=1 cp=2
    python3 -m bench.train_step versus --presets mamba2-370m mamba2-1.3b --seq-len 2048 \\
        --baseline .baseline [--allow-slow-baseline] [--fp8]
    python3 -m bench.train_step lora --preset nemotron-nano-9b-v2 --seq-len 4096 \\
        --lora-rank 16 --base-dtype bfloat16 --full-preset mamba2-2.7b

tiny: the first five losses of `python -m mamba_jax.train --steps 5` (tiny preset, float32;
  --set changes its fields, e.g. to a hybrid: --set layer_pattern=M*-M n_layer=4 ...) on the
  host CPU and under each mesh on the GPUs, at "highest" matmul precision, so that the
  meshes can be compared within float32 rounding.
throughput: one row per mesh, the same global batch: step time (median of --steps after two
  warm-up steps, the host clock around each step until its loss is ready), tokens/s, MFU
  and peak memory per device (the largest `peak_bytes_in_use` of the mesh's devices).
  --xla-variants runs each mesh once per entry, an entry being XLA flags without their
  leading dashes ('' for none), to compare them in one run:
  --xla-variants '' 'xla_gpu_enable_latency_hiding_scheduler=true'.
  --ssd-variants runs, in each mesh's process, one step per entry, an entry being the SSD
  kernels' config as bench.ssd's --breakdown spells it ('' the default): the steps share
  one state and take turns, --rounds times, so that their ratios are read within one
  process (peak memory is the process's, all of them run before it).
  --breakdown adds the jitted loss alone and the loss with its gradient, timed the same
  way: a coarse split of the step (the gradient alone writes every gradient out, which the
  step fuses into the update, so "the rest" is approximate).
longest: batch 1, --remat full, --loss-chunk: tokens/s at --seq-len (32K) and at the longest
  sequence that fits. XLA's memory analysis of the compiled step (arguments + outputs -
  donated + temporaries) at two lengths gives the bytes per token; the predicted longest
  multiple of --granule is compiled, checked to fit and run, and the next multiple is
  compiled to show that it does not fit.
versus: per preset, the largest batch that fits (ours: found as above over the batch; theirs:
  doubled until out of memory, then bisected), tokens/s and MFU of our step and of
  mamba_ssm's MambaLMHeadModel + torch.optim.AdamW (bf16 autocast over float32 weights, the
  same optimizer settings) in the same run, each on its own GPU (CUDA_VISIBLE_DEVICES), or
  on a one-GPU machine one after the other; and each side's time to its first step: ours,
  the compile and the first step at the batch measured (the batch search's other compiles
  not counted); theirs, the first training step its process runs (at --batch, before the
  search's other steps), which holds its CUDA and Triton compiles and autotuning.
  mamba_ssm comes from --baseline (a git-ignored copy of its Python, bench.baseline), its
  model built from our preset (bench.baseline.mamba_config). Mamba2 presets train on its fast
  path, use_mem_eff_path=True (mamba_split_conv1d_scan_combined, with causal_conv1d's conv),
  named in the table's header; without that extension the table prints no ratio unless
  --allow-slow-baseline, which runs use_mem_eff_path=False and marks them. Mamba-3 presets
  (mamba3-*; --baseline a copy of a commit whose MambaLMHeadModel takes ssm_cfg layer
  "Mamba3", e.g. .baseline/e9594ce) train its Mamba3 layers, SISO, on mamba3_siso_combined
  (its Triton kernels; no short conv, so no causal_conv1d); MIMO would need its TileLang
  kernels, which do not install on the GPU machine, so a MIMO preset (and a layer pattern its
  blocks cannot spell) gets our columns alone. Our Mamba-3 layers run mamba3_scan's default
  implementation, "auto".
lora: LoRA (--lora-rank, default 16, on every projection; the base stored in --base-dtype)
  of --preset at the largest batch that fits one GPU (found as versus finds ours), beside
  full fine-tuning of --full-preset at its largest, both measured in the run (tokens/s, peak
  GiB), and the memory full fine-tuning of --preset would need, computed: 16 bytes a
  parameter (float32 weights, gradients, AdamW's two moments) and the temporaries XLA plans
  for the LoRA step at its batch (its activations). --layers takes the preset's first
  layers, as throughput's.

--fp8 (throughput, versus): our step with the trainer's --fp8 too (--fp8-skip-layers, default
  1), in a process of its own, a row after our bf16 one: its tokens/s against mamba_ssm's and
  against our bf16 step's, and how many FP8 GEMMs XLA made of its matmuls (the cuBLASLt
  custom calls in the compiled step; a matmul it did not rewrite runs in bf16). mamba_ssm
  has no FP8 path: its row is its bf16 step.

Each mesh or framework runs in its own process, pinned to its GPUs (the first of those the
script sees: CUDA_VISIBLE_DEVICES=2,3 runs it on GPUs 2 and 3), so that its peak memory is
its own; ours compiled with the trainer's XLA options (cuBLAS's GEMMs, no cuBLASLt:
mamba_jax.optim.TRAIN_COMPILER_OPTIONS) but where XLA_FLAGS sets them. Progress (compile,
build and step times) goes to stderr. MFU:
mamba_jax.metrics.train_flops_per_token (every matmul, the SSD's chunked ones included,
forward x3; recomputation not counted) over the dense bf16 peak of the devices used
(mamba_jax.metrics.device_peak_flops: 989 TFLOP/s per H200, NVIDIA's datasheet).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import math
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench import baseline
from bench.harness import (ROOT, gpu_count, gpus, median_time, result, run_module,
                           table_header, table_row)

GIB = 2**30


# ---- one process: our step on the devices it sees ----

class Steps:
    """Our jitted train step for one preset and mesh, compiled once per (batch, seq_len);
    scan_layers as the trainer's --scan-layers (default: the layers one after the other);
    ssd_config: the SSD kernels' config it is traced with (bench.ssd.default_config);
    dtype: the compute dtype (the trainer's --dtype); tuning: a mamba_jax.adapters.Tuning
    (LoRA adapters, a bfloat16 base) or None (every parameter trains); fp8_skip_layers:
    None, or the trainer's --fp8 with --fp8-skip-layers this."""

    def __init__(self, preset, mesh_spec, remat, loss_chunk, layers=None, scan_layers=False,
                 ssd_config="", dtype="bfloat16", tuning=None, fp8_skip_layers=None):
        import jax
        from flax import nnx
        from jax.sharding import NamedSharding, PartitionSpec as P

        from mamba_jax import adapters, parallel
        from mamba_jax.config import Mamba2Config
        from mamba_jax.model import Fp8, Mamba2LM
        from mamba_jax.optim import make_optimizer, make_train_step, opt_state_shardings

        cfg = Mamba2Config.preset(preset)
        if layers:  # the first layers of the preset: the part of a model that fits
            cfg = cfg.replace(n_layer=layers, layer_pattern=cfg.layers[:layers],
                              attn_layer_idx=())
        self.cfg = cfg
        self.mesh_spec, self.loss_chunk, self.ssd_config = mesh_spec, loss_chunk, ssd_config
        n = math.prod(parallel.parse_mesh_spec(mesh_spec).values())
        self.mesh = mesh = parallel.make_mesh(mesh_spec, jax.devices()[:n])
        build = lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0), dtype=jax.numpy.dtype(dtype))
        self.build = tuning.build(build, 0) if tuning else build
        # what trains (params) and, with a tuning, the frozen base apart (frozen: [state])
        self.split = tuning.split if tuning else lambda state: (state,)
        graphdef, whole = nnx.split(nnx.eval_shape(self.build))
        specs = parallel.param_specs(whole, mesh)
        self.param_shardings = parallel.shardings(mesh, specs)
        abstract, *frozen = self.split(whole)
        self.trained_shardings, *frozen_shardings = self.split(self.param_shardings)
        self.tx, _ = make_optimizer(abstract, 3e-4, 1000, 10, 0.1, 1.0)
        self.fp8 = None if fp8_skip_layers is None else Fp8(fp8_skip_layers)
        self.loss_fn = parallel.make_loss_fn(graphdef, specs, mesh, remat=remat,
                                             loss_chunk=loss_chunk, scan_layers=scan_layers,
                                             fp8=self.fp8)
        if tuning:
            self.loss_fn = adapters.joined(self.loss_fn)
        self.step = make_train_step(self.loss_fn, self.tx)
        self.rows = NamedSharding(mesh, P(None, *parallel.TOKENS))
        self.replicated = NamedSharding(mesh, P())
        placed = lambda tree, shardings: jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)
        params = placed(abstract, self.trained_shardings)
        opt_state = placed(jax.eval_shape(self.tx.init, params), opt_state_shardings(
            self.tx, params, self.trained_shardings, self.replicated))
        self.abstract_state = (params, opt_state)
        self.abstract_frozen = tuple(map(placed, frozen, frozen_shardings))
        self.sizes = {"params": sum(a.size for a in jax.tree.leaves(whole)),
                      "trained": sum(a.size for a in jax.tree.leaves(abstract))}
        self.compiled = {}
        self.state = None  # (params, opt_state) on the devices, once measure() built them
        self.frozen = None  # the frozen part on the devices, once measure() built it

    def compile(self, batch, seq_len):
        """(compiled step, seconds to compile, device bytes XLA plans for it: arguments +
        outputs - donated + temporaries, per device)."""
        import jax

        from bench.ssd import default_config
        from mamba_jax import parallel

        if (batch, seq_len) not in self.compiled:
            parallel.check_layout(self.cfg, self.mesh, batch_size=batch, seq_len=seq_len,
                                  loss_chunk=self.loss_chunk)
            tokens = jax.ShapeDtypeStruct((1, batch, seq_len), jax.numpy.int32,
                                          sharding=self.rows)
            start = time.perf_counter()
            with default_config(self.ssd_config):
                lowered = self.step.lower(*self.abstract_state, (tokens, tokens),
                                          *self.abstract_frozen)
            log(f"  {self.mesh_spec} {batch}x{seq_len}: lowered in "
                f"{time.perf_counter() - start:.1f} s")
            exe = lowered.compile()
            m = exe.memory_analysis()
            log(f"  {self.mesh_spec} {batch}x{seq_len}: compiled in "
                f"{time.perf_counter() - start:.1f} s")
            self.compiled[batch, seq_len] = (
                exe, time.perf_counter() - start,
                m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                + m.temp_size_in_bytes, m.temp_size_in_bytes)
        return self.compiled[batch, seq_len]

    def planned(self, batch, seq_len):
        return self.compile(batch, seq_len)[2]

    def tokens(self, batch, seq_len):
        """(inputs, targets): one micro-batch of random tokens [1, batch, seq_len] on the
        mesh."""
        from mamba_jax import parallel

        ids = np.random.default_rng(0).integers(0, self.cfg.vocab_size,
                                                (1, batch, seq_len + 1), dtype=np.int32)
        return (parallel.global_array(ids[..., :-1], self.rows),
                parallel.global_array(ids[..., 1:], self.rows))

    def measure(self, batch, seq_len, steps, breakdown=False):
        """Run the step: compile seconds, the first step's seconds, median step seconds,
        tokens/s, MFU, peak memory per device (GiB), planned memory (GiB), loss; with
        breakdown also the median seconds of the loss alone (forward) and of the loss and its
        gradient (forward + backward), the rest of the step being the optimizer update."""
        import jax

        from bench.ssd import default_config
        from mamba_jax import parallel
        from mamba_jax.metrics import train_flops_per_token
        from mamba_jax.optim import init_opt_state

        exe, compile_s, planned, temporaries = self.compile(batch, seq_len)
        if self.state is None:  # built once per process; each step donates and returns it
            start = time.perf_counter()
            params, *frozen = self.split(parallel.init_params(self.build,
                                                              self.param_shardings))
            self.frozen = tuple(frozen)
            self.state = (params, init_opt_state(self.tx, params, self.trained_shardings,
                                                 self.replicated))
            jax.block_until_ready(self.state)
            log(f"  {self.mesh_spec}: parameters and optimizer state built in "
                f"{time.perf_counter() - start:.1f} s")
        params, opt_state = self.state
        self.state = None
        tokens = self.tokens(batch, seq_len)
        times = []

        def timed(loss, start):
            """Waits for loss; -> when it was read, the next step's start."""
            loss.block_until_ready()
            now = time.perf_counter()
            times.append(now - start)
            log(f"  {self.mesh_spec} {batch}x{seq_len}: step {len(times)} {times[-1]:.3f} s, "
                f"loss {float(loss):.3f}")
            return now

        for _ in range(2):  # warm-up, each step read before the next is dispatched
            start = time.perf_counter()
            params, opt_state, loss, _ = exe(params, opt_state, tokens, *self.frozen)
            timed(loss, start)
        # Then as the trainer runs them: each step dispatched before the loss of the one
        # before it is read, a step's time from one loss read to the next.
        start = time.perf_counter()
        params, opt_state, pending, _ = exe(params, opt_state, tokens, *self.frozen)
        for _ in range(steps):
            params, opt_state, loss, _ = exe(params, opt_state, tokens, *self.frozen)
            start, pending = timed(pending, start), loss
        loss.block_until_ready()
        step_s = float(np.median(times[2:]))
        parts = {}
        if breakdown:
            micro = tuple(a[0] for a in tokens)
            for name, fn in (("forward_s", jax.jit(self.loss_fn)),
                             ("forward_backward_s", jax.jit(jax.value_and_grad(self.loss_fn)))):
                # One warm-up call compiles it.
                with default_config(self.ssd_config):  # the warm-up call traces it
                    parts[name] = median_time(
                        lambda fn=fn: jax.block_until_ready(
                            fn(params, *self.frozen, *micro)), 1, steps)
                log(f"  {self.mesh_spec} {batch}x{seq_len}: {name} {parts[name]:.3f} s")
        devices = list(self.mesh.devices.flat)
        flops = train_flops_per_token(self.cfg, seq_len) * batch * seq_len
        peak = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in devices)
        loss = float(loss)
        self.state = (params, opt_state)
        return {"mesh": self.mesh_spec, "fp8": self.fp8 is not None,
                "fp8_gemms": fp8_gemms(exe.as_text()), "batch": batch, "seq_len": seq_len,
                "compile_s": compile_s, "first_step_s": times[0], "step_s": step_s,
                "tokens_s": batch * seq_len / step_s,
                "mfu": flops / step_s / (peak_flops(devices[0].device_kind) * len(devices)),
                "peak_gib": peak / GIB, "planned_gib": planned / GIB,
                "temporaries_gib": temporaries / GIB, **self.sizes, "loss": loss,
                "finite": math.isfinite(loss), "devices": len(devices),
                "device_kind": devices[0].device_kind, **parts}


# The custom call of XLA's FP8 GEMMs (its GEMM rewriter's, on cuBLASLt): a dot of dequantized
# FP8 operands that it did not rewrite runs as a bf16 GEMM instead, silently.
FP8_GEMM = 'custom_call_target="__cublas$lt$matmul$f8"'


def fp8_gemms(hlo_text: str) -> int:
    """How many FP8 GEMMs a compiled program's HLO holds (0 off a GPU)."""
    return hlo_text.count(FP8_GEMM)


def peak_flops(device_kind):
    """One device's dense bf16 peak FLOP/s (mamba_jax.metrics); NaN for a device it does not
    list (a CPU), so MFU prints as nan."""
    from mamba_jax.metrics import device_peak_flops
    return device_peak_flops(device_kind) or math.nan


def log(line):
    """Progress, on stderr (the parent passes lines that start with two spaces on)."""
    print(line, file=sys.stderr, flush=True)


def largest(plan, start, granule, limit, log):
    """The largest multiple of granule whose plan(value) bytes fit in limit: a guess from
    the line through the plans at start and 2*start (memory is about linear in the batch and
    in the length), then stepped down or up to where the next multiple no longer fits:
    (value, the next multiple's bytes)."""
    lo, hi = plan(start), plan(2 * start)
    per = (hi - lo) / start
    guess = max(granule, int((limit - (lo - per * start)) / per) // granule * granule)
    log(f"  planned {lo / GIB:.1f} GiB at {start}, {hi / GIB:.1f} GiB at {2 * start}: "
        f"{per / 2**20:.2f} MiB per unit; limit {limit / GIB:.1f} GiB -> try {guess}")
    # The guess and the next multiple compile side by side (XLA compiles outside the GIL).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        need, next_need = pool.map(plan, (guess, guess + granule))
    while need > limit and guess > granule:
        guess, next_need = guess - granule, need
        need = plan(guess)
    while next_need <= limit:  # the line under-predicted (a cp=2 run did): step up
        guess, need = guess + granule, next_need
        next_need = plan(guess + granule)
    return guess, next_need


def child(args):
    """One process's work; reports its results (harness.result)."""
    import jax

    if args.child == "variants":
        return variants(args)
    steps = Steps(args.preset, args.mesh, args.remat, args.loss_chunk, args.layers,
                  args.scan_layers, tuning=tuning(args), fp8_skip_layers=fp8_skip(args))
    if args.child == "measure":
        result(steps.measure(args.batch, args.seq_len, args.steps, args.breakdown))
        return
    limit = (args.limit_gib * GIB if args.limit_gib
             else jax.devices()[0].memory_stats()["bytes_limit"])
    if args.child == "longest":
        result(steps.measure(1, args.seq_len, args.steps))
        value, next_need = largest(lambda L: steps.planned(1, L), args.seq_len, args.granule,
                                   limit, log)
        measured = steps.measure(1, value, args.steps)
    else:  # the largest batch
        value, next_need = largest(lambda b: steps.planned(b, args.seq_len), args.batch,
                                   args.granule, limit, log)
        measured = steps.measure(value, args.seq_len, args.steps)
    result(dict(measured, next_planned_gib=next_need / GIB, limit_gib=limit / GIB))


def tuning(args):
    """The mamba_jax.adapters.Tuning of --lora-rank and --base-dtype, or None."""
    from mamba_jax.adapters import Tuning
    from mamba_jax.config import Mamba2Config

    if args.lora_rank is None:
        return None
    return Tuning(rank=args.lora_rank, base_dtype=args.base_dtype).check(
        Mamba2Config.preset(args.preset))


def variants(args):
    """One step per --ssd-variants entry, taking turns --rounds times over one state (the
    first step builds it; each hands it to the next): a result per step and round."""
    runs = [Steps(args.preset, args.mesh, args.remat, args.loss_chunk, args.layers,
                  args.scan_layers, config, fp8_skip_layers=fp8_skip(args))
            for config in args.ssd_variants]
    state = None
    for round_ in range(1, args.rounds + 1):
        for steps in runs:
            steps.state, state = state, None
            measured = steps.measure(args.batch, args.seq_len, args.steps, args.breakdown)
            state, steps.state = steps.state, None
            result(dict(measured, ssd=steps.ssd_config, round=round_))


def fp8_skip(args) -> int | None:
    """A child's Steps fp8_skip_layers: --fp8-skip-layers where it runs --fp8, else None."""
    return args.fp8_skip_layers if args.fp8 else None


def apart(jobs: dict, timeout: float) -> dict:
    """Each job (this script's child argv) on a GPU of its own, as many at once as there are
    GPUs (one after the other, in order, on a one-GPU machine): {key: its last report}."""
    lanes = queue.Queue()
    for lane in range(max(1, min(gpu_count(), len(jobs)))):
        lanes.put(lane)

    def run(argv):
        lane = lanes.get()
        try:
            return in_process(gpus(1, skip=lane), argv, timeout)[-1]
        finally:
            lanes.put(lane)
    with concurrent.futures.ThreadPoolExecutor(lanes.qsize()) as pool:
        running = {key: pool.submit(run, argv) for key, argv in jobs.items()}
        return {key: future.result() for key, future in running.items()}


def in_process(gpus: str, argv: list[str], timeout: float, xla_flags: str = "") -> list[dict]:
    """This script's child (argv) run pinned to gpus, with xla_flags added to XLA_FLAGS; what
    it reported (harness.run_module)."""
    flags = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags).strip()
    return run_module("train_step", argv, visible=gpus, timeout=timeout,
                      env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", "XLA_FLAGS": flags})


def gpus_for(mesh_spec: str) -> str:
    from mamba_jax.parallel import parse_mesh_spec
    return gpus(math.prod(parse_mesh_spec(mesh_spec).values()))


# ---- mamba_ssm's step (torch), in its own process ----

def their_step(cfg, baseline_dir):
    """mamba_ssm's training step for our config cfg, from the copy at baseline_dir: (step(ids
    [b, l + 1] int64 on the GPU) -> the loss tensor, its optimizer, the path it runs)."""
    import torch
    import torch.nn.functional as F

    MambaConfig, MambaLMHeadModel = baseline.import_mamba_lm(baseline_dir)
    if baseline.ssm_layer(cfg) == "Mamba3":  # one path: mamba3_siso_combined
        config = baseline.mamba_config(cfg, MambaConfig)
        path = "Mamba3 SISO (mamba3_siso_combined)"
    else:
        # Its fast path wherever it can run here; the parent's guard refused a run without
        # it or marks its ratios.
        mem_eff = not baseline.probe(baseline_dir).slow("train")
        config = baseline.mamba_config(cfg, MambaConfig, use_mem_eff_path=mem_eff)
        path = f"use_mem_eff_path={mem_eff}"
    model = MambaLMHeadModel(config, device="cuda", dtype=torch.float32)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embedding" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2
                                                           and "embedding" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)

    def step(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step, opt, path


def theirs(args):
    """Largest batch (doubling, then bisecting) and tokens/s of mamba_ssm's training step,
    and the seconds of the first step this process runs (at --batch, its CUDA and Triton
    compiles and autotuning included)."""
    import torch

    from mamba_jax.config import Mamba2Config
    from mamba_jax.metrics import train_flops_per_token

    cfg = Mamba2Config.preset(args.preset)
    step, opt, path = their_step(cfg, args.baseline)
    first = {}  # the first step that ran: its seconds and batch

    def fits(batch):
        try:
            ids = torch.randint(0, cfg.vocab_size, (batch, args.seq_len + 1), device="cuda")
            start = time.perf_counter()
            step(ids).item()
            first.setdefault("first_step_s", time.perf_counter() - start)
            first.setdefault("first_step_batch", batch)
            step(ids).item()
            return True
        except torch.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            return False

    ok, batch = 0, args.batch
    while fits(batch):
        ok, batch = batch, 2 * batch
    bad = batch
    while bad - ok > args.granule:
        mid = (ok + bad) // 2 // args.granule * args.granule
        ok, bad = (mid, bad) if fits(mid) else (ok, mid)
    ids = torch.randint(0, cfg.vocab_size, (ok, args.seq_len + 1), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    losses = []  # .item() waits for the step
    step_s = median_time(lambda: losses.append(step(ids).item()), 2, args.steps)
    loss = losses[-1]
    flops = train_flops_per_token(cfg, args.seq_len) * ok * args.seq_len
    result({"batch": ok, "seq_len": args.seq_len, "step_s": step_s,
            "tokens_s": ok * args.seq_len / step_s,
            "mfu": flops / step_s / peak_flops(torch.cuda.get_device_name()),
            "peak_gib": torch.cuda.max_memory_allocated() / GIB, "loss": loss,
            "finite": math.isfinite(loss), "first_oom_batch": bad, "path": path, **first})


# ---- the tables ----

def tiny(args):
    def losses(platform, mesh):
        with tempfile.TemporaryDirectory() as tmp:
            argv = ["--steps", "5", "--out", "none", "--metrics-file", f"{tmp}/m.jsonl",
                    "--mesh", mesh, *itertools.chain(*(("--set", c) for c in args.set))]
            env = dict(os.environ, JAX_PLATFORMS=platform,
                       JAX_DEFAULT_MATMUL_PRECISION="highest",
                       CUDA_VISIBLE_DEVICES=gpus_for(mesh))
            run = subprocess.run([sys.executable, "-m", "mamba_jax.train", *argv], env=env,
                                 capture_output=True, text=True, cwd=ROOT)
            if run.returncode:
                print(run.stderr[-2000:])
                return [float("nan")] * 5
            with open(f"{tmp}/m.jsonl") as f:
                return [json.loads(line)["loss"] for line in f]
    cpu = losses("cpu", "dp=1")
    gpu = {mesh: losses("cuda", mesh) for mesh in args.meshes}
    print("| step | CPU, one device | " + " | ".join(f"GPU {m}" for m in gpu)
          + " | max rel. diff between GPU meshes | max rel. diff GPU vs CPU |")
    print("|---|---|" + "---|" * len(gpu) + "---|---|")
    for i, c in enumerate(cpu):
        row = [g[i] for g in gpu.values()]
        between = (max(row) - min(row)) / abs(row[0])
        vs_cpu = max(abs(r - c) for r in row) / abs(c)
        print(f"| {i + 1} | {c:.6f} | " + " | ".join(f"{r:.6f}" for r in row)
              + f" | {between:.1e} | {vs_cpu:.1e} |", flush=True)


def row_head(*extra):
    return table_header(("mesh", "GPUs", "batch x seqlen", "compile s", "step ms", "tokens/s",
                         "tokens/s per GPU", "MFU", "peak GiB per GPU", "loss") + extra)


def row(r, label=None):
    if "error" in r:
        return f"| {label or '?'} | | | | | | | | | {r['error']} |"
    return (f"| {label or r['mesh']} | {r['devices']} | {r['batch']}x{r['seq_len']} | "
            f"{r['compile_s']:.1f} | {r['step_s'] * 1e3:.1f} | {r['tokens_s']:,.0f} | "
            f"{r['tokens_s'] / r['devices']:,.0f} | {100 * r['mfu']:.1f}% | "
            f"{r['peak_gib']:.1f} | {r['loss']:.3f}" + ("" if r["finite"] else " NOT FINITE")
            + " |")


def add_scan_layers_argument(parser):
    """--scan-layers / --no-scan-layers, as the trainer's flag, for the scripts that build
    our step."""
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=False,
                        help="our layers as one scan per run of a layer kind, as the "
                             "trainer's flag (default: one after the other)")


def layers_note(args) -> str:
    """What a table's introduction says of --scan-layers."""
    return "; our layers scanned (--scan-layers)" if args.scan_layers else ""


def child_argv(args, kind, mesh, fp8=False, **changes):
    """The argv of a child of `kind` on `mesh`: args' settings, those in `changes` instead
    (layers and lora_rank None: none); fp8: with the trainer's --fp8."""
    values = {**dict(preset=args.preset, batch=args.batch, seq_len=args.seq_len,
                     remat=args.remat, steps=args.steps, granule=args.granule,
                     layers=args.layers, limit_gib=args.limit_gib, lora_rank=args.lora_rank),
              **changes}
    if values["lora_rank"] is not None:
        values["base_dtype"] = args.base_dtype
    values = {k: v for k, v in values.items() if v is not None}
    flags = (["--breakdown"] if args.breakdown else []) + (["--scan-layers"] if args.scan_layers
                                                           else [])
    if fp8:  # this child's step with the trainer's --fp8
        flags += ["--fp8", f"--fp8-skip-layers={args.fp8_skip_layers}"]
    argv = ["_child", kind, "--mesh", mesh] + [
        f"--{k.replace('_', '-')}={v}" for k, v in values.items()]
    return argv + flags + ([f"--loss-chunk={args.loss_chunk}"] if args.loss_chunk else [])


def precisions(args) -> tuple[bool, ...]:
    """Our steps to run, as child_argv's fp8: the bf16 one, and with --fp8 the FP8 one."""
    return (False, True) if args.fp8 else (False,)


def fp8_note(args) -> str:
    """What a table's introduction says of --fp8."""
    return (f"; rows marked --fp8: the trainer's --fp8 (FP8 projections but in the first and "
            f"last {args.fp8_skip_layers} layers)" if args.fp8 else "")


def fp8_line(r, bf16) -> str:
    """An FP8 row's comparison with our bf16 row of the same mesh (or None)."""
    against = ("" if bf16 is None or "error" in bf16 else
               f"{r['tokens_s'] / bf16['tokens_s']:.3f}x our bf16 tokens/s, ")
    return f"{against}{r['fp8_gemms']} FP8 GEMMs (cuBLASLt) in the step"


def throughput(args):
    part = f" (its first {args.layers} layers)" if args.layers else ""
    print(f"{args.preset}{part}, bf16 compute, remat {args.remat}{layers_note(args)}"
          f"{fp8_note(args)}; median of {args.steps} steps")
    print(row_head(), flush=True)
    bases = {}
    kind, extra = ("variants", ["--rounds", str(args.rounds), "--ssd-variants",
                                *args.ssd_variants]) if args.ssd_variants else ("measure", [])
    bf16 = {}  # (mesh, flags, round) -> our bf16 row, for the FP8 row after it
    for mesh, variant, fp8 in itertools.product(args.meshes, args.xla_variants,
                                                precisions(args)):
        flags = " ".join("--" + flag for flag in variant.split())
        for r in in_process(gpus_for(mesh), child_argv(args, kind, mesh, fp8) + extra,
                            args.timeout, xla_flags=flags):
            label = " ".join(part for part in (
                mesh, flags, "--fp8" if fp8 else "",
                "ssd " + (r["ssd"] or "default") if "ssd" in r else "",
                f"round {r['round']}" if "round" in r else "") if part)
            print(row(r, label), flush=True)
            key = (mesh, flags, r.get("ssd"), r.get("round"))
            if fp8 and "error" not in r:
                print(f"|   --fp8 | | | | {fp8_line(r, bf16.get(key))} | | | | | |", flush=True)
            elif not fp8:
                bf16[key] = r
            if "forward_s" in r:
                print(f"|   breakdown | | | | forward {r['forward_s'] * 1e3:.1f} ms, "
                      f"forward+backward {r['forward_backward_s'] * 1e3:.1f} ms, optimizer "
                      f"and the rest {(r['step_s'] - r['forward_backward_s']) * 1e3:.1f} ms "
                      "| | | | | |", flush=True)
            if "error" not in r:  # with --ssd-variants, the first row of its process's round
                base = bases.setdefault((mesh, flags, r["round"]) if "round" in r else None, r)
                print(f"|   vs first row | | | | {r['step_s'] / base['step_s']:.3f}x step time "
                      f"| | | | {r['peak_gib'] / max(base['peak_gib'], 1e-9):.2f}x peak | |",
                      flush=True)


def lora(args):
    """LoRA of --preset at the largest batch that fits, beside full fine-tuning of
    --full-preset at its largest, both measured in this run, and the memory full
    fine-tuning of --preset would need: float32 weights, gradients and AdamW's two moments
    (16 bytes a parameter) and the activations and temporaries XLA plans for the LoRA step
    at its batch (the same layers' forward and backward)."""
    print(f"seqlen {args.seq_len}, bf16 compute, remat {args.remat}{layers_note(args)}; "
          f"largest batch that fits; median of {args.steps} steps; LoRA rank "
          f"{args.lora_rank} on every projection, the base in {args.base_dtype}")
    print(table_header(("run", "trained / all parameters", "batch x seqlen", "step ms",
                        "tokens/s", "peak GiB", "planned GiB")), flush=True)
    runs = ((f"LoRA of {args.preset}", child_argv(args, "batch", "dp=1")),
            (f"full fine-tuning of {args.full_preset}",
             child_argv(args, "batch", "dp=1", preset=args.full_preset, layers=None,
                        lora_rank=None)))
    measured = {}
    for label, argv in runs:
        r = measured[label] = in_process(gpus(1), argv, args.timeout)[-1]
        if "error" in r:
            print(table_row((label, r["error"], "", "", "", "", "")), flush=True)
            continue
        print(table_row((label, f"{r['trained'] / 1e6:,.1f}M / {r['params'] / 1e6:,.1f}M",
                         f"{r['batch']}x{r['seq_len']}", f"{r['step_s'] * 1e3:.1f}",
                         f"{r['tokens_s']:,.0f}", f"{r['peak_gib']:.1f}",
                         f"{r['planned_gib']:.1f}")), flush=True)
    r = measured[runs[0][0]]
    if "error" not in r:
        states = 16 * r["params"] / GIB
        print(table_row((f"full fine-tuning of {args.preset} (computed, not run)",
                         f"{r['params'] / 1e6:,.1f}M / {r['params'] / 1e6:,.1f}M",
                         f"{r['batch']}x{r['seq_len']}", "", "",
                         f"{states + r['temporaries_gib']:.1f} needed: {states:.1f} of "
                         f"weights, gradients and moments + {r['temporaries_gib']:.1f} of "
                         "activations", "")), flush=True)
        print(f"  LoRA peak / full fine-tuning's need: "
              f"{r['peak_gib'] / (states + r['temporaries_gib']):.2f}x; device limit "
              f"{r['limit_gib']:.1f} GiB", flush=True)


def longest(args):
    print(f"{args.preset}, batch 1, bf16 compute, remat {args.remat}, loss chunk "
          f"{args.loss_chunk}; median of {args.steps} steps")
    print(row_head("planned GiB (next length's)"), flush=True)
    for mesh in args.meshes:
        for r in in_process(gpus_for(mesh), child_argv(args, "longest", mesh), args.timeout):
            extra = (f" {r['planned_gib']:.1f} ({r['next_planned_gib']:.1f} > limit "
                     f"{r['limit_gib']:.1f}) |" if "next_planned_gib" in r else
                     f" {r.get('planned_gib', 0):.1f} |")
            print(row(r) + extra, flush=True)


def not_comparable(cfg, copy) -> str:
    """Why mamba_ssm's step (its copy at `copy`) does not run for this config ('' where it
    does)."""
    layer = baseline.ssm_layer(cfg)
    if layer is None:
        return (f"mamba_ssm's MambaLMHeadModel cannot spell the layer pattern "
                f"{cfg.layers[:12]}...")
    if layer == "Mamba3" and cfg.mamba3.is_mimo:
        return ("mamba_ssm's Mamba3 MIMO trains only on its TileLang kernels, which do not "
                "install on the GPU machine")
    return baseline.lacks_mamba3(copy) if layer == "Mamba3" else ""


def their_use(cfg) -> str:
    """The bench.baseline.USES key of mamba_ssm's training step for this config."""
    return "train-mamba3" if baseline.ssm_layer(cfg) == "Mamba3" else "train"


def versus(args):
    from mamba_jax.config import Mamba2Config

    configs = {preset: Mamba2Config.preset(preset) for preset in args.presets}
    # mamba_ssm's path per kind of preset, checked before any timing.
    uses = {preset: their_use(cfg) for preset, cfg in configs.items()
            if not not_comparable(cfg, args.baseline)}
    compared = {use: baseline.comparison(args.baseline, use, args.allow_slow_baseline)
                for use in dict.fromkeys(uses.values())}
    print(f"seqlen {args.seq_len}, bf16 compute over float32 weights, AdamW; largest batch "
          f"that fits; median of {args.steps} steps; ours and mamba_ssm each on a GPU of its "
          "own, at the same time where there are enough GPUs, else one after the other. First "
          "step: ours, the compile and the first step at the batch measured; theirs, the first "
          f"step its process ran (batch {args.batch}, its CUDA and Triton compiles and "
          f"autotuning included){layers_note(args)}{fp8_note(args)}")
    print(f"mamba_ssm from {args.baseline}")
    if any("3" in cfg.layers for cfg in configs.values()):
        print("ours: Mamba-3 layers on mamba3_scan's \"auto\": the SSD's Pallas kernels on a "
              "Hopper GPU where they take the shapes, else XLA's chunked form (logged: "
              "pallas_kernels.fallback)")
    for comparison in compared.values():
        print(comparison.line)
    print(table_header(("model", "ours batch", "ours tokens/s", "ours MFU", "ours peak GiB",
                        "theirs batch", "theirs tokens/s", "theirs MFU", "theirs peak GiB",
                        "ours/theirs tokens/s", "ours first step s", "theirs first step s")),
          flush=True)
    for preset, cfg in configs.items():
        args.preset = preset
        why = not_comparable(cfg, args.baseline)
        jobs = {fp8: child_argv(args, "batch", "dp=1", fp8) for fp8 in precisions(args)}
        if not why:
            jobs["theirs"] = ["_theirs", f"--preset={preset}", f"--batch={args.batch}",
                              f"--seq-len={args.seq_len}", f"--steps={args.steps}",
                              f"--granule={args.granule}", f"--baseline={args.baseline}"]
        done = apart(jobs, args.timeout)
        m, t = done[False], done.get("theirs", {"error": f"not run: {why}"})
        theirs_cells = ("", "", "", "", "") if "error" in t else (
            t["batch"], f"{t['tokens_s']:,.0f}", f"{100 * t['mfu']:.1f}%",
            f"{t['peak_gib']:.1f}", f"{t.get('first_step_s', math.nan):.1f}")
        for fp8 in precisions(args):
            r = done[fp8]
            ours_cells = ("", "", "", "", "") if "error" in r else (
                r["batch"], f"{r['tokens_s']:,.0f}", f"{100 * r['mfu']:.1f}%",
                f"{r['peak_gib']:.1f}", f"{r['compile_s'] + r['first_step_s']:.1f}")
            ratio = ("" if "error" in r or "error" in t else
                     compared[uses[preset]].ratio(r["tokens_s"], t["tokens_s"]))
            print(table_row((preset + (" --fp8" if fp8 else ""), *ours_cells[:4],
                             *theirs_cells[:4], ratio, ours_cells[4], theirs_cells[4])),
                  flush=True)
        for fp8 in precisions(args):
            r, who = done[fp8], "ours --fp8" if fp8 else "ours"
            if "error" in r:
                print(f"  {who}: {r['error']}", flush=True)
                continue
            print(f"  {who}: next batch planned {r['next_planned_gib']:.1f} GiB > "
                  f"{r['limit_gib']:.1f}; first step {r['first_step_s']:.1f} s after "
                  f"{r['compile_s']:.1f} s of compile"
                  + (f"; {fp8_line(r, m)}" if fp8 else ""), flush=True)
        if "error" in t:
            print(f"  theirs: {t['error']}", flush=True)
        else:
            print(f"  theirs: out of memory at batch {t['first_oom_batch']}, {t['path']}; "
                  f"first step at batch {t.get('first_step_batch')}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("tiny", "throughput", "longest", "versus", "lora",
                                    "_child", "_theirs"))
    p.add_argument("child", nargs="?", choices=("measure", "longest", "batch", "variants"))
    p.add_argument("--meshes", nargs="+", default=["dp=1"])
    p.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE",
                   help="tiny: Mamba2Config fields of the tiny preset to change "
                        "(mamba_jax.train's --set), e.g. a hybrid's layer_pattern")
    p.add_argument("--mesh", default="dp=1")
    p.add_argument("--preset", default="mamba2-1.3b")
    p.add_argument("--presets", nargs="+", default=["mamba2-370m", "mamba2-1.3b"])
    p.add_argument("--layers", type=int, default=None,
                   help="throughput, longest: the preset's first LAYERS layers only (the "
                        "largest part of a model that fits the devices)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--remat", default=None)
    add_scan_layers_argument(p)
    p.add_argument("--loss-chunk", type=int, default=None)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--granule", type=int, default=None,
                   help="step of the largest-batch / longest-sequence search")
    p.add_argument("--timeout", type=float, default=540)
    baseline.add_arguments(p, "train")
    p.add_argument("--xla-variants", nargs="+", default=[""], metavar="FLAGS",
                   help="throughput: run each mesh once per entry, XLA flags without their "
                        "leading dashes ('' for none)")
    p.add_argument("--ssd-variants", nargs="+", default=None, metavar="CONFIG",
                   help="throughput: in each mesh's process, one step per SSD kernel config "
                        "(bench.ssd's --breakdown CONFIG: '' the default, "
                        "'keep_states=True' ...), taking turns over one state")
    p.add_argument("--rounds", type=int, default=2,
                   help="throughput --ssd-variants: turns each step takes")
    p.add_argument("--fp8", action="store_true",
                   help="throughput, versus: our step with the trainer's --fp8 too, beside the "
                        "bf16 one (in a _child: this step with --fp8)")
    p.add_argument("--fp8-skip-layers", type=int, default=1, metavar="N",
                   help="with --fp8: the trainer's --fp8-skip-layers")
    p.add_argument("--breakdown", action="store_true",
                   help="throughput: also time the loss alone and the loss with its gradient")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="lora (default 16), throughput: LoRA adapters of this rank on every "
                        "projection, the only parameters that train")
    p.add_argument("--base-dtype", choices=("float32", "bfloat16"), default="bfloat16",
                   help="with --lora-rank: the frozen base's weights stored in this dtype")
    p.add_argument("--full-preset", default="mamba2-2.7b",
                   help="lora: the model whose full fine-tuning runs beside")
    p.add_argument("--limit-gib", type=float, default=None,
                   help="device memory to fit in (default: the device's bytes_limit)")
    args = p.parse_args(argv)
    defaults = {"throughput": (4, 4096, "none", None, 4),
                "longest": (1, 32768, "full", 4096, 16384),
                "versus": (8, 2048, "none", None, 4),
                "lora": (1, 4096, "none", None, 1)}.get(args.mode)
    if args.mode == "lora" and args.lora_rank is None:
        args.lora_rank = 16
    if defaults:
        for name, value in zip(("batch", "seq_len", "remat", "loss_chunk", "granule"),
                               defaults):
            if getattr(args, name) is None:
                setattr(args, name, value)
    if args.mode in ("tiny", "throughput", "longest", "versus", "lora"):
        import jax  # no backend here: the GPUs are left to the child processes
        names = (subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip().replace("\n", ", ")
                 if shutil.which("nvidia-smi") else "none")
        print(f"{time.strftime('%Y-%m-%d')} jax {jax.__version__}, GPU: {names}", flush=True)
    {"tiny": tiny, "throughput": throughput, "longest": longest, "versus": versus,
     "lora": lora, "_child": child, "_theirs": theirs}[args.mode](args)


if __name__ == "__main__":
    main()
