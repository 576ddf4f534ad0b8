"""K and V written back to host memory through two device chunk buffers, with fake streams.

The write-back (streams.WriteBack) copies chunk c's K and V to host on the side stream while
the first query chunk attends to it and chunk c + 1 is projected; chunk c + 2 reuses chunk c's
buffer only after that copy. FakeClock checks the orderings and the overlap on a simulated
clock; LazyCopies (a copy happens only when waited on) proves in the whole step program that no
buffer is overwritten before its copy and no host row is read back before its write: the
logits equal the non-overlapped schedule's bit for bit."""

import pytest
import torch
from conftest import random_model
from fake_streams import FakeClock, LazyCopies, ptr

import mosaic.graph.streams as S
from mosaic.graph.ctx import EagerCtx
from mosaic.graph.record import record
from mosaic.graph.streams import Offload, WriteBack, stream_attention
from mosaic.models.layers import step_program
from mosaic.models.step import Chunks, make_step
from mosaic.policy.probe import probe_step


def write_back(n_chunks, n_slots, compute_s, copy_s, rows=4, width=8):
    """Drive WriteBack as the layer program does: wait for the slot, compute into it, copy it."""
    host = torch.zeros(n_chunks * rows, width)
    slots = [torch.empty(rows, width) for _ in range(n_slots)]
    clock = FakeClock(bw=rows * width * 4 / copy_s)
    wb = WriteBack(clock, n_slots)
    for c in range(n_chunks):
        wb.acquire(c)
        slot = slots[c % n_slots]
        clock.compute(compute_s, ptr(slot))
        slot.fill_(c)
        wb.release(c, [(host[c * rows:(c + 1) * rows], slot)])
    wb.drain()
    return clock, host, slots


@pytest.mark.parametrize("n_slots", [1, 2, 3])
@pytest.mark.parametrize("compute_s, copy_s", [(3.0, 1.0), (1.0, 3.0), (2.0, 2.0)])
def test_no_buffer_is_overwritten_before_its_copy_and_copies_follow_their_compute(n_slots, compute_s, copy_s):
    n = 7
    clock, host, slots = write_back(n, n_slots, compute_s, copy_s)
    assert torch.equal(host, torch.arange(n).repeat_interleave(4)[:, None].expand(-1, 8).float())
    copies = [e for e in clock.log if e[0] == "copy"]
    computes = [e for e in clock.log if e[0] == "compute"]
    for c in range(n):
        assert copies[c][5] == computes[c][1] == ptr(slots[c % n_slots])   # chunk c's slot, on the side stream
        assert copies[c][2] >= computes[c][3]                               # compute -> copy
        if c + n_slots < n:
            assert computes[c + n_slots][2] >= copies[c][3]                 # copy -> overwrite
    assert clock.compute_t >= copies[-1][3]                                 # drain waited for the last


def test_two_buffers_hide_the_copy_behind_the_next_chunks_compute():
    n = 6
    one, _, _ = write_back(n, 1, compute_s=3.0, copy_s=1.0)
    two, _, _ = write_back(n, 2, compute_s=3.0, copy_s=1.0)
    assert one.compute_t == pytest.approx(n * (3.0 + 1.0))         # today's schedule: every copy exposed
    assert two.compute_t == pytest.approx(n * 3.0 + 1.0)           # only the last one
    bound, _, _ = write_back(n, 2, compute_s=1.0, copy_s=3.0)      # copy-bound: at the copy rate
    assert bound.compute_t == pytest.approx(1.0 + n * 3.0)


def run(model, step, copier):
    ctx = EagerCtx("cpu", torch.float32, copier=copier)
    ctx.new = lambda name, shape, dtype=None: torch.full(tuple(shape), 7, dtype=dtype or torch.float32)
    return step_program(ctx, model, step), ctx


