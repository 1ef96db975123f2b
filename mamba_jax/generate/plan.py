"""The decode plan: which implementation each layer's one-token step runs, for a model, a
batch size and a device. The one place that decides it; generate and the server ask it.

    plan = decode_plan(model, batch_size, "auto", ssm_state_dtype="float32")
    plan.steps   # per layer: "xla", "kernel" or "fused"

"xla": the step as XLA fusions. "kernel": the layer's step kernel between XLA's projections
(a Mamba layer's conv and SSM update, pallas_kernels.ssd.step). "fused": the whole layer, its
norm and projections included, as fused kernels (pallas_kernels.decode), for a few rows.
A layer kind says which it has (Mixer.step_kernels), up to which batch its step kernel beats
XLA's (Mixer.step_kernel_max_batch) and whether its kernels take the model's shapes
(Mixer.kernels_support).
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels import fallback

STEP_IMPLEMENTATIONS = ("auto", "xla", "triton")
# The largest batch whose step runs its layers "fused" under "triton" (larger batches take
# the step kernels alone between XLA's projections). At batch 8 an earlier fused Mamba step
# was several times slower than the XLA step for mamba2-370m and mamba2-1.3b (docs/
# performance.md): the norm-matmul kernels unroll the rows, each row's products reduced apart.
FUSED_STEP_MAX_BATCH = 1
# The SSM state dtypes the fused steps take. An int8 state (generate's ssm_state_dtype="int8")
# is for large batches, where its bytes are what a step moves and no layer is fused anyway:
# its steps run "kernel" at every batch.
FUSED_STATE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Per layer, its step implementation: "xla", "kernel" or "fused"."""

    steps: tuple[str, ...]


def resolve_implementation(implementation: str, model, backend: str | None = None) -> str:
    """"xla" or "triton" for one of STEP_IMPLEMENTATIONS. "auto" is "triton" on a GPU where
    every layer's step kernels take the model's shapes, "xla" otherwise: the fused steps at
    batch 1 and the step kernels alone at batches 8 to 64 took less time than XLA's step
    (docs/performance.md). backend: default jax.default_backend()."""
    if implementation not in STEP_IMPLEMENTATIONS:
        raise ValueError(f"step_implementation={implementation!r}; use one of "
                         f"{STEP_IMPLEMENTATIONS}")
    if implementation != "auto":
        return implementation
    kinds = {type(layer.mixer) for layer in model.layers}
    if (backend or jax.default_backend()) != "gpu":
        return "xla"
    refused = sorted(k.name for k in kinds if not k.kernels_support(model.config))
    if refused:  # the kernels would be faster here: say why they do not run
        sections = ", ".join(repr(getattr(model.config, name)) for name in refused)
        fallback.log_once("decode step", f"the {', '.join(refused)} step kernels do not take "
                          f"this model's shapes ({sections})")
        return "xla"
    return "triton"


def decode_plan(model, batch_size: int, implementation: str = "auto",
                backend: str | None = None, ssm_state_dtype: str = "float32") -> DecodePlan:
    """The DecodePlan of `model` at `batch_size` rows for a step implementation of
    STEP_IMPLEMENTATIONS and the SSM states stored in ssm_state_dtype: under "triton", each
    layer "fused" where its kind has it, the batch is at most FUSED_STEP_MAX_BATCH and the
    states' dtype is one of FUSED_STATE_DTYPES (so an int8 cache takes "kernel" at batch 1
    too), else "kernel" where its kind has one for this batch (Mixer.step_kernel_max_batch),
    else "xla"; under "xla", every layer "xla"."""
    kernels = resolve_implementation(implementation, model, backend) == "triton"
    fused = batch_size <= FUSED_STEP_MAX_BATCH and ssm_state_dtype in FUSED_STATE_DTYPES

    def step(mixer):
        if kernels and fused and "fused" in mixer.step_kernels:
            return "fused"
        limit = mixer.step_kernel_max_batch
        if kernels and "kernel" in mixer.step_kernels and (limit is None or batch_size <= limit):
            return "kernel"
        return "xla"
    return DecodePlan(tuple(step(layer.mixer) for layer in model.layers))
