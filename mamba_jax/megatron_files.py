"""Megatron-LM's checkpoint files <-> numpy: the legacy layout's per-rank
`model_optim_rng.pt` (torch.save pickles) and the torch_dist layout's
torch.distributed.checkpoint files, read and (legacy) written. No model knowledge: tensor
names as Megatron saves them, each era's spelling read back to one (READ_RENAMES); the
model's side is mamba_jax.megatron.

    files = open_iteration("ckpts")            # the tracker's iteration, or an iter_ folder
    files.args                                  # the run's saved arguments (a dict) or None
    files.parts("decoder.layers.0.mixer.A_log") # [rank 0's, rank 1's, ...] numpy arrays
    write_legacy("out/iter_0000000", ranks, args, iteration=0)

Needs torch, imported by these functions alone (and nothing of mamba_jax at import, so that
a Python with torch and numpy but without jax can load this file by its path); its absence
is one line naming the extra that installs it, `pip install mamba-jax[megatron]`.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np

from mamba_jax.files import holds_model

TRACKER = "latest_checkpointed_iteration.txt"
RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(_\d{3})?")
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
# Megatron has written checkpoint_version 3.0 since its tensor-parallel qkv order settled.
CHECKPOINT_VERSION = 3.0
# Each era's spelling of a layer's tensor -> the torch_dist one (which every version keeps):
# the conv weights as direct parameters of the mixer (Megatron-core 0.19 and later, legacy
# only), June 2024's first Mamba layer's own norm, and the local (non-TransformerEngine)
# layer spec's separate norms, where TransformerEngine's fuse them into the next projection.
READ_RENAMES = {"mixer.conv1d_weight": "mixer.conv1d.weight",
                "mixer.conv1d_bias": "mixer.conv1d.bias",
                "norm.weight": "mixer.in_proj.layer_norm_weight",
                "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
# torch_dist's components of one tensor, in their order along its first axis (Megatron's
# _split_tensor_factory names them name.z ...; a SwiGLU linear_fc1 saved with singleton
# local shards is name_w, name_v: gate and up; otherwise whole).
COMPONENTS = {"mixer.in_proj.weight": (".z", ".x", ".B", ".C", ".dt"),
              "mixer.conv1d.weight": (".x", ".B", ".C"),
              "mixer.conv1d.bias": (".x", ".B", ".C"),
              "mlp.linear_fc1.weight": ("_w", "_v")}


def torch_module(what: str):
    """torch, or one line naming the extra that installs it (MissingDependency)."""
    try:
        import torch
    except ImportError:
        from mamba_jax.cli import MissingDependency
        raise MissingDependency(f"{what} needs torch, which is not installed: "
                                "pip install 'mamba-jax[megatron]'") from None
    return torch


# ---------------------------------------------------------------- finding a checkpoint


def is_megatron_checkpoint(path) -> bool:
    """Whether `path` is a Megatron-LM --save dir (its tracker file) or one iteration's
    folder of it (legacy rank folders, or torch_dist's metadata.json), and holds no model of
    another layout (files.holds_model: a model folder may hold a metadata.json too)."""
    path = Path(path)
    return ((path / TRACKER).is_file() or (path / "metadata.json").is_file()
            or path.is_dir() and any(RANK_DIR.fullmatch(p.name) for p in path.iterdir())) \
        and not holds_model(path)


def iteration_dir(path) -> Path:
    """The folder of the iteration a --save dir's tracker names (iter_0000100, or release),
    or `path` itself where it is one iteration's folder."""
    path = Path(path)
    if not (path / TRACKER).is_file():
        return path
    text = (path / TRACKER).read_text().strip()
    if text == "release":
        return path / "release"
    if not text.isdigit():
        raise ValueError(f"{path / TRACKER}: {text!r} is no iteration (a number or "
                         "'release')")
    folder = path / f"iter_{int(text):07d}"
    if not folder.is_dir():
        raise FileNotFoundError(f"{path / TRACKER} names iteration {int(text)}, but {folder} "
                                "does not exist")
    return folder


def iteration_files(path) -> list[Path]:
    """Every file of the checkpoint's iteration folder (iteration_dir): its ranks' files, or
    torch_dist's, in the order of their paths."""
    return sorted(p for p in iteration_dir(path).rglob("*") if p.is_file())


# ---------------------------------------------------------------- reading


class _Unpickled:
    """An object of a class we do not import, in a checkpoint's pickle (Megatron's enums and
    configs in its saved arguments, numpy's RNG state): its arguments kept, nothing run."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


def _load_pickle(torch, file):
    """A torch.save file (a path, memory-mapped, or a file object) through torch's
    weights-only unpickler, every class it names but argparse.Namespace read as an
    _Unpickled: a checkpoint's code is never run, and Megatron need not be installed."""
    names = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    if not isinstance(file, (str, Path)):
        file.seek(0)
    stubs = [(argparse.Namespace if name == "argparse.Namespace" else
              type(name.rpartition(".")[2], (_Unpickled,), {}), name) for name in names]
    with torch.serialization.safe_globals(stubs):
        return torch.load(file, map_location="cpu", weights_only=True,
                          mmap=isinstance(file, (str, Path)))


def _numpy(torch, tensor) -> np.ndarray:
    """A CPU tensor as numpy, bfloat16 as ml_dtypes' (no float32 copy)."""
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _renamed(key: str) -> str | None:
    """A saved tensor's name as ours (its era's spelling read back), or None for one that
    holds no weight of the model: TransformerEngine's fp8 metadata (`_extra_state`) and the
    multi-token-prediction layers."""
    if key.endswith("_extra_state") or key.startswith("mtp."):
        return None
    layer = LAYER.match(key)
    if layer:
        rest = key[layer.end():]
        return layer.group(0) + READ_RENAMES.get(rest, rest)
    return key


class Legacy:
    """A legacy checkpoint's tensors: each tensor-parallel rank's state dict, its pipeline
    stages' together (their layers numbered across the stages), each era's names read back
    (_renamed). stages: per pipeline stage, per tp rank, the saved "model" state dict
    (tensors as `to_numpy` takes them; other values, such as TransformerEngine's
    `_extra_state` bytes, and empty tensors are dropped); args: the saved arguments (a
    dict) or None."""

    layout = "legacy"

    def __init__(self, stages: list, args: dict | None, to_numpy=np.asarray):
        self.args, self.to_numpy = args, to_numpy
        self.tp = len(stages[0])
        self.ranks = [{} for _ in range(self.tp)]
        offset = 0
        for stage in stages:
            count = 0
            for rank, state in zip(self.ranks, stage):
                for key, tensor in state.items():
                    layer = LAYER.match(key)
                    if layer:
                        count = max(count, int(layer.group(1)) + 1)
                        key = f"decoder.layers.{int(layer.group(1)) + offset}." \
                              + key[layer.end():]
                    name = _renamed(key)
                    if name is not None and math.prod(getattr(tensor, "shape", (0,))):
                        rank[name] = tensor
            offset += count

    def names(self):
        return self.ranks[0].keys()

    def rows(self, key) -> int:
        """The first axis of the whole tensor at key, where its rank parts stack on it."""
        return sum(rank[key].shape[0] for rank in self.ranks)

    def shape(self, key) -> tuple:
        """The first rank's part's shape."""
        return tuple(self.ranks[0][key].shape)

    def parts(self, key, whole: bool = False) -> list:
        """The tensor at key as each rank saved it (numpy), or the first rank's alone where
        each holds it `whole`."""
        return [self.to_numpy(rank[key]) for rank in self.ranks[:1 if whole else None]]


def read_legacy(torch, folder: Path) -> Legacy:
    """A legacy iteration folder's rank files (mp_rank_TT, or mp_rank_TT_PPP under
    pipeline parallelism), memory-mapped."""
    grid = {}
    for child in folder.iterdir():
        match = RANK_DIR.fullmatch(child.name)
        if match and match.group(3):
            raise ValueError(f"{child}: expert-parallel ranks (MoE) are not supported")
        if match:
            grid[int(match.group(1)), int(match.group(2) or 0)] = child / "model_optim_rng.pt"
    tp, stages = 1 + max(t for t, _ in grid), 1 + max(p for _, p in grid)
    absent = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if stages > 1 else "")
              for t in range(tp) for p in range(stages)
              if (t, p) not in grid or not grid[t, p].is_file()]
    if absent:
        raise FileNotFoundError(f"{folder}: {tp} tensor-parallel ranks and {stages} pipeline "
                                f"stages, but no model_optim_rng.pt in {', '.join(absent)}")
    saved = {place: _load_pickle(torch, file) for place, file in grid.items()}
    for place, state in saved.items():
        if not isinstance(state, dict) or "model" not in state:
            many = isinstance(state, dict) and "model0" in state
            raise ValueError(f"{grid[place]}: " + (
                "virtual pipeline stages (model0, model1, ...) are not supported" if many
                else "holds no 'model' state dict"))
    args = saved[0, 0].get("args")
    return Legacy([[saved[t, p]["model"] for t in range(tp)] for p in range(stages)],
                  vars(args) if isinstance(args, argparse.Namespace) else None,
                  lambda tensor: _numpy(torch, tensor))


