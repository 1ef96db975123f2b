"""Where the GPU time of our train step goes: a jax.profiler trace of a few steps, its
device kernels summed by name and by kind.

    python3 bench/profile_step.py --preset mamba2-1.3b --seq-len 2048 --batch 8 --out DIR

Builds and compiles the step as bench/train_step.py does (Steps: same mesh, remat and
parameters), runs two warm-up steps, traces --steps steps, and prints the step time, GPU
time per step by kind (matmul, SSD Pallas kernels, collectives, copies, other fusions) and
the --top kernels by GPU time per step. DIR keeps the trace (perfetto_trace.json.gz, for
ui.perfetto.dev) and the compiled step's HLO (step.hlo.txt), where a fusion's name leads to
the operations it holds. Kernel times are the trace's device events (CUPTI); kernels on
different streams may overlap, so their sum can exceed the step time.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

from train_step import Steps  # this script's folder is on sys.path

KINDS = (  # (kind, pattern on the kernel name), first match wins
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


def device_events(trace: dict) -> list[dict]:
    """The complete events ('X') of the trace's GPU streams: the processes named after a GPU
    device, threads named after a stream (not the XLA op/module summary tracks)."""
    names = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[e["name"], e["pid"], e.get("tid")] = e["args"]["name"]
    gpu_pids = {pid for (kind, pid, _), n in names.items()
                if kind == "process_name" and "GPU" in n}
    stream = lambda e: "stream" in names.get(("thread_name", e["pid"], e.get("tid")), "").lower()
    return [e for e in trace["traceEvents"]
            if e.get("ph") == "X" and e["pid"] in gpu_pids and stream(e)]


def summarize(events: list[dict], steps: int, step_s: float, top: int):
    by_name, calls, by_kind = (collections.Counter(), collections.Counter(),
                               collections.Counter())
    for e in events:
        by_name[e["name"]] += e["dur"] / 1e3 / steps  # us -> ms per step
        calls[e["name"]] += 1 / steps
        by_kind[kind_of(e["name"])] += e["dur"] / 1e3 / steps
    total = sum(by_kind.values())
    print(f"step {step_s * 1e3:.1f} ms (host clock, median of the traced steps); GPU "
          f"kernels {total:.1f} ms per step summed over {len(events) // max(steps, 1)} "
          "events per step")
    print("| kind | ms per step | share of kernel time |\n|---|---|---|")
    for k, ms in by_kind.most_common():
        print(f"| {k} | {ms:.1f} | {100 * ms / total:.1f}% |")
    print("\n| kernel | kind | calls per step | ms per step | share |\n|---|---|---|---|---|")
    for name, ms in by_name.most_common(top):
        print(f"| {name[:90]} | {kind_of(name)} | {calls[name]:.0f} | {ms:.2f} | "
              f"{100 * ms / total:.1f}% |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="mamba2-1.3b")
    p.add_argument("--mesh", default="dp=1")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--remat", default="none")
    p.add_argument("--loss-chunk", type=int, default=None)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", required=True, help="folder for the trace and the HLO")
    args = p.parse_args()

    import jax

    steps = Steps(args.preset, args.mesh, args.remat, args.loss_chunk)
    print(f"{time.strftime('%Y-%m-%d')} jax {jax.__version__}, {jax.devices()[0].device_kind}; "
          f"{args.preset} {args.mesh} {args.batch}x{args.seq_len} remat {args.remat}")
    steps.measure(args.batch, args.seq_len, 1)  # compiles, builds the state, warms up
    exe = steps.compiled[args.batch, args.seq_len][0]
    with open(os.path.join(args.out, "step.hlo.txt"), "w") as f:
        f.write(exe.as_text())
    params, opt_state = steps.state
    tokens = steps.tokens(args.batch, args.seq_len)
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(args.steps):
                start = time.perf_counter()
                params, opt_state, loss, _ = exe(params, opt_state, tokens)
                loss.block_until_ready()
                times.append(time.perf_counter() - start)
        found = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)
        if not found:
            raise SystemExit("jax.profiler wrote no perfetto_trace.json.gz")
        os.replace(found[0], os.path.join(args.out, "perfetto_trace.json.gz"))
    with gzip.open(os.path.join(args.out, "perfetto_trace.json.gz"), "rt") as f:
        events = device_events(json.load(f))
    summarize(events, args.steps, sorted(times)[len(times) // 2], args.top)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
