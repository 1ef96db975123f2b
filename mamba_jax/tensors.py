"""A checkpoint folder's tensors, read one at a time: a lazy mapping from the layout's tensor
names to numpy arrays in their stored dtype (bfloat16 through ml_dtypes), each read from its
file when it is asked for and held by no one after.

    tensors = open_tensors("path/to/dir")        # model.safetensors, a sharded index, or
    tensors.keys(); tensors["lm_head.weight"]     # pytorch_model.bin (which needs torch)

mamba_jax.convert.param_tensors turns such a mapping into our parameters; any other reader
(another framework's checkpoint) plugs in as a Mapping of the same names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

import numpy as np

from mamba_jax.cli import MissingDependency


class SafetensorsTensors(Mapping):
    """The tensors of safetensors files (one model.safetensors, or an index's shards), by
    name; each read from its file as it is asked for (safe_open's memory map), in its
    stored dtype. A file that is not safetensors, or a name in two files, is refused as the
    mapping is made."""

    def __init__(self, files: list[Path], folder: Path):
        from safetensors import SafetensorError, safe_open

        self._file = {}
        for f in files:
            try:
                with safe_open(f, framework="numpy") as fh:
                    keys = list(fh.keys())
            except SafetensorError as error:
                raise ValueError(f"{f}: cannot be read ({error}); the file is truncated or "
                                 "corrupt: download or convert it again") from None
            for key in keys:
                if key in self._file:
                    raise ValueError(f"{folder}: tensor {key!r} is in two shards, "
                                     f"{self._file[key].name} and {f.name}; which one is "
                                     "meant cannot be known: remove one")
                self._file[key] = f

    def __getitem__(self, key: str) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(self._file[key], framework="numpy") as fh:
            return fh.get_tensor(key)

    def __iter__(self):
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)


class TorchTensors(Mapping):
    """The tensors of a pytorch_model.bin (read with torch, memory-mapped), by name; each
    made a numpy array as it is asked for (a floating-point one float32: numpy has no torch
    bfloat16; another in its own dtype, for the reader to refuse)."""

    def __init__(self, file: Path):
        try:
            import torch
        except ImportError:
            raise MissingDependency(
                f"{file} is a PyTorch pickle and reading it needs torch, which is not "
                "installed. Either `pip install torch` (CPU is enough), or convert it once "
                "where torch is installed: `python -c \"import torch, safetensors.torch; sd = "
                "torch.load('pytorch_model.bin', map_location='cpu', weights_only=True); "
                "safetensors.torch.save_file({k: v.contiguous() for k, v in sd.items()}, "
                "'model.safetensors')\"`") from None
        self._tensors = torch.load(file, map_location="cpu", weights_only=True, mmap=True)

    def __getitem__(self, key: str) -> np.ndarray:
        tensor = self._tensors[key]
        return (tensor.float() if tensor.is_floating_point() else tensor).numpy()

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


INDEX = "model.safetensors.index.json"


def weight_files(path) -> list[Path]:
    """The files that hold a checkpoint folder's weights, in the order read: model.safetensors,
    else the index and its shards, else pytorch_model.bin. FileNotFoundError where there is
    none of them."""
    path = Path(path)
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    if (path / INDEX).is_file():
        return [path / INDEX] + [path / shard for shard in index_shards(path / INDEX)]
    if (path / "pytorch_model.bin").is_file():
        return [path / "pytorch_model.bin"]
    raise FileNotFoundError(f"{path}: no model.safetensors, {INDEX} or pytorch_model.bin")


def open_tensors(path) -> Mapping:
    """The tensors of a checkpoint folder (weight_files), read lazily: SafetensorsTensors,
    or TorchTensors for a pytorch_model.bin."""
    path = Path(path)
    files = weight_files(path)
    if files[0].name == "pytorch_model.bin":
        return TorchTensors(files[0])
    if files[0].name == "model.safetensors":
        return SafetensorsTensors(files, path)
    tensors = SafetensorsTensors(files[1:], path)
    # an entry no shard holds: the index and the shards are of other versions
    named = json.loads(files[0].read_text())["weight_map"]
    if absent := sorted(key for key in named if key not in tensors):
        raise ValueError(f"{files[0]}: names {absent[:3]}{' ...' if len(absent) > 3 else ''}, "
                         f"which no shard holds ({named[absent[0]]} should): the index and "
                         "the shards are of different versions; download them again")
    return tensors


def index_shards(index: Path) -> list[str]:
    """The shard files model.safetensors.index.json names, each inside its directory: a
    path that is absolute or climbs out (..) is refused, so that an index never has us read
    files elsewhere. (A shard may be a symlink, as in the Hugging Face cache.)"""
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{index}: expected a JSON object whose 'weight_map' maps tensor "
                         "names to shard files") from None
    for shard in shards:
        if not isinstance(shard, str) or PurePosixPath(shard).is_absolute() \
                or ".." in PurePosixPath(shard).parts:
            raise ValueError(f"{index}: shard {shard!r} is not a file inside {index.parent}; "
                             "an index names its shards relative to its own directory")
    return shards
