"""The gated norm of Mamba2's output (pallas_kernels.norm) on a GPU, against our XLA path and
mamba_ssm's Triton `rmsnorm_fn` (what its fused training path calls), on the same inputs.

    python3 -m bench.norm [--presets mamba2-370m mamba2-1.3b] [--shapes 20x2048]
                          [--baseline .baseline] [--warmup 5] [--reps 30]

For each preset's heads, headdim and ngroups and each batch x seqlen of --shapes: y, z and
the cotangent bf16, the weight float32 (as under mamba_ssm's bf16 autocast). Checks first,
stopping on a miss: our kernels' output and gradients against our XLA path on the GPU, and
mamba_ssm's output and gradients against ours (bf16 results within 2^-6 of the largest
value, dweight within 1e-3; both compute in float32). Then one row a pass (forward, and
forward+backward: the output and the gradients of <out, dy>, as a training step runs them):
milliseconds of ours, of our XLA path and of mamba_ssm, ours/theirs, and the floor: the
bytes each pass must move (forward: y and z read, out written; forward+backward adds the
backward's y, z and dy read and dy, dz written) over the copy bandwidth measured in the same
run. Timing: the host clock around one call until its results are ready, median of --reps
after --warmup.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp
import numpy as np

from bench import baseline
from bench.harness import (check_outputs, copy_bandwidth, forward_and_backward,
                           layer_op_arguments, print_versus_table, time_passes, to_torch)
from mamba_jax import Mamba2Config
from mamba_jax.layers import mamba2
from pallas_kernels.norm import gated_rms_norm

TOLERANCE = {"out": 2.0 ** -6, "dy": 2.0 ** -6, "dz": 2.0 ** -6, "dweight": 1e-3}


def main(argv=None):
    args = layer_op_arguments(__doc__, "norm").parse_args(argv)
    versus = baseline.comparison(args.baseline, "norm", allow_slow=False, in_child=False)
    rmsnorm_fn = baseline.import_gated_rmsnorm(args.baseline)
    copy_rate = copy_bandwidth(3, 10)
    rng = np.random.default_rng()
    rows = []
    for preset in args.presets:
        cfg = Mamba2Config.preset(preset)
        dims, eps, g = mamba2.dims(cfg), cfg.norm_eps, cfg.mamba2.ngroups
        for shape in args.shapes:
            b, l = (int(v) for v in shape.split("x"))
            arr = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
            y, z, dy = (arr(b, l, dims.h, dims.p) for _ in range(3))
            w = jnp.asarray(1 + 0.1 * rng.standard_normal((dims.h, dims.p)), jnp.float32)
            norm = {impl: lambda y, z, w, impl=impl: gated_rms_norm(
                y, z, w, eps, g, implementation=impl) for impl in ("triton", "xla")}
            both = {impl: forward_and_backward(f) for impl, f in norm.items()}
            forward = {impl: jax.jit(f) for impl, f in norm.items()}
            flat = lambda out, grads: [out, *grads]
            label = f"{preset} {b}x{l}"
            reference = flat(*both["xla"](y, z, w, dy))
            check_outputs(f"{label} ours against our XLA path",
                          flat(*both["triton"](y, z, w, dy)), reference, TOLERANCE)

            t_y, t_z, t_dy = (to_torch(a).reshape(b * l, -1) for a in (y, z, dy))
            t_w = to_torch(w).reshape(-1)

            def theirs(grad):
                leaves = [a.detach().requires_grad_(grad) for a in (t_y, t_z, t_w)]
                out = rmsnorm_fn(leaves[0], leaves[2], None, z=leaves[1], eps=eps,
                                 group_size=dims.d_inner // g, norm_before_gate=False)
                if not grad:
                    return out
                out.backward(t_dy)
                return [out, leaves[0].grad, leaves[1].grad, leaves[2].grad]

            got = [t.detach().float().cpu().numpy().reshape(a.shape)
                   for t, a in zip(theirs(True), reference)]
            check_outputs(f"{label} mamba_ssm against ours", got, reference, TOLERANCE)

            times = time_passes(forward, both, (y, z, w), dy, theirs, args.warmup, args.reps)
            size = b * l * dims.d_inner * 2  # one bf16 array
            for pass_, moved in (("fwd", 3 * size), ("fwd+bwd", 8 * size)):
                rows.append((preset, shape, pass_, *times[pass_], moved / copy_rate))
    print_versus_table(["preset", "batch x seqlen"], "mamba_ssm", rows, versus, copy_rate)


if __name__ == "__main__":
    main()