def streamed(model, slots, block=5, attn=3):
    ids = torch.randint(0, model.cfg.vocab - 4, (2, 24), generator=torch.Generator().manual_seed(1))
    ids[:, 16:] = model.cfg.mask_id
    step = make_step(model.cfg, ids, None, chunks=Chunks(attn, 2, 1))
    return step, step.with_(offload=Offload(1, kv=True, kv_block_rows=block, kv_write_slots=slots))


@pytest.mark.parametrize("block, attn", [(5, 3), (7, 1), (64, 2)])
def test_overlapped_write_back_equals_the_non_overlapped_path_bitwise(family, block, attn):
    model = random_model(family, num_layers=3)
    step, two = streamed(model, 2, block, attn)
    _, one = streamed(model, 1, block, attn)
    out2, _ = run(model, two, LazyCopies())
    out1, _ = run(model, one, LazyCopies())
    assert torch.equal(out2, out1)
    ref = step_program(EagerCtx("cpu", torch.float32), model, step)
    torch.testing.assert_close(out2, ref, rtol=1e-5, atol=1e-5)     # resident: the merge's rounding


def test_the_lazy_check_catches_a_write_back_that_does_not_wait(monkeypatch):
    model = random_model("llada", num_layers=2)
    step, two = streamed(model, 2)
    good, _ = run(model, two, LazyCopies())
    monkeypatch.setattr(WriteBack, "acquire", lambda self, c: None)   # overwrite before the copy
    bad, _ = run(model, two, LazyCopies())
    assert not torch.allclose(bad, good)


def test_host_rows_are_read_back_only_after_their_write_and_on_the_side_stream():
    model = random_model("llada", num_layers=2)
    _, two = streamed(model, 2)
    clock = FakeClock(bw=1e3)
    _, ctx = run(model, two, clock)
    host = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in ctx.host_pool.bufs.values()]
    in_host = lambda p: any(a <= p < b for a, b in host)  # noqa: E731
    copies = [e for e in clock.log if e[0] == "copy"]
    kinds = ["w" if in_host(e[1]) else "r" if in_host(e[5]) else "weights" for e in copies]
    assert kinds.count("w") == 2 * 2 * 5             # 2 layers x 2 sequences x 5 chunks of <= 5 rows
    for i, e in enumerate(copies[1:], 1):
        assert e[2] >= copies[i - 1][3]              # one side stream, in issue order
    kv = [k for k in kinds if k != "weights"]
    # per sequence: all of its writes, then the reads of the 2 later query chunks x 5 key blocks
    # (the first query chunk attends to each chunk of K and V on the device, reading nothing back)
    assert kv == (["w"] * 5 + ["r"] * 10) * 4


def test_one_query_chunk_keeps_k_and_v_on_the_device():
    model = random_model("llada", num_layers=2)
    step, one = streamed(model, 2, attn=1)
    clock = FakeClock(bw=1e3)
    out, ctx = run(model, one, clock)
    assert ctx.host_pool is None                     # no host K/V
    assert sum(e[0] == "copy" for e in clock.log) == 2       # one per layer: its weights (prefetch)
    torch.testing.assert_close(out, step_program(EagerCtx("cpu", torch.float32), model, step), rtol=1e-5, atol=1e-5)
    t = record(step_program, model, one, dtype=torch.float32)
    assert t.host_bytes == 0 and [b.name for b in t.buffers].count("k_dev") == 2   # one per sequence


@pytest.mark.parametrize("slots", [2, 1])
def test_the_write_back_hides_behind_the_first_query_chunks_attention(monkeypatch, slots):
    """Each chunk's copy to host runs while the first query chunk attends to that chunk (with
    one buffer, the schedule without overlap, none does)."""
    model = random_model("llada", num_layers=2)
    _, two = streamed(model, slots)
    clock = FakeClock(bw=5 * 32 * 4 * 2 / 1.0)          # a chunk's K and V (5 rows x kv_dim 32): 1 s
    real = S.A.attention_into

    def timed(out, q, k, v, **kw):
        real(out, q, k, v, **kw)
        clock.compute(1000.0, ptr(k))                  # attention over a block: longer than any copy
    monkeypatch.setattr(S.A, "attention_into", timed)
    _, ctx = run(model, two, clock)
    host = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in ctx.host_pool.bufs.values()]
    writes = [e for e in clock.log if e[0] == "copy" and any(a <= e[1] < b for a, b in host)]
    computes = [e for e in clock.log if e[0] == "compute"]
    assert len(writes) == 20
    for w in writes:                                   # inside one block's attention: hidden
        assert any(c[2] <= w[2] and w[3] <= c[3] for c in computes) == (slots == 2)


