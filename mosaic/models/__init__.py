"""Model weights in one container; the step program itself lives in layers.py."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..config import ModelConfig
from .families import FAMILIES, PRESETS, family_of, qkv_widths
from .fusion import fuse_layer

__all__ = ["KEYS", "PRESETS", "Model", "allocate", "fill_random", "inv_freq"]
# canonical key -> (checkpoint key, shape) per family (the records' weight_keys)
KEYS = {name: fam.weight_keys for name, fam in FAMILIES.items()}


@dataclass
class Model:
    cfg: ModelConfig
    embed: torch.Tensor                  # [V, d]
    final_norm: torch.Tensor             # [d]
    lm_head: torch.Tensor                # [V, d]
    layers: list[dict[str, torch.Tensor]]
    inv_freq: torch.Tensor               # [rot/2] fp32
    name: str = "model"
    tokenizer: object | None = None
    generation_defaults: dict = field(default_factory=dict)
    hf_config: dict = field(default_factory=dict)   # config.json as read (compat: the official defaults)
    charged_layers: int | None = None    # depth-truncated model charged the full weights (bench)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)   # e.g. embed_scale (FP8 embedding)
    quantized: bool = False              # some weights are FP8 (models/precision.py)
    precision: list[str] = field(default_factory=list)   # per layer: "fp8" or the model dtype's name
    packed_layers: list | None = None    # offloaded: each layer's pinned host bytes (runtime/placement.py)
    tensor: object | None = None         # graph.tensor.TensorShard: this rank's heads and FFN columns (tensor parallel)
    fused: list[dict[str, torch.Tensor]] | None = None   # per layer: fused projections (models/fusion.py)
    fusion: tuple[str, ...] = ()         # what fuse_projections was asked for (kept when layers move)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.final_norm.dtype     # the embedding may be FP8 (models/precision.py)

    def weight_bytes(self, layers: bool = True) -> int:
        """Bytes of the weights (FP8 layers count their e4m3 codes and scales); layers=False:
        only those outside the layers (embedding, final norm, LM head), which stay on the device
        when the layers are offloaded to host memory."""
        seen, total = set(), 0
        for t in [self.embed, self.final_norm, self.lm_head, self.inv_freq, *self.extra.values()] + \
                ([w for lw in self.layers for w in lw.values()] if layers else []):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        if self.charged_layers and layers:
            per_layer = sum(w.numel() * w.element_size() for w in self.layers[0].values())
            total += per_layer * (self.charged_layers - len(self.layers))
        return total

    def set_precision(self, precision: list[str], fp8_name: str = "fp8") -> None:
        """Record each layer's weight dtype after a precision transform (models/precision.py)."""
        self.precision = list(precision)
        self.quantized = fp8_name in self.precision or "embed_scale" in self.extra

    def set_embedding(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        """The embedding as FP8 codes [V, d] with one fp32 scale per row [V] (models/precision.py)."""
        self.embed = codes
        self.extra["embed_scale"] = scale
        self.quantized = True

    def set_packed_layers(self, layers: list, packed: list | None) -> None:
        """The layers' tensors where they now live and, offloaded, each layer's pinned host bytes
        (runtime/placement.py); the previous tensors are released, fused projections with them
        (made again when the layers come back to the device)."""
        self.layers[:] = layers
        self.packed_layers = packed
        self.fused = None
        if packed is None and self.fusion:
            self.fuse_projections(self.fusion)

    def fuse_projections(self, parts: tuple[str, ...] = ("gate_up",)) -> None:
        """Fuse each layer's projections named in parts ("qkv", "gate_up"; models/fusion.py): the
        fused matrices replace the separate ones, which become views of them (same bytes). Not
        for FP8 layers, a tensor-parallel share or offloaded layers. Idempotent."""
        self.fusion = tuple(parts)
        if self.tensor is not None or self.packed_layers is not None or not parts:
            return
        if self.fused is None:
            self.fused = [{} for _ in self.layers]
        for lw, have in zip(self.layers, self.fused):
            have.update(fuse_layer(lw, tuple(p for p in parts if p not in have)))

    def set_tensor(self, shard) -> None:
        """Record that this model holds one rank's share (graph.tensor.TensorShard) of the heads
        and FFN columns (models/tensor_shard.py): its step program reduces the row-parallel sums."""
        self.tensor = shard

    def release(self) -> None:
        """Drop every weight tensor (an engine that loaded this model is closed): the device memory
        goes back now, not when the garbage collector finds the model. The model cannot run after."""
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        self.embed = self.lm_head = empty
        self.final_norm = empty
        self.inv_freq = torch.empty(0, dtype=torch.float32, device=self.device)
        self.layers = []
        self.extra = {}
        self.packed_layers = None

    def layer_bytes(self) -> list[int]:
        """Bytes of each layer's weights (what one staging slot must hold: their max)."""
        return [sum(w.numel() * w.element_size() for w in lw.values()) for lw in self.layers]



def inv_freq(cfg: ModelConfig) -> torch.Tensor:
    rot = cfg.rot_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))


def allocate(cfg: ModelConfig, device, dtype, tied: bool = False, name: str = "model",
             experts: tuple[int, int] | None = None):
    """Empty weights on `device` and the slot each checkpoint key is copied into. experts: only
    the routed experts [lo, hi) are held, stacked [hi - lo, ...] (tensor parallelism splits the
    experts across ranks: models/tensor_shard.py); the others get no slot."""
    lo, hi = experts or (0, cfg.num_experts)
    tied = tied or cfg.tied
    fam = family_of(cfg)
    keys = fam.weight_keys(cfg, tied)
    slots: dict[str, torch.Tensor] = {}
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.num_layers)]
    top: dict[str, torch.Tensor] = {}
    expert = re.compile(r"layers\.(\d+)\.(experts_\w+)\.(\d+)$")
    for canon, (_, shape) in keys.items():
        m = expert.match(canon)
        if m:
            i, kind, j = int(m.group(1)), m.group(2), int(m.group(3))
            if not lo <= j < hi:
                continue
            if kind not in layers[i]:  # stacked [E, ...] once per layer and kind
                layers[i][kind] = torch.empty((hi - lo, *shape), dtype=dtype, device=device)
            slots[canon] = layers[i][kind][j - lo]
            continue
        t = torch.empty(shape, dtype=dtype, device=device)
        slots[canon] = t
        if canon.startswith("layers."):
            _, i, leaf = canon.split(".", 2)
            if leaf in fam.fused:   # one checkpoint tensor, row-slice views (LLaDA2: q, k, v)
                a, widths = 0, qkv_widths(cfg)
                for part in fam.fused[leaf]:
                    layers[int(i)][part] = t[a:a + widths[part]]
                    a += widths[part]
                continue
            layers[int(i)][leaf] = t
        else:
            top[canon] = t
    lm_head = top["embed"] if tied else top["lm_head"]
    model = Model(cfg, top["embed"], top["final_norm"], lm_head, layers,
                  inv_freq(cfg).to(device), name=name)
    return model, keys, slots


def fill_random(slots: dict[str, torch.Tensor], seed: int = 0, scale: float = 0.02) -> None:
    """Seeded random weights for the presets: N(0, scale) matrices and biases, unit norms."""
    devices = {t.device for t in slots.values()}
    gens = {dev: torch.Generator(device=dev).manual_seed(seed) for dev in devices}
    for canon, t in slots.items():
        if canon.endswith("norm"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, scale, generator=gens[t.device])
