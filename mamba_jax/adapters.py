"""LoRA and partial training: which parameters train, the adapters applied where a layer
reads its weights, merged on export, and written in PEFT's layout.

    model = Mamba2LM(cfg, rngs=nnx.Rngs(0))
    add_lora(model, rank=8)                    # every projection of every layer
    graphdef, trainable, frozen = nnx.split(model, LoRA, ...)   # train `trainable` only
    merged = merge(model)                      # a plain Mamba2LM: W + alpha/r * A @ B
    save_peft_adapter(model, "adapter/")       # adapter_config.json, adapter_model.safetensors

Legend: r the adapter's rank; "in..." and "out..." a projection's input and output axes as
the parameter holds them (e.g. z_proj [d, h, p]: in (d,), out (h, p); out_proj [h, p, d]:
in (h, p), out (d,)).

A target is a projection as the checkpoint layouts name it: the `Linear` entries of a kind's
key table (mamba_jax.layers.checkpoint_keys) in the layout the model exports to
(formats.export_format), e.g. Mamba2's `in_proj` (our z, x, B, C and dt projections, fused
in the torch tensor) and `out_proj`, NemotronH's attention `q_proj ... o_proj`, its MLP's
`up_proj`, `down_proj`. A target made of several of our parameters gets one adapter: A [in...,
r] shared and B [r, out...] per parameter, so that it is exactly PEFT's LoRA on that
nn.Linear (lora_A.weight [r, in], lora_B.weight [out, r], its parts concatenated).

An adapter is a weight delta, applied where each layer reads its weights
(`adapted`, called by model.Block): the layer then runs on W + alpha/r * A @ B, a
float32 copy of one layer's weights at a time, and every kernel path (the fused Mamba2
mixer, the decoding steps) sees the adapter without a case of its own. The backward pass
computes the merged weight's gradient [in..., out...] and projects it onto A and B: LoRA
saves the gradients' and the optimizer's memory, not the matmul compute. The merged weights
are recomputed in the backward pass, never kept (model.remat_policy's `tokens`).

The frozen base may be stored in bfloat16 (`cast_base`): the weights trained with decay
(projections, convs, embedding, head) are; A_log, D, dt_bias, the norms and the biases stay
float32, as in mamba_ssm. A layer reads them in float32 (`adapted`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mamba_jax.files import ADAPTER_FILES
from mamba_jax.formats import export_format
from mamba_jax.layers.checkpoint_keys import Linear
from mamba_jax.layers.registry import KINDS
from mamba_jax.sharding import is_param, param_name

BASE_DTYPES = ("float32", "bfloat16")
# The Mamba kinds whose out_proj PEFT refuses (transformers' Mamba, Mamba2, FalconMamba and
# NemotronH) or cannot reach (mamba_ssm's fused kernels read the weight, bypassing the module)
_OUT_PROJ_BYPASSED = {"M", "1", "3"}


class LoRA(nnx.Variable):
    """A LoRA factor: float32, trained, with logical axes (mamba_jax.sharding.RULES) like a
    parameter's. Not an nnx.Param: the base's parameters (nnx.state(model, nnx.Param), what
    the checkpoint layouts hold) stay those of the model without adapters."""


class Adapter(nnx.Module):
    """LoRA on one target: A [in..., r], initialised as PEFT's (nn.Linear's kaiming_uniform
    with a = sqrt(5): U(+-1/sqrt(fan_in)), fan_in = prod(in)), and B [r, out...] per
    parameter of the target, zeros: the adapted layer starts equal to the base."""

    def __init__(self, params: dict, inputs: int, rank: int, key: jax.Array):
        """params: {parameter name: its Variable} (the target's, in the layout's order)."""
        first = next(iter(params.values()))
        shape, axes = first.shape[:inputs], _axes(first)[:inputs]
        bound = 1.0 / math.sqrt(math.prod(shape))
        self.A = LoRA(jax.random.uniform(key, (*shape, rank), jnp.float32, -bound, bound),
                      axes=(*axes, "lora_rank"))
        self.B = nnx.Dict({name: LoRA(jnp.zeros((rank, *w.shape[inputs:]), jnp.float32),
                                      axes=("lora_rank", *_axes(w)[inputs:]))
                           for name, w in params.items()})

    def deltas(self, scale: float) -> dict:
        """{parameter name: scale * A @ B [in..., out...] float32}."""
        a = self.A[...]
        return {name: scale * jnp.einsum("...r,rk->...k", a, b[...].reshape(b.shape[0], -1),
                                         precision=jax.lax.Precision.HIGHEST
                                         ).reshape(*a.shape[:-1], *b.shape[1:])
                for name, b in self.B.items()}


class Adapters(nnx.Module):
    """One layer's adapters, by target name (`targets`), scaled by alpha / rank."""

    def __init__(self, adapters: dict, rank: int, alpha: float):
        self.targets = nnx.Dict(adapters)
        self.rank, self.alpha = rank, alpha

    def deltas(self) -> dict:
        """{parameter name: its delta [in..., out...] float32} over every target."""
        return {name: delta for adapter in self.targets.values()
                for name, delta in adapter.deltas(self.alpha / self.rank).items()}


