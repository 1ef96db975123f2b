"""Decoding speed on a GPU: mamba_jax.generate against mamba_ssm's generate(..., cg=True).

    python3 -m bench.generate [--baseline .baseline] [--allow-slow-baseline]
                              [--presets mamba2-370m,mamba2-1.3b]
                              [--batches 1,64] [--prompt 128] [--new 256] [--reps 3]
                              [--ssm-state-dtypes float32,bfloat16,int8]
                              [--command-buffers on,off] [--gemms xla,cublaslt]
                              [--step-implementations auto,xla,triton]
                              [--theirs-process child|same] [--only-ours]

Random weights, bf16 compute, greedy. For each preset and batch: our prefill time (the
jitted prefill, timed from the call until its result is on the device), ms per decode step
and decode tokens/s; mamba_ssm's the same; the ratio ours/theirs per step; and the roofline.
Both sides' decode time is taken the same way: a generation of new tokens minus one of a
single token (the prefill's), over the new - 1 steps between them. Theirs is
generate(max_length=prompt+new) minus generate(max_length=prompt+1), with CUDA graphs; ours
is mamba_jax.generate(max_new_tokens=new) minus the same program stopped after one token
(max_new_tokens_per_row=1: one decode loop to compile per row of the table). What a call
costs once (the host's work to start the programs, casting the weights for the loop) cancels
on both sides. The roofline: bytes one decode step must read (bf16 matmul weights, float32
conv weights and norms, the conv and SSM states read and written; mamba_ssm's cache keeps
its states in bf16, ours in the row's --ssm-state-dtypes, int8 with its scales; an
attention layer's keys and values for the average context, prompt + (new - 1) / 2 tokens)
over the measured copy bandwidth. Median of --reps after one warm-up.

A preset with attention or MLP layers (megatron-hybrid-800m) gets our rows only:
mamba_ssm's MambaLMHeadModel puts an MLP in every block, so it cannot spell such a layer
pattern, and its attention decodes only with flash_attn. So does a Mamba-1 preset
(mamba-1.4b): mamba_ssm's Mamba-1 prefill runs its compiled selective_scan_cuda, which the
GPU machine does not build (bench.selective_scan times its Triton decoding update alone).
A Mamba-3 preset (mamba3-1.3b) gets mamba_ssm's rows with its Triton step kernel
(ops/triton/mamba3/mamba3_siso_step.py) decoding each token (baseline.use_mamba3_triton_step):
its Mamba3.step runs a CuTe-DSL kernel (ops/cute/mamba3/mamba3_step_fn.py) that needs
nvidia-cutlass-dsl (its CUDA 13 libraries' wheel alone is 92 MB, more than can be carried
to the GPU machine) and quack; its prefill is its forward's Triton kernels; its cache keeps
the SSM state in float32. A MIMO Mamba-3 preset gets our rows only: its step is CuTe-DSL
alone. Our Mamba-3 layers step with their kernel (pallas_kernels.mamba3.step) where the
step implementation resolves to "triton", checked first against their XLA step. Its floor
counts its weights
and its state per row: the angles, the SSM state and the trapezoid's carried k and x
(mamba3_bytes).

One row of ours per SSM state dtype (generate's ssm_state_dtype), step implementation
(generate's step_implementation), command-buffer setting (on: the decode loop compiled
with generate.DECODE_COMPILER_OPTIONS, as generate does; off: XLA's defaults) and --gemms
setting (xla: XLA's choice for the loop's matrix products, its Triton GEMM fusions, as
generate compiles it; cublaslt: the loop compiled with those off and cuBLASLt's GEMMs on,
GEMM_OPTIONS). Checks, failing loudly: streamed tokens equal unstreamed ones (first); with
"triton" asked, the decoding kernels at each preset's shapes and batch against their
references (check_kernels); the command-buffer settings generate the same tokens. Last, the
share of each row's tokens equal to the first row's of its group: other state dtypes,
kernels and GEMMs round differently, and a random-weight model's greedy tokens part ways at
the first flipped argmax.

mamba_ssm runs in a child process of this script (--theirs-process same: in this one, before
ours), imported from --baseline (bench.baseline), on its fast path: causal_conv1d_fn in the
prefill, causal_conv1d_update and its Triton selective_state_update in each step. The table's
header names the path that runs; without the causal_conv1d extension the script prints no
ratio (bench.baseline.guard) unless --allow-slow-baseline, which marks them. --only-ours
times our rows alone, with no mamba_ssm copy: theirs and the ratios print as NaN.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench import baseline
from bench.harness import (INT8_TOLERANCE, check_kernel, copy_bandwidth, median_time, result,
                           run_module, table_header, table_row)
from mamba_jax import Mamba2Config, Mamba2LM, generate
from mamba_jax.generate import DECODE_COMPILER_OPTIONS, decode, prefill, prepare
from mamba_jax.generate.plan import FUSED_STEP_MAX_BATCH, decode_plan, resolve_implementation
from mamba_jax.layers import mamba1, mamba2, mamba3
from pallas_kernels.decode.norm_matmul import rms_norm_matmul
from pallas_kernels.decode.step_out import mamba_step_out
from pallas_kernels.mamba3 import Mamba3State
from pallas_kernels.mamba3.step import StepParams, decode_step
from pallas_kernels.ssd.step import dequantize, mamba_step, mamba_step_shifted, quantize


def state_bytes(cfg: Mamba2Config, dtype: str) -> float:
    """Bytes an SSM state element takes in generate's ssm_state_dtype: int8's 1 and its
    float32 scale's share, one per d_state elements (pallas_kernels.ssd.step.Int8State)."""
    if dtype == "int8":
        return 1 + 4 / cfg.mamba2.d_state
    return jnp.dtype(dtype).itemsize


