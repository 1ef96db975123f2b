"""Megatron-LM checkpoints (tests/fixtures/megatron_hybrid, made by
make_megatron_checkpoint_fixtures.py without mamba_jax: a tiny NemotronH hybrid, split over
two tensor-parallel ranks by Megatron's own hybrid_conversion.py) read here give
transformers' logits; ours split the same way; a model of ours goes to Megatron's layout at
TP 1, 2 and 4 (and two pipeline stages) and back equal. CI has no torch: these read the
fixtures' safetensors copies of the .pt and .distcp files through the same reader
(megatron_files.Legacy, TorchDist); the containers themselves are read by hand where torch
is (docs/megatron.md)."""

import json
import shutil
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from mamba_jax import Mamba2Config, Mamba2LM, from_pretrained, megatron
from mamba_jax.cli import MissingDependency
from mamba_jax.convert import flat_params, main, model_from_params, torch_to_params
from mamba_jax.megatron import checkpoint_tensors, megatron_args, rank_state_dicts
from mamba_jax.files import holds_model
from mamba_jax.megatron_files import TRACKER, Legacy, TorchDist, is_megatron_checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "megatron_hybrid"


def _safetensors(name) -> dict:
    """A fixture's bfloat16 safetensors as float32 numpy (each value exact)."""
    with safe_open(FIXTURE / name, framework="flax") as f:
        return {key: np.asarray(f.get_tensor(key).astype(jnp.float32)) for key in f.keys()}


@pytest.fixture(scope="module")
def megatron_ranks():
    tensors = _safetensors("legacy_tp2_ranks.safetensors")
    return [{key.partition("/")[2]: value for key, value in tensors.items()
             if key.startswith(f"rank{r}/")} for r in range(2)]


@pytest.fixture(scope="module")
def saved_args():
    return json.loads((FIXTURE / "legacy_args.json").read_text())


@pytest.fixture(scope="module")
def nemotron():
    return from_pretrained(FIXTURE / "nemotron_h")


def _read(files, overrides=None):
    cfg, tensors = checkpoint_tensors(files, overrides)
    return cfg, torch_to_params(tensors, cfg, "megatron")


def test_megatrons_tp2_split_gives_transformers_logits(megatron_ranks, saved_args, nemotron):
    # The arguments give the model (GQA 4 over 2, Mamba heads 4 of 8 = d_model, not
    # 2 * d_model, relu2, untied); its ranks merge into the NemotronH model's exact weights,
    # whose float32 forward is transformers' within 1e-4 of the largest logit.
    cfg, params = _read(Legacy([megatron_ranks], saved_args))
    assert (cfg.layers, cfg.attention.num_heads_kv, cfg.mamba2.nheads, cfg.mlp.activation,
            cfg.tie_embeddings) == ("M*-M-", 2, 4, "relu2", False)
    ours = flat_params(nemotron)
    assert params.keys() == ours.keys()
    for name in ours:
        np.testing.assert_array_equal(params[name], ours[name], err_msg=name)
    ids = np.load(FIXTURE / "nemotron_h" / "input_ids.npy")
    expected = np.load(FIXTURE / "nemotron_h" / "logits.npy")
    logits = np.asarray(model_from_params(cfg, params)(jnp.asarray(ids)))
    assert np.abs(logits - expected).max() < 1e-4 * np.abs(expected).max()


def test_torch_dist_components_give_the_same_weights(megatron_ranks, saved_args):
    # in_proj as .z .x .B .C .dt and the conv as .x .B .C, joined; an optimizer's tensor
    # beside is not the model's.
    tensors = _safetensors("torch_dist_tensors.safetensors")
    sizes = {key: value.shape for key, value in tensors.items()}
    sizes["optimizer.state.exp_avg.decoder.final_norm.weight"] = (32,)
    files = TorchDist(sizes, {**saved_args, "tensor_model_parallel_size": 1},
                      lambda names: [tensors[name] for name in names])
    assert "decoder.layers.0.mixer.in_proj.weight" in files.names()
    _, params = _read(files)
    _, expected = _read(Legacy([megatron_ranks], saved_args))
    for name in expected:
        np.testing.assert_array_equal(params[name], expected[name], err_msg=name)


