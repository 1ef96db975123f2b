"""Where a run's weights come from: the trainer's `--init-from DIR` (the model's config,
weights and tokenizer), the frozen base of a run that trains a part of the model (LoRA,
--train-only), rebuilt for a resume or a loader, and a trainer's checkpoint read as a model.

    source = InitSource.open("models/mamba2-130m")       # or runs/x/ckpt, or runs/x/ckpt/500
    cfg = source.config_for({"mamba2.chunk_size": 128})  # what changes a shape is refused
    params = source.load(abstract_params, param_shardings)  # each tensor onto its shard
    init_identity("models/mamba2-130m")                  # what a run records of its source
    model, meta = load_training_checkpoint("runs/x/ckpt")   # a step as a model (generate,
                                                             # serve, convert)

DIR is a folder `from_pretrained` reads (transformers' Mamba2, Mamba, FalconMamba or
NemotronH, mamba_ssm's MambaLMHeadModel of Mamba2, Mamba-1 or Mamba-3 layers, with attention
and MLP layers or without, or a Megatron-LM checkpoint, legacy at any tensor-parallel size or
torch_dist, whose saved arguments or --set give the config), a trainer's --checkpoint-dir
(its newest complete step) or one step folder of it (runs/x/ckpt/500). The weights go onto
the mesh as they are read, each in the dtype the run stores it in (a bfloat16 base is never
placed in float32 first): a model folder's tensor by tensor (mamba_jax.convert.place_params),
a trainer's checkpoint by Orbax straight into this run's shardings; the optimizer starts
fresh.

A run that trains a part of the model records its base's identity, {"path": the folder it
was read from, "hash": init_identity of it} (or, for a base initialised from the config,
adapters.identity), and its checkpoints hold only what trains: the base is read from that
folder again (a resume, load_training_checkpoint, a later --init-from of the checkpoints,
which reads them as the merged model), and refused where it changed or is gone.

What a folder cannot give is a ValueError or FileNotFoundError naming it; what the trainer's
flags ask that it cannot is a SystemExit naming the flag (one line each, mamba_jax.cli).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from mamba_jax import adapters, megatron, megatron_files, parallel
from mamba_jax.checkpoint import Checkpointer, abstract_like
from mamba_jax.config import SECTIONS, Mamba2Config
from mamba_jax.convert import (check_exportable, first_device, is_training_checkpoint,
                               load_config, param_shapes, param_tensors, place_params,
                               training_tokenizer)
from mamba_jax.data import dataset_meta, dataset_tokenizer, parse_blend
from mamba_jax.files import holds_model, holds_steps
from mamba_jax.model import Mamba2LM
from mamba_jax.tensors import INDEX, open_tensors, weight_files
from mamba_jax.tokenizer import find_tokenizer, load_tokenizer

# init_identity reads this many blocks of this many bytes, evenly spaced, of each weight file
_SAMPLES, _SAMPLE_BYTES = 64, 4096


# A Hugging Face hub id (org/name), as transformers 4 recorded it in config.json's
# _name_or_path, and the hub cache's folder of a downloaded snapshot
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_HUB_CACHE = re.compile(r"models--([^/]+)--([^/]+)/snapshots/[^/]+")


@dataclasses.dataclass(frozen=True)
class InitSource:
    """What --init-from DIR names: `path` (absolute), the model's `config`, the `layout`
    of a model folder ("hf", "mamba_ssm", "nemotron_h", "megatron"; None for a trainer's
    checkpoint), a trainer's `checkpoints` dir and the `step` read there (None for a model
    folder), and `tokenizer`, the folder's as load_tokenizer takes it (None where a model
    folder holds none)."""

    path: Path
    config: Mamba2Config
    layout: str | None
    checkpoints: Path | None
    step: int | None
    tokenizer: str | None

    @classmethod
    def open(cls, path, overrides: dict | None = None,
             config: Mamba2Config | None = None) -> "InitSource":
        """The source at `path` (locate's checks first). overrides: a Megatron-LM
        checkpoint's config fields (the trainer's --set), over its saved arguments or in
        their place (mamba_jax.megatron; a field its layers need that neither gives is named);
        config: read it as a model of this config (a run's, whose base it is) instead."""
        path, checkpoints, step = locate(path)
        if checkpoints is None:
            if megatron_files.is_megatron_checkpoint(path):
                layout = "megatron"
                if config is None:
                    config = megatron.read_megatron(path, overrides)[0]
            else:
                found, layout = load_config(path)
                config = config or found
            found = find_tokenizer(path)
            return cls(path, config, layout, None, None, None if found is None else str(found))
        ckpt = Checkpointer(checkpoints, read_only=True)
        try:
            meta = ckpt.read_meta(step)
        finally:
            ckpt.close()
        found = Mamba2Config.from_dict(meta["config"]["model"])
        flags = meta["config"]["train"]
        if adapters.Tuning.of(flags):  # its base must still be there: refused now, not later
            base_source(flags, found, f"{path} (step {step})")
        return cls(path, config or found, None, checkpoints, step,
                   training_tokenizer(checkpoints, meta))

    @property
    def folder(self) -> Path:
        """What is read: the model folder, or the trainer's step folder."""
        return self.path if self.step is None else self.checkpoints / str(self.step)

    @functools.cached_property
    def identity(self) -> str:
        """init_identity of what is read."""
        return init_identity(self.folder)

    def config_for(self, overrides: dict, tokenizer=None) -> Mamba2Config:
        """The folder's config with the trainer's model overrides (--set, a recipe's [model],
        Megatron's layer flags), each of which must leave every parameter's shape and the
        layers as they are: the weights come from the folder. A tokenizer with more tokens
        than the model's vocabulary is refused."""
        flat = {}
        for name, value in overrides.items():  # a recipe's section tables by their fields
            flat.update({f"{name}.{k}": v for k, v in value.items()} if name in SECTIONS
                        and isinstance(value, dict) else {name: value})
        base = self.config
        try:
            cfg = base.replace(**flat)
        except (TypeError, ValueError) as error:
            raise SystemExit(f"--init-from {self.path}: {error}") from None
        if flat and (cfg.layers != base.layers or param_shapes(cfg) != param_shapes(base)):
            shaped = param_shapes(base)
            for name, value in flat.items():
                try:  # (a field that needs another to go with it changes the layers too)
                    one = base.replace(**{name: value})
                    kept = one.layers == base.layers and param_shapes(one) == shaped
                except (TypeError, ValueError):
                    kept = False
                if not kept:
                    raise SystemExit(
                        f"{name}={value!r} would change the model's parameters or layers, "
                        f"which come from --init-from {self.path} (its {name} is "
                        f"{base.value_of(name)!r}): leave it out; fields that change neither "
                        "(mamba2.chunk_size, norm_eps, ...) can be set")
            raise SystemExit(f"{', '.join(flat)} together would change the model's "
                             f"parameters, which come from --init-from {self.path}: leave "
                             "them out")
        if tokenizer is not None and tokenizer.get_vocab_size() > cfg.vocab_size:
            raise SystemExit(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, more "
                             f"than the vocab_size {cfg.vocab_size} of --init-from "
                             f"{self.path}: give the tokenizer the model was trained with")
        return cfg

    def tokenizer_for(self, given: str | None, given_source: str,
                      data: list[str]) -> tuple[str | None, str]:
        """(tokenizer, what names it) for the run, as the trainer's --tokenizer and its
        source: the folder's. A --tokenizer, or a --data dataset prepared with a tokenizer,
        other than the folder's is refused naming both. A folder without a tokenizer takes
        --tokenizer, or else the prepared datasets' (the trainer's resolve_tokenizer);
        with neither it is refused rather than read as bytes."""
        flag = f"--init-from {self.path}"
        prepared = {path: dataset_tokenizer(path, meta) for _, path in parse_blend(data)
                    if (meta := dataset_meta(path)) is not None}
        if self.tokenizer is None:
            if given is None and not prepared:
                raise SystemExit(f"{flag} holds no tokenizer (tokenizer.json or "
                                 "tokenizer.model): give the one the model was trained with "
                                 "as --tokenizer, or copy it into the folder")
            return given, given_source
        theirs = load_tokenizer(self.tokenizer).to_str()
        if given is not None and load_tokenizer(given).to_str() != theirs:
            raise SystemExit(f"{given_source} {given} is not the tokenizer of {flag} "
                             f"({self.tokenizer}), which the model was trained with: leave "
                             "it out")
        for path, spec in prepared.items():
            if load_tokenizer(spec).to_str() != theirs:
                raise SystemExit(f"--data {path} was prepared with {spec}, not with the "
                                 f"tokenizer of {flag} ({self.tokenizer}): prepare it again "
                                 f"with `python -m mamba_jax.data prepare ... --tokenizer "
                                 f"{self.tokenizer}`")
        return self.tokenizer, f"the tokenizer of {flag}"

    def load(self, abstract, shardings):
        """The folder's parameters onto `shardings` (a pytree like `abstract`, an nnx.State of
        abstract parameters, each in the dtype it is to have: a bfloat16 base is read
        straight into bfloat16): a model folder's tensor by tensor (a Megatron-LM
        checkpoint's through mamba_jax.megatron.Tensors, its ranks joined), a trainer's
        checkpoint straight from Orbax (parameters only, not the optimizer state; a run
        that trained a part of the model as its merged model: checkpoint_params)."""
        if self.step is None:
            tensors = (megatron.Tensors(megatron_files.open_iteration(self.path),
                                        megatron.tp_parts(self.config))
                       if self.layout == "megatron" else open_tensors(self.path))
            return place_params(param_tensors(tensors, self.config, self.layout,
                                              source=self.path), abstract, shardings)
        ckpt = Checkpointer(self.checkpoints, read_only=True)
        try:
            return checkpoint_params(ckpt, self.step, ckpt.read_meta(self.step), abstract,
                                     shardings)
        except (jax.errors.JaxRuntimeError, BaseChanged):
            raise  # the devices' own failures (out of memory): the trainer names them
        except Exception as error:  # noqa: BLE001 - Orbax and TensorStore raise many kinds
            raise ValueError(f"{self.path}: checkpoint {self.step} cannot be read "
                             f"({type(error).__name__}: {str(error)[:200]}); give another "
                             "step's folder") from None
        finally:
            ckpt.close()

    def export_layout(self, cfg: Mamba2Config) -> str:
        """The layout the run's export writes (save_pretrained's format): the folder's own
        where it holds cfg (a NemotronH model back as NemotronH, mamba_ssm's as mamba_ssm),
        else "hf" (formats.export_format's choice for the model; a Megatron-LM
        checkpoint's too)."""
        if self.layout in (None, "megatron"):
            return "hf"
        try:
            return check_exportable(cfg, self.layout)
        except ValueError:
            return "hf"

    def record(self) -> dict:
        """What a run records of its source (train_config.json, checkpoints' meta): the
        folder, and the identity of what was read (of a trainer's dir, the step)."""
        return {"init_from": str(self.path), "init_identity": self.identity}

    def base(self) -> dict:
        """The identity of a base read from here (adapters.identity's form): the folder
        read (a trainer's step folder, not its dir, whose newest step moves on) and its
        init_identity."""
        return {"path": str(self.folder), "hash": self.identity}

    def name(self) -> str:
        """The source as PEFT's base_model_name_or_path: the hub id its config.json records
        (_name_or_path, as transformers 4 saved it) or its folder in the hub's cache names,
        else its folder."""
        if self.layout not in (None, "megatron"):
            recorded = json.loads((self.path / "config.json").read_text()).get("_name_or_path")
            if isinstance(recorded, str) and _HUB_ID.fullmatch(recorded) \
                    and not Path(recorded).exists():
                return recorded
            if cached := _HUB_CACHE.search(str(self.path)):
                return f"{cached[1]}/{cached[2]}"
        return str(self.folder)


def locate(path) -> tuple[Path, Path | None, int | None]:
    """(path made absolute, the trainer's --checkpoint-dir it names or None for a model
    folder, the step: the one a step folder names, else the dir's newest complete one).
    A missing folder, a folder that holds no model, a model folder whose config.json or
    weights cannot be found or read, a checkpoint dir without a complete step: a
    ValueError or FileNotFoundError naming `path` first."""
    given, path = path, Path(path).absolute()
    if not path.exists():
        raise FileNotFoundError(f"{given}: no such folder; give a model's folder (config.json "
                                "and its weights) or a trainer's --checkpoint-dir")
    if not path.is_dir():
        raise ValueError(f"{given} is a file; give the folder that holds it")
    if is_training_checkpoint(path):
        checkpoints, step = path, None
    elif path.name.isdigit() and holds_steps(path.parent):
        checkpoints, step = path.parent, int(path.name)
    elif megatron_files.is_megatron_checkpoint(path):
        megatron_files.iteration_dir(path)  # (its tracker's iteration, there)
        return path, None, None
    elif holds_model(path):
        load_config(path)  # (their errors name the file)
        weight_files(path)
        return path, None, None
    else:
        raise ValueError(f"{given} holds no model: a model's folder holds config.json and "
                         f"model.safetensors (or {INDEX} and its shards, or "
                         "pytorch_model.bin); a trainer's --checkpoint-dir holds numbered step "
                         "folders")
    ckpt = Checkpointer(checkpoints, read_only=True)
    try:
        steps = ckpt.steps()
    finally:
        ckpt.close()
    if step is None and not steps:
        raise ValueError(f"{given} is a trainer's --checkpoint-dir that holds no complete "
                         "checkpoint yet")
    if step is not None and step not in steps:
        raise ValueError(f"{given}: step {step} is not a complete checkpoint of {checkpoints},"
                         f" which holds steps {steps}")
    return path, checkpoints, steps[-1] if step is None else step


def check_resumed_source(step: int, directory, trained: dict, ours: dict) -> None:
    """Refuse to resume checkpoint `step` in `directory` where the run that saved it
    started from another source than this one: `trained` and `ours` are the two runs'
    recorded train flags (InitSource.record's fields, absent for a fresh start)."""
    theirs, now = trained.get("init_identity"), ours.get("init_identity")
    if theirs == now:
        return
    where = f"checkpoint {step} in {directory}"
    if now is None:
        raise SystemExit(f"{where} was trained from --init-from {trained['init_from']}: pass "
                         "it again to resume that run")
    if theirs is None:
        raise SystemExit(f"{where} was trained from a fresh initialisation, not from "
                         f"--init-from {ours['init_from']}: leave --init-from out to resume "
                         "it, or give another --checkpoint-dir")
    changed = ("its weights changed since" if trained["init_from"] == ours["init_from"]
               else "another model")
    raise SystemExit(f"{where} was trained from --init-from {trained['init_from']} (identity "
                     f"{theirs[:12]}), and --init-from {ours['init_from']} is now "
                     f"{now[:12]}: {changed}. Resume with the source it started from, or "
                     "start a new run in another --checkpoint-dir")


def init_identity(path) -> str:
    """An identity of the model in `path` (sha256 hex), cheap to compute: what a run started
    from it records, to tell later whether the folder still holds the same weights.

    A model folder: its config.json, and of each weight file (mamba_jax.tensors.weight_files)
    its name, size, header (a safetensors file's tensor names, dtypes and shapes; a sharded
    index whole) and 64 blocks of 4 KiB evenly spaced over it: other weights (another
    fine-tune of the same shape) change every block, so the identity is not a checksum of
    every byte, which would read the whole model. A Megatron-LM checkpoint: the same of
    every file of its iteration's folder (megatron_files.iteration_files). A trainer's
    checkpoint (its dir: the newest step; or a step folder): its step, model config and the
    checksums of its parameters recorded when it was saved, and the identity of the base
    of a run that trained a part of it. Raises as InitSource.open does."""
    path, checkpoints, step = locate(path)
    digest = hashlib.sha256()
    if checkpoints is not None:
        ckpt = Checkpointer(checkpoints, read_only=True)
        try:
            sums = ckpt.saved_checksums(step) or {}
            config = ckpt.read_meta(step)["config"]
        finally:
            ckpt.close()
        base = config["train"].get("base")
        digest.update(json.dumps({"step": step, "model": config["model"], "params": {
            key: value for key, value in sums.items() if key.startswith("['params']")},
            **({"base": base} if base else {})}, sort_keys=True).encode())
        return digest.hexdigest()
    files = (megatron_files.iteration_files(path)
             if megatron_files.is_megatron_checkpoint(path)
             else [path / "config.json", *weight_files(path)])
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.relative_to(path).as_posix()} {size}\n".encode())
        with open(file, "rb") as f:
            if file.suffix == ".json":
                digest.update(f.read())
                continue
            if file.suffix == ".safetensors":
                header = f.read(8)
                digest.update(header + f.read(min(int.from_bytes(header, "little"), size)))
            for i in range(_SAMPLES):
                f.seek(i * max(size - _SAMPLE_BYTES, 0) // (_SAMPLES - 1))
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


# ---------------------------------------------------------------- a run's frozen base


class BaseChanged(ValueError):
    """The base a run that trained a part of the model adapted is gone, or its folder holds
    other weights now: what trained cannot be used (the message names both)."""


def base_source(flags: dict, cfg: Mamba2Config, where: str) -> "InitSource | None":
    """The source of the frozen base that the run of `flags` (its recorded train flags;
    cfg: its model config) trained a part of, its identity checked against the one recorded
    (flags["base"]), opened to be read as a model of cfg; None for a base initialised from
    the config and --seed (whose identity is checked too). Where the folder is gone or holds
    other weights: BaseChanged, naming `where` (the checkpoint), both identities and the
    fix."""
    base = flags["base"]
    if base["path"] is None:
        now = adapters.identity(cfg, flags["seed"])
        if now["hash"] != base["hash"]:
            raise BaseChanged(f"{where} trained on {adapters.describe(base)}, which is "
                              f"{adapters.describe(now)} here: what trained fits the base it "
                              "trained on")
        return None
    folder = Path(base["path"])
    if not folder.exists():
        raise BaseChanged(f"{where} trained on the base {adapters.describe(base)}, which is "
                          f"gone (no such folder): put that model back at {folder} to read "
                          "what trained onto it")
    try:
        now = init_identity(folder)
    except (OSError, ValueError) as error:
        raise BaseChanged(f"{where} trained on the base {adapters.describe(base)}, which "
                          f"cannot be read now ({error}): put that model back at "
                          f"{folder}") from None
    if now != base["hash"]:
        raise BaseChanged(f"{where} trained on the base {adapters.describe(base)}, and "
                          f"{folder} now holds other weights (sha256 {now[:12]}): what "
                          f"trained fits the base it trained on; put that model back at "
                          f"{folder}")
    return InitSource.open(folder, config=cfg)


def placed_state(build, abstract, shardings, weights):
    """The state `abstract` describes (that of build(): a model, its adapters and their
    base's dtypes included) placed on `shardings` (a pytree like it): its parameters
    (nnx.Param) from weights(abstract parameters, their shardings), each in its dtype, and
    the rest (LoRA adapters) as build() draws them, under one jit that makes nothing else
    (XLA drops the base's initialisation, which no output reads)."""
    params, rest = nnx.split_state(abstract, nnx.Param, ...)
    params_shardings, rest_shardings = nnx.split_state(shardings, nnx.Param, ...)
    params = weights(params, params_shardings)
    if not jax.tree.leaves(rest):
        return params
    rest = jax.jit(lambda: nnx.split_state(nnx.split(build())[1], nnx.Param, ...)[1],
                   out_shardings=rest_shardings)()
    return nnx.merge_state(params, rest)


def _placed_like(shardings, abstract):
    """Shardings for `abstract` (a model's state) on the mesh of `shardings` (another's)."""
    mesh = jax.tree.leaves(shardings)[0].mesh
    return parallel.shardings(mesh, parallel.param_specs(abstract, mesh))


def checkpoint_params(ckpt: Checkpointer, step: int, meta: dict, abstract, shardings):
    """The model parameters of checkpoint `step` (its `meta`) of a trainer's checkpoints
    (ckpt) as `abstract` describes them (a plain model's nnx.State, each parameter in the
    dtype it is to have) on `shardings` (a pytree like it). A run that trained every
    parameter: its parameters. A run that trained a part (LoRA adapters, --train-only; its
    recorded flags say): its base read again from its source (base_source: identity checked;
    or initialised from its config and --seed), what trained restored beside it, and the two
    merged (adapters.merge, in float32) into the plain model's parameters, in one jit that
    takes the base's buffers."""
    flags = meta["config"]["train"]
    tuning = adapters.Tuning.of(flags)
    if tuning is None:
        return _restore(ckpt, step, abstract, shardings)
    cfg, seed = Mamba2Config.from_dict(meta["config"]["model"]), flags["seed"]
    source = base_source(flags, cfg, f"checkpoint {step} in {ckpt.directory}")
    build = tuning.build(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(seed)), seed)
    graphdef, whole = nnx.split(nnx.eval_shape(build))
    placed = _placed_like(shardings, whole)
    state = (placed_state(build, whole, placed, source.load) if source
             else parallel.init_params(build, placed))
    (trained, _), (trained_shardings, _) = tuning.split(whole), tuning.split(placed)
    trained = _restore(ckpt, step, trained, trained_shardings)
    frozen = tuning.split(state)[1]
    del state

    def merged(trained, frozen):
        model = adapters.merge(nnx.merge(graphdef, adapters.join(trained, frozen)))
        return jax.tree.map(lambda x, a: x.astype(a.dtype), nnx.state(model), abstract)
    return jax.jit(merged, out_shardings=shardings, donate_argnums=1)(trained, frozen)