def step_bytes(cfg: Mamba2Config, batch: int, state_bytes: float, context: float) -> float:
    """Bytes one decode step reads or writes at the least: every weight once (matmuls bf16,
    the rest float32), each row's conv window and SSM state (state_bytes an element) read
    and written, and an attention layer's keys and values for `context` tokens read (bf16)
    and one token's written."""
    d, _, h, p, g, n, k, e = mamba2.dims(cfg)
    matmul = d * (2 * h * p + 2 * g * n + h) + h * p * d  # in projections, out_proj
    small = k * e + e + 4 * h + h * p + d  # conv, A, D, dt, norms
    mamba = 2 * matmul + 4 * small + batch * 2 * (2 * e * k + state_bytes * h * p * n)
    _, i, r, n1, k1 = mamba1.dims(cfg)
    mamba1_bytes = (2 * (2 * d * i + i * (r + 2 * n1) + r * i + i * d)  # bf16 projections
                    + 4 * (k1 * i + 3 * i + i * n1 + d)  # conv, biases, D, A_log, norm
                    + batch * 2 * (2 * i * k1 + state_bytes * i * n1))
    a = cfg.attention
    q, kv = a.num_heads * a.head_dim, a.num_heads_kv * a.head_dim
    attention = 2 * d * (2 * q + 2 * kv) + 4 * d + batch * 2 * 2 * kv * (context + 1)
    mlp = 2 * d * cfg.mlp.d_intermediate * (3 if cfg.mlp.activation == "swiglu" else 2) + 4 * d
    per_kind = {"M": mamba, "1": mamba1_bytes, "3": mamba3_bytes(cfg, batch, state_bytes),
                "*": attention, "-": mlp}
    return (sum(per_kind[kind] for kind in cfg.layers) + 2 * cfg.padded_vocab_size * d
            + 4 * d)


