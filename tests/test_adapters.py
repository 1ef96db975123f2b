"""LoRA adapters and partial training (mamba_jax.adapters): every target of every layer kind
moves the output (also through the fused Mamba2 kernels), the merged model equals the
adapted one and PEFT's own forward, the base stays bit-identical while the adapters train,
meshes equal one device, a killed LoRA run resumes to the straight run's losses, and bad
input is one line.

Tolerances (float32): logits of the merged model within 1e-5 of the adapted one's (the
merged weight is the same float32 sum, added in another fusion); against PEFT's logits
within 1e-4 (torch sums the matmuls in another order, as the base fixtures' 1e-4); mesh
comparisons tests/mesh_check.py's.
"""

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import mamba_jax
from jax.sharding import NamedSharding, PartitionSpec as P
from mamba_jax import Mamba2LM, adapters, parallel
from mamba_jax.convert import flat_params
from mamba_jax.optim import make_optimizer, make_train_step
from mamba_jax.sharding import param_name
from mesh_check import (FAST_COMPILE, GRAD_ATOL, GRAD_RTOL, LOGIT_ATOL, LOSS_RTOL, SEQ,
                        model_and_batch, reference_loss, tiny_config)

FIXTURES = Path(__file__).parent / "fixtures"
# make_peft_fixtures.py's cases: (base fixture, targets)
PEFT_CASES = {"mamba2": ("hf_ngroups2_untied", ["in_proj"]),
              "nemotron_h": ("nemotron_h_hybrid", ["in_proj", "q_proj", "k_proj", "v_proj",
                                                   "o_proj", "up_proj", "down_proj"])}


def randomize_b(model, seed: int, scale: float = 0.1):
    """Every adapter's B factor drawn from N(0, scale^2) (they start at zero), in place."""
    key = jax.random.key(seed)
    for path, variable in nnx.iter_graph(model):
        if isinstance(variable, adapters.LoRA) and "B" in path:
            key, draw = jax.random.split(key)
            variable[...] = scale * jax.random.normal(draw, variable.shape)
    return model


def peft_case_model(case: str):
    """A base fixture with LoRA adapters (rank 4, alpha 8) whose B factors are random."""
    base, targets = PEFT_CASES[case]
    model = mamba_jax.from_pretrained(FIXTURES / base)
    return randomize_b(adapters.add_lora(model, 4, alpha=8, targets=targets, seed=0), 1)


def kind_model(symbol, rank=2, one_layer=False):
    """test_layer_kinds' model of `symbol` (pattern S M S S, or S alone) with adapters on
    every target, B zero: (model, its target names)."""
    from test_layer_kinds import kind_config

    cfg = kind_config(symbol)
    if one_layer:
        cfg = cfg.replace(n_layer=1, layer_pattern=symbol)
    model = Mamba2LM(cfg, rngs=nnx.Rngs(0))
    adapters.add_lora(model, rank)
    return model, adapters.target_names(model.config)


def set_target(model, target, seed):
    """Every layer's `target` adapter's B factors drawn from N(0, 1), every other B zero."""
    for block in model.layers:
        if (lora := adapters.lora_of(block)) is None:
            continue
        for name, adapter in lora.targets.items():
            for b in adapter.B.values():
                b[...] = jnp.zeros(b.shape) if name != target else \
                    jax.random.normal(jax.random.key(seed), b.shape)


@pytest.mark.parametrize("symbol", ["M", "*", "-", "1", "3"])
def test_an_adapter_on_every_target_of_every_kind_moves_the_output(symbol):
    # The base's logits at init (B zero; within 1e-6: the same float32 sums, compiled in
    # another program), then each target alone, with B random, moves them by more than 1e-4,
    # 100 times that (against PEFT's out_proj on Mamba, which the fused kernel bypassed).
    model, targets = kind_model(symbol)
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 100, (2, 16)), jnp.int32)
    logits = jax.jit(lambda state: nnx.merge(graphdef, state)(ids))
    base = Mamba2LM(model.config, rngs=nnx.Rngs(0))(ids)
    np.testing.assert_allclose(logits(state), base, rtol=0, atol=1e-6)
    kinds = {symbol, "M"}  # the pattern's kinds: every name of theirs is a target
    assert targets == sorted({n for s in kinds for n in adapters.kind_targets(
        s, adapters.layout(model.config))})
    for seed, target in enumerate(targets):
        set_target(model, target, seed)
        moved = float(jnp.abs(logits(nnx.state(model)) - base).max())
        assert moved > 1e-4, (target, moved)