def _axes(variable) -> tuple:
    return tuple(variable.get_metadata()["axes"])


# ---------------------------------------------------------------- targets


def layout(cfg) -> str:
    """The checkpoint layout whose names the targets take: the one the model exports to."""
    return export_format(cfg, "hf")


def kind_targets(symbol: str, fmt: str) -> dict[str, Linear]:
    """{target name: its Linear entry} of a layer kind in layout fmt (the kind's first
    layout where it has none in fmt): its key table's nn.Linear weights."""
    tables = KINDS[symbol].checkpoint_keys
    table = tables.get(fmt) or next(iter(tables.values()), {})
    return {key.removesuffix(".weight"): entry for key, entry in table.items()
            if isinstance(entry, Linear)}


def target_names(cfg) -> list[str]:
    """Every target name of the model's layers (the default targets)."""
    fmt = layout(cfg)
    return sorted({name for symbol in set(cfg.layers) for name in kind_targets(symbol, fmt)})


def check_targets(cfg, targets) -> tuple[str, ...]:
    """targets (None: every one) as a sorted tuple; a ValueError naming an unknown one and
    the model's names."""
    names = target_names(cfg)
    if targets is None:
        return tuple(names)
    unknown = sorted(set(targets) - set(names))
    if unknown:
        raise ValueError(f"--lora-targets {' '.join(unknown)}: this model (layers "
                         f"{cfg.layers!r}, named as its {layout(cfg)} layout names them) has "
                         f"no such projection; its projections are {' '.join(names)}")
    return tuple(sorted(set(targets)))


def check_rank(rank) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"--lora-rank {rank!r} must be an integer >= 1 (the adapters' rank); "
                         "leave it out to train every parameter")


def check_alpha(alpha) -> None:
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"--lora-alpha {alpha} must be a positive number (the adapters' "
                         "scale is alpha / rank)")


def add_lora(model, rank: int, alpha: float | None = None, targets=None, seed: int = 0):
    """Add LoRA adapters of `rank` to `targets` (names as target_names gives them; None: every
    projection of every layer) of model's layers, scaled by alpha / rank (alpha None: rank,
    a scale of 1). Layer i's A factors are drawn from fold_in(key(seed), i). Returns model,
    changed in place: each layer's `lora` (Adapters)."""
    check_rank(rank)
    alpha = float(rank if alpha is None else alpha)
    check_alpha(alpha)
    if any(lora_of(block) is not None for block in model.layers):
        raise ValueError("add_lora: the model has adapters already (merge them first: "
                         "adapters.merge)")
    cfg = model.config
    chosen, fmt = check_targets(cfg, targets), layout(cfg)
    for i, (symbol, block) in enumerate(zip(cfg.layers, model.layers)):
        params = dict(nnx.state(block.mixer).items())
        found = {name: entry for name, entry in kind_targets(symbol, fmt).items()
                 if name in chosen and all(p in params for p in entry.params)}
        if not found:
            continue
        keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), i), len(found))
        block.lora = Adapters({name: Adapter({p: params[p] for p in entry.params},
                                             entry.inputs, rank, key)
                               for (name, entry), key in zip(sorted(found.items()), keys)},
                              rank, alpha)
    return model


def lora_of(block) -> Adapters | None:
    return getattr(block, "lora", None)


def _float32(state) -> bool:
    return all(v.dtype == jnp.float32 for v in jax.tree.leaves(state))


def adapts(block) -> bool:
    """Whether a layer runs on weights derived from its parameters (`adapted`): it has
    adapters, or parameters stored in another dtype than float32 (a bfloat16 base)."""
    return lora_of(block) is not None or not _float32(nnx.state(block.mixer))


