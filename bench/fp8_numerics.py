"""FP8 training's numerics: one model trained twice, in bf16 and with --fp8, on the same
seed, data and steps; their held-out losses compared and their loss curves plotted.

    python3 -m bench.fp8_numerics corpus --out runs/linux-doc
    python3 -m bench.fp8_numerics run --data runs/linux-doc --out runs/fp8-numerics \\
        [--preset mamba2-370m --steps 400 --batch-size 16 --seq-len 2048]
    python3 -m bench.fp8_numerics plot runs/fp8-numerics/fp8_numerics.csv --png fp8_loss.png

corpus: a real corpus that a machine with Debian's package registry (and nothing else) can
  get: the reStructuredText sources of the Linux kernel's documentation as Debian's
  `linux-doc-6.1` package ships them (html/_sources/**/*.rst.txt; the kernel's
  documentation is GPL-2.0, its files' own notices where they differ: the package's
  copyright file), one document a file in path order, prepared with the byte tokenizer
  (`python -m mamba_jax.data prepare FILES --tokenizer bytes --out OUT`): 24.2M tokens, the
  last 1% of the documents held out, 47 MB, small enough to carry to a GPU machine (uint16
  tokens). Needs apt-get and dpkg-deb.
run: `python -m mamba_jax.train` twice, the second with --fp8 (its --fp8-skip-layers),
  otherwise the same command (--dtype bfloat16, --seed, --lr, the data's windows): each in a
  process of its own, at the same time on two GPUs where there are two, else one after the
  other. Prints a table (the last held-out loss of each, their difference against the 1%
  target, the median tokens/s) and writes OUT/fp8_numerics.csv (per step: each run's
  training loss, and held-out loss where evaluated) and, where matplotlib imports, the
  plot OUT/fp8_numerics.png; OUT keeps both runs' metrics (bf16.jsonl, fp8.jsonl) and logs.
plot: the plot from such a CSV (on a machine with matplotlib, where the run's had none).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench.harness import ROOT, gpu_count, gpus, table_header, table_row

PACKAGE = "linux-doc-6.1"  # Debian 12's; its html/_sources hold the documentation's sources
SOURCES = "usr/share/doc/linux-doc-6.1/html/_sources"
RUNS = ("bf16", "fp8")
TARGET = 0.01  # the FP8 run's last held-out loss within 1% of the bf16 run's


def corpus(args):
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp, check=True)
        deb, = glob.glob(os.path.join(tmp, "*.deb"))
        subprocess.run(["dpkg-deb", "-x", deb, os.path.join(tmp, "x")], check=True)
        files = sorted(glob.glob(os.path.join(tmp, "x", SOURCES, "**", "*.rst.txt"),
                                 recursive=True))
        if not files:
            raise SystemExit(f"{os.path.basename(deb)} holds no {SOURCES}/**/*.rst.txt")
        print(f"{os.path.basename(deb)}: {len(files)} documents", flush=True)
        subprocess.run([sys.executable, "-m", "mamba_jax.data", "prepare", *files,
                        "--tokenizer", "bytes", "--out", args.out], check=True,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                           p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)))


def train_argv(args, name: str) -> list[str]:
    """The trainer's command line for run `name` ("bf16" or "fp8")."""
    argv = [sys.executable, "-m", "mamba_jax.train", "--preset", args.preset, "--data",
            args.data, "--dtype", "bfloat16", "--steps", str(args.steps), "--batch-size",
            str(args.batch_size), "--seq-len", str(args.seq_len), "--lr", str(args.lr),
            "--warmup", str(args.warmup), "--eval-every", str(args.eval_every), "--seed",
            str(args.seed), "--out", "none", "--metrics-file",
            os.path.join(args.out, f"{name}.jsonl")]
    return argv + (["--fp8", "--fp8-skip-layers", str(args.fp8_skip_layers)]
                   if name == "fp8" else [])


def run(args):
    os.makedirs(args.out, exist_ok=True)
    for name in RUNS:  # a metrics file is appended to: a fresh run starts an empty one
        path = os.path.join(args.out, f"{name}.jsonl")
        if os.path.exists(path):
            os.remove(path)
    lanes = 2 if gpu_count() >= 2 else 1

    def train(name):
        lane = RUNS.index(name) if lanes == 2 else 0
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus(1, skip=lane),
                   PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH"))
                                              if p))
        with open(os.path.join(args.out, f"{name}.log"), "w") as log:
            return subprocess.run(train_argv(args, name), env=env, stdout=log,
                                  stderr=subprocess.STDOUT, cwd=ROOT).returncode
    print(f"{time.strftime('%Y-%m-%d')}: {args.preset} on {args.data}, {args.steps} steps of "
          f"{args.batch_size}x{args.seq_len}, lr {args.lr}, seed {args.seed}; the --fp8 run "
          f"keeps the first and last {args.fp8_skip_layers} layers in bf16", flush=True)
    print("bf16: " + " ".join(train_argv(args, "bf16")[1:]), flush=True)
    with concurrent.futures.ThreadPoolExecutor(lanes) as pool:
        codes = dict(zip(RUNS, pool.map(train, RUNS)))
    for name, code in codes.items():
        if code:
            tail = open(os.path.join(args.out, f"{name}.log")).read()[-2000:]
            print(f"the {name} run exited {code}:\n{tail}", flush=True)
    records = {name: read_metrics(os.path.join(args.out, f"{name}.jsonl")) for name in RUNS}
    csv_path = os.path.join(args.out, "fp8_numerics.csv")
    write_csv(records, csv_path)
    print(summary(records), flush=True)
    try:
        plot(csv_path, os.path.join(args.out, "fp8_numerics.png"))
    except ImportError:
        print(f"no matplotlib here: plot {csv_path} elsewhere with "
              f"`python3 -m bench.fp8_numerics plot {csv_path} --png FILE`", flush=True)
    if any(codes.values()):
        raise SystemExit(1)


