"""Checkpoint files: the safetensors shards of an HF-style folder, read tensor by tensor into
their slots, and written back in a family's published key layout (loader.py uses them)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import CheckpointError
from .models import Model
from .models.families import config_to_hf, family_of

LOADABLE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def read_json(path: Path, what: str | None = None):
    """A JSON file's content, or CheckpointError naming the file."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({what or 'a checkpoint file'}): {e}") from e
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from e


def shards(folder: Path) -> dict[str, Path]:
    """checkpoint key -> the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index, "the shard index")
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map (tensor name -> shard file)")
        missing = sorted({f for f in weight_map.values() if not (folder / f).exists()})
        if missing:
            raise CheckpointError(f"{index.name} names shard files that are missing: {missing}")
        return {k: folder / f for k, f in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise CheckpointError(
            f"{folder} has no model.safetensors or model.safetensors.index.json")
    with open_safetensors(single) as f:
        return {k: single for k in f.keys()}


def open_safetensors(path: Path):
    """safe_open, with a damaged file (truncated download, not safetensors) as a CheckpointError."""
    from safetensors import SafetensorError, safe_open
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {path}: {e}; the file is damaged or incomplete (a truncated "
                              f"download?): download it again") from e


def check_names(folder, cfg, full_layers: int, wanted: dict, where: dict) -> None:
    """CheckpointError when the checkpoint's tensor names are not the family's."""
    missing = sorted(set(wanted) - set(where))
    extra = sorted(k for k in set(where) - set(wanted) if not _skipped_layer(k, cfg, full_layers))
    if missing or extra:
        raise CheckpointError(
            f"{folder}: tensors do not match a {cfg.family} model of {full_layers} layers: "
            f"missing {missing[:20]}{' ...' if len(missing) > 20 else ''} "
            f"({len(missing)}), unexpected {extra[:20]}{' ...' if len(extra) > 20 else ''} "
            f"({len(extra)})")


def read_file(path: Path, names: list[str], wanted: dict, slots: dict, device, bad_shape: list,
               bad_dtype: list, cuts: dict | None = None) -> None:
    """Copy one safetensors file's tensors into their slots (mmap -> device, converted in the
    copy); shapes and dtypes that do not fit are collected, not copied. cuts: canonical key ->
    (dim 0 or 1, lo, hi) of the stored tensor to read (tensor parallelism: only this rank's
    slice leaves the file; models/tensor_shard.cut); absent keys are read whole."""
    from safetensors import SafetensorError
    with open_safetensors(path) as f:
        for hf in names:
            canon, shape = wanted[hf]
            sl = f.get_slice(hf)
            if tuple(sl.get_shape()) != tuple(shape):
                bad_shape.append(f"{hf}: {tuple(sl.get_shape())}, expected {tuple(shape)}")
                continue
            if sl.get_dtype() not in LOADABLE:
                bad_dtype.append(f"{hf}: {sl.get_dtype()}")
                continue
            if device.type != "meta":
                try:
                    where = (cuts or {}).get(canon)
                    if where is None:
                        slots[canon].copy_(f.get_tensor(hf))
                    else:
                        dim, lo, hi = where
                        slots[canon].copy_(sl[lo:hi] if dim == 0 else sl[:, lo:hi])
                except (SafetensorError, RuntimeError, OSError) as e:
                    raise CheckpointError(f"cannot read tensor {hf} from {path}: {e}; the file is "
                                          "damaged or incomplete: download it again") from e




def _skipped_layer(key: str, cfg: ModelConfig, full_layers: int) -> bool:
    """Keys of the layers a depth-truncated load leaves out."""
    for marker in ("blocks.", "layers."):
        if marker in key:
            i = key.split(marker, 1)[1].split(".", 1)[0]
            return i.isdigit() and cfg.num_layers <= int(i) < full_layers
    return False


def save(model: Model, folder: str | Path, raw_config: dict | None = None) -> Path:
    """Write an HF-style folder (config.json + model.safetensors) in the published key layout."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    tied = model.lm_head is model.embed
    if tied != cfg.tied:
        cfg = dataclasses.replace(cfg, tied=tied)
    tensors = {}
    for canon, (hf, _) in family_of(cfg).weight_keys(cfg, tied).items():
        tensors[hf] = _canonical(model, canon).detach().cpu().contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    raw = raw_config or config_to_hf(cfg)
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return folder


def _canonical(model: Model, canon: str) -> torch.Tensor:
    if not canon.startswith("layers."):
        return getattr(model, canon)
    _, i, leaf = canon.split(".", 2)
    fused = family_of(model.cfg).fused
    if leaf in fused:   # LLaDA2's query_key_value: the q, k, v views back in one tensor
        return torch.cat([model.layers[int(i)][part] for part in fused[leaf]])
    if leaf.startswith("experts_"):
        kind, j = leaf.rsplit(".", 1)
        return model.layers[int(i)][kind][int(j)]
    return model.layers[int(i)][leaf]