def adapted(mixer, lora: Adapters | None):
    """The mixer as its layer runs: its parameters in float32 and its adapters' deltas added
    (W + alpha/r * A @ B), or the mixer itself where there is nothing to add or widen."""
    graphdef, state = nnx.split(mixer)
    if lora is None and _float32(state):
        return mixer
    deltas = {} if lora is None else lora.deltas()

    def prepare(path, variable):
        w = variable[...].astype(jnp.float32)
        delta = deltas.get(param_name(path))
        return variable.copy(w if delta is None else w + delta)
    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(prepare, state,
                                                                is_leaf=is_param))


def merge(model):
    """A model of the same class and config without adapters: each targeted weight W + alpha/r
    * A @ B computed in float32, every parameter float32 (a bfloat16 base widened). model is
    left as it was."""
    plain = nnx.eval_shape(lambda: type(model)(model.config, rngs=nnx.Rngs(0),
                                               dtype=model.dtype))
    merged = {name: variable[...].astype(jnp.float32)
              for name, variable in _flat(nnx.state(model, nnx.Param)).items()}
    for i, block in enumerate(model.layers):
        if (lora := lora_of(block)) is not None:
            for name, delta in lora.deltas().items():
                merged[f"layers.{i}.mixer.{name}"] += delta
    state = nnx.state(plain, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(
        lambda path, _: merged[param_name(path)], nnx.to_pure_dict(state)))
    nnx.update(plain, state)
    return plain


def _flat(state) -> dict:
    """{dotted name: Variable} of a state."""
    return {param_name(path): v for path, v in
            jax.tree_util.tree_leaves_with_path(state, is_leaf=is_param)}


# ---------------------------------------------------------------- what trains


@dataclasses.dataclass(frozen=True)
class Tuning:
    """What a run trains where it does not train every parameter: LoRA adapters of `rank`
    (None: none) on `targets`, scaled by alpha / rank, and (`train_only`) the base parameters
    whose dotted names the regular expression matches whole (re.fullmatch, e.g.
    `layers\\.\\d+\\.mixer\\.(A_log|D)`); the rest is the frozen base, stored in base_dtype.
    The trainer's --lora-rank, --lora-alpha, --lora-targets, --train-only, --base-dtype."""

    rank: int | None = None
    alpha: float | None = None
    targets: tuple[str, ...] | None = None
    train_only: str | None = None
    base_dtype: str = "float32"

    @classmethod
    def of(cls, flags: dict) -> "Tuning | None":
        """The Tuning of a run's flags (the trainer's arguments, or a checkpoint's record of
        them); None for a run that trains every parameter."""
        if flags.get("lora_rank") is None and flags.get("train_only") is None:
            for flag in ("lora_alpha", "lora_targets"):
                if flags.get(flag) is not None:
                    raise ValueError(f"--{flag.replace('_', '-')} shapes LoRA adapters: give "
                                     "--lora-rank R too")
            if (flags.get("base_dtype") or "float32") != "float32":
                raise ValueError(f"--base-dtype {flags['base_dtype']} stores the frozen base "
                                 "in it: give --lora-rank or --train-only (a run that trains "
                                 "every parameter keeps them float32)")
            return None
        targets = flags.get("lora_targets")
        return cls(flags.get("lora_rank"), flags.get("lora_alpha"),
                   None if targets is None else tuple(targets), flags.get("train_only"),
                   flags.get("base_dtype") or "float32")

    def check(self, cfg) -> "Tuning":
        """This Tuning with its targets spelt out, or a ValueError naming the flag, the value
        and the fix: a rank below 1, an alpha that is no positive number, a target that the
        model does not have, a --train-only that is no regular expression or matches no
        parameter."""
        if self.rank is not None:
            check_rank(self.rank)
        if self.alpha is not None:
            check_alpha(self.alpha)
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(f"--base-dtype {self.base_dtype!r}: use one of {BASE_DTYPES}")
        if self.train_only is not None:
            names = list(_flat(nnx.state(_abstract(cfg), nnx.Param)))
            try:
                pattern = re.compile(self.train_only)
            except re.error as error:
                raise ValueError(f"--train-only {self.train_only!r} is not a regular "
                                 f"expression ({error})") from None
            if not any(pattern.fullmatch(name) for name in names):
                raise ValueError(f"--train-only {self.train_only!r} matches none of the "
                                 f"model's {len(names)} parameters (it must match a whole "
                                 f"dotted name, such as {', '.join(names[:2])}, "
                                 f"{names[-1]}; e.g. 'layers\\.\\d+\\.mixer\\.(A_log|D)')")
        if self.rank is None:
            return self
        return dataclasses.replace(self, targets=check_targets(cfg, self.targets),
                                   alpha=float(self.rank if self.alpha is None else self.alpha))

    def trains(self, path, variable) -> bool:
        """An nnx filter: whether the parameter at path trains (an adapter's factor, or a base
        parameter --train-only matches)."""
        return isinstance(variable, LoRA) or (
            self.train_only is not None
            and re.fullmatch(self.train_only, ".".join(map(str, path))) is not None)

    def build(self, base: Callable, seed: int) -> Callable:
        """base() -> the base model; returns a function that makes it with this run's
        adapters (drawn from seed) and its frozen parameters cast to base_dtype."""
        return lambda: self.apply(base(), seed)

    def apply(self, model, seed: int):
        """model (a base model, changed in place and returned) with this run's adapters
        (drawn from seed) and its frozen parameters cast to base_dtype."""
        if self.rank is not None:
            add_lora(model, self.rank, self.alpha, self.targets, seed)
        cast_base(model, jnp.dtype(self.base_dtype), self.trains)
        return model

    def split(self, state):
        """A model's state -> (the part that trains, the frozen part): two nnx.States."""
        return nnx.split_state(state, self.trains, ...)


