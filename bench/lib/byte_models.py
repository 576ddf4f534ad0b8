"""Tiny random checkpoints with a byte-level tokenizer, one per family: the models that try
hardest to break an output constraint (every token about equally likely, JSON spellable).

`byte_checkpoint(family, folder, seed)` writes config.json, model.safetensors and a
tokenizer.json whose vocabulary is the 256 bytes (GPT-2's byte-level alphabet, no merges) plus
<|eos|> and <|mask|> (and <|bos|>), so every string is spelled one byte per token."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mosaic.config import ModelConfig
from mosaic.loader import save
from mosaic.models import allocate
from mosaic.models.families import config_from_hf

V = 260
EOS, MASK, BOS = 256, 257, 258
SPECIALS = {"<|eos|>": EOS, "<|mask|>": MASK, "<|bos|>": BOS}
FAMILIES = ("llada", "dream", "llada_moe", "llada2")
# a plain chat format (no tool rendering: the server's default tool prompt applies)
CHAT_TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|bos|>assistant: {% endif %}")

_BASE = dict(hidden=32, num_layers=2, num_heads=4, head_dim=8, rope_theta=10000.0, rms_eps=1e-5, vocab=V,
             mask_id=MASK, eos_id=EOS, bos_id=BOS, pad_id=EOS)
LLADA2 = {
    "model_type": "llada2_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48, "moe_intermediate_size": 12, "num_experts": 8,
    "num_experts_per_tok": 3, "num_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
    "score_function": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "moe_router_enable_expert_bias": True, "use_qk_norm": True, "use_qkv_bias": False, "use_bias": False,
    "partial_rotary_factor": 0.5, "rotary_dim": 4, "vocab_size": V, "rope_theta": 600000.0, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512, "tie_word_embeddings": False, "hidden_act": "silu", "pad_token_id": EOS,
    "eos_token_id": EOS, "mask_token_id": MASK,
}


def config(family: str) -> ModelConfig:
    if family == "llada2":
        return config_from_hf(LLADA2)
    if family == "llada":
        return ModelConfig(family="llada", num_kv_heads=4, ffn=48, eot_id=None, **_BASE)
    if family == "dream":
        return ModelConfig(family="dream", num_kv_heads=2, ffn=48, rope_fp32=False, qkv_bias=True,
                           logit_shift=True, **_BASE)
    if family == "llada_moe":
        return ModelConfig(family="llada_moe", num_kv_heads=4, ffn=16, rotary_dim=4, rope_fp32=False, qk_norm=True,
                           num_experts=8, top_k=2, **_BASE)
    raise ValueError(f"family {family!r}: one of {FAMILIES}")


def byte_tokenizer_json() -> str:
    """A byte-level BPE tokenizer.json with no merges: one token per byte, then the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return tok.to_str()


def _byte_of(c: str) -> int:
    from mosaic.runtime.grammar import byte_alphabet
    return byte_alphabet()[c]


def byte_checkpoint(family: str, folder: Path, seed: int = 0) -> Path:
    """A random checkpoint of `family` with the byte-level tokenizer, written to folder."""
    cfg = config(family)
    model, _, slots = allocate(cfg, "cpu", torch.float32, name=f"byte-random-{family}")
    g = torch.Generator().manual_seed(seed)
    for name, t in slots.items():
        if name.endswith("norm"):
            t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
        elif name == "embed":
            t.copy_(torch.randn(t.shape, generator=g))
        elif name.endswith("expert_bias"):
            t.copy_(0.05 * torch.randn(t.shape, generator=g))
        else:
            t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)
    folder = Path(folder)
    save(model, folder, LLADA2 if family == "llada2" else None)
    (folder / "tokenizer.json").write_text(byte_tokenizer_json())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>", "bos_token": "<|bos|>",
                                                             "chat_template": CHAT_TEMPLATE}))
    return folder


__all__ = ["BOS", "EOS", "FAMILIES", "MASK", "V", "byte_checkpoint", "config"]
