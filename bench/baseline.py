"""mamba_ssm, the baseline, imported from a git-ignored copy of its Python (`--baseline`,
mamba_ssm v2.3.2.post1's package): never a dependency of mamba_jax.

Its __init__ is bypassed and the compiled `selective_scan_cuda` (Mamba1 only, never called
here) stubbed, so only its pure-Python Triton kernels and torch code run; without the
`causal_conv1d` package its Mamba2 takes its torch fallbacks for the conv.
"""

import os
import sys
import types


def _bypass_init(baseline):
    """Make `mamba_ssm` the package folder at `baseline`, its __init__ not run."""
    package = types.ModuleType("mamba_ssm")
    package.__path__ = [os.path.join(baseline, "mamba_ssm")]
    sys.modules["mamba_ssm"] = package


def import_mamba_chunk_scan(baseline):
    """mamba_ssm's mamba_chunk_scan_combined (its SSD Triton kernels) from the copy."""
    _bypass_init(baseline)
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    return mamba_chunk_scan_combined


def import_mamba_lm(baseline):
    """(MambaConfig, MambaLMHeadModel) from the copy at `baseline`."""
    _bypass_init(baseline)
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
    return MambaConfig, MambaLMHeadModel


def mamba_config(cfg, MambaConfig, **ssm_cfg):
    """Our Mamba2Config as mamba_ssm's MambaConfig (extra ssm_cfg entries passed through)."""
    return MambaConfig(d_model=cfg.d_model, n_layer=cfg.n_layer, vocab_size=cfg.vocab_size,
                       ssm_cfg={"layer": "Mamba2", "d_state": cfg.d_state,
                                "headdim": cfg.headdim, "ngroups": cfg.ngroups,
                                "chunk_size": cfg.chunk_size, **ssm_cfg},
                       rms_norm=True, residual_in_fp32=True, fused_add_norm=True,
                       pad_vocab_size_multiple=cfg.pad_vocab_size_multiple,
                       tie_embeddings=cfg.tie_embeddings)