def _restore(ckpt: Checkpointer, step: int, abstract, shardings):
    """Checkpoint step's parameters that `abstract` describes, onto `shardings`. They are
    saved in float32 (the trainer's parameters always are); where abstract asks for another
    dtype (a bfloat16 base), a layer at a time is restored in float32 (its checksums checked
    as saved) and cast, so no float32 copy of the whole model is held."""
    if all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(abstract)):
        return ckpt.restore_part(step, {"params": abstract_like(abstract, shardings)})["params"]
    layers = sorted({path[1] for path, _ in nnx.to_flat_state(abstract)
                     if path[0] == "layers"})
    parts = [lambda path, _, i=i: path[:2] == ("layers", i) for i in layers] + [...]
    restored = []
    for part, placed in zip(nnx.split_state(abstract, *parts),
                            nnx.split_state(shardings, *parts)):
        wide = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, jnp.float32,
                                                              sharding=s), part, placed)
        read = ckpt.restore_part(step, {"params": wide})["params"]
        restored.append(jax.jit(lambda x, part=part: jax.tree.map(
            lambda y, a: y.astype(a.dtype), x, part), out_shardings=placed,
            donate_argnums=0)(read))
    return nnx.merge_state(*restored)


def load_training_checkpoint(path, step: int | None = None, dtype=None, log=None):
    """(model, meta) of checkpoint `step` (default: the newest that reads) in a trainer's
    --checkpoint-dir. The parameters are read onto one device; `dtype` is the compute dtype
    (default float32). meta["config"] is the run's effective config: {"model": Mamba2Config
    fields, "train": its flags}. The rest of the step's state (the optimizer state) is
    checked, not kept: where it cannot be restored, one line on `log` (stderr) says which
    step the weights are from, what is damaged and what train --resume would do, as does
    a newer step skipped (Checkpointer.read_newest).

    The checkpoint of a run that trained a part of the model (LoRA adapters, --train-only)
    holds that part: the base is read again from its source (checkpoint_params), and the
    model returned is the base with what trained merged in. A base that changed or is gone
    since is one line (BaseChanged) before any step is read."""
    def read(step):
        meta = ckpt.read_meta(step)
        cfg = Mamba2Config.from_dict(meta["config"]["model"])
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Mamba2LM(
            cfg, rngs=nnx.Rngs(0), dtype=jnp.float32 if dtype is None else dtype)))
        placed = _placed_like(first_device(), abstract)
        return nnx.merge(graphdef, checkpoint_params(ckpt, step, meta, abstract, placed)), meta

    ckpt = Checkpointer(path, read_only=True)
    try:
        steps = ckpt.steps()
        if not steps:
            raise FileNotFoundError(f"{path}: holds no complete training checkpoint")
        if step is not None and step not in steps:
            raise ValueError(f"{path}: no checkpoint of step {step}; it holds steps {steps}")
        first = steps[-1] if step is None else step
        try:  # the run's base, refused once where it changed (every step holds the same)
            config = ckpt.read_meta(first)["config"]
        except Exception:  # noqa: BLE001 - a damaged step: read_newest says so, and goes on
            config = None
        if config is not None and adapters.Tuning.of(config["train"]):
            base_source(config["train"], Mamba2Config.from_dict(config["model"]),
                        f"checkpoint {first} in {path}")
        # The newest that reads: a run writing there may have a step half-pruned.
        read_step, (model, meta) = ckpt.read_newest(read, step, log)
        if damage := ckpt.unread_damage(read_step):
            before = [s for s in steps if s < read_step]
            instead = (f"resume from step {before[-1]}" if before else
                       "refuse to resume, with no step before it")
            print(f"checkpoint {ckpt.directory / str(read_step)}: its weights are read, but "
                  f"{damage}; train --resume would set step {read_step} aside and {instead}",
                  file=log or sys.stderr)
        return model, meta
    finally:
        ckpt.close()
