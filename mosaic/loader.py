"""Load a model: an HF-style folder, a bundled checkpoint, or a preset with seeded random weights.

Weights are allocated once on the target device and each checkpoint tensor is copied straight
from the memory-mapped safetensors file into its slot: no second copy of the model anywhere."""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from pathlib import Path

import torch

from .checkpoint_fields import ConfigFieldWarning, generation_fields
from .checkpoint_io import LOADABLE, check_names, read_file, read_json, save, shards  # noqa: F401  (save: public)
from .config import GenerationConfig, ModelConfig
from .errors import CheckpointError, InputError, MemoryBudgetError, gib
from .graph.tensor import TensorShard
from .host_memory import host_available_bytes
from .models import PRESETS, Model, allocate, fill_random
from .models import tensor_shard as TS
from .models.families import config_from_hf, family_of
from .tokenizer import TextTokenizer

ASSETS = Path(__file__).parent / "assets"
# bundled models: a folder of mosaic/assets per name (add a name here, drop the folder there);
# a name whose folder has no weights yet loads as a missing folder, with this list in the error
BUNDLED = {name: ASSETS / name for name in ("tiny-llada", "tiny-dream", "tiny-long")}
DEFAULT_MODEL = "tiny-llada"
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")   # owner/name, as on the Hugging Face Hub


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
         num_layers: int | None = None, seed: int = 0, tensor: TensorShard | None = None) -> Model:
    """A preset (models.PRESETS, from the family records: 'llada-8b', 'dream-7b', 'llada2-mini', ...), a
    bundled model (BUNDLED: 'tiny-llada', 'tiny-dream', 'tiny-long') or a checkpoint folder (or a file
    in it, e.g. its config.json).
    num_layers keeps the first layers only (a depth-truncated model that is still charged the full
    weights' bytes). tensor: this rank's share under tensor parallelism (models/tensor_shard.py):
    only its slices are allocated and read from the files (a preset's shard is filled with seeded
    random weights of its own, not slices of the one-process preset). Raises CheckpointError for a
    folder or preset that cannot be loaded, InputError when the heads or FFN width do not divide
    by the processes, and MemoryBudgetError, before allocating, when the weights cannot fit the
    device's free memory."""
    name = model_name(model)
    if not name.strip():     # Path("") is the current folder: never what an empty name meant
        raise CheckpointError(f"no model named: give a checkpoint folder, a bundled model {sorted(BUNDLED)} or a "
                              f"preset {sorted(PRESETS)}")
    dev = torch.device("meta") if str(device) == "meta" else resolve_device(device)
    dt = resolve_dtype(dtype, dev if dev.type != "meta" else torch.device("cuda"))
    if name in PRESETS:
        cfg = PRESETS[name]
        full = cfg.num_layers
        if num_layers:
            cfg = cfg.truncated(num_layers)
        if tensor is not None:
            cfg = TS.shard_config(cfg, tensor.world)
        held = TS.experts(cfg, tensor)
        check_room(cfg, dev, dt, name=name, experts=held)
        m, _, slots = allocate(cfg, dev, dt, name=name, experts=held)
        if dev.type != "meta":
            fill_random(slots, seed)
        m.charged_layers = full if num_layers else None
        if tensor is not None:
            TS.finish(m, tensor)
        return m
    folder = BUNDLED.get(name, name)
    if name in BUNDLED and not Path(folder).is_dir():   # e.g. an install that left out tiny-long's folder
        raise CheckpointError(f"the bundled model {name!r} is not in this installation yet; train it with "
                              f"`python tools/train_long.py --device cuda --out mosaic/assets/{name}` (one GPU, "
                              "about 5 minutes; docs/RESULTS.md)")
    return load_folder(folder, dev, dt, num_layers=num_layers, tensor=tensor)


def model_name(model) -> str:
    """The name or folder `model` gives, as text; InputError when it is neither text nor a path
    (MosaicEngine(None) used to be told "model folder 'None' does not exist")."""
    if not isinstance(model, (str, Path)):
        raise InputError(f"model must be a checkpoint folder (a str or pathlib.Path), a bundled model "
                         f"{sorted(BUNDLED)}, a preset {sorted(PRESETS)} or a loaded Model, got "
                         f"{type(model).__name__}")
    return str(model)


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
            f"folder. Download it first, e.g. `hf download {text} --local-dir "
            f"{text.split('/')[-1]}`, then pass --model {text.split('/')[-1]}{hint}")
    raise CheckpointError(f"model folder {text!r} does not exist{hint}")


