"""pallas_kernels.mamba2_mixer (the Mamba2 mixer after its in-projection as one custom_vjp
on the kernels, reading zxbcdt in place and writing its gradient as one array) against the
same mixer composed of the XLA forms (the conv's, the chunked scan's, the gated norm's
reference, out_proj), differentiated by JAX: the output, the final state and the gradients
of zxbcdt, the conv's weight and bias, dt_bias, A_log, D, the norm's weight, out_proj and
the initial state and the conv's inputs before the first token, on fresh random inputs of odd
lengths, with packed documents, an initial state and a conv window before the first token
(the conv's kernel reads them as an operand of their own), 1 and 2 groups, D per head and per
head channel (mamba_ssm's D_has_hdim), and a tensor-parallel rank's heads reading one or
several of the groups in B and C (head_groups). The kernels run in Pallas's interpreter.

Tolerances (the largest difference over the largest value): float32 5e-5 (dA_log and
dt_bias sum every token's terms, in another order than XLA's: seen up to 1.3e-5 over 40
seeds, the rest below 2e-6);
bfloat16 inputs 3e-2 (the kernels round y, x, B, C and the gradients to bf16 at other points
than XLA's fusions; seen ~8e-3).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fp8
from pallas_kernels.conv import causal_conv1d
from pallas_kernels.mamba2_mixer import Shapes, mamba2_mixer
from pallas_kernels.norm import gated_rms_norm_reference
from pallas_kernels.ssd import document_ids, ssd

TOLERANCE = {"float32": 5e-5, "bfloat16": 3e-2}
NAMES = ("out", "final_state", "dzxbcdt", "dconv_w", "dconv_b", "ddt_bias", "dA_log", "dD",
         "dnorm_w", "dout_proj", "dinitial_state", "dconv_before")


def composed(zxbcdt, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_proj, initial_state,
             conv_before, seq_idx, head_groups, s):
    hp, e = s.h * s.p, sum(s.parts)
    b, l = zxbcdt.shape[:2]
    doc = None if seq_idx is None else document_ids(seq_idx)
    xBC = zxbcdt[..., hp:hp + e]
    if conv_before is not None:
        xBC = jnp.concatenate([conv_before, xBC], axis=1)
    x, B, C = causal_conv1d(xBC, conv_w, conv_b, doc, length=l, parts=s.parts,
                            implementation="xla")
    B, C = (t.reshape(b, l, s.g, s.n) for t in (B, C))
    if head_groups is not None:
        B, C = (jnp.take(t, head_groups, axis=2) for t in (B, C))
    y, final_state = ssd(x.reshape(b, l, s.h, s.p), zxbcdt[..., hp + e:].astype(jnp.float32),
                         -jnp.exp(A_log), B, C, chunk_size=s.chunk_size, D=D, dt_bias=dt_bias,
                         dt_softplus=True, dt_limit=s.dt_limit, initial_state=initial_state,
                         seq_idx=None if seq_idx is None else seq_idx[:, -l:],
                         return_final_state=True, implementation="xla")
    normed = gated_rms_norm_reference(y, zxbcdt[..., :hp].reshape(y.shape), norm_w, s.eps,
                                      s.norm_groups)
    if s.fp8 is None:
        out = jnp.einsum("blhp,hpd->bld", normed, out_proj.astype(s.dtype),
                         preferred_element_type=jnp.dtype(s.out_dtype))
    else:
        out = fp8.matmul("blhp,hpd->bld", normed, out_proj, s.dtype, s.out_dtype, s.fp8)
    return out, final_state


CASES = {  # name: (b, l, h, p, g, n, documents, initial state, conv bias, D per channel,
    #               a conv window before the first token, head_groups)
    "documents_initial_state": (2, 53, 4, 16, 1, 16, True, True, True, False, False, None),
    "two_groups": (1, 37, 8, 16, 2, 16, False, False, False, False, False, None),
    # a continued sequence, documents starting inside the window before the first token; D
    # [h, p]; a tp rank's 4 heads of 3 groups' B and C, which read groups 1, 1, 2, 2
    "window_before_D_per_channel_head_groups": (2, 29, 4, 16, 3, 16, True, True, True, True,
                                                True, (1, 1, 2, 2)),
}
# bf16 changes only where values are rounded, the same points on every case's path: it runs
# on the first case alone
RUNS = [(case, dtype) for case in CASES for dtype in ("float32", "bfloat16")
        if dtype == "float32" or case == "documents_initial_state"]


@pytest.mark.parametrize("case,dtype", RUNS, ids=[f"{c}-{d}" for c, d in RUNS])
def test_the_mixer_on_the_kernels_matches_its_composed_form(case, dtype):
    compare(case, dtype, np.random.SeedSequence().entropy % 2**31, TOLERANCE[dtype])


def test_the_mixer_on_the_kernels_with_fp8_out_proj_matches_its_composed_form():
    # out_proj's matmuls in FP8 (Shapes.fp8): the kernels' custom_vjp against the composed
    # form through pallas_kernels.fp8.matmul. A fixed seed: the norm's output from the
    # kernel and from the reference differ in float32's last bits, which can move a value
    # across an FP8 rounding boundary (one E4M3 step, 1/8 of it) on another draw.
    compare("documents_initial_state", "float32", 0, TOLERANCE["float32"], fp8=())


def compare(case, dtype, seed, tolerance, fp8=None):
    """The mixer on the kernels against its composed form: outputs and gradients within
    tolerance of the largest value, on inputs drawn from seed."""
    (b, l, h, p, g, n, documents, initial, bias, D_per_channel, before,
     head_groups) = CASES[case]
    s = Shapes(h=h, p=p, g=g, n=n, chunk_size=16, dt_limit=(0.0, float("inf")), eps=1e-5,
               norm_groups=g if head_groups is None else 1, dtype=dtype, out_dtype=dtype,
               fp8=fp8)
    e, d, k = h * p + 2 * g * n, 32, 4
    keys = jax.random.split(jax.random.PRNGKey(seed), 13)
    rows = l + (k - 1 if before else 0)  # the conv's inputs, those before the first first
    args = (jax.random.normal(keys[0], (b, l, h * p + e + h)).astype(dtype),
            jax.random.normal(keys[1], (k, e)) * 0.5,
            jax.random.normal(keys[2], (e,)) * 0.5 if bias else None,
            jax.random.normal(keys[3], (h,)) * 0.5 - 2,
            jnp.log(jax.random.uniform(keys[4], (h,), minval=1, maxval=8)),
            jax.random.normal(keys[5], (h, p) if D_per_channel else (h,)),
            1 + 0.1 * jax.random.normal(keys[6], (h, p)),
            jax.random.normal(keys[7], (h, p, d)) / (h * p) ** 0.5,
            jax.random.normal(keys[8], (b, h, p, n)) * 0.3 if initial else None,
            jax.random.normal(keys[12], (b, k - 1, e)).astype(dtype) if before else None)
    seq_idx = None
    if documents:  # a document starts inside the window before the first token too
        starts = (jax.random.uniform(keys[9], (b, rows)) < 0.08).at[:, 1].set(True)
        seq_idx = jnp.cumsum(starts, axis=1).astype(jnp.int32)
    head_groups = None if head_groups is None else jnp.asarray(head_groups, jnp.int32)
    cotangents = (jax.random.normal(keys[10], (b, l, d)).astype(dtype),
                  jax.random.normal(keys[11], (b, h, p, n)))

    @functools.partial(jax.jit, static_argnums=0)  # one compile, not one per operation
    def values_and_gradients(f, args, cotangents):
        outs, vjp = jax.vjp(lambda *a: f(*a, seq_idx, head_groups, s), *args)
        return outs + vjp(cotangents)
    ours = values_and_gradients(mamba2_mixer, args, cotangents)
    theirs = values_and_gradients(composed, args, cotangents)
    for name, o, t in zip(NAMES, ours, theirs):
        if t is None:
            assert o is None, name
            continue
        o, t = np.asarray(o, np.float64), np.asarray(t, np.float64)
        assert o.shape == t.shape, name
        error = np.abs(o - t).max() / np.abs(t).max()
        assert error < tolerance, f"{name}: {error:.1e} (seed {seed})"
