"""Ops over named buffers: the vocabulary every model program is written in.

A program calls ops on a context. Each op allocates its outputs with `new`, declares every tensor
it reads or writes with `use`, and computes unless the context only records. Three contexts:

  EagerCtx    fresh tensors from PyTorch's allocator (the native path)
  RecordCtx   meta tensors, no math: logs buffer sizes and lifetimes -> Template (graph/record.py)
  PlannedCtx  views of one arena at planned offsets (runtime/executor.py)

Buffers are identified by allocation order within a segment (head, one layer, tail), so a
layer's buffers land at the same offsets in every layer.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .. import kernels
from ..config import keep_count
from ..kernels import attention as A
from ..kernels import elementwise as E
from ..kernels import fp8 as FP8
from ..kernels import masked_logits as ML
from ..kernels import reference as R
from ..kernels import sparse_select as SS
from .block_ops import BlockOps
from .ring import ring_attend
from .shard import broadcast, chunk_bounds
from .stream_ops import StreamOps

F32 = torch.float32


class Ctx(StreamOps, BlockOps):
    compute = True
    recording = False

    def __init__(self, device: torch.device, dtype: torch.dtype, *, logits_kernel: str = "auto",
                 attention_kernel: str = "sdpa", elementwise_kernel: str = "torch", probe=None,
                 copier=None, host_pool=None):
        """logits_kernel / elementwise_kernel: 'auto' | 'triton' | 'torch' (kernels.want_triton;
        the fused elementwise kernels give the reference's bits); attention_kernel: 'sdpa' (the
        reference's order) | 'cudnn'; probe(ctx, op_name) after every op (measurement); copier,
        host_pool: the engine's CopyEngine and HostPool for streamed ops (stream_ops.py)."""
        self.device, self.dtype = torch.device(device), dtype
        self.cur: int | None = None   # index of the op running now
        self.n_ops = 0
        self.logits_kernel = logits_kernel
        self.attention_kernel = attention_kernel
        self.elementwise_kernel = elementwise_kernel
        self._segs = ["main"]                  # segment stack: main, then nested loop ids
        self._loops: dict[str, int] = {}      # loops started so far per segment
        self._count: dict[str, int] = {}      # allocations so far per segment
        self.phase = "embed"          # embed | attn | ffn | logits: which phase each op belongs to
        self.probe = probe
        self.copier, self.host_pool = copier, host_pool

    # -- buffers and bookkeeping (overridden by record / planned contexts)

    def set_phase(self, phase: str) -> None:
        """The step program enters a phase (embed | attn | ffn | logits): the ops that follow
        belong to it (templates report each phase's peak)."""
        self.phase = phase
    def new(self, name: str, shape, dtype=None) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype or self.dtype, device=self.device)

    def use(self, *reads, writes=()) -> None:
        """Declare the tensors the running op reads (or updates in place) and the ones it only
        writes. Both extend lifetimes; the sanitizer checks reads for poison."""

    def _done(self) -> None:
        pass

    def external(self, nbytes: int) -> None:
        """Bytes an op allocates outside the plan (library outputs, workspaces), for accounting."""

    @contextmanager
    def op(self, name: str):
        assert self.cur is None, f"op {name} nested in another op"
        self.cur, self.n_ops = self.n_ops, self.n_ops + 1
        try:
            yield self.cur
        finally:
            self._done()
            if self.probe is not None:
                self.probe(self, name)
            self.cur = None

    def loop(self, items):
        """Iterate a loop whose iterations run the same ops on same-sized (or smaller) buffers:
        chunk loops and the layer loop. Recording keeps one iteration (the first, the largest);
        a planned run replays that iteration's offsets for every iteration."""
        items = list(items)
        parent = self._segs[-1]
        seg = f"{parent}/{self._loops.get(parent, 0)}"
        self._loops[parent] = self._loops.get(parent, 0) + 1
        self._enter(seg, len(items))
        for i, item in enumerate(items):
            self._iteration(seg, i)
            yield item
            if self.recording:
                break
        self._exit(seg)

    def layers(self, layer_weights):
        return self.loop(layer_weights)

    def _enter(self, seg, count: int):
        self._segs.append(seg)

    def _iteration(self, seg, i):
        self._loops[seg] = 0    # inner loops restart their numbering in every iteration
        self._count[seg] = 0    # and so do the iteration's allocations

    def _exit(self, seg):
        self._segs.pop()

    # -- ops
    def embed(self, name, ids, weight, out=None, scale=None):
        """Rows of the embedding table; with `scale` (an FP8 table, per-row scales [V]) the rows
        are dequantized into the model dtype, 4096 rows at a time (their codes and fp32 products
        live outside the plan)."""
        with self.op("embed"):
            if out is None:
                out = self.new(name, (ids.shape[0], weight.shape[1]), weight.dtype if scale is None else None)
            self.use(writes=(out,))
            if scale is not None:
                self.external(min(ids.shape[0], R.ROW_TILE) * weight.shape[1] * 5)
            if self.compute:
                if scale is None:
                    R.embed(out, ids, weight)
                else:
                    for a, b in R.row_tiles(ids.shape[0]):
                        out[a:b] = FP8.dequantize(weight.index_select(0, ids[a:b]), scale.index_select(0, ids[a:b]))
        return out

    def rmsnorm(self, name, x, w, eps, out=None):
        """A new normalised buffer, or in place when out is x."""
        n, d = x.shape
        with self.op("rmsnorm"):
            if out is None:
                out = self.new(name, (n, d))
            rows = min(n, R.ROW_TILE)
            s1, s2 = self.new("rms_s1", (rows, d), F32), self.new("rms_s2", (rows, d), F32)
            self.use(x, writes=(out, s1, s2))
            if self.compute:
                E.rmsnorm(out, x, w, eps, s1, s2, self.elementwise_kernel)
        return out

    def linear(self, name, x, w, b=None, out=None, scale=None, quant: bool = False):
        """out [n, o] = x [n, i] @ w [o, i]^T (+ b). With `scale` (w is e4m3 with per-output-channel
        scales [o]): x is quantized per row into planned fp8 buffers and multiplied in FP8
        (kernels/fp8.py). quant=True allocates those buffers even for a 16-bit w, so that every
        layer of a mixed-precision model has the same buffers (one recorded layer serves all)."""
        with self.op("linear"):
            if out is None:
                out = self.new(name, (x.shape[0], w.shape[0]))
            if scale is None and not quant:
                self.use(x, writes=(out,))
                if self.compute:
                    R.linear(out, x, w, b)
                return out
            x8 = self.new("x_fp8", tuple(x.shape), FP8.E4M3)
            xs = self.new("x_scale", (x.shape[0],), F32)
            self.use(x, writes=(out, x8, xs))
            if scale is not None and self.device.type != "cuda":   # emulation's fp32 operands
                self.external(4 * (x.numel() + w.numel() + out.numel()))
            if self.compute:
                if scale is None:
                    R.linear(out, x, w, b)
                else:
                    FP8.quantize_rows(x8, xs, x, self.elementwise_kernel)
                    FP8.scaled_mm(out, x8, xs, w, scale, b)
        return out

    def rope_(self, t, positions, inv_freq, fp32):
        n, heads, _ = t.shape
        half = inv_freq.shape[0]
        rows = min(n, R.ROW_TILE)
        with self.op("rope"):
            sdt = F32 if fp32 else t.dtype
            s1 = self.new("rope_s1", (rows, heads, half), sdt)
            s2 = self.new("rope_s2", (rows, heads, half), sdt)
            c, s = self.new("rope_cos", (rows, half), F32), self.new("rope_sin", (rows, half), F32)
            self.use(t, writes=(s1, s2, c, s))
            if self.compute:
                E.rope_(t, positions, inv_freq, fp32, s1, s2, c, s, self.elementwise_kernel)

    def attention(self, name, q, k, v):
        """out [nq, Hq*hd] = attention of q [nq, Hq, hd] over k, v [Nk, Hkv, hd]. With
        attention_kernel 'sdpa' / 'cudnn', PyTorch's SDPA (its output and a regrouped or
        contiguous q live outside the plan, charged as external bytes); with 'triton', Mosaic's
        kernel writes into the planned buffer (a planned split-K workspace, nothing outside)."""
        nq, hq, hd = q.shape
        with self.op("attention"):
            out = self.new(name, (nq, hq * hd))
            if self.attention_kernel == "triton":
                ws = self.new("attn_ws", (max(1, A.workspace_bytes(nq, hq, hd, k.shape[0])),), torch.uint8)
                self.use(q, k, v, writes=(out, ws))
                if self.compute:
                    A.attention_into(out, q, k, v, workspace=ws)
                return out
            self.use(q, k, v, writes=(out,))
            cudnn = kernels.prefer_cudnn_attention(self.device, q.dtype, hd, max(q.numel(), k.numel()),
                                                   self.attention_kernel)
            # SDPA's own output before the copy, and the regrouped (or, for cuDNN, contiguous) q
            groups = 2 if hq != k.shape[1] or cudnn else 1
            # + its fp32 log-sum-exp per head and query row (flash and cuDNN: [H, nq]; the
            # memory-efficient kernel pads the rows to a multiple of 32)
            self.external(groups * nq * hq * hd * q.element_size() + hq * (nq + 32) * 4)
            if self.compute:
                R.attention(out, q, k, v, cudnn)
        return out

    def block_means(self, name, x, block: int, group: int = 1):
        """[Hkv, ceil(n / block), hd] fp32 means of x [n, Hkv * group, hd] over blocks of rows
        (and the group's heads): the pooled keys or queries of the sparse-layout estimate."""
        n, h, hd = x.shape
        nb = -(-n // block)
        with self.op("block_means"):
            out = self.new(name, (h // group, nb, hd), torch.float32)
            self.use(x, writes=(out,))
            self.external(nb * (h // group) * hd * 4)          # the mean's result before the copy
            if self.compute:
                SS.block_means_into(out, x, block, group)
        return out

    def block_minmax(self, name, x, block: int):
        """[2, Hkv, ceil(n / block), hd] fp32 channel-wise max ([0]) and min ([1]) of x
        [n, Hkv, hd] over blocks of rows: the key bounds of the minmax sparse-layout estimate."""
        n, h, hd = x.shape
        nb = -(-n // block)
        with self.op("block_minmax"):
            out = self.new(name, (2, h, nb, hd), torch.float32)
            self.use(x, writes=(out,))
            self.external(2 * nb * h * hd * x.element_size())   # the reductions before the copies
            if self.compute:
                SS.block_minmax_into(out, x, block)
        return out

    def attention_sparse(self, name, q, k, v, kpool, rng, block: int, k_total: int, q_block0: int,
                         per_row: bool = False):
        """Block-sparse attention of q [nq, Hq, hd] over k, v [Nk, Hkv, hd] with Mosaic's kernel:
        a layout per key/value head chosen from pooled-query scores against kpool: the key block
        means [Hkv, nkb, hd] or the key block bounds [2, Hkv, nkb, hd] (max, min; the minmax
        estimate) (kernels/sparse_select.py) under the layer's SparseRange `rng` (None: dense), keeping
        up to k_total key blocks per query block. Every buffer, the layout included, is planned;
        only the small top-k sort and pooled-mean results live outside the plan. per_row (the
        rows estimate, kpool the key bounds): every query row is bounded, not the pooled query
        (sparse_select.row_bound_scores_into; its row tiles are charged per op)."""
        nq, hq, hd = q.shape
        hkv, nkb = k.shape[1], kpool.shape[-2]
        nqb = -(-nq // block)
        bounds = kpool.dim() == 4
        with self.op("attention"):
            out = self.new(name, (nq, hq * hd))
            qpool = self.new("qpool", (hkv, nqb, hd), torch.float32)
            scores = self.new("block_scores", (hkv, nqb, nkb), torch.float32)
            top_v = self.new("top_v", (hkv, nqb, k_total), torch.float32)
            top_i = self.new("top_i", (hkv, nqb, k_total), torch.int64)
            idx = self.new("layout_idx", (hkv * nqb * k_total,), torch.int32)
            ptr = self.new("layout_ptr", (hkv, nqb + 1), torch.int32)
            ws = self.new("attn_ws", (max(1, A.workspace_bytes(nq, hq, hd, k.shape[0])),), torch.uint8)
            self.use(q, k, v, kpool, writes=(out, qpool, scores, top_v, top_i, idx, ptr, ws))
            # sort results, means (and the minmax estimate's negative query parts), or row tiles
            est = (SS.rows_tile_bytes(block, hq // hkv, nkb, hd) if per_row
                   else (2 if bounds else 1) * nqb * hkv * hd * 4)
            self.external(2 * hkv * nqb * k_total * 8 + est)
            if self.compute:
                layout = None
                if rng is not None:
                    if per_row:
                        SS.row_bound_scores_into(scores, q, kpool, block)
                    else:
                        SS.block_means_into(qpool, q, block, hq // hkv)
                        if bounds:
                            SS.bound_scores_into(scores, qpool, kpool)
                        else:
                            torch.bmm(qpool, kpool.transpose(1, 2), out=scores)
                    kt = min(nkb, keep_count(rng, nkb), k_total)
                    layout = SS.select_into(scores, q_block0, rng, block, kt, top_v[..., :kt],
                                            top_i[..., :kt], idx[: hkv * nqb * kt], ptr)
                A.attention_into(out, q, k, v, layout=layout, workspace=ws)
        return out

    def ring_attention(self, q, k, v, kv_peer, shard, pad):
        """Attention of local queries q [nq, Hq, hd] against every rank's K/V shard (sequence
        parallelism, graph/ring.py): pieces broadcast into the receive slots kv_peer
        [slots, piece, 2 * kv_dim], partial results merged in log-sum-exp form into a planned
        fp32 accumulator. Keys before `pad` (left padding) are never attended. The result is
        written over q (not read after the last piece) and returned as [nq, Hq*hd]."""
        nq, hq, hd = q.shape
        with self.op("attention"):
            acc = self.new("ring_acc", (nq, hq, hd), F32)
            lse = self.new("ring_lse", (hq, nq), F32)
            self.use(q, k, v, writes=(kv_peer, acc, lse))
            self.external(R.partial_bytes(nq, hq, k.shape[1] // hd, hd, q.element_size()))
            out = q.view(nq, hq * hd)
            if self.compute:
                ring_attend(out, q, k, v, kv_peer, acc, lse, shard, pad)
        return out

    def halo(self, x, body, shard, batch):
        """Row j-1 for the first position of each shard (Dream's shift): the last final-normed
        row of the previous rank's slice of every sequence, written after the body rows."""
        with self.op("halo"):
            self.use(body, writes=(x,))
            self.external(x.shape[1] * x.element_size())
            if self.compute:
                rows = shard.rows
                if shard.rank == 0:  # no previous rank: defined bytes, never read by a slot
                    x[batch * rows:].zero_()
                tmp = torch.empty(x.shape[1], dtype=x.dtype, device=x.device)
                for b in range(batch):
                    for src in range(shard.world - 1):
                        if src == shard.rank:
                            tmp.copy_(body[b * rows + rows - 1])
                        broadcast(tmp, src, shard)
                        if src + 1 == shard.rank:
                            x[batch * rows + b].copy_(tmp)

    def silu_mul_(self, g, u):
        with self.op("silu_mul"):
            self.use(g, u)
            if self.compute:
                E.silu_mul_(g, u, self.elementwise_kernel)

    def add_(self, x, y):
        with self.op("add"):
            self.use(x, y)
            if self.compute:
                x.add_(y)

    def gather_rows(self, name, x, rows, out=None):
        with self.op("gather"):
            if out is None:
                out = self.new(name, (rows.shape[0], x.shape[1]), x.dtype)
            self.use(x, writes=(out,))
            if self.compute:
                R.gather_rows(out, x, rows)
        return out

    def custom(self, name, fn, *tensors):
        """An op written by a model (MoE routing, expert loops) over buffers it already owns."""
        with self.op(name):
            self.use(*tensors)
            if self.compute:
                fn()

    def masked_logits(self, x, rows, head_w, reducer, num_chunks, rows_uncond=None):
        """Per masked row, the sampler's reduction of its logits, never an M x V tensor at once.

        x: final-normed hidden [N, d]; rows: [M] int64 row of x per masked slot. Results are
        reducer.outputs buffers [M]; each chunk of M_c rows either runs the fused kernel or
        writes logits into a planned [M_c, V] buffer (two with cfg) and reduces them."""
        M, V = rows.shape[0], head_w.shape[0]
        outs = {k: self.new(f"out_{k}", (M,), dt) for k, dt in reducer.outputs(self.dtype)}
        fused = reducer.fused is not None and rows_uncond is None and \
            kernels.want_triton(self.device.type, self.logits_kernel)
        bounds = chunk_bounds(M, num_chunks, allow_empty=True)  # M may shrink below the count
        for a, b in self.loop(bounds):
            with self.op("logits"):
                self.use(x, writes=tuple(outs.values()))
                if fused:
                    ws = self.new("logits_ws", (ML.workspace_rows(b - a), ML.NUM_FIELDS), torch.float32)
                    self.use(writes=(ws,))
                    self.external(ML.extra_bytes(b - a))
                    if self.compute and b > a:
                        ML.fused_reduce(x, rows[a:b], head_w, reducer.fused,
                                        {k: o[a:b] for k, o in outs.items()}, ws)
                    continue
                m = b - a
                hm = self.new("logits_h", (m, x.shape[1]))
                lg = self.new("logits", (m, V))
                extra = []
                if rows_uncond is not None:
                    extra = [self.new("logits_h_u", (m, x.shape[1])), self.new("logits_u", (m, V))]
                self.use(writes=(hm, lg, *extra))
                self.external(reducer.transient_bytes(m, V, self.dtype))
                if self.compute and b > a:
                    R.gather_rows(hm, x, rows[a:b])
                    R.linear(lg, hm, head_w)
                    lu = None
                    if extra:
                        R.gather_rows(extra[0], x, rows_uncond[a:b])
                        R.linear(extra[1], extra[0], head_w)
                        lu = extra[1]
                    reducer(lg, lu, a, b, {k: o[a:b] for k, o in outs.items()})
        return outs


class EagerCtx(Ctx):
    """Plain PyTorch allocation; with full logits this is the native path."""
