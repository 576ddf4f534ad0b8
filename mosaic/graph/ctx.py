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
from ..errors import StepInterrupted
from ..kernels import attention as A
from ..kernels import elementwise as E
from ..kernels import fp8 as FP8
from ..kernels import invariant as INV
from ..kernels import masked_logits as ML
from ..kernels import reference as R
from .block_ops import BlockOps
from .rope_ops import RopeOps
from .shard import chunk_bounds
from .shard_ops import ShardOps
from .sparse_ops import SparseOps
from .stream_ops import StreamOps
from .varlen_ops import VarlenOps

F32 = torch.float32


class Ctx(RopeOps, StreamOps, BlockOps, SparseOps, ShardOps, VarlenOps):
    compute = True
    recording = False

    def __init__(self, device: torch.device, dtype: torch.dtype, *, logits_kernel: str = "auto",
                 attention_kernel: str = "sdpa", elementwise_kernel: str = "torch", probe=None,
                 copier=None, host_pool=None, batch_invariant: bool = False, interrupt=None,
                 moe_kernel: str = "auto"):
        """logits_kernel / elementwise_kernel: 'auto' | 'triton' | 'torch' (kernels.want_triton;
        the fused elementwise kernels give the reference's bits); attention_kernel: 'sdpa' (the
        reference's order) | 'cudnn'; probe(ctx, op_name) after every op (measurement); copier,
        host_pool: the engine's CopyEngine and HostPool for streamed ops (stream_ops.py);
        batch_invariant: every row's values independent of the other rows (kernels/invariant.py:
        fixed-tile products, per-row norms, attention without split-K, fixed logits splits);
        interrupt() after every op: True stops the step there (StepInterrupted), so a cancelled
        request waits at most one op (one layer's attention or FFN chunk), not a whole step.
        moe_kernel: the routed experts' kernel setting (kernels.moe_kernel: 'auto' | 'loop' |
        'grouped' | 'triton')."""
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
        self.probe, self.interrupt = probe, interrupt
        self.copier, self.host_pool = copier, host_pool
        self.batch_invariant = batch_invariant
        self.moe_kernel = moe_kernel   # resolved per MoE layer (models/moe_grouped.routed_experts)
        self.one_pass = False          # rmsnorm's one-pass kernel asked for (one_pass_norms)

    def matmul(self, out, x, w, b=None) -> None:
        """out [n, o] = x [n, i] @ w [o, i]^T (+ b), with this context's product (row-invariant in
        batch-invariant mode): for models' own ops (MoE experts and routers) inside an op."""
        if self.batch_invariant:
            INV.linear(out, x, w, b)
        else:
            R.linear(out, x, w, b)

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
        if self.interrupt is not None and self.interrupt():
            raise StepInterrupted(f"step interrupted after op {name!r}")

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

    def rmsnorm(self, name, x, w, eps, out=None, add=None):
        """A new normalised buffer, or in place when out is x. add [n, d]: x += add first (a
        residual: one pass with the squares on the fused path). The one-pass kernel
        (kernels.rmsnorm_kernel: batch-invariant mode on CUDA, or inside one_pass_norms) needs
        no scratch, so none is planned for it."""
        n, d = x.shape
        with self.op("rmsnorm"):
            if out is None:
                out = self.new(name, (n, d))
            one = kernels.rmsnorm_kernel(self.device.type, self.elementwise_kernel, self.batch_invariant,
                                         self.one_pass) == "one_pass"
            rows = min(n, R.ROW_TILE)
            s = () if one else (self.new("rms_s1", (rows, d), F32), self.new("rms_s2", (rows, d), F32))
            self.use(x, *(() if add is None else (add,)), writes=(out, *s))
            if self.compute:
                E.rmsnorm(out, x, w, eps, *(s or (None, None)), self.elementwise_kernel, self.batch_invariant, add,
                          self.one_pass)
        return out

    @contextmanager
    def one_pass_norms(self, on: bool = True):
        """rmsnorm's inside run the one-pass kernel where Triton runs (a Fast-dLLM block step of a
        model fused with fused_projections 'all': models/fusion.one_pass_norms): the program sets
        it, so a recording and its run choose alike."""
        before, self.one_pass = self.one_pass, on
        try:
            yield
        finally:
            self.one_pass = before

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
                if self.batch_invariant and self.device.type != "cuda":   # the padded last tile
                    self.external(INV.pad_bytes(x, w.shape[0]))
                if self.compute:
                    self.matmul(out, x, w, b)
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

    def attention(self, name, q, k, v, own: bool = False):
        """out [nq, Hq*hd] = attention of q [nq, Hq, hd] over k, v [Nk, Hkv, hd] (attend_now: the
        one definition, graph/varlen_ops.py). With attention_kernel 'sdpa' / 'cudnn', PyTorch's
        SDPA (its output and a regrouped or contiguous q live outside the plan, charged as
        external bytes); with 'triton', Mosaic's kernel writes into the planned buffer (a planned
        split-K workspace, nothing outside); batch-invariant: no split-K (CUDA) or fixed query
        tiles (CPU). own: SDPA's output is returned itself where its layout is out's (no copy; it
        then lives until the caller's next op reads it: for a block step's few rows only, a few
        hundred KiB beyond this op's charge)."""
        nq, hq, hd = q.shape
        with self.op("attention"):
            out = self.new(name, (nq, hq * hd))
            ws = None
            if self.attention_kernel == "triton" and not self.batch_invariant:
                ws = self.new("attn_ws", (max(1, A.workspace_bytes(nq, hq, hd, k.shape[0])),), torch.uint8)
            self.use(q, k, v, writes=(out,) if ws is None else (out, ws))
            self.external(self.attend_external(q.shape, k))
            if self.compute:
                out = self.attend_now(out, q, k, v, ws, own)
        return out

    def silu_mul_(self, g, u):
        with self.op("silu_mul"):
            self.use(g, u)
            self.pointwise_scratch(2)
            if self.compute:
                self.silu_mul_now(g, u)

    def silu_mul_now(self, g, u) -> None:
        """g = silu(g) * u in place [n, F] with this context's kernel (row-invariant in
        batch-invariant mode), for models' own ops (MoE experts) inside an op."""
        E.silu_mul_(g, u, self.elementwise_kernel, self.batch_invariant)

    def pointwise_scratch(self, num_tensors: int) -> None:
        """Charge the CPU batch-invariant pointwise scratch (kernels/invariant.pointwise_rows)."""
        if self.batch_invariant and self.device.type != "cuda":
            self.external(INV.pointwise_bytes(num_tensors))

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
        writes logits into a planned [M_c, V] buffer (two with cfg) and reduces them. An output
        the reducer declares with a width w is [M, w] (a constrained step's saved logits); a
        reducer with `after_bytes(M, V, dtype)` allocates that much outside the plan once the
        step's ops are done (charged as one more op)."""
        M, V = rows.shape[0], head_w.shape[0]
        outs = {k: self.new(f"out_{k}", (M, *w), dt) for k, dt, *w in reducer.outputs(self.dtype)}
        spec = reducer.fused
        fused = spec is not None and rows_uncond is None and kernels.want_triton(self.device.type, self.logits_kernel)
        seed = self._gumbel_seed(reducer) if fused and spec.temperature > 0 else None
        keep = () if seed is None else (seed,)
        bounds = chunk_bounds(M, num_chunks, allow_empty=True)  # M may shrink below the count
        for a, b in self.loop(bounds):
            with self.op("logits"):
                self.use(x, *keep, writes=tuple(outs.values()))
                if fused:
                    inv = self.batch_invariant
                    ws = self.new("logits_ws", (ML.workspace_rows(b - a, inv), ML.NUM_FIELDS), torch.float32)
                    self.use(writes=(ws,))
                    self.external(ML.extra_bytes(b - a, inv))
                    if self.compute and b > a:
                        ML.fused_reduce(x, rows[a:b], head_w, spec,
                                        {k: o[a:b] for k, o in outs.items()}, ws, inv, seed=seed)
                    continue
                m = b - a
                hm = self.new("logits_h", (m, x.shape[1]))
                lg = self.new("logits", (m, V))
                extra = []
                if rows_uncond is not None:
                    extra = [self.new("logits_h_u", (m, x.shape[1])), self.new("logits_u", (m, V))]
                self.use(writes=(hm, lg, *extra))
                self.external(reducer.transient_bytes(m, V, self.dtype))
                if self.batch_invariant and self.device.type != "cuda":   # padded last tiles
                    self.external(INV.pad_bytes(hm, V) * (2 if extra else 1))
                if self.compute and b > a:
                    R.gather_rows(hm, x, rows[a:b])
                    self.matmul(lg, hm, head_w)
                    lu = None
                    if extra:
                        R.gather_rows(extra[0], x, rows_uncond[a:b])
                        self.matmul(extra[1], extra[0], head_w)
                        lu = extra[1]
                    reducer(lg, lu, a, b, {k: o[a:b] for k, o in outs.items()})
        after = getattr(reducer, "after_bytes", None)
        if after is not None:
            with self.op("outputs"):
                self.use(*outs.values())
                self.external(after(M, V, self.dtype))
        return outs


    def _gumbel_seed(self, reducer):
        """The fused kernel's Gumbel key [1] int64, drawn once per step from the request's
        generator inside the step (a captured step draws a fresh one at every replay), so every
        logits chunk reads the same stream."""
        with self.op("logits_seed"):
            seed = self.new("logits_seed", (1,), torch.int64)
            self.use(writes=(seed,))
            if self.compute:
                reducer.draw_seed(seed)
        return seed


class EagerCtx(Ctx):
    """Plain PyTorch allocation; with full logits this is the native path."""
