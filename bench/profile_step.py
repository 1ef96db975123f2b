"""Where the GPU time of our train step goes: a jax.profiler trace of a few steps, its
device kernels summed by name and by kind. With --decode NEW, the same for generation.

    python3 -m bench.profile_step --preset mamba2-1.3b --seq-len 2048 --batch 8 --out DIR
    python3 -m bench.profile_step --preset mamba2-1.3b --seq-len 128 --batch 1 --decode 256 \\
        [--step-implementation triton] [--ssm-state-dtype bfloat16] --out DIR

Builds and compiles the step as bench.train_step does (Steps: same mesh, remat and
parameters; the trainer's XLA options, cuBLAS's GEMMs; --fp8: the trainer's --fp8, whose
FP8 GEMMs XLA runs on cuBLASLt, counted in the header), runs two warm-up steps, traces
--steps steps, and prints the step time, GPU time per step by kind (matmul, SSD Pallas
kernels, collectives, copies, other fusions) and the --top kernels by GPU time per step,
each with the HLO ops that launched it (the trace's `hlo_op`, by time) and, for an XLA
fusion, what it computes (`fusion_contents`: its output's and operands' shapes, its
operations and the JAX operation it came from, read from the compiled HLO: under XLA's
command buffers the trace names only the buffer). DIR keeps the trace
(perfetto_trace.json.gz, for ui.perfetto.dev) and the compiled step's HLO (step.hlo.txt).
Kernel times are the trace's device events (CUPTI); kernels on different streams may
overlap, so their sum can exceed the step time.

--scan KIND: a scan alone, its forward and its forward+backward (the output returned with
the gradients, harness.forward_and_backward) each traced --steps times, each fusion with
what it computes (DIR/forward.hlo.txt and DIR/forward_backward.hlo.txt keep their compiled
HLO), at --batch x --seq-len with bench.ssd's ("ssd": 64 heads of 64, d_state 128, --groups,
chunk 256) or bench.mamba3's ("mamba3", "mamba3-mimo": the same head layout, one group, rank
4 for MIMO) inputs, bf16, on the kernels.

    python3 -m bench.profile_step --scan mamba3 --batch 8 --seq-len 2048 --out DIR

--theirs: the same for mamba_ssm's training step (bench.train_step.their_step: its
MambaLMHeadModel and fused AdamW, built from --preset, from the copy at --baseline; its
fast path, or refused as bench.baseline's guard says), after two steps (its autotuning),
traced by torch.profiler over --steps steps (DIR/mamba_ssm_trace.json, for ui.perfetto.dev).
Its kernels fall in the same kinds by name (torch's elementwise kernels under "other
fusion"); no HLO ops.

    python3 -m bench.profile_step --theirs --preset mamba2-1.3b --seq-len 2048 --batch 16 \
        --baseline .baseline --out DIR

--theirs --scan mamba3: mamba_ssm's Mamba-3 SISO scan (mamba3_siso_combined, its Triton
kernels; its main's copy at --baseline) on the same inputs as ours, its forward and its
forward+backward traced alike (DIR/mamba_ssm_forward.json, mamba_ssm_forward_backward.json).

    python3 -m bench.profile_step --theirs --scan mamba3 --batch 8 --seq-len 2048 \
        --baseline .baseline/e9594ce --out DIR

--decode NEW: `mamba_jax.generate` of NEW tokens after a --seq-len prompt for --batch rows
(random bf16 weights, greedy), compiled by one call and traced in a second; the kernels of
the decode loop's program (not the prefill's) per decode step (NEW - 1 of them), each fusion
with what it computes from the loop's compiled HLO (DIR/decode.hlo.txt, which XLA writes as
it compiles: --xla_dump_to). The loop is compiled with XLA's default command buffers, not
generate's (a loop run as a CUDA graph hides its kernels from the profiler).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
import time

from bench import baseline
from bench.train_step import (Steps, add_scan_layers_argument, fp8_gemms, fp8_note, fp8_skip,
                              layers_note, not_comparable, their_step, their_use)

KINDS = (  # (kind, pattern on the kernel name), first match wins
    ("FP8 matmul", r"e4m3|e5m2"),  # cuBLASLt's names carry their FP8 types
    ("matmul", r"gemm|cublas|cutlass|sm90_xmma|nvjet|dot"),
    ("SSD Pallas", r"ssd|chunk|state_passing|bmm|pallas"),
    ("collective", r"nccl|all_reduce|all-reduce|all_gather|all-gather|reduce_scatter|"
                   r"reduce-scatter|collective|permute"),
    ("copy/transpose", r"copy|transpose|memcpy|memset"),
    ("reduction fusion", r"reduce"),
    ("other fusion", r"fusion|loop|input|kernel"),
)


def kind_of(name: str) -> str:
    lower = name.lower()
    return next((k for k, pattern in KINDS if re.search(pattern, lower)), "other")


def device_events(trace: dict, module: str = "") -> list[dict]:
    """The complete events ('X') of the trace's GPU streams: the processes named after a GPU
    device, threads named after a stream (not the XLA op/module summary tracks); with
    module, only the kernels of XLA programs whose name contains it."""
    names = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[e["name"], e["pid"], e.get("tid")] = e["args"]["name"]
    gpu_pids = {pid for (kind, pid, _), n in names.items()
                if kind == "process_name" and "GPU" in n}
    stream = lambda e: "stream" in names.get(("thread_name", e["pid"], e.get("tid")), "").lower()
    return [e for e in trace["traceEvents"]
            if e.get("ph") == "X" and e["pid"] in gpu_pids and stream(e)
            and module in e.get("args", {}).get("hlo_module", "")]


def busy_fraction(events: list[dict]) -> float:
    """The share of the span from the first kernel's start to the last one's end in which at
    least one kernel runs: what is left is launch gaps and host waits."""
    if not events:
        return float("nan")
    busy, end = 0.0, None
    for e in sorted(events, key=lambda e: e["ts"]):
        start, stop = e["ts"], e["ts"] + e["dur"]
        if end is None or start > end:
            busy, end = busy + stop - start, stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    return busy / span if span else 1.0


# One HLO instruction of the compiled module's text: its name, shape, opcode, operands and
# attributes (`%add.3 = f32[8]{0} add(%a, %b), metadata={...}`).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*?)\)(.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+) \(.*\{$")


def fusion_contents(hlo_text: str) -> dict[str, str]:
    """The compiled module's HLO text -> {a fusion's kernel name (its HLO name with "." and "-"
    as "_", as the profiler names the kernel): "out shape <- operand shapes: the fused
    computation's operations (from the JAX operation's name)"}, shapes without layouts."""
    unlaid = lambda shape: re.sub(r"\{[^{}]*\}", "", shape)
    shapes, opcodes, fusions = {}, collections.defaultdict(list), []
    computation = None
    for line in hlo_text.splitlines():
        if (header := _COMPUTATION.match(line)) is not None:
            computation = header.group(1)
            continue
        if (m := _INSTRUCTION.match(line)) is None:
            continue
        name, shape, opcode, operands, attributes = m.groups()
        shapes[name] = unlaid(shape)
        if opcode not in ("parameter", "constant") and opcode not in opcodes[computation]:
            opcodes[computation].append(opcode)
        if opcode == "fusion" and (called := re.search(r"calls=%?([\w.\-]+)", attributes)):
            source = re.search(r'op_name="([^"]*)"', attributes)
            fusions.append((name, shapes[name], re.findall(r"%([\w.\-]+)", operands),
                            called.group(1), source.group(1) if source else "?"))
    return {re.sub(r"[.\-]", "_", name): (
        f"{shape} <- {', '.join(shapes.get(o, '?') for o in operands)}: "
        f"{', '.join(opcodes[called])} (from {source[-70:]})")
        for name, shape, operands, called, source in fusions}