def mamba3_bytes(cfg: Mamba2Config, batch: int, state_bytes: float) -> float:
    """Bytes one Mamba-3 layer's decode step reads or writes at the least: in_proj and
    out_proj once in bf16 (Mamba3Mixer.step_weights casts them), its float32 vectors once
    (dt_bias, the B and C biases [h, r, n] and norms, D, the block's norm; with MIMO mimo_x,
    mimo_z, mimo_o [h, r, p]; with is_outproj_norm its weight [h, p]), and each row's state
    read and written: the angles [h, a], the SSM state [h, p, n] (state_bytes an element),
    the trapezoid's carried k [r, h, n] and x [h, p] (float32)."""
    d, h, p, g, r, n, a = mamba3.dims(cfg)
    m = cfg.mamba3
    matmul = d * (2 * h * p + 2 * r * g * n + 3 * h + a) + h * p * d
    small = (2 * h + 2 * h * r * n + 2 * n + d + (3 * h * r * p if m.is_mimo else 0)
             + (h * p if m.is_outproj_norm else 0))
    state = 4 * (h * a + r * h * n + h * p) + state_bytes * h * p * n
    return 2 * matmul + 4 * small + batch * 2 * state


# The decode loop's compiler options of each --gemms setting, over the command buffers'
GEMM_OPTIONS = {"xla": {},
                "cublaslt": {"xla_gpu_enable_triton_gemm": False,
                             "xla_gpu_enable_cublaslt": True}}


def ours(model, batch, prompt, new, reps, ssm_state_dtype, command_buffers, implementation,
         gemms="xla"):
    """(prefill s, decode s for new - 1 steps, tokens [batch, new]) of mamba_jax.generate.
    The decode time is generate of `new` tokens minus generate of one token (the prefill's
    alone), as mamba_ssm's is taken (theirs). The one token is the same program told to
    stop after it (max_new_tokens_per_row=1): one decode loop to compile, not two. gemms:
    a GEMM_OPTIONS key."""
    ids = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size,
                                                        (batch, prompt)))

    options = {**(DECODE_COMPILER_OPTIONS if command_buffers else {}), **GEMM_OPTIONS[gemms]}
    prepared = {n: prepare(model, ids, new, max_new_tokens_per_row=n,
                           ssm_state_dtype=ssm_state_dtype, step_implementation=implementation)
                for n in (1, new)}

    def run(n):  # generate(model, ids, n, ...), its decode loop compiled with `options`
        first, cache = prefill(model, ids, prepared[n])
        return jax.block_until_ready(decode(model, first, cache, prepared[n],
                                            compiler_options=options))

    t_prefill = median_time(lambda: jax.block_until_ready(prefill(model, ids, prepared[new])),
                            1, reps)
    # Each length is its own program: all runs of one, then the other, as theirs.
    t_full = median_time(lambda: run(new), 1, reps)
    t_one = median_time(lambda: run(1), 1, reps)
    return t_prefill, t_full - t_one, np.asarray(run(new))


def check_streaming():
    """Streamed tokens (an io_callback inside the decode loop) equal the unstreamed ones, in
    order: a callback captured into a CUDA graph would run once, not at every step."""
    cfg = Mamba2Config.preset("tiny")
    model = Mamba2LM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 8)))
    seen = []
    streamed = generate(model, ids, 16, on_token=lambda i, t: seen.append((i, t.tolist())))
    plain = generate(model, ids, 16)
    if not (np.array_equal(streamed, plain) and [i for i, _ in seen] == list(range(16))
            and np.array_equal(np.asarray([t for _, t in seen]).T, plain[:, 8:])):
        raise SystemExit(f"streaming check FAILED: steps {[i for i, _ in seen]}")
    print("check: streamed tokens equal the unstreamed ones, every step in order")


