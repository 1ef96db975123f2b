import json

import jax
import numpy as np
import pytest
from flax import nnx

import mamba_jax
from mamba_jax import Mamba2Config, Mamba2LM
from mamba_jax.data import byte_tokenizer, load_tokenizer
from mamba_jax.model import param_name
from mamba_jax.train import main, parse_overrides, weight_decay_mask


def test_default_run_trains_tiny_with_a_falling_loss_and_saves_a_checkpoint(tmp_path):
    metrics = tmp_path / "m.jsonl"
    main(["--steps", "60", "--batch-size", "8", "--seq-len", "64", "--warmup", "10",
          "--eval-every", "30", "--metrics-file", str(metrics), "--out", str(tmp_path / "ck")])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 61))
    losses = [r["loss"] for r in records]
    assert np.all(np.isfinite(losses))
    # Bytes start near ln(256) = 5.5 nats; 60 steps on English text get well below 3.
    assert losses[0] > 4.5 and np.mean(losses[-10:]) < 3.0
    assert "eval_loss" in records[29] and "eval_loss" in records[-1]
    model = mamba_jax.from_pretrained(tmp_path / "ck")
    assert model.config.vocab_size == 256 and model.config.n_layer == 2
    tok = load_tokenizer(tmp_path / "ck" / "tokenizer.json")
    assert tok.encode("GNU").ids == list(b"GNU")


def test_set_overrides_config_fields(tmp_path):
    assert parse_overrides(["ngroups=2", "dt_limit=0.001,0.2", "tie_embeddings=false",
                            "norm_eps=1e-6"]) == {"ngroups": 2, "dt_limit": (0.001, 0.2),
                                                  "tie_embeddings": False, "norm_eps": 1e-6}
    main(["--steps", "2", "--batch-size", "8", "--seq-len", "32", "--set", "ngroups=2",
          "--set", "tie_embeddings=false", "--out", str(tmp_path)])
    assert mamba_jax.from_pretrained(tmp_path).config.ngroups == 2


@pytest.mark.parametrize("arg,match", [("nope=1", "FIELD=VALUE with FIELD one of"),
                                       ("ngroups=two", "'two' is not a valid int for ngroups"),
                                       ("bias=maybe", "not a valid bool")])
def test_bad_overrides_are_named(arg, match):
    with pytest.raises(SystemExit, match=match):
        parse_overrides([arg])


def test_missing_data_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        main(["--data", str(tmp_path / "absent.txt"), "--steps", "1"])


def test_no_weight_decay_on_A_log_D_dt_bias_norms_and_biases():
    cfg = Mamba2Config.preset("tiny", bias=True, tie_embeddings=False)
    _, params = nnx.split(Mamba2LM(cfg, rngs=nnx.Rngs(0)))
    mask = {param_name(p): v for p, v in
            jax.tree_util.tree_leaves_with_path(weight_decay_mask(params))}
    decayed = {name.replace("layers.0.", "") for name, v in mask.items()
               if v and not name.startswith("layers.1.")}
    assert decayed == {"embedding", "lm_head", "mixer.z_proj", "mixer.x_proj", "mixer.B_proj",
                       "mixer.C_proj", "mixer.dt_proj", "mixer.x_conv", "mixer.B_conv",
                       "mixer.C_conv", "mixer.out_proj"}


def test_byte_tokenizer_round_trips_any_text():
    tok = byte_tokenizer()
    text = "naïve — 数据\n\tend "
    assert tok.encode(text).ids == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text).ids) == text