def test_adapters_reach_the_fused_mamba2_kernels(monkeypatch):
    # The layer as pallas_kernels.mamba2_mixer (in Pallas's interpreter), which takes the
    # out-projection's weight itself: each adapter moves its output.
    from test_kernel_path import take_the_kernels

    calls = take_the_kernels(monkeypatch)
    model, targets = kind_model("M", one_layer=True)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 100, (1, 32)), jnp.int32)
    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda state: nnx.merge(graphdef, state)(ids))
    base = logits(state)
    assert calls and targets == ["in_proj", "out_proj"]
    for seed, target in enumerate(targets):
        set_target(model, target, seed)
        assert float(jnp.abs(logits(nnx.state(model)) - base).max()) > 1e-4, target


@pytest.mark.parametrize("case", sorted(PEFT_CASES))
def test_the_merged_model_and_peft_give_the_adapted_models_logits(case):
    # PEFT's forward of the adapter we export, on transformers' model of the base
    # (make_peft_fixtures.py), within 1e-4; our merged model's within 1e-5 of the adapted.
    base, _ = PEFT_CASES[case]
    model = peft_case_model(case)
    ids = jnp.asarray(np.load(FIXTURES / base / "input_ids.npy"))
    peft = np.load(FIXTURES / "peft_lora" / case / "logits.npy")
    adapted = np.asarray(model(ids))[..., :peft.shape[-1]]
    merged = np.asarray(adapters.merge(model)(ids))[..., :peft.shape[-1]]
    assert not any(isinstance(v, adapters.LoRA) for _, v in nnx.iter_graph(adapters.merge(model)))
    np.testing.assert_allclose(merged, adapted, rtol=0, atol=1e-5)
    np.testing.assert_allclose(adapted, peft, rtol=0, atol=1e-4)
    # what we write is what PEFT read, from the model as built and as the trainer holds it
    # (split and merged again: its adapters' parts then sorted by name)
    fixture = load_file(FIXTURES / "peft_lora" / case / "adapter_model.safetensors")
    for held in (model, nnx.merge(*nnx.split(model))):
        ours = adapters.peft_tensors(held)
        assert ours.keys() == fixture.keys()
        for key in ours:
            np.testing.assert_array_equal(ours[key], fixture[key], err_msg=key)


def lora_case(cfg, rank=2):
    """(graphdef, the adapters, the base) of a model of cfg with adapters on every target,
    their B factors random (so that A's gradients are not zero)."""
    model = randomize_b(adapters.add_lora(Mamba2LM(cfg, rngs=nnx.Rngs(0)), rank), 1)
    graphdef, state = nnx.split(model)
    return (graphdef, *adapters.Tuning(rank=rank).split(state))


def lora_loss_and_grads(cfg, spec=None, seq_len=SEQ):
    """(loss, the adapters' gradients) over packed documents, on one device (the model's
    logits and optax's cross-entropy) or the trainer's sharded loss on mesh `spec`."""
    graphdef, trainable, frozen = lora_case(cfg)
    *_, batch = model_and_batch(cfg, seq_len, packed=True)
    loss = reference_loss(graphdef)
    if spec is not None:
        mesh = parallel.make_mesh(spec)
        specs = parallel.param_specs(adapters.join(trainable, frozen), mesh)
        trainable, frozen = (jax.device_put(part, parallel.shardings(mesh, s)) for part, s in
                             zip((trainable, frozen), adapters.Tuning(rank=2).split(specs)))
        batch = jax.device_put(batch, NamedSharding(mesh, parallel.TOKENS))
        loss = parallel.make_loss_fn(graphdef, specs, mesh, sequence_parallel=True)
    step = jax.jit(jax.value_and_grad(adapters.joined(loss)), compiler_options=FAST_COMPILE)
    return step(trainable, frozen, *batch)


