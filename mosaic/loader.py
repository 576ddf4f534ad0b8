"""Load a model: an HF-style folder, a bundled checkpoint, or a preset with seeded random weights.

Weights are allocated once on the target device and each checkpoint tensor is copied straight
from the memory-mapped safetensors file into its slot: no second copy of the model anywhere."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import CheckpointError, MemoryBudgetError, gib
from .models import KEYS, PRESETS, Model, allocate, fill_random
from .models.llada2 import FUSED
from .tokenizer import TextTokenizer

ASSETS = Path(__file__).parent / "assets"
# bundled models: a folder of mosaic/assets per name (add a name here, drop the folder there);
# a name whose folder has no weights yet loads as a missing folder, with this list in the error
BUNDLED = {name: ASSETS / name for name in ("tiny-llada", "tiny-dream", "tiny-long")}
DEFAULT_MODEL = "tiny-llada"
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")   # owner/name, as on the Hugging Face Hub
LOADABLE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(f"device {device!r} asked for, but CUDA is not available here")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def load(model: str | Path = DEFAULT_MODEL, device="auto", dtype="auto", *,
         num_layers: int | None = None, seed: int = 0) -> Model:
    """A preset (models.PRESETS: 'llada-8b', 'illada-8b', 'dream-7b', 'llada-moe-7b', 'llada2-mini'), a
    bundled model (BUNDLED: 'tiny-llada', 'tiny-dream', 'tiny-long') or a checkpoint folder (or a file
    in it, e.g. its config.json).
    num_layers keeps the first layers only (a depth-truncated model that is still charged the full
    weights' bytes). Raises CheckpointError for a folder or preset that cannot be loaded and
    MemoryBudgetError, before allocating, when the weights cannot fit the device's free memory."""
    dev = torch.device("meta") if str(device) == "meta" else resolve_device(device)
    dt = resolve_dtype(dtype, dev if dev.type != "meta" else torch.device("cuda"))
    name = str(model)
    if name in PRESETS:
        cfg = PRESETS[name]
        full = cfg.num_layers
        if num_layers:
            cfg = cfg.truncated(num_layers)
        check_room(cfg, dev, dt, name=name)
        m, _, slots = allocate(cfg, dev, dt, name=name)
        if dev.type != "meta":
            fill_random(slots, seed)
        m.charged_layers = full if num_layers else None
        return m
    folder = BUNDLED.get(name, name)
    if name in BUNDLED and not Path(folder).is_dir():   # e.g. an install that left out tiny-long's folder
        raise CheckpointError(f"the bundled model {name!r} is not in this installation yet; train it with "
                              f"`python tools/train_long.py --device cuda --out mosaic/assets/{name}` (one GPU, "
                              "about 5 minutes; docs/RESULTS.md)")
    return load_folder(folder, dev, dt, num_layers=num_layers)


def resolve_folder(folder: str | Path) -> Path:
    """The checkpoint folder a path names: the folder itself, or the folder of a file in it."""
    text = str(folder)
    folder = Path(folder).expanduser()
    if folder.is_file() and (folder.parent / "config.json").is_file():
        return folder.parent
    if folder.is_dir():
        return folder
    hint = f"; presets: {sorted(PRESETS)}; bundled: {sorted(BUNDLED)}"
    if HUB_ID.match(text) and not text.startswith((".", "/", "~")):
        raise CheckpointError(
            f"{text!r} looks like a Hugging Face Hub id, but Mosaic never downloads: it loads a local "
            f"folder. Download it first, e.g. `huggingface-cli download {text} --local-dir "
            f"{text.split('/')[-1]}`, then pass --model {text.split('/')[-1]}{hint}")
    raise CheckpointError(f"model folder {text!r} does not exist{hint}")


def read_json(path: Path, what: str | None = None):
    """A JSON file's content, or CheckpointError naming the file."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({what or 'a checkpoint file'}): {e}") from e
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from e


def read_config(folder: Path) -> tuple[ModelConfig, dict]:
    folder = resolve_folder(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{folder} has no config.json (the model's fields; an HF checkpoint "
                              "folder has one next to its *.safetensors)")
    raw = read_json(cfg_path, "the model's fields")
    return ModelConfig.from_hf(raw), raw


def host_available_bytes() -> int | None:
    """Host memory the OS reports available now (bytes): MemAvailable of /proc/meminfo, else
    sysconf's available pages; None where it cannot tell. The one reading of it (the loader's
    room check, offload's host K/V and weights, the block cache's host tier, the CPU request
    check)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_bytes(device: torch.device) -> int | None:
    """Free memory a model's weights could take on `device` (bytes): the host's available memory
    for the CPU, the free memory of a CUDA card, None elsewhere."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_available_bytes() if device.type == "cpu" else None


def check_room(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tied: bool = False,
               name: str = "model") -> None:
    """MemoryBudgetError, before anything is allocated, when the weights alone exceed the free
    memory of the device (a preset on the CPU needs weight_bytes of RAM: without this the OS
    kills the process minutes later with no message)."""
    if device.type == "meta":
        return
    free = available_bytes(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    need = itemsize * sum(math.prod(shape) for _, shape in KEYS[cfg.family](cfg, tied or cfg.tied).values())
    if free is None or need <= free:
        return
    where = "host memory (RAM)" if device.type == "cpu" else f"free memory on {device}"
    alt = []
    if itemsize > 2:
        half = need // itemsize * 2
        alt.append(f"the bfloat16 dtype (--dtype bfloat16: {gib(half)}{', fits' if half <= free else ''})")
    if device.type == "cpu":
        alt.append("a GPU")
    alt.append("`mosaic plan` (plans memory without loading weights)")
    raise MemoryBudgetError(
        f"{name} needs {gib(need)} for its weights in {str(dtype).replace('torch.', '')} on {device}, but "
        f"only {gib(free)} of {where} is available; try {', or '.join(alt)}",
        needed_bytes=need, budget_bytes=free)


def _shards(folder: Path) -> dict[str, Path]:
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


def load_folder(folder: str | Path, device: torch.device, dtype: torch.dtype, *,
                num_layers: int | None = None) -> Model:
    """An HF-style checkpoint folder: config.json, model.safetensors (or a sharded index), and
    optionally tokenizer files (tokenizer.py reads them) and generation_config.json."""
    from safetensors import SafetensorError
    folder = resolve_folder(folder)
    cfg, raw = read_config(folder)
    full_layers = cfg.num_layers
    if num_layers:
        cfg = cfg.truncated(min(num_layers, cfg.num_layers))
    where = _shards(folder)
    tied = bool(raw.get("weight_tying") or raw.get("tie_word_embeddings")) or cfg.tied
    tokenizer = TextTokenizer.from_folder(folder)    # a broken tokenizer fails before the weights load
    generation_defaults = read_generation_defaults(folder)
    check_room(cfg, device, dtype, tied, name=folder.name)
    model, keys, slots = allocate(cfg, device, dtype, tied, name=folder.name)
    wanted = {hf: (canon, shape) for canon, (hf, shape) in keys.items()}
    missing = sorted(set(wanted) - set(where))
    extra = sorted(k for k in set(where) - set(wanted) if not _skipped_layer(k, cfg, full_layers))
    if missing or extra:
        raise CheckpointError(
            f"{folder}: tensors do not match a {cfg.family} model of {full_layers} layers: "
            f"missing {missing[:20]}{' ...' if len(missing) > 20 else ''} "
            f"({len(missing)}), unexpected {extra[:20]}{' ...' if len(extra) > 20 else ''} "
            f"({len(extra)})")
    by_file: dict[Path, list[str]] = {}
    for hf in wanted:
        by_file.setdefault(where[hf], []).append(hf)
    bad_shape, bad_dtype = [], []
    for path, names in by_file.items():
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
                        slots[canon].copy_(f.get_tensor(hf))  # mmap -> device, converted in the copy
                    except (SafetensorError, RuntimeError, OSError) as e:
                        raise CheckpointError(f"cannot read tensor {hf} from {path}: {e}; the file is "
                                              "damaged or incomplete: download it again") from e
    if bad_shape:
        raise CheckpointError(f"{folder}: tensors of the wrong shape: {bad_shape}")
    if bad_dtype:
        raise CheckpointError(f"{folder}: tensor dtypes not supported ({bad_dtype}); "
                              f"supported: {sorted(LOADABLE)}")
    model.tokenizer = tokenizer
    model.generation_defaults = generation_defaults
    if num_layers:
        model.charged_layers = full_layers
    return model


def read_generation_defaults(folder: Path) -> dict:
    """generation_config.json as a dict ({} without one); its sampling fields become the request
    defaults (engine.generation_config), its token ids are informative only."""
    path = folder / "generation_config.json"
    if not path.exists():
        return {}
    data = read_json(path, "generation defaults")
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not an object of fields")
    return data


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
    for canon, (hf, _) in KEYS[cfg.family](cfg, tied).items():
        tensors[hf] = _canonical(model, canon).detach().cpu().contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    raw = raw_config or cfg.to_hf()
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return folder


def _canonical(model: Model, canon: str) -> torch.Tensor:
    if not canon.startswith("layers."):
        return getattr(model, canon)
    _, i, leaf = canon.split(".", 2)
    if leaf in FUSED:   # LLaDA2's query_key_value: the q, k, v views back in one tensor
        return torch.cat([model.layers[int(i)][part] for part in FUSED[leaf]])
    if leaf.startswith("experts_"):
        kind, j = leaf.rsplit(".", 1)
        return model.layers[int(i)][kind][int(j)]
    return model.layers[int(i)][leaf]