def _bytes_planner():
    """A torch.distributed.checkpoint load planner that keeps an object's bytes (its default
    unpickles them with the weights-only check off)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class KeepBytes(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            self.original_state_dict[read_item.dest_index.fqn] = value.read()

    return KeepBytes(flatten_state_dict=False)


def _whole(key: str) -> str:
    """torch_dist's name of a component (`decoder.layers.0.mixer.in_proj.weight.z`, a SwiGLU
    linear_fc1's `..._w`) -> the name of the tensor it is part of; other names as they are."""
    layer = LAYER.match(key)
    if layer:
        rest = key[layer.end():]
        for name, suffixes in COMPONENTS.items():
            if rest in (name + suffix for suffix in suffixes):
                return layer.group(0) + name
    return key


class TorchDist:
    """A torch_dist checkpoint's tensors: its global ones by name, each of ours (its
    components joined: COMPONENTS) one part. sizes: every saved tensor's name -> shape
    (the optimizer's, the RNG's and other states' too: only the model's are taken); args:
    the saved arguments (a dict) or None; read(names) -> those tensors (numpy)."""

    layout = "torch_dist"
    tp = 1

    def __init__(self, sizes: dict, args: dict | None, read):
        self.sizes, self.args, self.read = sizes, args, read
        self.sources = {}  # our name -> the saved tensors it is made of, in order
        for key, size in sorted(sizes.items()):
            name = _renamed(_whole(key))
            if key.startswith(("embedding.", "decoder.", "output_layer.")) and name \
                    and math.prod(size):
                self.sources.setdefault(name, []).append(key)
        for name, keys in self.sources.items():
            layer = LAYER.match(name)
            suffixes = COMPONENTS.get(name[layer.end():]) if layer else None
            if suffixes and keys != [name]:
                order = [name + suffix for suffix in suffixes]
                if sorted(keys) != sorted(order):
                    raise ValueError(f"{name} is saved as {keys}, not as its components "
                                     f"{order}")
                self.sources[name] = order

    def names(self):
        return self.sources.keys()

    def rows(self, key) -> int:
        return sum(self.sizes[k][0] for k in self.sources[key])

    def shape(self, key) -> tuple:
        return tuple(self.sizes[self.sources[key][0]])

    def parts(self, key, whole: bool = False) -> list:
        """[the tensor at key, whole] (numpy), its components read and joined."""
        return [np.concatenate(self.read(self.sources[key]), axis=0)]