def summarize(events: list[dict], steps: int, step_s: float, top: int, what="step",
              contents: dict[str, str] | None = None):
    """Print the kernel time by kind and the top kernels; contents: fusion_contents of the
    program's HLO, a column of what each fusion computes."""
    by_name, calls, by_kind = (collections.Counter(), collections.Counter(),
                               collections.Counter())
    ops = collections.defaultdict(collections.Counter)  # kernel -> the HLO ops that ran it
    for e in events:
        by_name[e["name"]] += e["dur"] / 1e3 / steps  # us -> ms per step
        calls[e["name"]] += 1 / steps
        by_kind[kind_of(e["name"])] += e["dur"] / 1e3 / steps
        ops[e["name"]][e.get("args", {}).get("hlo_op", "?")] += e["dur"]
    total = sum(by_kind.values())
    print(f"{what} {step_s * 1e3:.3f} ms (host clock); GPU kernels {total:.3f} ms per {what} "
          f"summed over {len(events) // max(steps, 1)} events per {what}; the GPU runs a "
          f"kernel {100 * busy_fraction(events):.0f}% of the time from the first to the last")
    print(f"| kind | ms per {what} | share of kernel time |\n|---|---|---|")
    for k, ms in by_kind.most_common():
        print(f"| {k} | {ms:.1f} | {100 * ms / total:.1f}% |")
    print(f"\n| kernel | kind | calls per {what} | ms per {what} | share | its largest HLO ops "
          "| what it computes |\n|---|---|---|---|---|---|---|")
    for name, ms in by_name.most_common(top):
        largest = ", ".join(op for op, _ in ops[name].most_common(3))
        print(f"| {name[:90]} | {kind_of(name)} | {calls[name]:.0f} | {ms:.3f} | "
              f"{100 * ms / total:.1f}% | {largest} | {(contents or {}).get(name, '')} |")


