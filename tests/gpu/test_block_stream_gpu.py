"""The block-diffusion sampler's random stream on CUDA: seeded LLaDA2.0 runs on the GPU (float32,
a tiny random checkpoint) give the tokens of the plain re-implementation of the published
generate() run on the same GPU with a CUDA generator of the same seed, i.e. the one exponential_
call over every row of the block that Mosaic makes is the draw CUDA's torch.multinomial makes
(docs/MODELS.md "The published random stream"; LLaDA2.1 and SDAR draw through the same code).
Skipped without CUDA."""

import json

import pytest
import torch
from conftest import needs_cuda
from plain_families import TINY_LLADA2, llada2_forward, llada2_generate, llada2_keys, random_state
from safetensors.torch import save_file

from mosaic import MosaicEngine, load

pytestmark = [pytest.mark.gpu, needs_cuda]
EOS, MASK = 45, 47


@pytest.fixture(scope="module")
def llada2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llada2")
    sd = random_state(llada2_keys(TINY_LLADA2), 1)
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(TINY_LLADA2))
    return folder, {k: v.cuda() for k, v in sd.items()}


def cut(t, stop):
    t = t.tolist()
    return t[: t.index(stop) + 1] if stop in t else t


@pytest.mark.parametrize("kw", [dict(temperature=0.8), dict(temperature=1.0, top_k=5, top_p=0.9)])
def test_llada20_seeded_on_cuda_is_the_published_stream(llada2, kw):
    folder, sd = llada2
    engine = MosaicEngine(load(folder, device="cuda", dtype="float32"), {"progress": False})
    fwd = lambda ids, m, pos: llada2_forward(sd, TINY_LLADA2, ids, m, pos)  # noqa: E731
    for n, seed in ((5, 1), (9, 2)):
        p = torch.randint(0, 44, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        got = engine.generate([p], max_new_tokens=12, block_length=4, steps=4, seed=seed, **kw)
        with torch.device("cuda"):     # the published code's tensors on the GPU, as it runs there
            ref = llada2_generate(fwd, torch.tensor([p]), block_length=4, steps=4, gen_length=12, eos_id=EOS,
                                  mask_id=MASK, generator=torch.Generator(device="cuda").manual_seed(seed), **kw)
        assert cut(got.tokens[0].cpu(), EOS) == ref.cpu().tolist(), (n, seed, kw)