def test_adapters_on_a_mesh_give_one_devices_loss_and_gradients():
    # Every kind (Mamba2, attention, MLP, Mamba-1, Mamba-3) in one model, over packed
    # documents, under fsdp, cp and tp with sequence parallel at once: the base sharded as
    # without adapters, the adapters as the weights they adapt (tests/mesh_check.py's
    # tolerances).
    spec = "fsdp=2,cp=2,tp=2"
    from test_layer_kinds import SECTIONS

    cfg = tiny_config(n_layer=5, layer_pattern="M*-13", **SECTIONS)
    value, grads = lora_loss_and_grads(cfg, spec, seq_len=64)
    ref_value, ref_grads = lora_loss_and_grads(cfg, seq_len=64)
    # the Mamba2 layer's: A as the weight's inputs (d over fsdp), B as each part's outputs
    # (z's heads over tp); out_proj's A as its heads, its B as d
    lora = grads["layers"][0]["lora"]["targets"]
    assert lora["in_proj"]["A"][...].sharding.spec == P("fsdp", None)
    assert lora["in_proj"]["B"]["z_proj"][...].sharding.spec == P(None, "tp", None)
    assert lora["out_proj"]["A"][...].sharding.spec == P("tp", None, None)
    assert lora["out_proj"]["B"]["out_proj"][...].sharding.spec == P(None, "fsdp")
    np.testing.assert_allclose(value, ref_value, rtol=0, atol=LOGIT_ATOL)
    ref = dict(jax.tree_util.tree_leaves_with_path(ref_grads))
    assert len(ref) == len(jax.tree.leaves(grads)) > 5 * 2
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert np.abs(ref[path]).max() > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, ref[path], rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   err_msg=jax.tree_util.keystr(path))


def test_lora_steps_train_the_adapters_alone_and_leave_the_base_bit_identical():
    # The trainer's jitted step under fsdp and tp: the optimizer state holds the adapters'
    # moments alone, the base (passed beside them, not donated) keeps every bit.
    cfg = tiny_config()
    graphdef, trainable, frozen = lora_case(cfg)
    *_, (inputs, targets) = model_and_batch(cfg)
    mesh = parallel.make_mesh("fsdp=2,tp=2,dp=2")
    specs = parallel.param_specs(adapters.join(trainable, frozen), mesh)
    trained_specs, frozen_specs = adapters.Tuning(rank=2).split(specs)
    trainable = jax.device_put(jax.tree.map(jnp.copy, trainable),
                               parallel.shardings(mesh, trained_specs))
    frozen = jax.device_put(frozen, parallel.shardings(mesh, frozen_specs))
    before = (jax.tree.map(np.asarray, trainable), jax.tree.map(np.asarray, frozen))
    tx, _ = make_optimizer(trainable, 1e-2, 3, 1, 0.1, 1.0)
    opt_state = jax.jit(tx.init)(trainable)
    assert jax.tree.structure(opt_state[1][0].mu) == jax.tree.structure(trainable)
    step = make_train_step(adapters.joined(parallel.make_loss_fn(graphdef, specs, mesh)), tx)
    rows = NamedSharding(mesh, P(None, *parallel.TOKENS))
    batch = tuple(parallel.global_array(a[None], rows) for a in (inputs, targets))
    step = step.lower(trainable, opt_state, batch, frozen).compile(FAST_COMPILE)
    losses = []
    for _ in range(3):
        trainable, opt_state, loss, _ = step(trainable, opt_state, batch, frozen)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    base = dict(jax.tree_util.tree_leaves_with_path(before[1]))
    for path, value in jax.tree_util.tree_leaves_with_path(frozen):
        np.testing.assert_array_equal(value, base[path], err_msg=jax.tree_util.keystr(path))
    moved = [np.abs(np.asarray(a) - b).max() for a, b in zip(jax.tree.leaves(trainable),
                                                             jax.tree.leaves(before[0]))]
    assert min(moved) > 0


