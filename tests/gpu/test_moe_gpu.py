"""The MoE experts on the GPU: torch._grouped_mm gives the per-expert loop's bits in bf16 at the
presets' geometry, the grouped path runs with torch's sync detector set to error and captures
into a CUDA graph, and MoE steps of both families are captured by the engine (no failure) with
the eager tokens. Skipped without CUDA."""

import pytest
import torch
from conftest import left_padded, needs_cuda

from mosaic import MosaicEngine, load
from mosaic.kernels import moe as MK
from mosaic.kernels import reference as R

pytestmark = [pytest.mark.gpu, needs_cuda]

GEOMETRY = {"llada2-mini": (256, 8, 512, 2048), "llada-moe-7b": (64, 8, 1024, 2048)}   # E, k, F, d


def _case(name, n, seed=0):
    E, k, F, d = GEOMETRY[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16
    h = torch.randn(n, d, device="cuda", generator=g).to(bf)
    w = [(torch.randn(E, F, d, device="cuda", generator=g) * 0.02).to(bf),
         (torch.randn(E, F, d, device="cuda", generator=g) * 0.02).to(bf),
         (torch.randn(E, d, F, device="cuda", generator=g) * 0.02).to(bf)]
    top_i = torch.rand(n, E, device="cuda", generator=g).topk(k, dim=-1)[1]
    return h, w, top_i, k


def _silu_mul(g, u):
    R.silu_mul_(g, u)


def _grouped(h, w, top_i, k, slots, xs):
    order, offs = MK.sort_by_expert(top_i, num_experts=w[0].shape[0])
    MK.experts_grouped(slots, h, order, offs, k, *w, xs, _silu_mul)


@pytest.mark.parametrize("name", list(GEOMETRY))
@pytest.mark.parametrize("n", [1, 32, 256])
def test_grouped_gives_the_loops_bits(name, n):
    h, w, top_i, k = _case(name, n)
    d, F = h.shape[1], w[0].shape[1]
    loop = torch.empty(n * k, d, device="cuda", dtype=h.dtype)
    order, offs = MK.sort_by_expert(top_i, num_experts=w[0].shape[0])
    scratch = [torch.empty(n, c, device="cuda", dtype=h.dtype) for c in (d, F, F)]
    MK.experts_loop(loop, h, order, offs, k, *w, *scratch, R.linear, _silu_mul)
    got = torch.empty_like(loop)
    _grouped(h, w, top_i, k, got, torch.empty_like(loop))
    assert torch.equal(got, loop)


def test_grouped_path_never_syncs_and_captures():
    h, w, top_i, k = _case("llada2-mini", 32)
    slots, xs = torch.empty(32 * k, h.shape[1], device="cuda", dtype=h.dtype), torch.empty(32 * k, h.shape[1],
                                                                                          device="cuda", dtype=h.dtype)
    _grouped(h, w, top_i, k, slots, xs)                      # warm (library handles, workspaces)
    ref = slots.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _grouped(h, w, top_i, k, slots, xs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _grouped(h, w, top_i, k, slots, xs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    slots.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(slots, ref)


def test_triton_kernel_is_close_to_the_loop():
    pytest.importorskip("triton")
    for name in GEOMETRY:
        h, w, top_i, k = _case(name, 32)
        R_, d, F, E = 32 * k, h.shape[1], w[0].shape[1], w[0].shape[0]
        ref = torch.empty(R_, d, device="cuda", dtype=h.dtype)
        _grouped(h, w, top_i, k, ref, torch.empty_like(ref))
        got = torch.empty_like(ref)
        order, offs = MK.sort_by_expert(top_i, num_experts=E)
        nb = MK.num_blocks(R_, E, MK.tiles(R_, E, h.dtype)[0])
        MK.experts_triton(got, h, order, offs, k, *w, torch.empty(R_, F, device="cuda", dtype=h.dtype),
                   torch.empty(3, nb, device="cuda", dtype=torch.int32))
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("preset, opts", [("llada-moe-7b", dict(block_length=8, steps=16)),
                                          ("llada2-mini", dict(block_length=8, steps=8))])
def test_moe_steps_are_captured_with_the_eager_tokens(preset, opts):
    model = load(preset, device="cuda", dtype="bfloat16", num_layers=3)
    graphs = MosaicEngine(model, {"progress": False})
    eager = MosaicEngine(model, {"progress": False, "cuda_graphs": "off"})
    prompt = [7 + i % 500 for i in range(200)]
    for _ in range(2):
        assert torch.equal(graphs.generate(prompt, max_new_tokens=16, **opts).tokens,
                           eager.generate(prompt, max_new_tokens=16, **opts).tokens)
    st = graphs.graphs.stats
    assert st.captures >= 1 and st.replays > st.captures and not st.failures, st


def test_llada_moe_planned_tokens_equal_the_native_loops():
    """The planned step's grouped GEMM against the native path's per-expert loop (the published
    structure): the same tokens (the exact sampler, bf16)."""
    model = load("llada-moe-7b", device="cuda", dtype="bfloat16", num_layers=3)
    prompt = [7 + i % 500 for i in range(300)]
    opts = dict(max_new_tokens=16, block_length=8, steps=16)
    planned = MosaicEngine(model, {"progress": False}).generate(prompt, **opts)
    native = MosaicEngine(model, {"progress": False, "native": True}).generate(prompt, **opts)
    assert torch.equal(planned.tokens, native.tokens)


@pytest.mark.parametrize("fp32", [True, False])
def test_combine_kernel_gives_the_references_bits(fp32):
    """One Triton launch for the k weighted slots (LLaDA2: fp32 sum; LLaDA-MoE: bf16 sums, with a
    tensor-parallel mask) against the reference's 2k + 2 PyTorch ops, bit for bit."""
    pytest.importorskip("triton")
    from mosaic.kernels import moe_combine_triton as T
    g = torch.Generator(device="cuda").manual_seed(3)
    n, k, d = 96, 8, 2048
    slots = torch.randn(n * k, d, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand(n, k, device="cuda", generator=g)
    w = w if fp32 else w.to(torch.bfloat16)
    held = None if fp32 else torch.rand(n, k, device="cuda", generator=g) > 0.3
    ref, got = (torch.empty(n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if fp32:
        MK.combine_f32(ref, slots, w, torch.empty(n, d, device="cuda"))
    else:
        MK.combine_model_dtype(ref, slots, w, held)
    T.combine(got, slots, w, fp32, held)
    assert torch.equal(got, ref)


def test_llada2_batched_block_steps_are_captured():
    """One left-padded request of four rows runs its block steps batched (one flash varlen
    attention over every (sequence, block) entry): captured, with the eager tokens, labelled."""
    model = load("llada2-mini", device="cuda", dtype="bfloat16", num_layers=3)
    prompts = [[7 + (i * 31 + b) % 500 for i in range(n)] for b, n in enumerate((300, 120, 260, 64))]
    inputs, mask = left_padded(model.cfg, prompts)
    opts = dict(max_new_tokens=32, block_length=8, steps=8, inputs=inputs, attention_mask=mask)
    graphs = MosaicEngine(model, {"progress": False})
    eager = MosaicEngine(model, {"progress": False, "cuda_graphs": "off"})
    for _ in range(2):
        got = graphs.generate(**opts)
        assert torch.equal(got.tokens, eager.generate(**opts).tokens)
    st = graphs.graphs.stats
    assert st.captures >= 1 and st.replays > st.captures and not st.failures, st
    assert any("varlen" in label for label in got.lossy)


def test_llada2_requests_stack_into_captured_steps():
    """Four requests (a list of prompts: a batch of requests under the Scheduler) at different
    block positions run their block steps as one stacked step over the paged K/V pool, padded to
    its batch bucket and captured once per bucket, with the eager tokens."""
    model = load("llada2-mini", device="cuda", dtype="bfloat16", num_layers=3)
    prompts = [[7 + (i * 31 + b) % 500 for i in range(n)] for b, n in enumerate((300, 120, 260, 64))]
    opts = dict(max_new_tokens=32, block_length=8, steps=8)
    graphs = MosaicEngine(model, {"progress": False})
    eager = MosaicEngine(model, {"progress": False, "cuda_graphs": "off"})
    for _ in range(2):
        got = graphs.generate(prompts, **opts)
        assert torch.equal(got.tokens, eager.generate(prompts, **opts).tokens)
    st = graphs.graphs.stats
    assert st.captures >= 1 and st.replays > st.captures and not st.failures, st
    assert any(k[3] and k[3][0] == "pool" for k in graphs.graphs.graphs), "no stacked step was captured"


@pytest.mark.parametrize("preset", ["llada-moe-7b", "llada2-mini"])
def test_moe_steps_are_captured_under_a_budget(preset):
    """Under a 20 GiB budget (the guard's pool holds the graphs' transients) the MoE block steps
    are captured and replayed, with the unbudgeted tokens."""
    model = load(preset, device="cuda", dtype="bfloat16", num_layers=3)
    prompt = [7 + i % 500 for i in range(200)]
    opts = dict(max_new_tokens=16, block_length=8, steps=8)
    if preset == "llada-moe-7b":
        opts.update(cache="dual", threshold=0.9)
    want = MosaicEngine(model, {"progress": False}).generate(prompt, **opts).tokens
    eng = MosaicEngine(model, {"progress": False, "memory_budget": "20GiB"})
    for _ in range(2):
        got = eng.generate(prompt, **opts)
        assert torch.equal(got.tokens, want)
    g = got.stats["graphs"]
    assert g["mode"] == "captured" and g["replays"] > 0 and g["failures"] == 0, g
