"""The model's geometry, numerics and special ids (ModelConfig): what the step program computes.

A family's record (models/families/<name>.py) parses it from a checkpoint's config.json in the
family's published field names and writes it back; everything else a family is lives there too."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    family: str                # the family record's name (models/families: llada, dream, llada2, ...)
    hidden: int                # d
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int                   # F (dense) or expert FFN width (MoE)
    vocab: int                 # V: width of the LM head (LLaDA: embedding_size)
    rope_theta: float
    rms_eps: float
    mask_id: int
    eos_id: int | None         # None: the checkpoint has no end-of-text token
    bos_id: int | None = None
    eot_id: int | None = None
    pad_id: int | None = None
    rotary_dim: int = 0        # 0 = head_dim; LLaDA-MoE may rotate only part of each head
    rope_fp32: bool = True     # LLaDA applies RoPE in fp32; Dream / MoE in the model dtype
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    top_k: int = 0
    logit_shift: bool = False  # Dream: masked position j reads hidden state j-1
    max_seq_len: int = 4096    # trained length; longer is allowed (with a warning)
    extra_eos_ids: tuple[int, ...] = ()  # more end-of-text ids (config.json may list several)
    tied: bool = False         # LM head = embedding (iLLaDA; a preset's byte count needs it)
    o_bias: bool = False       # a bias on the attention output projection (LLaDA2: use_bias)
    # LLaDA2 (BailingMoeV2) MoE: the first `first_dense` layers are dense FFNs of width dense_ffn;
    # the others route top_k of num_experts experts (width ffn) plus shared experts of total
    # width shared_ffn; the router scores (softmax | sigmoid) + a per-expert bias choose experts
    # within the top `topk_groups` of `num_groups` groups; route_norm renormalises the chosen
    # weights, route_scale multiplies them (models/moe_grouped.py)
    first_dense: int = 0
    dense_ffn: int = 0
    shared_ffn: int = 0
    num_groups: int = 1
    topk_groups: int = 1
    route_score: str = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0
    route_bias: bool = False
    # block diffusion (LLaDA2.x, SDAR): generation attends causally across blocks of the sampler's
    # block length and bidirectionally inside one, over an exact block K/V cache
    block_causal: bool = False

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rot_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def truncated(self, num_layers: int) -> ModelConfig:
        return dataclasses.replace(self, num_layers=num_layers)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
