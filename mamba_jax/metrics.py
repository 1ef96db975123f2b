"""What the trainer reports: a progress line, model FLOPs and MFU, JSON lines, TensorBoard.

Model FLOPs per token of a training step: forward + backward = 3x the forward's, counting
matmuls only (2 FLOPs a multiply-add): each layer's kind's `flops_per_token` (its
projections, and a Mamba layer's chunked SSD matmuls or an attention layer's scores), and
once the LM head, 2*d*v. MFU = that x tokens/s / (the devices' peak dense matmul FLOP/s x
device count).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax

from mamba_jax.config import Mamba2Config
from mamba_jax.files import replace_text
from mamba_jax.layers.registry import KINDS

# Dense bf16 matmul peaks (vendor datasheets, FLOP/s) by device kind; float32 runs use the
# TF32 peak, half of it. Devices not listed (CPUs) report no MFU.
_PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12,
              "L40S": 362e12, "B200": 2250e12}


def train_flops_per_token(cfg: Mamba2Config, seq_len: int) -> float:
    layers = sum(KINDS[symbol].flops_per_token(cfg, seq_len) for symbol in cfg.layers)
    return 3.0 * (layers + 2 * cfg.d_model * cfg.padded_vocab_size)


def device_peak_flops(device_kind: str, dtype_name: str = "bfloat16") -> float | None:
    """One device's peak dense matmul FLOP/s for the compute dtype, by its kind ("NVIDIA
    H200", as jax and torch name it); None if unknown."""
    peak = next((v for k, v in _PEAK_BF16.items() if k in device_kind), None)
    return None if peak is None else peak * (1.0 if dtype_name == "bfloat16" else 0.5)


def peak_flops(dtype_name: str) -> float | None:
    """The whole machine's peak matmul FLOP/s for the compute dtype, None if unknown."""
    peak = device_peak_flops(jax.devices()[0].device_kind, dtype_name)
    return None if peak is None else peak * jax.device_count()


def peak_memory_gib() -> float | None:
    """The largest device-memory use so far on the first local device, if it reports one."""
    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


class Progress:
    """One status line, redrawn in place on a terminal, printed every 10% otherwise; a step
    with an evaluation always gets a line of its own, kept on screen."""

    def __init__(self, total: int, first: int = 0):
        self.total, self.tty, self.last = total, sys.stderr.isatty(), -1
        self.first = first

    def update(self, step: int, record: dict):
        parts = [f"loss {record['loss']:.3f}"]
        evaluated = "eval_loss" in record
        if evaluated:
            parts.append(f"eval {record['eval_loss']:.3f} (ppl {record['eval_ppl']:.1f})")
        parts.append(f"{record['tokens_per_s']:.0f} tok/s {record['step_time_s'] * 1e3:.0f} ms")
        if record.get("mfu") is not None:
            parts.append(f"MFU {100 * record['mfu']:.1f}%")
        if record.get("peak_memory_gib") is not None:
            parts.append(f"{record['peak_memory_gib']:.1f} GiB")
        text = " ".join(parts)
        frac = (step - self.first) / max(self.total - self.first, 1)
        if self.tty:
            bar = "#" * int(30 * frac)
            print(f"\r{step:>6}/{self.total} [{bar:<30}] {text}", end="", file=sys.stderr,
                  flush=True)
            if step == self.total or evaluated:
                print(file=sys.stderr)
        elif evaluated or int(10 * frac) > self.last or step == self.total:
            self.last = int(10 * frac)
            print(f"{step:>6}/{self.total} {text}", file=sys.stderr, flush=True)


class MetricsWriter:
    """Each step's record to a JSON-lines file and TensorBoard event files, as asked.

    resume_step: the run continues from a checkpoint of this step, so the records a killed
    run wrote after it are superseded: the JSON-lines file keeps only the rows of steps up
    to it (rewritten through a temporary file; the others moved to a file beside it, said
    in a line, as the file may have held another run's), and TensorBoard is told to drop
    the events from the next step on (purge_step).
    """

    def __init__(self, jsonl_path=None, tensorboard_dir=None, resume_step: int | None = None):
        if jsonl_path and resume_step is not None and Path(jsonl_path).is_file():
            _keep_rows_up_to(Path(jsonl_path), resume_step)
        if jsonl_path:  # its folder made as TensorBoard's is
            Path(jsonl_path).parent.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(jsonl_path, "a") if jsonl_path else None
        self.tensorboard = None
        if tensorboard_dir:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                raise SystemExit("--tensorboard needs tensorboardX: pip install "
                                 "'mamba-jax[tensorboard]'") from None
            self.tensorboard = SummaryWriter(
                str(tensorboard_dir), purge_step=None if resume_step is None else resume_step + 1)

    def write(self, record: dict):
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if self.tensorboard:
            for key, value in record.items():
                if key != "step" and value is not None:
                    self.tensorboard.add_scalar(f"train/{key}", value, record["step"])

    def close(self):
        if self.jsonl:
            self.jsonl.close()
        if self.tensorboard:
            self.tensorboard.close()


def check_metrics_file(path) -> None:
    """Refuse (ValueError) an existing --metrics-file whose first line is no step's record:
    the rows appended to it would spoil what it holds (a model's config.json, a dataset's
    meta.json)."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
        if not first.strip():
            return
        record = json.loads(first)
    except FileNotFoundError:
        return
    except (OSError, ValueError):  # unreadable, not UTF-8, or no JSON
        record = None
    if not (isinstance(record, dict) and "step" in record):
        raise ValueError(f"--metrics-file {path} holds something else than metrics (its first "
                         "line is no record of a step), which the run's rows would spoil: "
                         "give a new file, or a run's metrics file")


def _keep_rows_up_to(path: Path, step: int):
    """Rewrite the JSON-lines file `path` without the rows of steps after `step` and the
    lines that are no step's record (one a kill cut short), which go to
    `<path>.after-step-<step>[-<n>]` (a new file), said on stderr."""
    kept, moved = [], []
    for line in path.read_text().splitlines():
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            row_step = None
        (kept if row_step is not None and row_step <= step else moved).append(line + "\n")
    if not moved:
        return
    aside = path.with_name(f"{path.name}.after-step-{step}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.after-step-{step}-{n}")
    aside.write_text("".join(moved))
    replace_text(path, "".join(kept))
    print(f"--metrics-file {path}: the {len(moved)} rows after step {step}, which this run "
          f"writes again from its checkpoint, moved to {aside}", file=sys.stderr)