def read_torch_dist(torch, folder: Path) -> TorchDist:
    """A torch_dist iteration folder, read a tensor at a time in-process (no process
    group): its arguments from the "common_state" object (common.pt before Megatron-core
    0.14)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    backend = json.loads((folder / "metadata.json").read_text()).get("sharded_backend")
    if backend != "torch_dist":
        raise ValueError(f"{folder / 'metadata.json'}: sharded_backend {backend!r} is not "
                         "supported (torch_dist is)")
    metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    tensors = {key: m for key, m in metadata.items() if isinstance(m, TensorStorageMetadata)}
    common = [key for key in metadata if key.startswith("common_state/")]
    if (folder / "common.pt").is_file():
        saved = _load_pickle(torch, folder / "common.pt")
    elif common:
        out = {common[0]: io.BytesIO()}
        load(out, storage_reader=FileSystemReader(str(folder)), planner=_bytes_planner(),
             no_dist=True)
        saved = _load_pickle(torch, io.BytesIO(out[common[0]]))[0]
    else:
        saved = {}
    args = saved.get("args") if isinstance(saved, dict) else None

    def read(names):
        out = {k: torch.empty(tuple(tensors[k].size), dtype=tensors[k].properties.dtype)
               for k in names}
        load(out, storage_reader=FileSystemReader(str(folder)), no_dist=True)
        return [_numpy(torch, out[k]) for k in names]

    return TorchDist({key: tuple(m.size) for key, m in tensors.items()},
                     vars(args) if isinstance(args, argparse.Namespace) else None, read)


def open_iteration(path):
    """The checkpoint of a --save dir's tracked iteration, or of an iteration folder: a
    Legacy or a TorchDist."""
    torch = torch_module(f"reading the Megatron-LM checkpoint {path}")
    folder = iteration_dir(path)
    if (folder / "metadata.json").is_file():
        return read_torch_dist(torch, folder)
    if not any(RANK_DIR.fullmatch(p.name) for p in folder.iterdir()):
        raise FileNotFoundError(f"{folder}: neither legacy rank folders (mp_rank_00/"
                                "model_optim_rng.pt) nor a torch_dist checkpoint "
                                "(metadata.json)")
    return read_legacy(torch, folder)


# ---------------------------------------------------------------- writing


def write_legacy(path, ranks: list, args: dict, iteration: int = 0,
                 extra: dict | None = None) -> Path:
    """Write a legacy checkpoint: path/latest_checkpointed_iteration.txt naming `iteration`
    and path/iter_{iteration:07d}/mp_rank_TT/model_optim_rng.pt, rank TT's {"model": its
    state dict (ranks[TT], numpy arrays, as torch tensors), "args": argparse.Namespace of
    `args`, "checkpoint_version", "iteration", and `extra`'s entries}. The folder is written
    beside and renamed into place (an iteration folder there before is replaced). Returns
    it."""
    torch = torch_module("writing a Megatron-LM checkpoint")
    path = Path(path)
    folder = path / f"iter_{iteration:07d}"
    temporary = path / f".{folder.name}.tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    for r, state in enumerate(ranks):
        (temporary / f"mp_rank_{r:02d}").mkdir(parents=True)
        torch.save({"model": {k: torch.from_numpy(np.ascontiguousarray(v))
                              for k, v in state.items()},
                    "args": argparse.Namespace(**args),
                    "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                    **(extra or {})},
                   temporary / f"mp_rank_{r:02d}" / "model_optim_rng.pt")
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(temporary, folder)
    tracker = path / f".{TRACKER}.tmp"
    tracker.write_text(f"{iteration}\n")
    os.replace(tracker, path / TRACKER)
    return folder