def read_metrics(path: str) -> list[dict]:
    """A trainer's --metrics-file: one record a step ([] where the run wrote none)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_csv(records: dict, path: str):
    """Per step: each run's training loss and held-out loss (blank where not evaluated)."""
    by_step = {}
    for name, rows in records.items():
        for r in rows:
            by_step.setdefault(r["step"], {})[f"{name}_loss"] = r["loss"]
            if "eval_loss" in r:
                by_step[r["step"]][f"{name}_eval_loss"] = r["eval_loss"]
    columns = ["step"] + [f"{name}_{what}" for name in RUNS for what in ("loss", "eval_loss")]
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, columns)
        out.writeheader()
        for step in sorted(by_step):
            out.writerow({"step": step, **by_step[step]})


def summary(records: dict) -> str:
    """The table: each run's last held-out loss and its step, its median tokens/s; the FP8
    run's held-out loss against the bf16 run's, and the 1% target."""
    last = {name: next((r for r in reversed(rows) if "eval_loss" in r), None)
            for name, rows in records.items()}
    lines = [table_header(("run", "steps", "last held-out loss (step)", "last training loss",
                           "median tokens/s"))]
    for name, rows in records.items():
        evaluated = last[name]
        lines.append(table_row((
            "bf16" if name == "bf16" else "--fp8", len(rows),
            "" if evaluated is None else f"{evaluated['eval_loss']:.4f} ({evaluated['step']})",
            f"{rows[-1]['loss']:.4f}" if rows else "",
            f"{statistics.median(r['tokens_per_s'] for r in rows[1:]):,.0f}"
            if len(rows) > 1 else "")))
    if all(last.values()) and last["bf16"]["step"] == last["fp8"]["step"]:
        difference = last["fp8"]["eval_loss"] / last["bf16"]["eval_loss"] - 1
        verdict = "within" if abs(difference) <= TARGET else "NOT within"
        lines.append(f"--fp8's last held-out loss {100 * difference:+.2f}% of bf16's: "
                     f"{verdict} the {100 * TARGET:.0f}% target")
    else:
        lines.append("no held-out loss at the same step in both runs to compare")
    return "\n".join(lines)


def plot(csv_path: str, png_path: str, smooth: int = 20):
    """Above, both runs' training losses (a running mean of `smooth` steps, the raw ones
    faint) and held-out losses against the step; below, --fp8's against bf16's in percent;
    from write_csv's file. ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    curves = {}  # (run, "training" or "held out") -> {step: loss}
    for name in RUNS:
        points = [(int(r["step"]), float(r[f"{name}_loss"])) for r in rows
                  if r[f"{name}_loss"]]
        losses = [loss for _, loss in points]
        curves[name, "training"] = {
            step: statistics.fmean(losses[max(0, i - smooth + 1):i + 1])
            for i, (step, _) in enumerate(points)}
        curves[name, "raw"] = dict(points)
        curves[name, "held out"] = {int(r["step"]): float(r[f"{name}_eval_loss"])
                                    for r in rows if r[f"{name}_eval_loss"]}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), dpi=120, sharex=True,
                                      gridspec_kw={"height_ratios": (3, 1)})
    for name, color, label in (("bf16", "tab:blue", "bf16"), ("fp8", "tab:orange", "--fp8")):
        raw, mean, held = (curves[name, what] for what in ("raw", "training", "held out"))
        if raw:
            top.plot(list(raw), list(raw.values()), color=color, alpha=0.2, linewidth=0.8)
            top.plot(list(mean), list(mean.values()), color=color,
                     label=f"{label}, training (mean of {smooth} steps)")
        if held:
            top.plot(list(held), list(held.values()), color=color, marker="o",
                     linestyle="--", label=f"{label}, held out")
    for what, style in (("training", "-"), ("held out", "o--")):
        both = sorted(set(curves["bf16", what]) & set(curves["fp8", what]))
        if both:
            bottom.plot(both, [100 * (curves["fp8", what][s] / curves["bf16", what][s] - 1)
                               for s in both], style, color="tab:gray", label=what)
    bottom.axhline(0, color="black", linewidth=0.6)
    top.set_ylabel("loss (nats per token)")
    bottom.set_ylabel("--fp8 vs bf16 (%)")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    print(f"plotted {png_path}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("corpus", "run", "plot"))
    p.add_argument("csv", nargs="?", help="plot: the CSV a run wrote")
    p.add_argument("--png", default="fp8_numerics.png", help="plot: the image to write")
    p.add_argument("--out", default=None, help="corpus: the dataset's folder; run: the "
                                               "runs' folder")
    p.add_argument("--data", default=None, help="run: a prepared dataset (corpus's --out)")
    p.add_argument("--preset", default="mamba2-370m")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp8-skip-layers", type=int, default=1)
    args = p.parse_args(argv)
    if args.mode == "plot":
        if not args.csv:
            raise SystemExit("plot: give the CSV a run wrote")
        return plot(args.csv, args.png)
    if not args.out or (args.mode == "run" and not args.data):
        raise SystemExit(f"{args.mode}: give --out" + (" and --data" if args.mode == "run"
                                                       else ""))
    if args.mode == "corpus" and shutil.which("apt-get") is None:
        raise SystemExit("corpus: needs Debian's apt-get (and dpkg-deb)")
    (corpus if args.mode == "corpus" else run)(args)


if __name__ == "__main__":
    main()
