"""The training path's conv, gated-norm and add-and-norm kernels alone, as the model calls
them, under the tiles given: each kernel's forward and backward time, its floor, and its
largest difference from the first tiles' results.

    python3 -m bench.tiles [--preset mamba2-1.3b] [--shape 16x2048]
        [--conv '' run=64,step_rows=1 ...] [--norm '' backward_prefetch=0,backward_warps=4 ...]
        [--add-norm '' block_elements=2048,backward_prefetch=1 ...] [--calls 20] [--rounds 7]

--conv, --norm and --add-norm: each value one Config of the kernels
(pallas_kernels.conv.triton.Config, pallas_kernels.norm.triton.Config) as comma-separated
field=value pairs over the kernels' defaults (conv.Config(), norm.Config(),
norm.ADD_CONFIG; '' the defaults themselves; a bool field takes 0 or 1, an optional one
`none`); no values, no rows of that kernel. The conv reads x, B and C from the
in-projection's output zxbcdt [b, l, W] in place and writes them as the parts the SSD
kernels read, its backward reading their cotangents; the gated norm reads z from zxbcdt in
place, its backward recomputing the output for out_proj's weight gradient (`with_out`), as
the Mamba2 mixer's do; the add and norm takes a float32 residual and a delta in bf16 [b, l,
d], its backward a float32 cotangent of the sum and a bf16 one of the normed output, as the
residual stream's (residual_in_fp32). Other activations bf16, weights float32, random.

Timing: --calls calls dispatched back to back and then waited for (the host's dispatch of
each hidden behind the GPU's work, where a call waited for alone counts it), per call, the
median of --rounds rounds. The floor: the bytes each pass must read and write (the conv
forward xBC and its output, backward xBC, dy and dx; the gated norm forward y, z and its
output, backward y, z, dout, dy, dz and the output; the add and norm forward the residual,
delta, their sum and the normed output, backward the sum, both cotangents and the two
gradients) over the copy bandwidth measured in the same run.
Off a GPU the kernels run in Pallas's interpreter and no floor is measured: a check of the
script, not a timing.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import copy_bandwidth, device_line, median_time, table_header, table_row
from mamba_jax import Mamba2Config
from mamba_jax.layers import mamba2
from pallas_kernels.conv import triton as conv
from pallas_kernels.norm import triton as norm
from pallas_kernels.triton_call import off_gpu

EPS = 1e-5


def parse_config(defaults, text):
    """One --conv, --norm or --add-norm value: the Config `defaults` with the given
    `field=value` pairs."""
    cls = type(defaults)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    changes = {}
    try:
        for pair in filter(None, text.split(",")):
            name, _, value = pair.partition("=")
            if name not in fields:
                raise ValueError(f"{cls.__module__}.Config has no field {name!r}: it has "
                                 f"{', '.join(fields)}")
            changes[name] = (None if value == "none" else bool(int(value))
                             if fields[name].type == "bool" else int(value))
        return dataclasses.replace(defaults, **changes)
    except ValueError as e:  # a field unknown, a value not an integer, a Config refused
        raise SystemExit(f"tiles {text!r}: {e}") from None


def per_call(fn, calls, rounds):
    """Seconds a call of fn: `calls` calls dispatched back to back, then waited for; the median
    of `rounds` rounds, after one such round."""
    return median_time(lambda: jax.block_until_ready([fn() for _ in range(calls)]), 1,
                       rounds) / calls


def largest_difference(got, first):
    """The largest difference of any result from the first tiles', over that one's largest
    value."""
    return max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))
                     / np.max(np.abs(np.asarray(b, np.float64))))
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(first)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="mamba2-1.3b")
    parser.add_argument("--shape", default="16x2048", help="batch x seqlen")
    for kind in ("conv", "norm", "add-norm"):
        parser.add_argument(f"--{kind}", nargs="*", default=[""],
                            help=f"{kind} Configs (see above)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    tiles = {"conv": (conv.Config(), args.conv), "norm": (norm.Config(), args.norm),
             "add-norm": (norm.ADD_CONFIG, args.add_norm)}
    configs = {kind: [(parse_config(defaults, text), text or "defaults") for text in texts]
               for kind, (defaults, texts) in tiles.items()}

    interpret = off_gpu()
    dims = mamba2.dims(Mamba2Config.preset(args.preset))
    b, l = (int(v) for v in args.shape.split("x"))
    parts = (dims.d_inner, dims.g * dims.n, dims.g * dims.n)
    width = dims.d_inner + dims.e + dims.h  # zxbcdt's z, xBC and dt
    rng = np.random.default_rng()
    bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    zxbcdt, y, dout = bf16(b, l, width), bf16(b, l, dims.h, dims.p), bf16(b, l, dims.h, dims.p)
    dparts = tuple(bf16(b, l, size) for size in parts)
    conv_w = jnp.asarray(rng.standard_normal((dims.k, dims.e)) / dims.k, jnp.float32)
    conv_b = jnp.asarray(0.1 * rng.standard_normal(dims.e), jnp.float32)
    norm_w = jnp.asarray(1 + 0.1 * rng.standard_normal((dims.h, dims.p)), jnp.float32)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    residual, dsummed = f32(b, l, dims.d), f32(b, l, dims.d)  # the backward's sum: residual
    delta, dnormed = bf16(b, l, dims.d), bf16(b, l, dims.d)
    add_w = jnp.asarray(1 + 0.1 * rng.standard_normal(dims.d), jnp.float32)

    def passes(config, kind):
        """The kind's forward and backward at config, each a call of a jitted function on
        the inputs above (arguments, not constants the executable would hold)."""
        if kind == "conv":
            options = dict(config=config, interpret=interpret, x_start=dims.d_inner)
            forward = jax.jit(lambda zx, w, bias: conv.forward(zx, w, bias, None, l, parts,
                                                                **options))
            backward = jax.jit(lambda zx, w, bias, dys: conv.backward(zx, w, bias, None, dys,
                                                                       **options))
            return (lambda: forward(zxbcdt, conv_w, conv_b),
                    lambda: backward(zxbcdt, conv_w, conv_b, dparts))
        options = dict(config=config, interpret=interpret)
        if kind == "add-norm":
            forward = jax.jit(lambda r, x, w: norm.add_forward(r, x, w, EPS, **options))
            backward = jax.jit(lambda s, w, ds, dn: norm.add_backward(s, w, ds, dn, EPS,
                                                                       **options))
            return (lambda: forward(residual, delta, add_w),
                    lambda: backward(residual, add_w, dsummed, dnormed))
        forward = jax.jit(lambda y, zx, w: norm.forward(y, zx, w, EPS, dims.g, **options))

        @jax.jit
        def backward(y, zx, w, dout):
            dy, dz, dw, out = norm.backward(y, zx, w, dout, EPS, dims.g, with_out=True,
                                            **options)
            return dy, dz[..., :dims.d_inner], dw, out  # dz's other columns are not written

        return lambda: forward(y, zxbcdt, norm_w), lambda: backward(y, zxbcdt, norm_w, dout)

    # bytes each pass must move: entries of xBC (the conv), of y (the gated norm) or of the
    # residual stream (the add and norm), times the bytes of each that the pass reads and
    # writes (bf16 2, float32 4)
    entries = {"conv": b * l * dims.e, "norm": b * l * dims.d_inner, "add-norm": b * l * dims.d}
    per_entry = {"conv": (2 * 2, 3 * 2), "norm": (3 * 2, 6 * 2),
                 "add-norm": (4 + 2 + 4 + 2, 4 + 4 + 2 + 4 + 2)}
    copy_rate = None if interpret else copy_bandwidth(3, 10)
    rows = []
    for kind, kind_configs in configs.items():
        first = None
        for config, text in kind_configs:
            forward, backward = passes(config, kind)
            results = (forward(), backward())
            first = first or results
            seconds = [per_call(f, args.calls, args.rounds) for f in (forward, backward)]
            floors = ([entries[kind] * n / copy_rate for n in per_entry[kind]]
                      if copy_rate else [None, None])
            rows.append((kind, text, *seconds, *floors, largest_difference(results, first)))
            print(f"{kind} {text}: forward {seconds[0] * 1e3:.3f} ms, backward "
                  f"{seconds[1] * 1e3:.3f} ms", flush=True)

    bandwidth = "" if copy_rate is None else f"; copy bandwidth {copy_rate / 1e12:.2f} TB/s"
    print(f"\n{device_line()}; {args.preset} {args.shape}"
          f"{' (Pallas interpreter)' if interpret else ''}{bandwidth}")
    print(table_header(("kernel", "tiles", "fwd ms", "bwd ms", "fwd floor ms", "bwd floor ms",
                        "bwd/floor", "difference from the first")))
    ms = lambda s: "" if s is None else f"{s * 1e3:.3f}"
    for kind, text, fwd, bwd, fwd_floor, bwd_floor, difference in rows:
        print(table_row((kind, text, ms(fwd), ms(bwd), ms(fwd_floor), ms(bwd_floor),
                         "" if bwd_floor is None else f"{bwd / bwd_floor:.2f}x",
                         f"{difference:.1e}")))


if __name__ == "__main__":
    main()
