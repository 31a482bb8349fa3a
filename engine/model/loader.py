"""Loads a HuggingFace safetensors checkpoint into our modules.

Each checkpoint tensor is routed to the parameter that owns it (q/k/v into the
fused qkv_proj, gate/up into gate_up_proj) and handed to that parameter's
`weight_loader`, which keeps only this rank's slice. Tensors are read lazily
from the files, one at a time, so a rank never holds the whole checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn


class CheckpointError(ValueError):
    """The checkpoint's files do not match the model its config.json describes."""


class LazyTensor:
    """A checkpoint tensor not yet read. `narrow` reads only the requested
    slice from the file, so a tensor-parallel rank never materialises the
    parts of a weight other ranks own."""

    def __init__(self, file_slice):
        self._slice = file_slice
        self.shape = torch.Size(file_slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def materialize(self) -> torch.Tensor:
        return self._slice[tuple(slice(None) for _ in self.shape)]


def _weight_map(model_dir: Path) -> dict[str, str] | None:
    """The checkpoint index's tensor name -> file map; None without an index, and where the one
    file model.safetensors is there, which transformers reads first (an index beside it is a
    leftover: save_pretrained over a sharded save removes the shards but keeps their index)."""
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file() or (model_dir / "model.safetensors").is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
            raise TypeError(f"weight_map is {type(weight_map).__name__}, not names of files")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is not a safetensors index (a JSON object whose weight_map maps "
                              f"tensor names to files): {type(exc).__name__}: {exc}") from None
    return weight_map


@contextmanager
def _reading(path: Path) -> Iterator:
    """safe_open(path); a file safetensors cannot read, on opening or on reading a
    tensor, raises CheckpointError naming it and the likely causes."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file (a Git LFS pointer whose weights "
                              f"were never pulled, or a partial download?): {exc}") from None


def checkpoint_files(model_dir: Path, weight_map: dict[str, str] | None = None) -> list[Path]:
    """The checkpoint's safetensors files (`weight_map`: its index's, when already read)."""
    weight_map = weight_map if weight_map is not None else _weight_map(model_dir)
    if weight_map is not None:
        files = sorted({model_dir / name for name in weight_map.values()})
    elif (model_dir / "model.safetensors").is_file():
        # transformers' one file (a repository may keep other formats beside it, such as Mistral's
        # consolidated.safetensors, with other names for the same weights)
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}; pdserve loads safetensors checkpoints")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"the checkpoint index names files that do not exist: {missing}")
    return files


def stored_tensor_names(model_dir: str | Path) -> set[str]:
    """The names of the tensors the checkpoint in `model_dir` stores: its index's weight map, else
    the files' headers (no tensor data). Raises CheckpointError as `checkpoint_files` does."""
    model_dir = Path(model_dir)
    weight_map = _weight_map(model_dir)
    if weight_map is not None:
        checkpoint_files(model_dir, weight_map)      # (the files it names are there)
        return set(weight_map)
    names: set[str] = set()
    for path in checkpoint_files(model_dir):
        with _reading(path) as f:
            names.update(f.keys())
    return names


def stores_separate_head(model_dir: str | Path) -> bool:
    """Whether the checkpoint stores `lm_head.weight` beside the input embedding: for a config that
    ties them, transformers then keeps the stored head (a fine-tune of a tied model that trained its
    head) unless the two are equal, when it ties them, which gives the same logits."""
    try:
        names = stored_tensor_names(model_dir)
    except Exception:  # noqa: BLE001 - no weights to decide by (a config-only directory, LFS pointers, a
        return False   # truncated file): loading, where there is any, says what is wrong with them
    return "lm_head.weight" in names and bool(names & _EMBEDDING_NAMES)


_EMBEDDING_NAMES = {"model.embed_tokens.weight", "embed_tokens.weight"}


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Fills every parameter of `model` from the checkpoint in `model_dir`.
    Raises CheckpointError naming any parameter the checkpoint does not provide."""
    model_dir = Path(model_dir)
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[str] = set()
    unused: list[str] = []
    fused = {f".{our_part}." for our_part, _ in packed.values()}
    expected = _expected(params, packed)
    # tied, with the head stored alone: the head's tensor is the shared weight (transformers ties to it)
    head_is_embedding = tied and not (stored_tensor_names(model_dir) & _EMBEDDING_NAMES)
    for path in checkpoint_files(model_dir):
        with _reading(path) as f:
            for stored in f.keys():
                if "rotary_emb." in stored:   # inv_freq, or cos/sin caches some trainers save: computed here
                    continue
                # weights saved from the base model (no "model." prefix), as transformers loads them
                name = f"model.{stored}" if stored not in expected and f"model.{stored}" in expected else stored
                if any(part in name for part in fused):
                    raise CheckpointError(f"{stored} in {path.name}: a fused projection; pdserve loads q/k/v_proj "
                                          "and gate/up_proj as separate tensors, as transformers saves them")
                target, shard_id = name, None
                for ckpt_part, (our_part, sid) in packed.items():
                    if f".{ckpt_part}." in name:
                        target, shard_id = name.replace(ckpt_part, our_part), sid
                        break
                if tied and name == "lm_head.weight":
                    if not head_is_embedding:
                        continue  # tied: the embedding's weight is the head's
                    target = "model.embed_tokens.weight"
                param = params.get(target)
                if param is None:
                    unused.append(stored)
                    continue
                tensor = LazyTensor(f.get_slice(stored))
                weight_loader = getattr(param, "weight_loader", _copy)
                try:
                    weight_loader(param, tensor, shard_id)
                except ValueError as exc:
                    raise CheckpointError(f"{stored} in {path.name}: {exc}") from None
                loaded.add(f"{target}:{shard_id}")
    if unused:
        # weights of a layer this model lacks (a Qwen3 checkpoint whose config says llama, say): run without
        # them, it would generate garbage without a word
        shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        raise CheckpointError(f"the checkpoint holds {len(unused)} tensor(s) that no parameter of "
                              f"{model.config.architecture} takes: {shown}; its config.json (model_type, "
                              "architectures, sizes) does not describe these weights")
    _check_complete(params, packed, loaded, tied)


def _expected(params: dict[str, nn.Parameter], packed: dict) -> set[str]:
    """Every checkpoint tensor name the model takes (its fused parameters by their parts' names)."""
    names = set(params)
    for name in params:
        for ckpt_part, (our_part, _) in packed.items():
            if f".{our_part}." in name:
                names.add(name.replace(our_part, ckpt_part))
    return names


def _copy(param: nn.Parameter, tensor: LazyTensor, shard_id: object = None) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor.materialize())


def _check_complete(params: dict[str, nn.Parameter], packed: dict, loaded: set[str], tied: bool) -> None:
    missing = []
    for name in params:
        if tied and name == "lm_head.weight":
            continue
        shard_ids = [sid for part, (our, sid) in packed.items() if f".{our}." in name]
        if shard_ids:
            for part, (our, sid) in packed.items():
                if f".{our}." in name and f"{name}:{sid}" not in loaded:
                    missing.append(name.replace(our, part))
        elif f"{name}:None" not in loaded:
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
