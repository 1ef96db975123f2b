"""The short conv and SiLU (pallas_kernels.conv) on a GPU, against our XLA path and the
`causal_conv1d` extension's `causal_conv1d_fn` (the CUDA kernels mamba_ssm's fused training
path calls), on the same inputs.

    python3 -m bench.conv [--presets mamba2-370m mamba2-1.3b] [--shapes 20x2048]
                          [--baseline .baseline] [--warmup 5] [--reps 30]

For each preset's conv channels (x, B and C: h * p + 2 * g * n), written as the Mamba2 mixer
asks for them (`parts`: x, B and C each its own array; causal_conv1d's is one array, which
mamba_ssm's kernels read in place), and each batch x seqlen of --shapes, with and without
packed documents (a document start in about every 512 tokens, its `seq_idx`): x and the
cotangent bf16, the weight and bias float32. Checks first, stopping on a miss: our kernels'
output and gradients against our XLA path on the GPU, and causal_conv1d's against ours (bf16
results within 2^-6 of the largest value, the weight's and bias's gradients within 1e-3).
Then one row a pass (forward, and forward+backward: the output and the gradients of <y,
dy>): milliseconds of ours, of our XLA path and of causal_conv1d (on x in the channel-last
layout mamba_ssm gives it), ours/theirs, and the floor: the bf16 arrays each pass must read
and write (forward x and y; forward+backward adds x and dy read and dx written) over the
copy bandwidth measured in the same run. Timing: the host clock around one call until its
results are ready, median of --reps after --warmup.
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
from pallas_kernels.conv import causal_conv1d

TOLERANCE = {"y": 2.0 ** -6, "dx": 2.0 ** -6, "dweight": 1e-3, "dbias": 1e-3}


def main(argv=None):
    args = layer_op_arguments(__doc__, "conv").parse_args(argv)
    versus = baseline.comparison(args.baseline, "conv", allow_slow=False, in_child=False)
    import torch
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError as e:
        raise SystemExit(f"causal_conv1d does not import ({e}): {baseline.INSTALL}")
    copy_rate = copy_bandwidth(3, 10)
    rng = np.random.default_rng()
    rows = []
    for preset in args.presets:
        cfg = Mamba2Config.preset(preset)
        dims = mamba2.dims(cfg)
        e, k = dims.e, dims.k
        parts = (dims.d_inner, dims.g * dims.n, dims.g * dims.n)
        whole = lambda out: [jnp.concatenate(out[0], axis=-1), *out[1]]
        for shape in args.shapes:
            b, l = (int(v) for v in shape.split("x"))
            x, dy = (jnp.asarray(rng.standard_normal((b, l, e)), jnp.bfloat16) for _ in "xy")
            dy_parts = tuple(jnp.split(dy, np.cumsum(parts)[:-1], axis=-1))
            w = jnp.asarray(rng.standard_normal((k, e)) / k ** 0.5, jnp.float32)
            bias = jnp.asarray(0.1 * rng.standard_normal(e), jnp.float32)
            for documents in (False, True):
                doc = (jnp.asarray(np.cumsum(rng.random((b, l)) < 1 / 512, axis=1), jnp.int32)
                       if documents else None)
                conv = {impl: lambda x, w, bias, impl=impl: causal_conv1d(
                    x, w, bias, doc, parts=parts, implementation=impl)
                    for impl in ("triton", "xla")}
                both = {impl: forward_and_backward(f) for impl, f in conv.items()}
                forward = {impl: jax.jit(f) for impl, f in conv.items()}
                label = f"{preset} {b}x{l}{' documents' if documents else ''}"
                reference = whole(both["xla"](x, w, bias, dy_parts))
                check_outputs(f"{label} ours against our XLA path",
                              whole(both["triton"](x, w, bias, dy_parts)), reference, TOLERANCE)

                # [b, l, e] memory seen as [b, e, l]: the channel-last layout mamba_ssm passes
                t_x, t_dy = (to_torch(a).transpose(1, 2) for a in (x, dy))
                t_w, t_bias = to_torch(w).T.contiguous(), to_torch(bias)
                t_doc = None if doc is None else torch.from_numpy(np.asarray(doc)).cuda()

                def theirs(grad):
                    leaves = [a.detach().requires_grad_(grad) for a in (t_x, t_w, t_bias)]
                    out = causal_conv1d_fn(leaves[0], leaves[1], leaves[2], seq_idx=t_doc,
                                           activation="silu")
                    if not grad:
                        return out
                    out.backward(t_dy)
                    return [out, leaves[0].grad, leaves[1].grad, leaves[2].grad]

                got = theirs(True)
                got = [got[0].transpose(1, 2), got[1].transpose(1, 2), got[2].T, got[3]]
                check_outputs(f"{label} causal_conv1d against ours",
                              [t.detach().float().cpu().numpy() for t in got], reference,
                              TOLERANCE)

                times = time_passes(forward, both, (x, w, bias), dy_parts, theirs,
                                    args.warmup, args.reps)
                size = x.nbytes
                for pass_, moved in (("fwd", 2 * size), ("fwd+bwd", 5 * size)):
                    rows.append((preset, shape, "yes" if documents else "no", pass_,
                                 *times[pass_], moved / copy_rate))
    print_versus_table(["preset", "batch x seqlen", "documents"], "causal_conv1d", rows,
                       versus, copy_rate)


if __name__ == "__main__":
    main()