# The flags that say which parameters train, and the shapes of what trains
_TRAINED_FLAGS = ("lora_rank", "lora_alpha", "lora_targets", "train_only")


def check_same_part(saved: dict, flags: dict) -> None:
    """A ValueError where a run's flags (`flags`) would train another part of the model than
    a checkpoint's run did (`saved`, its recorded flags; their shapes differ), or adapt
    another base, naming both."""
    spell = lambda run: " ".join(
        f"--{k.replace('_', '-')} " + (" ".join(v) if isinstance(v, (list, tuple)) else str(v))
        for k in _TRAINED_FLAGS if (v := run.get(k)) is not None) or "every parameter"
    if [_listed(saved.get(k)) for k in _TRAINED_FLAGS] != \
            [_listed(flags.get(k)) for k in _TRAINED_FLAGS]:
        raise ValueError(f"it trained {spell(saved)}, this run trains {spell(flags)}")
    check_base(saved.get("base"), flags.get("base"))


def check_base(saved: dict | None, current: dict | None) -> None:
    """A ValueError naming both where the base a checkpoint's run adapted (`saved`, its
    identity) is not the one found now (`current`): their hashes differ (the same weights
    moved to another folder are the same base)."""
    if (saved or {}).get("hash") != (current or {}).get("hash"):
        raise ValueError(f"its base is {describe(saved)}, this one's is {describe(current)}: "
                         "what trained fits the base it trained on")


def _listed(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def _abstract(cfg):
    from mamba_jax.model import Mamba2LM  # model imports this module
    return nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0)))


def join(trainable, frozen):
    """The two parts of a model's state (Tuning.split) as one state."""
    return nnx.merge_state(trainable, frozen)


def joined(fn):
    """fn(params, *args) -> fn of (trainable, frozen, *args), the parameters joined."""
    return lambda trainable, frozen, *args: fn(join(trainable, frozen), *args)


def cast_base(model, dtype, trains=lambda path, variable: False) -> None:
    """Store model's frozen weights in dtype, in place: the parameters trained with weight
    decay (projections, convs, embedding, head) that `trains` (an nnx filter) leaves out;
    A_log, D, dt_bias, norms and biases (created with decay=False) stay float32."""
    if dtype == jnp.float32:
        return
    for path, variable in nnx.iter_graph(model):
        if isinstance(variable, nnx.Param) and variable.get_metadata().get("decay", True) \
                and not trains(path, variable):
            variable.set_value(variable[...].astype(dtype))


def identity(cfg, seed: int) -> dict:
    """What the frozen base is: {"path": its source, "hash": of its weights' source}. A base
    initialised from its config has no path; its hash is of the config and --seed."""
    text = json.dumps({"model": cfg.to_dict(), "seed": seed}, sort_keys=True)
    return {"path": None, "hash": hashlib.sha256(text.encode()).hexdigest()}


def describe(base: dict) -> str:
    """A base identity in words, for the lines that name two of them."""
    if base is None:
        return "none (every parameter trained)"
    where = base.get("path") or "initialised from the model config and --seed"
    return f"{where} (sha256 {str(base.get('hash'))[:12]})"


# ---------------------------------------------------------------- PEFT's layout


