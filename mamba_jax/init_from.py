"""Training that starts from a published model or a trainer's checkpoint (the trainer's
`--init-from DIR`): where the model's config, weights and tokenizer come from.

    source = InitSource.open("models/mamba2-130m")       # or runs/x/ckpt, or runs/x/ckpt/500
    cfg = source.config_for({"mamba2.chunk_size": 128})  # what changes a shape is refused
    params = source.load(abstract_params, param_shardings)  # each tensor onto its shard
    init_identity("models/mamba2-130m")                  # what a run records of its source

DIR is a folder `from_pretrained` reads (transformers' Mamba2, Mamba, FalconMamba or
NemotronH, or mamba_ssm's MambaLMHeadModel of Mamba2, Mamba-1 or Mamba-3 layers, with
attention and MLP layers or without; not a Megatron-LM checkpoint, which convert turns into
one), a trainer's --checkpoint-dir (its newest complete step) or one step folder of it
(runs/x/ckpt/500). The weights go onto the mesh as they are read: a model folder's tensor by
tensor (mamba_jax.convert.load_params), a trainer's checkpoint by Orbax straight into this
run's shardings; the optimizer starts fresh.

What a folder cannot give is a ValueError or FileNotFoundError naming it; what the trainer's
flags ask that it cannot is a SystemExit naming the flag (one line each, mamba_jax.cli).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import jax

from mamba_jax.checkpoint import Checkpointer, abstract_like
from mamba_jax.config import SECTIONS, Mamba2Config
from mamba_jax.convert import (check_exportable, is_training_checkpoint, load_config,
                               load_params, param_shapes, training_tokenizer)
from mamba_jax.data import dataset_meta, dataset_tokenizer, parse_blend
from mamba_jax.files import holds_model, holds_steps
from mamba_jax.megatron_files import is_megatron_checkpoint
from mamba_jax.tensors import INDEX, weight_files
from mamba_jax.tokenizer import find_tokenizer, load_tokenizer

# init_identity reads this many blocks of this many bytes, evenly spaced, of each weight file
_SAMPLES, _SAMPLE_BYTES = 64, 4096


@dataclasses.dataclass(frozen=True)
class InitSource:
    """What --init-from DIR names: `path` (absolute), the model's `config`, the `layout`
    of a model folder ("hf", "mamba_ssm", "nemotron_h"; None for a trainer's checkpoint),
    a trainer's `checkpoints` dir and the `step` read there (None for a model folder), and
    `tokenizer`, the folder's as load_tokenizer takes it (None where a model folder holds
    none)."""

    path: Path
    config: Mamba2Config
    layout: str | None
    checkpoints: Path | None
    step: int | None
    tokenizer: str | None

    @classmethod
    def open(cls, path) -> "InitSource":
        """The source at `path` (locate's checks first)."""
        path, checkpoints, step = locate(path)
        if checkpoints is None:
            config, layout = load_config(path)
            found = find_tokenizer(path)
            return cls(path, config, layout, None, None, None if found is None else str(found))
        ckpt = Checkpointer(checkpoints, read_only=True)
        try:
            meta = ckpt.read_meta(step)
        finally:
            ckpt.close()
        return cls(path, Mamba2Config.from_dict(meta["config"]["model"]), None, checkpoints,
                   step, training_tokenizer(checkpoints, meta))

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
        """The folder's parameters onto `shardings` (a pytree like `abstract`, the run's
        nnx.State of abstract parameters): a model folder's tensor by tensor, a trainer's
        checkpoint straight from Orbax (parameters only, not the optimizer state)."""
        if self.step is None:
            return load_params(self.path, self.config, self.layout, abstract, shardings)
        ckpt = Checkpointer(self.checkpoints, read_only=True)
        try:
            target = {"params": abstract_like(abstract, shardings)}
            return ckpt.restore_part(self.step, target)["params"]
        except jax.errors.JaxRuntimeError:
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
        else "hf" (formats.export_format's choice for the model)."""
        if self.layout is None:
            return "hf"
        try:
            return check_exportable(cfg, self.layout)
        except ValueError:
            return "hf"

    def record(self) -> dict:
        """What a run records of its source (train_config.json, checkpoints' meta): the
        folder, and the identity of what was read (of a trainer's dir, the step)."""
        read = self.path if self.step is None else self.checkpoints / str(self.step)
        return {"init_from": str(self.path), "init_identity": init_identity(read)}


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
    elif is_megatron_checkpoint(path) and not holds_model(path):
        raise ValueError(f"{given} is a Megatron-LM checkpoint, which --init-from does not "
                         "read: convert it once (python -m mamba_jax.convert DIR OUT --to "
                         "hf) and start from OUT")
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
    every byte, which would read the whole model. A trainer's checkpoint (its dir: the
    newest step; or a step folder): its step, model config and the checksums of its
    parameters recorded when it was saved. Raises as InitSource.open does."""
    path, checkpoints, step = locate(path)
    digest = hashlib.sha256()
    if checkpoints is not None:
        ckpt = Checkpointer(checkpoints, read_only=True)
        try:
            sums = ckpt.saved_checksums(step) or {}
            model = ckpt.read_meta(step)["config"]["model"]
        finally:
            ckpt.close()
        digest.update(json.dumps({"step": step, "model": model, "params": {
            key: value for key, value in sums.items() if key.startswith("['params']")}},
            sort_keys=True).encode())
        return digest.hexdigest()
    for file in [path / "config.json", *weight_files(path)]:
        size = file.stat().st_size
        digest.update(f"{file.name} {size}\n".encode())
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