def saved_shapes(fn, *args) -> set[tuple]:
    """The shapes of what the backward pass of fn keeps that is not one of its arguments
    (jax.ad_checkpoint.print_saved_residuals' lines)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    return {tuple(int(n) for n in shape.split(",") if n)
            for shape, where in re.findall(r"\w+\[([\d,]*)\] (.*)", out.getvalue())
            if "from the argument" not in where}


@pytest.mark.parametrize("remat", ["none", "block"])
def test_the_merged_weights_are_recomputed_not_kept_for_the_backward_pass(remat):
    # Kept, every layer's W + A @ B (or its cast, its transpose, the kernel's saved copy)
    # would be held through the step: a copy of the model (model.remat_policy's tokens).
    from test_layer_kinds import SECTIONS

    cfg = tiny_config(n_layer=4, layer_pattern="M*-1", **SECTIONS)
    graphdef, trainable, frozen = lora_case(cfg)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 100, (2, 16)), jnp.int32)

    def loss(trainable, frozen):
        model = nnx.merge(graphdef, adapters.join(trainable, frozen))
        return model.loss(ids, ids, remat=remat, scan_layers=False).mean()
    weights = {tuple(v.shape) for v in jax.tree.leaves(frozen)
               if v.ndim >= 2 and v.shape[0] != cfg.padded_vocab_size}
    assert not saved_shapes(loss, trainable, frozen) & weights


# The trainer's runs: test_train_resume.py's tiny model (1 layer, d_model 64, 8 x 32)
SMALL = ["--batch-size", "8", "--seq-len", "32", "--set", "d_model=64", "--set", "n_layer=1",
         "--set", "headdim=16", "--set", "d_state=16", "--set", "chunk_size=16",
         "--eval-every", "1000", "--warmup", "2"]
LORA = ["--lora-rank", "2", "--lora-alpha", "4", "--base-dtype", "bfloat16", "--lr", "0.01"]


def losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """6 LoRA steps over a bfloat16 base in one go, checkpointing at 3 and 6, exporting the
    merged model: (losses, the run's folder)."""
    from mamba_jax.train import main

    tmp = tmp_path_factory.mktemp("lora")
    main([*SMALL, *LORA, "--steps", "6", "--save-every", "3", "--checkpoint-dir",
          str(tmp / "ck"), "--metrics-file", str(tmp / "m.jsonl"), "--out", str(tmp / "out")])
    return losses(tmp / "m.jsonl"), tmp


@pytest.mark.parametrize("mesh", [None, "fsdp=2,tp=2,dp=2"])
def test_a_lora_run_stopped_and_resumed_gives_the_straight_runs_losses_and_model(straight,
                                                                              tmp_path, mesh):
    # On its mesh, bit for bit; on another, the adapters and their moments restored onto
    # it, within float32 sums in another order (tests/mesh_check.py's LOSS_RTOL).
    from mamba_jax.train import main

    full, run = straight
    assert len(full) == 6 and np.all(np.isfinite(full)) and full[-1] < full[0]
    shutil.copytree(run / "ck", tmp_path / "ck")
    shutil.rmtree(tmp_path / "ck" / "6")  # as if the run had stopped after step 3
    main([*SMALL, *LORA, "--steps", "6", "--save-every", "3", "--checkpoint-dir",
          str(tmp_path / "ck"), "--resume", "--metrics-file", str(tmp_path / "m.jsonl"),
          "--out", str(tmp_path / "out"), *(["--mesh", mesh] if mesh else [])])
    if mesh:
        np.testing.assert_allclose(losses(tmp_path / "m.jsonl"), full[3:], rtol=LOSS_RTOL)
        return
    np.testing.assert_array_equal(losses(tmp_path / "m.jsonl"), full[3:])
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == \
        (run / "out" / "model.safetensors").read_bytes()


def test_a_lora_checkpoint_holds_the_adapters_and_the_base_identity_and_exports_merged(
        straight, tmp_path):
    # What a step saves: the adapters and their moments, none of the base; the run's record
    # names the base. `convert` rebuilds the base, merges, and writes --out's model.
    from mamba_jax.convert import main as convert

    _, run = straight
    saved = json.loads((run / "ck" / "6" / "state" / "_METADATA").read_text())
    arrays = [key for key in saved["tree_metadata"]  # the parameters and Adam's moments
              if any(f"'{part}'" in key for part in ("params", "mu", "nu"))]
    assert len(arrays) == 3 * 8  # in_proj's A and its B's 5 parts, out_proj's A and B
    assert all("'lora'" in key for key in arrays), arrays
    train = json.loads((run / "ck" / "train_config.json").read_text())["train"]
    assert train["base"]["path"] is None and len(train["base"]["hash"]) == 64
    assert train["lora_targets"] == ["in_proj", "out_proj"] and train["lora_alpha"] == 4.0
    convert([str(run / "ck"), str(tmp_path / "hf"), "--to", "hf"])
    out, converted = (load_file(d / "model.safetensors") for d in (run / "out", tmp_path / "hf"))
    assert out.keys() == converted.keys()
    for key in out:
        np.testing.assert_array_equal(converted[key], out[key], err_msg=key)
    # the merged model is no base: the adapters trained
    base = mamba_jax.Mamba2LM(mamba_jax.from_pretrained(run / "out").config, rngs=nnx.Rngs(0))
    moved = np.abs(out["backbone.layers.0.mixer.in_proj.weight"][:2] -
                   np.asarray(base.layers[0].mixer.z_proj[...]).reshape(64, -1).T[:2]).max()
    assert moved > 1e-3


def test_a_resume_that_trains_another_part_or_another_base_is_refused(straight, tmp_path,
                                                                     capsys):
    from mamba_jax.train import main

    _, run = straight
    for changed, said in ((["--lora-rank", "4"], "it trained --lora-rank 2 --lora-alpha 4.0 "
                           "--lora-targets in_proj out_proj, this run trains --lora-rank 4 "
                           "--lora-alpha 4.0 --lora-targets in_proj out_proj"),
                          (["--seed", "1"], "its base is initialised from the model config "
                           "and --seed")):
        shutil.rmtree(tmp_path / "ck", ignore_errors=True)
        shutil.copytree(run / "ck", tmp_path / "ck")
        with pytest.raises(SystemExit) as refused:
            main([*SMALL, *LORA, *changed, "--steps", "6", "--checkpoint-dir",
                  str(tmp_path / "ck"), "--resume", "--out", "none"])
        err = capsys.readouterr().err.splitlines()
        assert refused.value.code == 2 and len(err) == 1
        assert err[-1].startswith(f"python -m mamba_jax.train: checkpoint 6 in "
                                  f"{tmp_path / 'ck'}: {said}"), err[-1]


def test_train_only_trains_the_matching_parameters_over_a_bfloat16_base(tmp_path):
    # A_log and D train; every other parameter is the base's, its weights rounded to
    # bfloat16 (the norms, dt_bias and biases float32), bit for bit.
    from mamba_jax.train import main

    main([*SMALL, "--steps", "2", "--train-only", r"layers\.\d+\.mixer\.(A_log|D)",
          "--base-dtype", "bfloat16", "--lr", "0.1", "--out", str(tmp_path / "out")])
    model = mamba_jax.from_pretrained(tmp_path / "out")
    base = jax.jit(lambda: nnx.split(Mamba2LM(model.config, rngs=nnx.Rngs(0)))[1])()
    base = {param_name(path): v for path, v in jax.tree_util.tree_leaves_with_path(
        nnx.state(base, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable))}
    for name, value in flat_params(model).items():
        if name in ("layers.0.mixer.A_log", "layers.0.mixer.D"):
            assert np.abs(value - base[name][...]).max() > 1e-4, name
        else:
            rounded = base[name][...] if not base[name].get_metadata().get("decay", True) \
                else base[name][...].astype(jnp.bfloat16).astype(jnp.float32)
            np.testing.assert_array_equal(value, rounded, err_msg=name)


@pytest.mark.parametrize("flags,said", [
    (["--lora-rank", "0"], "--lora-rank 0 must be an integer >= 1 (the adapters' rank); leave "
                           "it out to train every parameter"),
    (["--lora-rank", "2", "--lora-targets", "in_proj", "qkv"],
     "--lora-targets qkv: this model (layers 'MM', named as its hf layout names them) has no "
     "such projection; its projections are in_proj out_proj"),
    (["--train-only", "A_log"], "--train-only 'A_log' matches none of the model's 36 "
                                "parameters (it must match a whole dotted name, such as"),
    (["--train-only", "("], "--train-only '(' is not a regular expression"),
    (["--lora-targets", "in_proj"], "--lora-targets shapes LoRA adapters: give --lora-rank R "
                                    "too"),
    (["--base-dtype", "bfloat16"], "--base-dtype bfloat16 stores the frozen base in it: give "
                                   "--lora-rank or --train-only"),
    (["--lora-rank", "2", "--export-adapter", "ADAPTER"],
     "--export-adapter: PEFT refuses LoRA on a Mamba layer's out_proj (the fused kernel reads "
     "its weight and bypasses the module, so the adapter would do nothing); train with "
     "--lora-targets in_proj for an adapter PEFT loads"),
    (["--train-only", ".*norm.*", "--export-adapter", "ADAPTER"],
     "--export-adapter writes LoRA adapters: give --lora-rank R"),
])
def test_bad_lora_input_is_one_line_naming_it(flags, said, tmp_path, capsys):
    from mamba_jax.train import main

    flags = [str(tmp_path / "adapter") if f == "ADAPTER" else f for f in flags]
    with pytest.raises(SystemExit) as refused:
        main(["--steps", "1", "--out", "none", *flags])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"python -m mamba_jax.train: {said}"), err
    assert not (tmp_path / "adapter").exists()
