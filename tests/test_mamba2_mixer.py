"""pallas_kernels.mamba2_mixer (the Mamba2 mixer after its in-projection as one custom_vjp
on the kernels, reading zxbcdt in place and writing its gradient as one array) against the
same mixer composed of the XLA forms (the conv's, the chunked scan's, the gated norm's
reference, out_proj), differentiated by JAX: the output, the final state and the gradients
of zxbcdt, the conv's weight and bias, dt_bias, A_log, D, the norm's weight, out_proj and
the initial state, on fresh random inputs of odd lengths, with packed documents and an
initial state, 1 and 2 groups. The kernels run in Pallas's interpreter.

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

from pallas_kernels.conv import causal_conv1d
from pallas_kernels.mamba2_mixer import Shapes, mamba2_mixer
from pallas_kernels.norm import gated_rms_norm_reference
from pallas_kernels.ssd import document_ids, ssd

TOLERANCE = {"float32": 5e-5, "bfloat16": 3e-2}
NAMES = ("out", "final_state", "dzxbcdt", "dconv_w", "dconv_b", "ddt_bias", "dA_log", "dD",
         "dnorm_w", "dout_proj", "dinitial_state")


def composed(zxbcdt, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_proj, initial_state,
             seq_idx, s):
    hp, e = s.h * s.p, sum(s.parts)
    b, l = zxbcdt.shape[:2]
    doc = None if seq_idx is None else document_ids(seq_idx)
    x, B, C = causal_conv1d(zxbcdt[..., hp:hp + e], conv_w, conv_b, doc, parts=s.parts,
                            implementation="xla")
    y, final_state = ssd(x.reshape(b, l, s.h, s.p), zxbcdt[..., hp + e:].astype(jnp.float32),
                         -jnp.exp(A_log), B.reshape(b, l, s.g, s.n), C.reshape(b, l, s.g, s.n),
                         chunk_size=s.chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True,
                         dt_limit=s.dt_limit, initial_state=initial_state, seq_idx=seq_idx,
                         return_final_state=True, implementation="xla")
    normed = gated_rms_norm_reference(y, zxbcdt[..., :hp].reshape(y.shape), norm_w, s.eps,
                                      s.norm_groups)
    out = jnp.einsum("blhp,hpd->bld", normed, out_proj.astype(s.dtype),
                     preferred_element_type=jnp.dtype(s.out_dtype))
    return out, final_state


CASES = {  # name: (b, l, h, p, g, n, documents, initial state, conv bias)
    "documents_initial_state": (2, 53, 4, 16, 1, 16, True, True, True),
    "two_groups": (1, 37, 8, 16, 2, 16, False, False, False),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_the_mixer_on_the_kernels_matches_its_composed_form(case, dtype):
    b, l, h, p, g, n, documents, initial, bias = CASES[case]
    s = Shapes(h=h, p=p, g=g, n=n, chunk_size=16, dt_limit=(0.0, float("inf")), eps=1e-5,
               norm_groups=g, dtype=dtype, out_dtype=dtype)
    e, d = h * p + 2 * g * n, 32
    seed = np.random.SeedSequence().entropy % 2**31
    keys = jax.random.split(jax.random.PRNGKey(seed), 12)
    args = (jax.random.normal(keys[0], (b, l, h * p + e + h)).astype(dtype),
            jax.random.normal(keys[1], (4, e)) * 0.5,
            jax.random.normal(keys[2], (e,)) * 0.5 if bias else None,
            jax.random.normal(keys[3], (h,)) * 0.5 - 2,
            jnp.log(jax.random.uniform(keys[4], (h,), minval=1, maxval=8)),
            jax.random.normal(keys[5], (h,)),
            1 + 0.1 * jax.random.normal(keys[6], (h, p)),
            jax.random.normal(keys[7], (h, p, d)) / (h * p) ** 0.5,
            jax.random.normal(keys[8], (b, h, p, n)) * 0.3 if initial else None)
    seq_idx = (jnp.cumsum(jax.random.uniform(keys[9], (b, l)) < 0.08, axis=1).astype(jnp.int32)
               if documents else None)
    cotangents = (jax.random.normal(keys[10], (b, l, d)).astype(dtype),
                  jax.random.normal(keys[11], (b, h, p, n)))

    @functools.partial(jax.jit, static_argnums=0)  # one compile, not one per operation
    def values_and_gradients(f, args, cotangents):
        outs, vjp = jax.vjp(lambda *a: f(*a, seq_idx, s), *args)
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
        assert error < TOLERANCE[dtype], f"{name}: {error:.1e} (seed {seed})"
