"""Our kernels on the GPU against their plain-JAX references on the CPU (imported as `checks`:
each benchmark script runs with bench/ first on sys.path)."""

import jax
import numpy as np


def check_kernel(label, f, kwargs):
    """f(**kwargs, implementation="triton") on the default device against
    f(**kwargs, implementation="xla") on the CPU: prints the worst difference over the
    largest value of any output, exits on one over 2**-8 (one bf16 ulp, where float32 sums in
    another order round to the neighbour), and returns it. kwargs: arrays (and None) are the
    jitted arguments, the rest static. The reference runs on the CPU because XLA's GPU
    fusions may skip the model's bf16 roundings (xla_allow_excess_precision), which alone
    moves the SSM update by about 2e-3 relative."""
    cpu = jax.devices("cpu")[0]
    args = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array) or v is None}
    static = {k: v for k, v in kwargs.items() if k not in args}
    ours = jax.jit(lambda a: f(**a, **static, implementation="triton"))(args)
    with jax.default_device(cpu):
        ref = jax.jit(lambda a: f(**a, **static, implementation="xla"))(
            jax.device_put(args, cpu))
    err = max(float(np.abs(np.asarray(o, np.float64) - np.asarray(r, np.float64)).max()
                    / np.abs(np.asarray(r, np.float64)).max())
              for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)))
    print(f"check {label}: worst error relative to the largest value {err:.1e}", flush=True)
    if not err <= 2.0 ** -8:  # NaN fails too
        raise SystemExit(f"CHECK FAILED: {label}: {err:.2e}")
    return err