def test_our_tp2_ranks_are_megatrons_split(megatron_ranks, saved_args, nemotron):
    # Megatron's hybrid_conversion.py cut the fixture (in_proj's z, x, B, C, dt each over the
    # ranks, linear_qkv a KV group each, out_proj by columns); ours, with core 0.19's conv
    # names, is the same tensor for tensor.
    ranks = rank_state_dicts(flat_params(nemotron), nemotron.config, 2, "0.19")
    for ours, theirs in zip(ranks, megatron_ranks):
        assert ours.keys() == theirs.keys()
        for key in ours:
            np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


HYBRID = Mamba2Config(
    d_model=32, n_layer=4, layer_pattern="M*-M", vocab_size=60, pad_vocab_size_multiple=32,
    tie_embeddings=True, mamba2=dict(d_state=8, headdim=8, ngroups=4, chunk_size=16),
    attention=dict(num_heads=4, num_heads_kv=2, head_dim=8, rotary_emb_dim=4,
                   qkv_bias=True, out_bias=False),
    mlp=dict(d_intermediate=48, activation="swiglu"))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_ours_to_megatron_and_back_is_equal(tp):
    # SwiGLU ([gate_r | up_r] a rank), rotary, a qkv bias, fewer KV heads than ranks at 4
    # (Megatron then cuts a group over two ranks), a tied head; through the arguments saved.
    # At tp 2, two pipeline stages too: their files number their layers from 0.
    params = flat_params(Mamba2LM(HYBRID, rngs=nnx.Rngs(tp)))
    ranks = rank_state_dicts(params, HYBRID, tp, "0.8")
    args = megatron_args(HYBRID, tp, iteration=0)
    stages = [ranks]
    if tp == 2:
        def stage(rank, layers, keep):
            return {(key.replace(f"layers.{layers[0] + i}.", f"layers.{i}.", 1)
                     if f"layers.{layers[0] + i}." in key else key): value
                    for i in range(len(layers)) for key, value in rank.items()
                    if f"layers.{layers[0] + i}." in key or key in keep}
        stages = [[stage(r, [0, 1], {"embedding.word_embeddings.weight"}) for r in ranks],
                  [stage(r, [2, 3], {"decoder.final_norm.weight"}) for r in ranks]]
    cfg, back = _read(Legacy(stages, args))
    assert (cfg.layers, cfg.padded_vocab_size, cfg.mlp.activation, cfg.tie_embeddings,
            cfg.attention.rotary_emb_dim) == ("M*-M", 64, "swiglu", True, 4)
    assert back.keys() == params.keys()
    for name in params:
        np.testing.assert_array_equal(back[name], params[name], err_msg=name)


def test_without_saved_arguments_set_names_what_is_missing(megatron_ranks, saved_args):
    files = Legacy([megatron_ranks], None)
    with pytest.raises(ValueError, match=r"no saved arguments, and --set lacks "
                                         r"mamba2\.d_state, mamba2\.headdim, mamba2\.ngroups, "
                                         r"attention\.num_heads, .* for the layers 'M\*-M-'"):
        checkpoint_tensors(files, {"layer_pattern": "M*-M-"})
    given = {"layer_pattern": "M*-M-", "mamba2.d_state": 8, "mamba2.headdim": 8,
             "mamba2.ngroups": 2, "mamba2.nheads": 4, "attention.num_heads": 4,
             "attention.num_heads_kv": 2, "attention.head_dim": 8,
             "mlp.d_intermediate": 48, "mlp.activation": "relu2"}
    _, params = _read(files, given)
    _, expected = _read(Legacy([megatron_ranks], saved_args))
    for name in expected:
        np.testing.assert_array_equal(params[name], expected[name], err_msg=name)


