from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from plain_families import TINY_ILLADA, TINY_LLADA2  # noqa: E402

from mosaic.config import ModelConfig  # noqa: E402
from mosaic.loader import BUNDLED, save  # noqa: E402
from mosaic.models import allocate  # noqa: E402
from mosaic.models.families import config_from_hf  # noqa: E402

os.environ.setdefault("TQDM_DISABLE", "1")
if not torch.cuda.is_available():  # Triton kernels run on CPU tensors under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY = {
    "llada": ModelConfig(
        family="llada", hidden=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8, ffn=48,
        vocab=37, rope_theta=10000.0, rms_eps=1e-5, mask_id=36, eos_id=35, bos_id=34, eot_id=33,
        pad_id=35),
    "dream": ModelConfig(
        family="dream", hidden=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn=48,
        vocab=41, rope_theta=10000.0, rms_eps=1e-6, mask_id=40, eos_id=39, bos_id=38, pad_id=39,
        rope_fp32=False, qkv_bias=True, logit_shift=True),
    "llada_moe": ModelConfig(
        family="llada_moe", hidden=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8,
        ffn=16, vocab=43, rope_theta=50000.0, rms_eps=1e-5, mask_id=42, eos_id=41, bos_id=40,
        pad_id=41, rotary_dim=4, rope_fp32=False, qk_norm=True, num_experts=8, top_k=2),
}
# the new families from their official config.json field names (tests/plain_families.py)
TINY["illada"] = config_from_hf(TINY_ILLADA)
TINY["llada2"] = config_from_hf(TINY_LLADA2)


def random_model(family: str, seed: int = 0, dtype=torch.float32, **changes):
    """A small random model whose distributions are peaked enough that near-ties are rare."""
    cfg = dataclasses.replace(TINY[family], **changes)
    model, _, slots = allocate(cfg, "cpu", dtype, name=f"tiny-random-{family}")
    g = torch.Generator().manual_seed(seed)
    for name, t in slots.items():
        if name.endswith("norm"):
            t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
        elif name == "embed":
            t.copy_(torch.randn(t.shape, generator=g))
        else:
            t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)
    return model


@pytest.fixture(params=["llada", "dream", "llada_moe"])
def family(request):
    return request.param


@pytest.fixture
def saved(tmp_path):
    """family -> (folder of a saved random checkpoint, the model)."""
    def make(fam, seed=0):
        m = random_model(fam, seed)
        return save(m, tmp_path / fam), m
    return make


def bundled(name="tiny-llada"):
    path = BUNDLED[name]
    if not (path / "model.safetensors").exists():
        pytest.skip(f"bundled model {name} is not trained yet")
    return path


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def left_padded(cfg, prompts):
    """[B, P] left-padded ids (the pad id) and their attention mask, as a tokenizer writes them:
    generate(inputs=ids, attention_mask=mask) runs them as ONE request of B rows (the references'
    batch), where a list of prompts is a batch of requests."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), cfg.pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    return ids, mask


# GPU tests share one process (`pytest -m gpu tests/gpu`): an engine a module made and left open
# holds its arena, K/V pool and graphs, and every later budgeted engine counts them as memory the
# process already holds (H200: 10 budget tests refused after earlier modules, run4_cebfa5a.log).
# So on CUDA every module's engines are closed when it ends, and each test's garbage collected.
_ENGINES = None


def _track_engines():
    global _ENGINES
    if _ENGINES is None:
        import weakref

        from mosaic import MosaicEngine
        _ENGINES = weakref.WeakSet()
        init = MosaicEngine.__init__

        def tracked(self, *a, **k):
            init(self, *a, **k)
            _ENGINES.add(self)
        MosaicEngine.__init__ = tracked
    return _ENGINES


@pytest.fixture(autouse=True, scope="module")
def _close_gpu_engines():
    if not torch.cuda.is_available():
        yield
        return
    engines = _track_engines()
    yield
    import gc
    for e in list(engines):
        try:
            e.close()
        except Exception:      # an engine a test broke on purpose: its memory goes with it below
            pass
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _collect_gpu_garbage():
    yield
    if torch.cuda.is_available():
        import gc
        gc.collect()
        torch.cuda.empty_cache()