def check_kernels(preset, cfg, batch, int8=False):
    """Our decoding kernels (pallas_kernels.ssd.step and .norm_matmul, as a step of this
    preset at this batch calls them) on the GPU against their plain-JAX references run on
    the CPU, on random inputs (harness.check_kernel); exits on a miss. int8: the step kernel
    over an Int8State too, its state compared dequantised, where one value may round to
    its neighbour (one step, 1/127 of its row's largest)."""
    rng = np.random.default_rng(0)
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    matrix = lambda n, k: (arr(n, k) / k ** 0.5).astype(jnp.bfloat16)  # a w [n, k]
    d, hp, h, p, g, n, k, e = mamba2.dims(cfg)
    zxbcdt = hp + e + h  # in_proj: z, xBC, dt
    cases = {"mamba_step": (mamba_step, dict(
        conv_state=arr(batch, e, k).astype(jnp.bfloat16),
        zxbcdt=arr(batch, zxbcdt).astype(jnp.bfloat16), conv_w=0.5 * arr(e, k), conv_b=None,
        A=-jnp.asarray(rng.uniform(1.0, 16.0, h), jnp.float32),
        D=arr(h), dt_bias=0.5 * arr(h), state=arr(batch, h, p, n), y_dtype=jnp.bfloat16))}
    if int8:
        def step_int8(**kw):  # the new state dequantised: the values it stands for
            y, window, state = mamba_step(**kw)
            return y, window, dequantize(state)
        check_kernel(f"{preset} batch {batch} mamba_step (int8 state)", step_int8, dict(
            cases["mamba_step"][1], state=quantize(cases["mamba_step"][1]["state"])),
            tolerance=INT8_TOLERANCE)
    if batch <= FUSED_STEP_MAX_BATCH:  # the fused steps' kernels (generate.plan)
        shifted = {key: v for key, v in cases["mamba_step"][1].items() if key != "conv_state"}
        cases["mamba_step_shifted"] = (mamba_step_shifted, dict(
            shifted, window=arr(batch, e, k).astype(jnp.bfloat16), gate=True))
        # With a counter, one cooperative kernel where the GPU holds its programs (the
        # counter itself is not compared: only that kernel advances it)
        cases["mamba_step_out"] = (lambda **kw: mamba_step_out(**kw)[:2], dict(
            shifted, window=arr(batch, e, k).astype(jnp.bfloat16), residual=arr(batch, d),
            norm_weight=arr(hp), w_out=matrix(d, hp), eps=cfg.norm_eps, ngroups=g,
            sync=jnp.zeros((1,), jnp.int32)))
        # As fused_step calls it: the conv window shifted in place, xBC at column h*p.
        cases["rms_norm_matmul (in_proj)"] = (
            lambda conv_state, **kw: rms_norm_matmul(**kw, window=(conv_state, hp)), dict(
                x=arr(batch, d), weight=arr(d), w=matrix(zxbcdt, d), eps=cfg.norm_eps,
                w_transposed=True, conv_state=arr(batch, e, k).astype(jnp.bfloat16)))
        cases["rms_norm_matmul (out_proj)"] = (rms_norm_matmul, dict(  # y already gated
            x=arr(batch, hp), weight=arr(hp), w=matrix(d, hp), eps=cfg.norm_eps, ngroups=g,
            residual=arr(batch, d), w_transposed=True))
        if "-" in cfg.layers:  # an MLP block's two kernels (MLP.fused_step)
            f = cfg.mlp.d_intermediate
            swiglu = cfg.mlp.activation == "swiglu"
            cases["rms_norm_matmul (MLP in)"] = (rms_norm_matmul, dict(
                x=arr(batch, d), weight=arr(d), w=matrix(2 * f if swiglu else f, d),
                eps=cfg.norm_eps, w_transposed=True, out_dtype=jnp.float32))
            cases["rms_norm_matmul (MLP down)"] = (rms_norm_matmul, dict(
                x=arr(batch, f), weight=None, w=matrix(d, f),
                eps=None, z=arr(batch, f) if swiglu else None,
                activation=None if swiglu else cfg.mlp.activation, residual=arr(batch, d),
                w_transposed=True))
        if "*" in cfg.layers:  # an attention block's two kernels (Attention.fused_step)
            a = cfg.attention
            qkv = (a.num_heads + 2 * a.num_heads_kv) * a.head_dim
            o = a.num_heads * a.head_dim
            cases["rms_norm_matmul (attention qkv)"] = (rms_norm_matmul, dict(
                x=arr(batch, d), weight=arr(d), w=matrix(qkv, d), eps=cfg.norm_eps,
                w_transposed=True))
            cases["rms_norm_matmul (attention out)"] = (rms_norm_matmul, dict(
                x=arr(batch, o).astype(jnp.bfloat16), weight=None, w=matrix(d, o), eps=None,
                bias=arr(d) if a.out_bias else None, residual=arr(batch, d),
                w_transposed=True))
    for name, (f, kwargs) in cases.items():
        check_kernel(f"{preset} batch {batch} {name}", f, kwargs)


