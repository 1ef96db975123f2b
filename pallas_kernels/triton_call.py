"""What every module of Triton kernels (`pl.pallas_call`) shares: the call with its launch
parameters, where it runs in Pallas's interpreter, and the optional inputs a kernel takes
after the others."""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def call(kernel, grid, out_shape, warps, stages, interpret, name, aliases=None):
    """pl.pallas_call of kernel over grid, lowered through Triton with `warps` warps a program
    and `stages` software-pipelining stages (None: Triton's default), Pallas's interpreter
    where interpret; aliases: {input index: output index} updated in place."""
    return pl.pallas_call(
        kernel, grid=grid, out_shape=out_shape, interpret=interpret, name=name,
        input_output_aliases=aliases or {},
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages))


def off_gpu() -> bool:
    """Whether the kernels run in Pallas's interpreter: where no GPU runs them (the tests and
    CI, on CPUs)."""
    return jax.default_backend() != "gpu"


def present(*optional):
    """The optional inputs given, in order (the kernels take them after the others)."""
    return tuple(a for a in optional if a is not None)


def split_optional(refs, present):
    """(the first ref, the rest) where an optional input is present, else (None, refs)."""
    return (refs[0], refs[1:]) if present else (None, refs)
