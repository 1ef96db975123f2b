"""What the kernels' heuristics know of the GPU, in one place: the multiprocessor count, how
many programs it holds at once, and its compute capability.

Off a GPU (Pallas's interpreter on a CPU, the tests) the heuristics see an H200, the GPU
every tile was measured on, so that the interpreter runs the tiles a GPU would.
"""

from __future__ import annotations

import functools

import jax

H200_MULTIPROCESSORS = 132


def _gpu():
    """The first GPU device, or None off a GPU."""
    return jax.local_devices(backend="gpu")[0] if jax.default_backend() == "gpu" else None


@functools.cache
def multiprocessors() -> int:
    """The GPU's streaming multiprocessor count (an H200's off a GPU)."""
    device = _gpu()
    return device.core_count if device is not None else H200_MULTIPROCESSORS


def two_waves() -> int:
    """Programs enough for two waves over the multiprocessors: the grid size the tile
    heuristics aim for (264 on an H200)."""
    return 2 * multiprocessors()


def cooperative_programs() -> int:
    """How many programs of 4 warps the GPU holds at once, at least: two a multiprocessor (a
    thread has at most 255 registers, so two programs take at most 2 x 128 x 255 of an SM's
    65536; a kernel that keeps nothing in shared memory but Triton's scratch for its
    reductions fits; on an H200 256 programs, 1.94 an SM, ran 500 launches of
    pallas_kernels.decode.step_out without a stall: BENCHMARKS.md). 0 off a GPU: Pallas's
    interpreter runs programs one at a time, so none may wait for another."""
    return 2 * multiprocessors() if _gpu() is not None else 0


def compute_capability() -> float | None:
    """The GPU's compute capability (9.0 for Hopper), None off an NVIDIA GPU (ROCm devices
    report "gfx..." names)."""
    device = _gpu()
    capability = str(getattr(device, "compute_capability", ""))
    return float(capability) if capability.replace(".", "", 1).isdigit() else None


def measured_gpu() -> bool:
    """Whether this is a GPU of the kind the kernels' "auto" choices were measured on (an H200:
    compute capability 9.0 or more); other GPUs, and CPUs, keep the XLA paths."""
    capability = compute_capability()
    return capability is not None and capability >= 9.0
