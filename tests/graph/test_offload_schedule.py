"""The weight prefetch schedule and the K/V block stream, with fake streams.

FakeClock simulates the compute stream and the side (copy) stream: events carry completion
times, a copy starts when the side stream is free and its `after` event has happened, compute
advances only the compute stream. From its log the tests check the two orderings the real CUDA
streams must keep (copy -> compute, compute -> next overwrite) and that copies run ahead.
LazyCopies performs a copy only when the compute stream waits for it, so a program that reads a
staging slot before waiting sees stale bytes: outputs equal to the resident path's prove every
read waited for its copy."""

import pytest
import torch
from conftest import random_model
from fake_streams import FakeClock, LazyCopies, NoWait

from mosaic.graph.ctx import EagerCtx
from mosaic.graph.streams import Offload, Prefetcher, pack_layout, stream_attention, views
from mosaic.kernels.attention_ref import attention_ref
from mosaic.models.layers import step_program
from mosaic.models.step import Chunks, make_step


def host_layers(n, sizes=(64, 64), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"a": torch.randn(sizes[0], generator=g), "b": torch.randn(sizes[1], generator=g)} for _ in range(n)]


def run_schedule(n_layers, ahead, compute_s, bw):
    layers = host_layers(n_layers)
    layouts = [pack_layout(lw) for lw in layers]
    nbytes = max(n for _, n in layouts)
    slots = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(ahead + 1)]
    clock = FakeClock(bw)
    pf = Prefetcher(clock, slots, [lay for lay, _ in layouts], layers)
    pf.start()
    seen = []
    for i in range(n_layers):
        lw = pf.acquire(i)
        seen.append(all(torch.equal(lw[k], layers[i][k]) for k in lw))
        clock.compute(compute_s, slots[i % len(slots)].data_ptr())
        pf.release(i)
    return clock, slots, seen, nbytes


@pytest.mark.parametrize("ahead", [1, 2, 3])
@pytest.mark.parametrize("compute_s, bw", [(10.0, 1e9), (1e-9, 1.0), (3.0, 100.0)])
def test_copies_never_overwrite_a_slot_in_use_and_compute_waits_for_its_copy(ahead, compute_s, bw):
    n = 7
    clock, slots, seen, _ = run_schedule(n, ahead, compute_s, bw)
    assert all(seen)
    copies = [e for e in clock.log if e[0] == "copy"]
    computes = [e for e in clock.log if e[0] == "compute"]
    assert len(copies) == n and len(computes) == n
    for i, c in enumerate(computes):
        cp = copies[i]
        assert cp[1] == c[1]                       # layer i was copied into the slot it computes on
        assert c[2] >= cp[3]                       # copy -> compute
        nxt = i + len(slots)
        if nxt < n:
            assert copies[nxt][1] == c[1] and copies[nxt][2] >= c[3]   # compute -> next overwrite


def test_copies_are_issued_ahead_and_hide_behind_compute():
    n, ahead = 8, 1
    clock, _, _, nbytes = run_schedule(n, ahead, compute_s=10.0, bw=nbytes_per_s(2.0))
    order = {("copy", i): e[4] for i, e in enumerate(e for e in clock.log if e[0] == "copy")}
    order |= {("compute", i): e[4] for i, e in enumerate(e for e in clock.log if e[0] == "compute")}
    for i in range(n - 1):
        assert order[("copy", i + 1)] < order[("compute", i)]        # issued a layer ahead
        assert order[("copy", i + 1)] < order[("compute", i + 1)]
    # copies take 2 s, compute 10 s: only the first copy is exposed
    assert clock.compute_t == pytest.approx(2.0 + n * 10.0)


def nbytes_per_s(seconds_per_layer):
    return max(n for _, n in (pack_layout(lw) for lw in host_layers(1))) / seconds_per_layer


def test_transfer_bound_schedule_runs_at_the_copy_rate():
    n = 6
    clock, _, _, nbytes = run_schedule(n, 1, compute_s=1.0, bw=nbytes_per_s(5.0))
    assert clock.compute_t == pytest.approx(n * 5.0 + 1.0)


def run(model, step, copier):
    ctx = EagerCtx("cpu", torch.float32, copier=copier)
    ctx.new = lambda name, shape, dtype=None: torch.full(tuple(shape), 7, dtype=dtype or torch.float32) \
        if (dtype or torch.float32).is_floating_point else torch.full(tuple(shape), 7, dtype=dtype)
    return step_program(ctx, model, step)


@pytest.mark.parametrize("off", [Offload(1), Offload(2), Offload(1, kv=True, kv_block_rows=5),
                                 Offload(2, kv=True, kv_block_rows=64)])
def test_step_program_reads_staged_weights_only_after_their_copy(family, off):
    model = random_model(family, num_layers=4)
    ids = torch.randint(0, model.cfg.vocab - 4, (2, 24))
    ids[:, 16:] = model.cfg.mask_id
    step = make_step(model.cfg, ids, None, chunks=Chunks(3, 2, 1))
    ref = step_program(EagerCtx("cpu", torch.float32), model, step)
    out = run(model, step.with_(offload=off), LazyCopies())
    tol = 0 if not off.kv else 1e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_the_lazy_check_catches_a_schedule_that_does_not_wait(family):
    model = random_model(family, num_layers=3)
    ids = torch.randint(0, model.cfg.vocab - 4, (1, 16))
    step = make_step(model.cfg, ids, None)
    ref = step_program(EagerCtx("cpu", torch.float32), model, step)
    out = run(model, step.with_(offload=Offload(1)), NoWait())
    assert not torch.allclose(out, ref)


@pytest.mark.parametrize("nq, nk, hq, hkv, block", [(7, 50, 4, 4, 16), (33, 100, 4, 2, 7), (5, 9, 6, 3, 64),
                                                    (16, 64, 2, 1, 64), (3, 1, 2, 2, 1)])
def test_streamed_blocks_merge_to_dense_attention(nq, nk, hq, hkv, block):
    g = torch.Generator().manual_seed(nq + nk)
    hd = 8
    q = torch.randn(nq, hq, hd, generator=g)
    k, v = torch.randn(nk, hkv, hd, generator=g) * 2, torch.randn(nk, hkv, hd, generator=g)
    dense = torch.empty(nq, hq * hd)
    attention_ref(dense, q, k, v)
    kb = min(block, nk)
    out = torch.empty(nq, hq * hd)
    slots = [torch.empty(kb, hkv, hd) for _ in range(4)]
    f32 = lambda *s: torch.empty(*s)  # noqa: E731
    for eng in (FakeClock(), LazyCopies()):
        stream_attention(eng, out, q, k, v, slots[:2], slots[2:], f32(nq, hq * hd), f32(hq, nq),
                         f32(nq, hq, hd), f32(hq, nq), f32(hq, nq), f32(hq, nq), torch.empty(1, dtype=torch.uint8),
                         impl="torch")
        torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


def test_pack_layout_aligns_and_views_round_trip():
    lw = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2).bfloat16()}
    layout, n = pack_layout(lw)
    assert all(off % 256 == 0 for off, _, _ in layout.values()) and n % 256 == 0
    buf = torch.empty(n, dtype=torch.uint8)
    v = views(buf, layout)
    for k in lw:
        v[k].copy_(lw[k])
    assert all(torch.equal(views(buf, layout)[k], lw[k]) for k in lw)