def step_label(model, batch, implementation, ssm_state_dtype):
    """A row's step column: the implementation asked for and, in brackets, what the decode
    plan runs at this batch ("fused", "kernel" or "xla"; several for a hybrid's kinds),
    e.g. "auto (xla)" for Mamba-3 above its step kernel's batch."""
    steps = decode_plan(model, batch, implementation,
                        ssm_state_dtype=ssm_state_dtype).steps
    return f"{implementation} ({'/'.join(dict.fromkeys(steps))})"


def check_mamba3_kernel(preset, cfg, batch, int8=False):
    """Mamba-3's step kernel (pallas_kernels.mamba3.step.decode_step, at this preset's shapes
    and batch) on the GPU against its XLA step on the CPU, on random inputs, over a float32
    state and, with int8, an Int8State (compared dequantised: a value may round to its
    neighbour); the gated y is rounded to bf16 twice (after the step and after the gate), so
    two bf16 roundings; where the plan fuses, the fused block's norm_matmul kernels too;
    exits on a miss."""
    rng = np.random.default_rng(0)
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    _, h, p, g, r, n, a = mamba3.dims(cfg)
    state = Mamba3State(jnp.asarray(rng.uniform(0, 6, (batch, h, a)), jnp.float32),
                        arr(batch, h, p, n), arr(batch, r, h, n), arr(batch, h, p))
    m = cfg.mamba3
    mimo = [arr(h, r, p) for _ in range(3)] if m.is_mimo else [None] * 3
    params = StepParams(arr(h), 1 + arr(n) / 4, 1 + arr(n) / 4, arr(h, r, n), arr(h, r, n),
                        arr(h), *mimo, 1 + arr(h, p) / 4 if m.is_outproj_norm else None)
    zxbcdt = arr(batch, 2 * h * p + 2 * r * g * n + 3 * h + a).astype(jnp.bfloat16)
    kwargs = dict(state=state, zxbcdt=zxbcdt, params=params, A_floor=m.A_floor,
                  rotary=mamba3.rotary_layout(cfg))
    check_kernel(f"{preset} batch {batch} mamba3 decode_step", decode_step, kwargs,
                 tolerance=2.0 ** -7)
    if batch <= FUSED_STEP_MAX_BATCH:  # the fused block's (Mamba3Mixer.fused_step)
        d = cfg.d_model
        matrix = lambda n, k: (arr(n, k) / k ** 0.5).astype(jnp.bfloat16)  # a w [n, k]
        check_kernel(f"{preset} batch {batch} rms_norm_matmul (mamba3 in_proj)",
                     rms_norm_matmul, dict(x=arr(batch, d), weight=arr(d),
                                           w=matrix(zxbcdt.shape[1], d), eps=cfg.norm_eps,
                                           w_transposed=True))
        check_kernel(f"{preset} batch {batch} rms_norm_matmul (mamba3 out_proj)",
                     rms_norm_matmul, dict(x=arr(batch, h * p).astype(jnp.bfloat16),
                                           weight=None, w=matrix(d, h * p), eps=None,
                                           residual=arr(batch, d), w_transposed=True))
    if int8:
        def step_int8(**kw):  # the new state dequantised: the values it stands for
            y, new = decode_step(**kw)
            return y, new._replace(ssm=dequantize(new.ssm))
        check_kernel(f"{preset} batch {batch} mamba3 decode_step (int8 state)", step_int8,
                     dict(kwargs, state=state._replace(ssm=quantize(state.ssm))),
                     tolerance=INT8_TOLERANCE)


