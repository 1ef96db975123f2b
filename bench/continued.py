"""A training step continued from states on one GPU: the Mamba2 mixer fused on its kernels
(pallas_kernels.mamba2_mixer, the conv window before the first token read by the conv
kernel as an operand of its own) against the composed mixer on the same kernels (the conv
inside the SSD's custom_vjp over xBC with the window copied in front, then the gated norm and
out_proj), which the layer ran wherever a sequence continued from a conv window before the
fused mixer took one.

    python3 -m bench.continued [--presets mamba2-370m mamba2-1.3b] [--batch 8]
                               [--seq-len 2048] [--prefix 256] [--layers N] [--warmup 2]
                               [--reps 10]

Per preset, the model in bf16 (its first --layers layers where given): the states a
prefix of --prefix tokens leaves (each Mamba layer's conv window and SSM state), then the step
over the next --batch x --seq-len tokens continued from them: the mean next-token loss
(Mamba2LM.loss, the layers one after the other as the trainer runs them) and its gradients
for the parameters and the states, jitted once for each mixer in the same process. Checks
first, stopping on a miss: the fused side traced the fused mixer and the composed side did
not; the two losses within 1e-2 relative (bf16: kernels and fusions round at other points).
One row a preset: milliseconds a step of each (the host clock around a call until its
results are ready, median of --reps after --warmup, the two taking turns call by call), their
ratio, and the device memory XLA plans for each (arguments + outputs + temporaries). mamba_ssm
has no row: its Mamba2.forward continues from no state in training (its fused path,
mamba_split_conv1d_scan_combined, takes an SSM state but no conv window, and the layer
passes neither), which the table's header says.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.harness import device_line, table_header, table_row
from mamba_jax import Mamba2Config, Mamba2LM
from mamba_jax.layers import mamba2

GIB = 2**30


@contextlib.contextmanager
def mixer(fused: bool, traced: list):
    """While tracing: the Mamba2 layers on the fused mixer where its kernels run (fused), or
    on the composed form (not); traced gains an entry at each fused mixer traced."""
    run, call = mamba2.Mamba2Mixer.mixer_kernels_run, mamba2.mamba2_mixer
    if not fused:
        mamba2.Mamba2Mixer.mixer_kernels_run = lambda *args: False
    mamba2.mamba2_mixer = lambda *args: traced.append(1) or call(*args)
    try:
        yield
    finally:
        mamba2.Mamba2Mixer.mixer_kernels_run, mamba2.mamba2_mixer = run, call


def step_for(preset, graphdef, fused, params, states, ids):
    """(the compiled step, planned device bytes) on the fused mixer or the composed one; a
    SystemExit where the side did not trace the mixer it was asked for."""
    def objective(params, states, ids):
        model = nnx.merge(graphdef, params)
        return model.loss(ids[:, :-1], ids[:, 1:], initial_states=states,
                          scan_layers=False).mean()
    traced = []
    with mixer(fused, traced):
        lowered = jax.jit(jax.value_and_grad(objective, argnums=(0, 1))).lower(params, states,
                                                                              ids)
    if bool(traced) != fused:
        raise SystemExit(f"{preset}: the {'fused' if fused else 'composed'} side traced the "
                         f"fused mixer: {bool(traced)} (its kernels run on a Hopper GPU)")
    exe = lowered.compile()
    m = exe.memory_analysis()
    return exe, (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                 + m.temp_size_in_bytes)


def measure(preset, args):
    cfg = Mamba2Config.preset(preset)
    if args.layers:
        cfg = cfg.replace(n_layer=args.layers, layer_pattern=cfg.layers[:args.layers],
                          attn_layer_idx=())
    model = Mamba2LM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    prefix = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, args.prefix)),
                         jnp.int32)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, args.seq_len + 1)),
                      jnp.int32)
    _, states = jax.jit(lambda p, x: nnx.merge(graphdef, p).hidden(x, return_states=True))(
        params, prefix)
    steps = {name: step_for(preset, graphdef, fused, params, states, ids)
             for name, fused in (("fused", True), ("composed", False))}
    losses = {name: float(exe(params, states, ids)[0]) for name, (exe, _) in steps.items()}
    if not all(np.isfinite(list(losses.values()))) \
            or abs(losses["fused"] - losses["composed"]) > 1e-2 * abs(losses["composed"]):
        raise SystemExit(f"{preset}: losses differ: {losses}")
    times = {name: [] for name in steps}
    for i in range(args.warmup + args.reps):  # the two take turns, call by call
        for name, (exe, _) in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(exe(params, states, ids))
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return table_row((f"{preset}" + (f" ({args.layers} layers)" if args.layers else ""),
                      f"{args.batch}x{args.seq_len}", f"{ms['composed']:.1f}",
                      f"{ms['fused']:.1f}", f"{ms['composed'] / ms['fused']:.2f}x",
                      f"{steps['composed'][1] / GIB:.1f}", f"{steps['fused'][1] / GIB:.1f}",
                      f"{losses['fused']:.4f}"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["mamba2-370m", "mamba2-1.3b"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--prefix", type=int, default=256,
                   help="the tokens before the piece, whose states it continues from")
    p.add_argument("--layers", type=int, default=None,
                   help="the presets' first layers only (the part of a model that fits)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    print(f"{device_line()}; a step continued from states (conv window and SSM state), the "
          "loss's gradients for the parameters and the states; mamba_ssm: no row (its "
          "Mamba2 trains from no state)")
    print(table_header(("model", "batch x seq", "composed ms", "fused ms",
                        "composed/fused", "composed GiB", "fused GiB", "loss")))
    for preset in args.presets:
        print(measure(preset, args), flush=True)


if __name__ == "__main__":
    main()