def check_peft(cfg, tuning: Tuning) -> None:
    """A ValueError where PEFT's adapter layout cannot hold what the run trains: parameters
    that --train-only trains (PEFT's adapter holds LoRA factors), or a Mamba layer's out_proj
    (PEFT refuses it on transformers' Mamba models; mamba_ssm's fused kernels read its weight,
    bypassing the module, so an adapter there would do nothing)."""
    if tuning.rank is None:
        raise ValueError("--export-adapter writes LoRA adapters: give --lora-rank R")
    if tuning.train_only is not None:
        raise ValueError(f"--export-adapter: PEFT's adapter holds LoRA factors only, and the "
                         f"parameters --train-only {tuning.train_only!r} trains have no place "
                         "in it; leave one of the two out (--out holds the whole model)")
    if "out_proj" in tuning.targets and _OUT_PROJ_BYPASSED & set(cfg.layers):
        kept = [name for name in tuning.targets if name != "out_proj"]
        raise ValueError("--export-adapter: PEFT refuses LoRA on a Mamba layer's out_proj "
                         "(the fused kernel reads its weight and bypasses the module, so the "
                         "adapter would do nothing); train with --lora-targets "
                         f"{' '.join(kept) or 'in_proj'} for an adapter PEFT loads, or leave "
                         "--export-adapter out (--out holds the merged model)")


def peft_tensors(model) -> dict[str, np.ndarray]:
    """The adapters in PEFT's layout: base_model.model.<module path>.lora_A.weight [r, in]
    and .lora_B.weight [out, r] float32, the module paths of the model's layout as
    transformers (or mamba_ssm) names its modules."""
    from mamba_jax.convert import _layer_keys  # convert imports the model, which imports this

    cfg = model.config
    fmt = layout(cfg)
    out = {}
    for symbol, block, (_, prefix) in zip(cfg.layers, model.layers, _layer_keys(cfg, fmt)):
        if (lora := lora_of(block)) is None:
            continue
        if fmt == "nemotron_h":  # its modules are model.layers..., its files' keys backbone.
            prefix = "model." + prefix.removeprefix("backbone.")
        for name, adapter in lora.targets.items():
            a = np.asarray(adapter.A[...], np.float32)
            key = f"base_model.model.{prefix}{name}"
            out[f"{key}.lora_A.weight"] = Linear("A", inputs=a.ndim - 1).to_torch([a])
            # B's parts in the tensor's order (the key table's): an nnx.Dict that went
            # through nnx.split and merge (the trainer's model) holds them sorted by name
            parts = [p for p in kind_targets(symbol, fmt)[name].params if p in adapter.B]
            out[f"{key}.lora_B.weight"] = Linear(*parts).to_torch(
                [np.asarray(adapter.B[p][...], np.float32) for p in parts])
    return {key: np.ascontiguousarray(value) for key, value in out.items()}


def adapter_file(path) -> str | None:
    """The name of a PEFT adapter's file in folder `path` (one save_peft_adapter would
    replace), or None."""
    return next((name for name in ADAPTER_FILES if (Path(path) / name).is_file()), None)


def save_peft_adapter(model, path, base_model_name_or_path: str | None = None) -> None:
    """Write model's adapters in PEFT's layout: adapter_config.json (LoRA, CAUSAL_LM, r,
    lora_alpha, target_modules) and adapter_model.safetensors (peft_tensors), which
    `PeftModel.from_pretrained(base, path)` loads onto the base in the model's layout."""
    from safetensors.numpy import save_file

    adapted_layers = [lora for block in model.layers if (lora := lora_of(block)) is not None]
    if not adapted_layers:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters (add_lora)")
    targets = sorted({name for lora in adapted_layers for name in lora.targets})
    tuning = Tuning(adapted_layers[0].rank, adapted_layers[0].alpha, tuple(targets))
    check_peft(model.config, tuning)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": tuning.rank,
              "lora_alpha": tuning.alpha, "target_modules": targets, "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "init_lora_weights": True, "inference_mode": True,
              "base_model_name_or_path": base_model_name_or_path}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json.tmp").write_text(json.dumps(config, indent=2) + "\n")
    save_file(peft_tensors(model), path / "adapter_model.safetensors.tmp",
              metadata={"format": "pt"})
    # safetensors writes for its owner alone (0600): the mode of the config (the umask's)
    os.chmod(path / "adapter_model.safetensors.tmp",
             (path / "adapter_config.json.tmp").stat().st_mode & 0o777)
    for name in ADAPTER_FILES:
        (path / f"{name}.tmp").replace(path / name)