def test_key_block_reads_overlap_the_previous_blocks_attention(monkeypatch):
    """Block j + 1 is copied while block j is computed: with copies shorter than a block's
    attention only the first block's copy is exposed."""
    nq, nk, h, hd, kb = 4, 40, 2, 8, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(nq, h, hd, generator=g), torch.randn(nk, h, hd, generator=g), torch.randn(nk, h, hd,
                                                                                                      generator=g)
    clock = FakeClock(bw=kb * h * hd * 4 * 2 / 1.0)               # one block's K and V: 1 s
    real = S.A.attention_into

    def timed(out, q, k, v, **kw):
        real(out, q, k, v, **kw)
        clock.compute(5.0, ptr(k))                                 # a block's attention: 5 s
    monkeypatch.setattr(S.A, "attention_into", timed)
    f = lambda *s: torch.empty(*s)  # noqa: E731
    slots = [torch.empty(kb, h, hd) for _ in range(4)]
    stream_attention(clock, f(nq, h * hd), q, k, v, slots[:2], slots[2:], f(nq, h * hd), f(h, nq), f(nq, h, hd),
                     f(h, nq), f(h, nq), f(h, nq), torch.empty(1, dtype=torch.uint8), impl="torch")
    assert clock.compute_t == pytest.approx(1.0 + 5 * 5.0)
    copies = [e for e in clock.log if e[0] == "copy"]
    computes = [e for e in clock.log if e[0] == "compute"]
    for j in range(1, 5):
        assert copies[j][3] <= computes[j - 1][3]                  # landed before block j - 1 ended


def test_the_second_chunk_buffer_is_planned_and_charged_exactly():
    """The template holds kv_write_slots K and V chunk buffers of exactly rows x kv_dim, live
    from before the K/V loop to after it: the live bytes of those ops grow by one chunk of K
    and V and no other op's do, so the plan's peak grows by at most that."""
    model = random_model("dream", num_layers=2)
    from mosaic import MosaicEngine
    eng = MosaicEngine(model, {"device": "cpu", "progress": False, "chunks": (2, 1, 1)})   # K, V read back once
    base = probe_step(model, 40, 8)
    t = {}
    for n in (1, 2):
        step = base.with_(offload=Offload(1, kv=True, kv_block_rows=16, kv_write_slots=n))
        t[n] = eng.preparer.prepare(step, remember=False)
    rows, kv = 14, model.cfg.kv_dim                      # 40 rows in chunks of <= 16: 14, 13, 13
    chunk = 2 * rows * kv * 4                           # K and V, float32
    for n, prep in t.items():
        dev = [b for b in prep.template.buffers if b.name in ("k_dev", "v_dev")]
        assert len(dev) == 2 * n and all(b.nbytes == rows * kv * 4 for b in dev)
    t1, t2 = t[1].template, t[2].template
    assert t1.op_names == t2.op_names
    assert sum(b.nbytes for b in t2.buffers) - sum(b.nbytes for b in t1.buffers) == chunk
    lo, hi = t2.op_names.index("kv_stage"), t2.op_names.index("kv_written")
    diff = [b - a for a, b in zip(t1.live_bytes(), t2.live_bytes())]
    assert diff == [chunk if lo <= i <= hi else 0 for i in range(len(diff))]
    assert t2.load() == max(t1.load(), max(t2.live_bytes()[lo:hi + 1]))
    assert 0 <= t[2].plan_bytes - t[1].plan_bytes <= chunk