def theirs(preset, batch, prompt, new, reps, copy):
    """(prefill s, decode s) of mamba_ssm's generate(..., cg=True) for the named preset, its
    copy at the folder `copy` (--baseline)."""
    import torch

    cfg = Mamba2Config.preset(preset)
    MambaConfig, MambaLMHeadModel = baseline.import_mamba_lm(copy)
    config = baseline.mamba_config(cfg, MambaConfig)
    model = MambaLMHeadModel(config, device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device="cuda")
    if baseline.ssm_layer(cfg) == "Mamba3":  # its CuTe-DSL step cannot run there
        baseline.use_mamba3_triton_step(copy)
        check_mamba3_step(model, ids, copy)

    def run(max_length):
        with torch.inference_mode():
            model.generate(ids, max_length=max_length, top_k=1, cg=True)
        torch.cuda.synchronize()

    # Each max_length captures its own graphs: all runs of one length, then the other.
    t_full = median_time(lambda: run(prompt + new), 1, reps)
    t_prefill = median_time(lambda: run(prompt + 1), 1, reps)
    return t_prefill, t_full - t_prefill


def check_mamba3_step(model, ids, copy):
    """mamba_ssm's model with its Mamba3 step swapped for the Triton one: the logits of one
    decoded token (the prompt's cache, then a step) against its forward over the prompt and
    that token, 3e-2 of the largest at most (bf16), else a RuntimeError."""
    import torch
    InferenceParams = baseline.import_inference_params(copy)
    with torch.inference_mode():
        params = InferenceParams(max_seqlen=ids.shape[1] + 1, max_batch_size=ids.shape[0])
        token = model(ids, inference_params=params).logits[:, -1:].argmax(-1)
        params.seqlen_offset += ids.shape[1]
        stepped = model(token, inference_params=params).logits[:, -1].float()
        whole = model(torch.cat([ids, token], 1)).logits[:, -1].float()
    error = ((stepped - whole).abs().max() / whole.abs().max()).item()
    # to stderr, two spaces in: what a child process's parent passes on (run_module)
    print(f"  check mamba_ssm's Mamba3 Triton step against its forward: {error:.1e}",
          file=sys.stderr, flush=True)
    if not error < 3e-2:
        raise RuntimeError(f"mamba_ssm's Mamba3 with its Triton step decodes off its forward "
                           f"({error:.1e} of the largest logit)")