def traced(fn, out, steps):
    """Run fn steps times under jax.profiler; (host seconds of each run, the trace as a dict).
    The trace is kept as out/perfetto_trace.json.gz."""
    import jax

    times = []
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(steps):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
        found = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)
        if not found:
            raise SystemExit("jax.profiler wrote no perfetto_trace.json.gz")
        os.replace(found[0], os.path.join(out, "perfetto_trace.json.gz"))
    with gzip.open(os.path.join(out, "perfetto_trace.json.gz"), "rt") as f:
        return times, json.load(f)


def profile_theirs(args):
    from mamba_jax.config import Mamba2Config

    cfg = Mamba2Config.preset(args.preset)
    why = not_comparable(cfg, args.baseline)
    if why:
        raise SystemExit(f"--theirs --preset {args.preset}: {why}")
    compared = baseline.comparison(args.baseline, their_use(cfg), args.allow_slow_baseline,
                                   in_child=False)
    import torch

    step, _, _ = their_step(cfg, args.baseline)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), device="cuda")
    for _ in range(2):  # its Triton autotuning, then a warm step
        step(ids).item()
    times, events = torch_traced(lambda: step(ids).item(),  # .item() waits for the step
                                 os.path.join(args.out, "mamba_ssm_trace.json"), args.steps)
    print(f"{time.strftime('%Y-%m-%d')} torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}; {compared.line}; {args.preset} "
          f"{args.batch}x{args.seq_len}")
    summarize(events, args.steps, sorted(times)[len(times) // 2], args.top)


def profile_scan_theirs(args):
    """mamba_ssm's Mamba-3 SISO scan (mamba3_siso_combined, its Triton kernels) on
    bench.mamba3's inputs, as profile_scan traces ours: its forward (no gradients) and its
    forward+backward, each after two calls (its autotuning)."""
    if args.scan != "mamba3":
        raise SystemExit(f"--theirs --scan {args.scan}: only --scan mamba3 is traced on "
                         "mamba_ssm's side (its SISO Triton kernels); " + (
                             "bench.ssd times its SSD kernels beside ours" if args.scan == "ssd"
                             else "its MIMO kernels are TileLang's, which the GPU machine "
                                  "does not have"))
    import numpy as np
    import torch

    from bench import mamba3
    from bench.harness import to_torch

    kernels = baseline.import_mamba3_siso(args.baseline)
    path = baseline.mamba3_siso_path(args.baseline)
    b, l = args.batch, args.seq_len
    inputs, dy = mamba3.inputs_and_cotangent(np.random.default_rng(0), b, l, 1)
    dy = to_torch(dy[:, :, 0])  # its y has no rank axis
    run = mamba3.theirs_fn(kernels, {k: to_torch(v) for k, v in inputs.items()}, 64)

    def forward():
        with torch.no_grad():
            run(False)
        torch.cuda.synchronize()

    def both():
        run(True, dy)
        torch.cuda.synchronize()

    print(f"{time.strftime('%Y-%m-%d')} torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}; {path}; mamba3 scan, {b}x{l}, bf16")
    for what, fn in (("forward", forward), ("forward+backward", both)):
        for _ in range(2):
            fn()
        trace = os.path.join(args.out, f"mamba_ssm_{file_name(what)}.json")
        times, events = torch_traced(fn, trace, args.steps)
        summarize(events, args.steps, sorted(times)[len(times) // 2], args.top, what=what)


def file_name(what: str) -> str:
    """A pass's name as a file name: "forward+backward" -> "forward_backward" (a "+" is
    awkward in paths that tools copy)."""
    return what.replace("+", "_")


def torch_traced(fn, trace, steps):
    """Run fn (which waits for its GPU work) steps times under torch.profiler; (host seconds
    of each run, the trace's kernel, memcpy and memset events). The trace is kept as the
    file `trace` (Chrome's JSON, for ui.perfetto.dev)."""
    import torch

    times = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        return times, [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"
                       and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def profile_decode(args):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from mamba_jax import Mamba2Config, Mamba2LM
    from mamba_jax.generate import decode, prefill, prepare

    # XLA writes the decode loop's optimised HLO as it compiles it (a flag read when jax starts
    # its backends, which the first array below does): the loop's jit is generate's own
    dump = os.path.join(args.out, "xla_dump")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                               " --xla_dump_hlo_module_re=.*decode_loop.*")
    cfg = Mamba2Config.preset(args.preset)
    model = Mamba2LM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size,
                                                        (args.batch, args.seq_len)))
    prepared = prepare(model, ids, max_new_tokens=args.decode,
                       step_implementation=args.step_implementation,
                       ssm_state_dtype=args.ssm_state_dtype)

    def run():  # generate, its decode loop under XLA's default command buffers: the profiler
        # does not see the kernels of a loop that runs as a CUDA graph (generate's
        # DECODE_COMPILER_OPTIONS)
        first, cache = prefill(model, ids, prepared)
        return jax.block_until_ready(decode(model, first, cache, prepared,
                                            compiler_options={}))
    run()  # compiles the prefill and the decode loop
    hlo = decode_hlo(dump, os.path.join(args.out, "decode.hlo.txt"))
    times, trace = traced(run, args.out, 1)
    steps = args.decode - 1
    print(f"{time.strftime('%Y-%m-%d')} jax {jax.__version__}, {jax.devices()[0].device_kind}; "
          f"{args.preset} generate: batch {args.batch}, prompt {args.seq_len}, "
          f"{args.decode} new tokens, step_implementation {args.step_implementation}, "
          f"{args.ssm_state_dtype} SSM states; "
          f"the whole call {times[0] * 1e3:.1f} ms")
    summarize(device_events(trace, module="decode"), steps, times[0] / args.decode, args.top,
              what="decode step", contents=fusion_contents(hlo))


def decode_hlo(dump: str, keep: str) -> str:
    """The decode loop's optimised HLO text from XLA's dump folder (--xla_dump_to; the last
    written, were it compiled more than once), kept as `keep`; the folder removed."""
    found = glob.glob(os.path.join(dump, "*decode_loop*after_optimizations.txt"))
    if not found:
        raise SystemExit(f"XLA dumped no optimised HLO of the decode loop into {dump}")
    shutil.move(max(found, key=os.path.getmtime), keep)
    shutil.rmtree(dump)
    with open(keep) as f:
        return f.read()


def profile_scan(args):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench import mamba3, ssd
    from bench.harness import forward_and_backward
    from pallas_kernels.ssd import ssd as ssd_scan

    b, l = args.batch, args.seq_len
    rng = np.random.default_rng(0)
    if args.scan == "ssd":
        inputs, options = ssd.make_inputs(rng, b, l, args.groups, jnp.bfloat16)
        args_in = ({**inputs, **options},)
        scan = lambda a: ssd_scan(**a, chunk_size=ssd.CHUNK, dt_softplus=True,
                                  implementation="triton")
        dy = jnp.asarray(rng.standard_normal((b, l, ssd.H, ssd.P)), jnp.bfloat16)
    else:
        r = 4 if args.scan == "mamba3-mimo" else 1
        inputs, dy = mamba3.inputs_and_cotangent(rng, b, l, r)
        args_in = (inputs,)
        scan = mamba3.ours(64, "triton", "halves" if r > 1 else "pairwise")
    forward, both = jax.jit(scan), forward_and_backward(scan)
    print(f"{time.strftime('%Y-%m-%d')} jax {jax.__version__}, {jax.devices()[0].device_kind}; "
          f"{args.scan} scan on the kernels, {b}x{l}, bf16")
    for what, jitted, call_args in (("forward", forward, args_in),
                                    ("forward+backward", both, (*args_in, dy))):
        compiled = jitted.lower(*call_args).compile()
        hlo = compiled.as_text()
        with open(os.path.join(args.out, f"{file_name(what)}.hlo.txt"), "w") as f:
            f.write(hlo)
        fn = lambda: jax.block_until_ready(compiled(*call_args))  # noqa: E731
        fn()
        times, trace = traced(fn, args.out, args.steps)
        summarize(device_events(trace), args.steps, sorted(times)[len(times) // 2], args.top,
                  what=what, contents=fusion_contents(hlo))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="mamba2-1.3b")
    p.add_argument("--mesh", default="dp=1")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--remat", default="none")
    add_scan_layers_argument(p)
    p.add_argument("--loss-chunk", type=int, default=None)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--fp8", action="store_true", help="our step with the trainer's --fp8")
    p.add_argument("--fp8-skip-layers", type=int, default=1, metavar="N",
                   help="with --fp8: the trainer's --fp8-skip-layers")
    p.add_argument("--out", required=True, help="folder for the trace and the HLO")
    p.add_argument("--decode", type=int, default=0, metavar="NEW",
                   help="profile generate() of NEW tokens after a --seq-len prompt instead")
    p.add_argument("--step-implementation", default="auto",
                   help="with --decode: generate's step_implementation")
    p.add_argument("--ssm-state-dtype", default="float32",
                   help="with --decode: generate's ssm_state_dtype")
    p.add_argument("--scan", choices=("ssd", "mamba3", "mamba3-mimo"), default=None,
                   help="profile a scan alone (its forward, and forward+backward) instead")
    p.add_argument("--groups", type=int, default=1, help="with --scan ssd: B/C groups")
    p.add_argument("--theirs", action="store_true",
                   help="profile mamba_ssm's training step (from --baseline) instead; with "
                        "--scan mamba3, its Mamba-3 SISO scan")
    baseline.add_arguments(p, "train")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.theirs:
        return profile_scan_theirs(args) if args.scan else profile_theirs(args)
    if args.decode:
        return profile_decode(args)
    if args.scan:
        return profile_scan(args)

    import jax

    steps = Steps(args.preset, args.mesh, args.remat, args.loss_chunk,
                  scan_layers=args.scan_layers, fp8_skip_layers=fp8_skip(args))
    print(f"{time.strftime('%Y-%m-%d')} jax {jax.__version__}, {jax.devices()[0].device_kind}; "
          f"{args.preset} {args.mesh} {args.batch}x{args.seq_len} remat {args.remat}"
          f"{layers_note(args)}{fp8_note(args)}")
    steps.measure(args.batch, args.seq_len, 1)  # compiles, builds the state, warms up
    exe = steps.compiled[args.batch, args.seq_len][0]
    hlo = exe.as_text()
    if args.fp8:
        print(f"{fp8_gemms(hlo)} FP8 GEMMs (cuBLASLt) in the step")
    with open(os.path.join(args.out, "step.hlo.txt"), "w") as f:
        f.write(hlo)
    state = list(steps.state)
    tokens = steps.tokens(args.batch, args.seq_len)

    def step():  # each step donates the state and returns the next
        state[0], state[1], loss, _ = exe(*state, tokens)
        loss.block_until_ready()
    times, trace = traced(step, args.out, args.steps)
    summarize(device_events(trace), args.steps, sorted(times)[len(times) // 2], args.top,
              contents=fusion_contents(hlo))


if __name__ == "__main__":
    main()
