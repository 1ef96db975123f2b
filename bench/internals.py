"""The library's internals that the benchmarks use, all in this module: what generate() does
not expose as public API, so that a change there changes only this file.

- prefill(): mamba_jax.generate._check and ._prefill, to time generate's prefill alone
  (bench.generate);
- decode_loop(): mamba_jax.generate._decode and .jit_decode, to run generate's decode loop
  under XLA's default command buffers (bench.generate --command-buffers off;
  bench.profile_step --decode, whose profiler cannot see into a loop run as a CUDA graph);
- DECODE_COMPILER_OPTIONS (mamba_jax.generate): the decode loop's compiler options, which
  bench.step and bench.norm_matmul compile their kernel loops with;
- step_implementation_for and uses_fused_step (mamba_jax.mixer): the step implementation
  generate resolves "auto" to, and whether a batch runs the fused step, so that
  bench.generate names its rows and checks the kernels a step calls.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import jax

from mamba_jax.generate import DECODE_COMPILER_OPTIONS, _check, _decode, _prefill, jit_decode
from mamba_jax.mixer import step_implementation_for, uses_fused_step

__all__ = ["DECODE_COMPILER_OPTIONS", "decode_loop", "prefill", "step_implementation_for",
           "uses_fused_step"]


def prefill(model, ids, new, ssm_state_dtype, implementation):
    """A function that runs generate(model, ids, new, ssm_state_dtype=..., step_implementation=
    implementation)'s prefill alone (greedy, seed 0) and waits for its result."""
    settings, sampling, lengths, _ = _check(model, ids, new, 0.0, None, None, None, None,
                                            ssm_state_dtype, implementation)
    key = jax.random.key(0)
    return lambda: jax.block_until_ready(_prefill(
        model, ids, lengths, key, settings, sampling=sampling,
        ssm_state_dtype=ssm_state_dtype))


@functools.cache
def _default_buffers_loop():
    """The decode loop under XLA's default command buffers, jitted once so that its programs
    are cached like generate's."""
    return jit_decode({})


@contextlib.contextmanager
def decode_loop(command_buffers: bool):
    """Within the block, generate() runs its decode loop compiled with
    DECODE_COMPILER_OPTIONS (command_buffers, as it does by default) or with XLA's defaults."""
    module = sys.modules["mamba_jax.generate"]  # (mamba_jax.generate is the function)
    module._decode = _decode if command_buffers else _default_buffers_loop()
    try:
        yield
    finally:
        module._decode = _decode