def theirs_in_child(preset, batch, prompt, new, reps, copy):
    """theirs() run by this script in a child process (--theirs-child), so that neither
    library's runtime shares a process with the other's, as neither does in use (our decode
    timed right after mamba_ssm's in one process ran slower: BENCHMARKS.md, Decoding against
    mamba_ssm)."""
    reported = run_module("generate", [
        "--theirs-child", "--presets", preset, "--batches", str(batch), "--prompt",
        str(prompt), "--new", str(new), "--reps", str(reps), "--baseline", copy])[-1]
    if "error" in reported:
        raise RuntimeError(f"mamba_ssm's child process failed: {reported['error']}")
    return reported["prefill_s"], reported["decode_s"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    baseline.add_arguments(parser, "decode")
    parser.add_argument("--presets", default="mamba2-370m,mamba2-1.3b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ssm-state-dtypes", default="float32,bfloat16",
                        help="a row of ours per dtype the decoding cache stores states in")
    parser.add_argument("--step-implementations", default="auto",
                        help="a row of ours per implementation of the Mamba layers' conv and "
                             "SSM update (generate's step_implementation): auto (triton on a "
                             "GPU), xla, triton")
    parser.add_argument("--command-buffers", default="on",
                        help="'on', 'off' or 'on,off': our decode loop compiled with "
                             "generate.DECODE_COMPILER_OPTIONS (on) or XLA's defaults (off)")
    parser.add_argument("--gemms", default="xla",
                        help="'xla', 'cublaslt' or 'xla,cublaslt': our decode loop's matrix "
                             "products as XLA chooses them (Triton GEMM fusions) or through "
                             "cuBLASLt (GEMM_OPTIONS)")
    parser.add_argument("--theirs-process", choices=("child", "same"), default="child",
                        help="where mamba_ssm runs: a child process (the default) or this one, "
                             "before ours")
    parser.add_argument("--only-ours", action="store_true",
                        help="time our rows alone: no mamba_ssm copy needed, its columns NaN "
                             "(an A/B of our trees without their minutes)")
    parser.add_argument("--theirs-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    gemm_settings = args.gemms.split(",")
    if not set(gemm_settings) <= set(GEMM_OPTIONS):
        parser.error(f"--gemms {args.gemms}: each setting one of {', '.join(GEMM_OPTIONS)}")
    if args.theirs_child:  # the child of theirs_in_child: one preset and batch
        t_prefill, t_decode = theirs(args.presets, int(args.batches), args.prompt, args.new,
                                     args.reps, args.baseline)
        result({"prefill_s": t_prefill, "decode_s": t_decode})
        return

    presets = args.presets.split(",")

    def not_run(cfg):
        return "--only-ours" if args.only_ours else _theirs_not_run(cfg, args.baseline)
    # mamba_ssm runs for the presets it decodes here (_theirs_not_run): its path checked
    # before any timing, in the process it will run in
    versus = None
    if any(not not_run(Mamba2Config.preset(preset)) for preset in presets):
        versus = baseline.comparison(args.baseline, "decode", args.allow_slow_baseline,
                                     in_child=args.theirs_process == "child")
    bandwidth = copy_bandwidth(1, 5)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s; prompt {args.prompt}, {args.new} new tokens, bf16, "
          "greedy")
    check_streaming()
    if versus:
        print(versus.line)
    header = ("preset", "batch", "our SSM state", "step", "command buffers", "GEMMs",
              "prefill ours ms", "prefill theirs ms", "ms/step ours", "ms/step theirs",
              "ours/theirs", "tok/s ours", "tok/s theirs", "ours/theirs tok/s",
              "floor ms ours", "floor ms theirs", "ours/floor")
    print(table_header(header))
    steps, agreement = args.new - 1, []
    dtypes, implementations, settings = (args.ssm_state_dtypes.split(","),
                                         args.step_implementations.split(","),
                                         args.command_buffers.split(","))
    for preset in presets:
        cfg = Mamba2Config.preset(preset)
        model = Mamba2LM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
        # "auto" as generate resolves it (the rows name each layer's step: step_label)
        resolved = {impl: resolve_implementation(impl, model) for impl in implementations}
        why = not_run(cfg)
        for batch in (int(b) for b in args.batches.split(",")):
            if "triton" in resolved.values() and "M" in cfg.layers:  # Mamba2's kernels
                check_kernels(preset, cfg, batch, int8="int8" in dtypes)
            if "triton" in resolved.values() and "3" in cfg.layers:  # Mamba-3's
                check_mamba3_kernel(preset, cfg, batch, int8="int8" in dtypes)
            p_theirs = d_theirs = float("nan")  # a row's theirs where it did not run
            if why:
                ratio = baseline.Comparison("").ratio  # NaN, and no mamba_ssm to mark
                print(f"{preset}: mamba_ssm not run ({why})")
            else:
                if baseline.ssm_layer(cfg) == "Mamba3":
                    print(f"{preset}: mamba_ssm's Mamba3 decodes with its Triton step kernel "
                          "(mamba3_siso_step) in place of its CuTe-DSL step "
                          "(baseline.use_mamba3_triton_step)")
                ratio = versus.ratio
                try:
                    run = theirs_in_child if args.theirs_process == "child" else theirs
                    p_theirs, d_theirs = run(preset, batch, args.prompt, args.new, args.reps,
                                             args.baseline)
                except Exception:  # still print our rows; the table marks theirs as failed
                    traceback.print_exc()
            for dtype in dtypes:
                tokens = {}
                for impl, gemms in itertools.product(implementations, gemm_settings):
                    for graphs in settings:
                        p_ours, d_ours, tokens[impl, gemms, graphs] = ours(
                            model, batch, args.prompt, args.new, args.reps, dtype,
                            graphs == "on", resolved[impl], gemms)
                        label = step_label(model, batch, impl, dtype)
                        row = _row(cfg, preset, batch, dtype, label, graphs, gemms, p_ours,
                                   d_ours, p_theirs, d_theirs, args.prompt, steps, bandwidth,
                                   ratio)
                        print(table_row(row), flush=True)
                    if len({tokens[impl, gemms, g].tobytes() for g in settings}) > 1:
                        raise SystemExit(f"{preset} batch {batch} {dtype} {impl} {gemms}: the "
                                         "command-buffer settings generated different tokens")
                first = next(iter(tokens.values()))
                agreement += [f"{preset} batch {batch} {dtype} {' '.join(key)}: "
                              f"{np.mean(t == first):.3f} of the tokens equal the first row's"
                              for key, t in tokens.items()]
    print("\n".join(agreement))


def _theirs_not_run(cfg, copy) -> str:
    """Why mamba_ssm (its copy at `copy`) does not decode this preset here, or '' where it
    does."""
    if set(cfg.layers) == {"M"}:
        return ""
    if set(cfg.layers) == {"1"}:
        return ("its Mamba-1 prefill needs its selective_scan_cuda extension; "
                "bench.selective_scan times its Triton selective_state_update")
    if set(cfg.layers) == {"3"}:
        if cfg.mamba3.is_mimo:
            return ("its MIMO Mamba3 decodes only through its CuTe-DSL step (mamba3_step_fn: "
                    "nvidia-cutlass-dsl and quack), which does not install on the GPU machine")
        return baseline.lacks_mamba3(copy)
    return (f"its blocks cannot spell the layer pattern {cfg.layers}, and its attention "
            "decodes only with flash_attn")


def _row(cfg, preset, batch, dtype, impl, graphs, gemms, p_ours, d_ours, p_theirs, d_theirs,
         prompt, steps, bandwidth, ratio):
    """A table row; ratio(ours, theirs, spec) formats ours/theirs (baseline.Comparison)."""
    ms_ours, ms_theirs = 1e3 * d_ours / steps, 1e3 * d_theirs / steps
    tps_ours, tps_theirs = batch * steps / d_ours, batch * steps / d_theirs
    context = prompt + steps / 2  # the tokens an attention layer reads, on average
    # mamba_ssm's caches: Mamba2's SSM states in bf16, Mamba3's in float32
    theirs_state = 4 if baseline.ssm_layer(cfg) == "Mamba3" else 2
    floor_ours, floor_theirs = (1e3 * step_bytes(cfg, batch, size, context) / bandwidth
                                for size in (state_bytes(cfg, dtype), theirs_state))
    return (preset, batch, dtype, impl, graphs, gemms, f"{1e3 * p_ours:.1f}",
            f"{1e3 * p_theirs:.1f}", f"{ms_ours:.3f}", f"{ms_theirs:.3f}",
            ratio(ms_ours, ms_theirs, ".3f"),
            f"{tps_ours:.0f}", f"{tps_theirs:.0f}", ratio(tps_ours, tps_theirs, ".2f"),
            f"{floor_ours:.3f}", f"{floor_theirs:.3f}", f"{ms_ours / floor_ours:.2f}x")


if __name__ == "__main__":
    main()