def read_config(folder: Path) -> tuple[ModelConfig, dict]:
    folder = resolve_folder(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{folder} has no config.json (the model's fields; an HF checkpoint "
                              "folder has one next to its *.safetensors)")
    raw = read_json(cfg_path, "the model's fields")
    return config_from_hf(raw), raw


def available_bytes(device: torch.device) -> int | None:
    """Free memory a model's weights could take on `device` (bytes): the host's available memory
    for the CPU, the free memory of a CUDA card, None elsewhere."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_available_bytes() if device.type == "cpu" else None


def planned_weight_bytes(model: str | Path, dtype: torch.dtype, itemsize: int | None = None) -> tuple[int, int] | None:
    """(every weight, the weights outside the layers) in bytes of the model `load(model)` would
    build in `dtype` (itemsize: bytes per element instead, e.g. 1 for a lower bound under FP8),
    read from the preset table or config.json alone: nothing is allocated and no tensor read.
    None where that cannot be told without loading (a folder whose config.json is missing or
    wrong: load() then names what is wrong)."""
    name = str(model)
    try:
        if name in PRESETS:
            cfg, tied = PRESETS[name], PRESETS[name].tied
        else:
            cfg, raw = read_config(BUNDLED.get(name, name))
            tied = bool(raw.get("weight_tying") or raw.get("tie_word_embeddings")) or cfg.tied
    except (CheckpointError, InputError, OSError):
        return None
    size = itemsize or torch.empty((), dtype=dtype).element_size()
    numel = {c: math.prod(shape) for c, (_, shape) in family_of(cfg).weight_keys(cfg, tied or cfg.tied).items()}
    outside = sum(n for c, n in numel.items() if not c.startswith("layers."))
    return size * sum(numel.values()), size * outside


def check_room(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tied: bool = False,
               name: str = "model", experts: tuple[int, int] | None = None) -> None:
    """MemoryBudgetError, before anything is allocated, when the weights alone exceed the free
    memory of the device (a preset on the CPU needs weight_bytes of RAM: without this the OS
    kills the process minutes later with no message)."""
    if device.type == "meta":
        return
    free = available_bytes(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    keys = family_of(cfg).weight_keys(cfg, tied or cfg.tied)
    need = itemsize * sum(math.prod(shape) for c, (_, shape) in keys.items() if TS.holds(c, experts))
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


def load_folder(folder: str | Path, device: torch.device, dtype: torch.dtype, *,
                num_layers: int | None = None, tensor: TensorShard | None = None) -> Model:
    """An HF-style checkpoint folder: config.json, model.safetensors (or a sharded index), and
    optionally tokenizer files (tokenizer.py reads them) and generation_config.json. tensor: read
    only this rank's slices (load)."""
    folder = resolve_folder(folder)
    cfg, raw = read_config(folder)
    full_layers = cfg.num_layers
    if num_layers:
        cfg = cfg.truncated(min(num_layers, cfg.num_layers))
    where = shards(folder)
    tied = bool(raw.get("weight_tying") or raw.get("tie_word_embeddings")) or cfg.tied
    tokenizer = TextTokenizer.from_folder(folder)    # a broken tokenizer fails before the weights load
    generation_defaults, cfg = read_generation_defaults(folder, cfg, raw)
    part = cfg if tensor is None else TS.shard_config(cfg, tensor.world)
    held = TS.experts(cfg, tensor)
    check_room(part, device, dtype, tied, name=folder.name, experts=held)
    model, keys, slots = allocate(part, device, dtype, tied, name=folder.name, experts=held)
    cuts = None
    if tensor is not None:   # the stored (full) shapes, and the slice of each this rank reads
        keys = family_of(cfg).weight_keys(cfg, tied or cfg.tied)
        cuts = {c: w for c in keys if (w := TS.cut(c, cfg, tensor)) is not None}
    wanted = {hf: (canon, shape) for canon, (hf, shape) in keys.items()}
    check_names(folder, cfg, full_layers, wanted, where)
    by_file: dict[Path, list[str]] = {}
    for hf, (canon, _) in wanted.items():
        if canon in slots:    # tensor parallelism: another rank's experts stay in the file
            by_file.setdefault(where[hf], []).append(hf)
    bad_shape, bad_dtype = [], []
    for path, names in by_file.items():
        read_file(path, names, wanted, slots, device, bad_shape, bad_dtype, cuts)
    if bad_shape:
        raise CheckpointError(f"{folder}: tensors of the wrong shape: {bad_shape}")
    if bad_dtype:
        raise CheckpointError(f"{folder}: tensor dtypes not supported ({bad_dtype}); "
                              f"supported: {sorted(LOADABLE)}")
    model.tokenizer = tokenizer
    model.generation_defaults = generation_defaults
    model.hf_config = raw
    if num_layers:
        model.charged_layers = full_layers
    if tensor is not None:
        TS.finish(model, tensor)
    return model


def read_generation_defaults(folder: Path, cfg: ModelConfig, raw: dict | None = None) -> tuple[dict, ModelConfig]:
    """The request defaults a checkpoint sets, and cfg with generation_config.json's end-of-text
    ids added (an eos_token_id list ends the text at any of its ids). The defaults: what the
    family's published code takes from the checkpoint itself (Family.checkpoint_defaults: a
    config.json field, the generate() it ships), overridden by generation_config.json's
    sampling fields, which become the request defaults (engine.generation_config) unless the
    family's published sampler does not read them (Family.reads_generation_config: then they
    are named in a warning); every other field is named in one warning
    (checkpoint_fields.generation_fields)."""
    fam = family_of(cfg)
    base = fam.checkpoint_defaults(raw or {}, folder) if fam.checkpoint_defaults is not None else {}
    path = folder / "generation_config.json"
    if not path.exists():
        return base, cfg
    data = read_json(path, "generation defaults")
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not an object of fields")
    ids = {"eos_id": cfg.eos_id, "extra_eos_ids": cfg.extra_eos_ids, "pad_id": cfg.pad_id, "bos_id": cfg.bos_id,
           "mask_id": cfg.mask_id, "eot_id": cfg.eot_id}
    sampling = {f.name for f in dataclasses.fields(GenerationConfig)} | {"gen_length"}
    defaults, ids = generation_fields(data, ids, cfg.vocab, sampling, where=str(path))
    if defaults and not fam.reads_generation_config:
        warnings.warn(f"{path}: {sorted(defaults)} left out: the published {fam.display} sampler does not read "
                      "generation_config.json's sampling fields (only its end-of-text ids)", ConfigFieldWarning,
                      stacklevel=3)
        defaults = {}
    return base | defaults, dataclasses.replace(cfg, eos_id=ids["eos_id"], extra_eos_ids=ids["extra_eos_ids"])