@pytest.mark.parametrize("change,match", [
    (dict(hybrid_layer_pattern="M*E-"), r"layers we have no kind for: E \(MoE\)"),
    (dict(normalization="LayerNorm"), r"normalization='LayerNorm' is not supported"),
    (dict(add_bias_linear=True), r"add_bias_linear=True gives the MLP layers biases"),
])
def test_what_megatron_has_and_we_lack_is_refused(megatron_ranks, saved_args, change, match):
    with pytest.raises(ValueError, match=match):
        checkpoint_tensors(Legacy([megatron_ranks], {**saved_args, **change}))


def test_a_tp_size_megatron_cannot_split_is_refused():
    with pytest.raises(ValueError, match=r"--target-tp-size 8 does not divide mamba2.ngroups=4, "
                                         r".*sizes that work: \[1, 2, 4\]"):
        rank_state_dicts(flat_params(Mamba2LM(HYBRID, rngs=nnx.Rngs(0))), HYBRID, 8)
    # One KV head over 3 ranks: Megatron splits linear_qkv's (6 + 2) * 8 rows evenly, which
    # 3 does not divide (it was a numpy traceback, "array split does not result in an equal
    # division")
    mqa = HYBRID.replace(d_model=48, layer_pattern="*", n_layer=1, pad_vocab_size_multiple=48,
                         attention=dict(num_heads=6, num_heads_kv=1, head_dim=8,
                                        rotary_emb_dim=4))
    with pytest.raises(ValueError, match=r"--target-tp-size 3 does not divide linear_qkv's 64 "
                                         r"rows .* sizes that work: \[1, 2\]"):
        rank_state_dicts(flat_params(Mamba2LM(mqa, rngs=nnx.Rngs(0))), mqa, 3)


def test_megatron_files_without_torch_are_one_line_naming_the_extra(tmp_path, monkeypatch,
                                                                    capsys):
    # (CI has no torch; where it is installed, the import is made to fail.)
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(MissingDependency, match=r"needs torch, which is not installed: "
                                                r"pip install 'mamba-jax\[megatron\]'$"):
        from_pretrained(FIXTURE / "legacy_tp2")
    for src, to in ((FIXTURE / "torch_dist", "hf"), (FIXTURE / "nemotron_h", "megatron")):
        with pytest.raises(SystemExit):
            main([str(src), str(tmp_path / to), "--to", to])
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "pip install 'mamba-jax[megatron]'" in err, err


def test_set_is_refused_for_a_checkpoint_with_a_config_json():
    with pytest.raises(ValueError, match=r"its config.json gives the model's config; config "
                                         r"fields \(mamba2.chunk_size\) are taken for a "
                                         r"Megatron-LM checkpoint only"):
        from_pretrained(FIXTURE / "nemotron_h", overrides={"mamba2.chunk_size": 8})


def test_a_megatron_checkpoint_written_over_a_model_removes_that_model(tmp_path, monkeypatch,
                                                                       capsys):
    """convert --to megatron --overwrite into a folder holding a model removes the model's
    config.json and weights, which from_pretrained read before the checkpoint beside them
    (the conversion's output read back as the replaced model). CI has no torch: the writer
    is a stand-in laying out a checkpoint's folders."""
    def write(model, path, tp, keys):
        folder = Path(path) / "iter_0000000"
        (folder / "mp_rank_00").mkdir(parents=True)
        (Path(path) / TRACKER).write_text("0\n")
        return folder

    monkeypatch.setattr(megatron, "save_megatron", write)
    dst = tmp_path / "dst"
    shutil.copytree(FIXTURE / "nemotron_h", dst)
    main([str(FIXTURE / "nemotron_h"), str(dst), "--to", "megatron", "--overwrite"])
    assert is_megatron_checkpoint(dst) and not holds_model(dst)
    assert capsys.readouterr().out.splitlines()[-1] == \
        "removed the replaced model's config.json, model.safetensors"
