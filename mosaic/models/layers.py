"""The step program shared by all three families, written once over ctx ops.

One step: embed -> per layer (attention block, FFN or MoE block) -> tail. Every block can run
in row chunks with an in-place residual, which is exact (DESIGN.md section 3):
  attention: K, V for the whole sequence built chunk by chunk from norm(x[c]); then per query
             chunk q = rope(norm(x[c]) Wq), o = attention(q, K, V), x[c] += o Wo
  FFN / MoE: x[c] += down(silu(gate(norm(x[c]))) * up(norm(x[c])))
Buffer shapes depend only on (B, L, M, chunk counts), never on data.
"""

from __future__ import annotations

from ..errors import InputError
from ..graph.ctx import Ctx
from ..graph.shard import chunk_bounds
from .families import family_of
from .fusion import fused_of
from .moe_grouped import grouped_moe_block, moe_block
from .step import Step


def step_program(ctx: Ctx, model, step: Step):
    cfg = model.cfg
    B, L = step.ids.shape
    ctx.set_phase("embed")
    sh = step.shard
    if sh is None:
        x = ctx.embed("x", step.ids.reshape(-1), model.embed, scale=model.extra.get("embed_scale"))  # [N, d]
        body = x
    else:  # this rank's rows of every sequence, plus one halo row per sequence (Dream shift)
        n_body = B * sh.rows
        x = ctx.new("x", (n_body + (B if cfg.logit_shift else 0), cfg.hidden))
        body = ctx.embed("x", step.ids[:, sh.lo:sh.hi].reshape(-1), model.embed, out=x[:n_body],
                         scale=model.extra.get("embed_scale"))
    run_layers(ctx, model, body, step, attention_block)
    return tail(ctx, model, x, body, step)


def run_layers(ctx, model, body, step: Step, attend, span: tuple[int, int] | None = None) -> None:
    """Every layer over the residual rows `body` [n, d], in place: attend(ctx, model, lw, body,
    step, i), then the FFN or MoE block. Resident weights, or streamed from host memory through
    planned staging slots (step.offload). span: only layers [a, b) (a fill in slices,
    models/fill_slices.py; resident weights only)."""
    off = step.offload
    groups = layer_groups(model.cfg)
    if off is not None and (len(groups) > 1 or span is not None):
        raise InputError("offloaded layers stream through one recorded layer; a model whose first layers are "
                         "dense and the rest MoE (LLaDA2) runs with resident weights only (offload: none)")
    grouped = family_of(model.cfg).moe_block == "grouped"   # LLaDA2's router (models/moe_grouped.py)
    if span is not None:
        groups = [(max(lo, span[0]), min(hi, span[1])) for lo, hi in groups]
        groups = [(lo, hi) for lo, hi in groups if lo < hi]
    for lo, hi in groups:   # one recorded loop per run of layers with the same buffers
        layers = ctx.layers(model.layers[lo:hi]) if off is None else \
            ctx.streamed_layers(model.layers, off, getattr(model, "packed_layers", None))
        for i, lw in enumerate(layers, start=lo):
            # a block step's attention may leave its residual add to the FFN's norm (one pass)
            pending = attend(ctx, model, lw, body, step, i)
            ctx.set_phase("ffn")
            if "router" not in lw:
                ffn_block(ctx, model, lw, body, step, pending, fused_of(model, i, step))
                continue
            if pending is not None:
                ctx.add_(body, pending)
            if grouped:
                grouped_moe_block(ctx, model, lw, body, step)
            else:
                moe_block(ctx, model, lw, body, step, reduce_tp)


def layer_groups(cfg) -> list[tuple[int, int]]:
    """[lo, hi) runs of layers with the same program: LLaDA2's first dense layers, then its MoE
    layers; every other family is one run."""
    k = min(cfg.first_dense, cfg.num_layers)
    return [(0, k), (k, cfg.num_layers)] if 0 < k < cfg.num_layers else [(0, cfg.num_layers)]


def _lin(ctx, model, name, x, lw, key, out=None):
    """x @ lw[key]^T (+ its bias): FP8 when the layer holds a scale for it (models/precision.py);
    a model with any FP8 layer gives every linear the same buffers (one recorded layer)."""
    return ctx.linear(name, x, lw[key], lw.get(key + "_bias"), out=out, scale=lw.get(key + "_scale"),
                      quant=getattr(model, "quantized", False))


def _heads(t, heads, hd):
    return t.view(t.shape[0], heads, hd)


def _qk(ctx, model, t, norm_w, heads, positions):
    cfg = model.cfg
    th = _qk_norm(ctx, model, t, norm_w, heads)                             # [n, H, hd]
    ctx.rope_(th, positions, model.inv_freq, cfg.rope_fp32)
    return th


def _qk_norm(ctx, model, t, norm_w, heads):
    """t [n, heads * hd] as [n, heads, hd], per-head RMSNorm'd in place where the family has it."""
    cfg = model.cfg
    if cfg.qk_norm:  # per-head RMSNorm over head_dim, in place
        flat = t.view(t.shape[0] * heads, cfg.head_dim)
        ctx.rmsnorm("qk_norm", flat, norm_w, cfg.rms_eps, out=flat)
    return _heads(t, heads, cfg.head_dim)


def attention_block(ctx, model, lw, x, step: Step, layer: int = 0):
    cfg = model.cfg
    B, L = step.ids.shape
    sh = step.shard
    lo, L = (sh.lo, sh.rows) if sh else (0, L)                             # this rank's rows
    ctx.set_phase("attn")
    for b in range(B):
        xb = x[b * L:(b + 1) * L]                                           # [L, d]
        pos = step.positions[b, lo:lo + L]
        # masking the left-padded keys == attending to the keys after them (exact, and SDPA
        # keeps its flash kernel: no [nq, L] mask is ever built)
        pad = step.pads[b] if step.pads else 0
        bounds = chunk_bounds(L, step.chunks.attn)
        if step.offload is not None and step.offload.kv:   # K, V in host memory, streamed back
            _streamed_kv(ctx, model, lw, xb, pos, pad, bounds, step)
            continue
        k = ctx.new("k", (L, cfg.kv_dim))                                  # [L, kv_dim]
        v = ctx.new("v", (L, cfg.kv_dim))
        for s, e in ctx.loop(bounds):
            h = ctx.rmsnorm("h_kv", xb[s:e], lw["attn_norm"], cfg.rms_eps)  # [n, d]
            _lin(ctx, model, "k", h, lw, "k", out=k[s:e])
            _lin(ctx, model, "v", h, lw, "v", out=v[s:e])
            _qk(ctx, model, k[s:e], lw.get("k_norm"), cfg.num_kv_heads, pos[s:e])
        attend = _attention_over(ctx, model, k, v, pad, sh, step.chunks.attn, step.sparse, layer)
        # sharded: exactly chunks.attn query chunks on every rank (some may be empty), since each
        # one is a round of broadcasts all ranks take part in
        for s, e in ctx.loop(bounds if sh is None else chunk_bounds(L, step.chunks.attn, allow_empty=True)):
            _query_chunk(ctx, model, lw, xb, pos, pad, lo, s, e, step, attend)


def _query_chunk(ctx, model, lw, xb, pos, pad, lo, s, e, step, attend) -> None:
    """xb[s:e] += o_proj(attend(q, s - pad)), q = rope(norm(xb[s:e]) Wq) [n, Hq, hd]."""
    cfg = model.cfg
    h = ctx.rmsnorm("h_q", xb[s:e], lw["attn_norm"], cfg.rms_eps)
    q = _lin(ctx, model, "q", h, lw, "q")                                  # [n, q_dim]
    qh = _qk(ctx, model, q, lw.get("q_norm"), cfg.num_heads, pos[s:e])
    o = attend(qh, s - pad)                                                # [n, q_dim]
    if step.zero_pad_rows and lo + s < pad:
        ctx.custom("pad_rows", lambda o=o, r=min(pad - lo, e) - s: o[:r].zero_(), o)
    y = _lin(ctx, model, "o_proj", o, lw, "o")                             # [n, d]
    ctx.add_(xb[s:e], reduce_tp(ctx, model, y))


def _streamed_kv(ctx, model, lw, xb, pos, pad, bounds, step) -> None:
    """The attention block of one sequence with K and V off the device. The first query chunk
    is projected first; K and V are then built chunk by chunk (at most kv_block_rows rows) and
    the first chunk attends to each one as it is built (stream_ops.merge_block) while, if more
    query chunks follow, it is copied to host memory behind that attention
    (stream_ops.written_back, kv_write_slots device buffers); the later chunks stream K and V
    back in key blocks (stream_ops.attention_streamed). One query chunk: K and V never leave
    the device. The device holds K and V of one or two chunks and two key blocks instead of
    [L, kv_dim] twice."""
    cfg, off = model.cfg, step.offload
    L = xb.shape[0]
    rest = bounds[1:]
    hosts = None
    if rest:
        hosts = [ctx.host_new("k_host", (L, cfg.kv_dim)), ctx.host_new("v_host", (L, cfg.kv_dim))]  # host
    chunks = chunk_bounds(L, max(len(bounds), -(-L // off.kv_block_rows)))

    def first(qh, row0):
        merge = ctx.merge_begin("attn_o", qh, max(e - s for s, e in chunks))
        attend = lambda s, e, kv: ctx.merge_block(  # noqa: E731  (after the chunk's copy is issued)
            merge, *(_heads(t, cfg.num_kv_heads, cfg.head_dim) for t in kv), max(0, pad - s))
        for s, e, (kc, vc) in ctx.written_back(("k", "v"), (cfg.kv_dim,), chunks, hosts, off.kv_write_slots,
                                               then=attend):
            h = ctx.rmsnorm("h_kv", xb[s:e], lw["attn_norm"], cfg.rms_eps)  # [n, d]
            _lin(ctx, model, "k", h, lw, "k", out=kc)                      # [n, kv_dim]
            _lin(ctx, model, "v", h, lw, "v", out=vc)
            _qk(ctx, model, kc, lw.get("k_norm"), cfg.num_kv_heads, pos[s:e])
        return ctx.merge_end(merge)

    _query_chunk(ctx, model, lw, xb, pos, pad, 0, *bounds[0], step, first)
    if rest:
        kh = _heads(hosts[0][pad:], cfg.num_kv_heads, cfg.head_dim)        # [L - pad, Hkv, hd]
        vh = _heads(hosts[1][pad:], cfg.num_kv_heads, cfg.head_dim)
        for s, e in ctx.loop(rest):
            _query_chunk(ctx, model, lw, xb, pos, pad, 0, s, e, step,
                         lambda qh, row0: ctx.attention_streamed("attn_o", qh, kh, vh, off.kv_block_rows))


def _attention_over(ctx, model, k, v, pad, sh, num_chunks: int, sparse=None, layer: int = 0):
    """attend(q chunk, its first row's key index) for a query chunk: against this sequence's
    K/V after the left padding (block-sparse when the step says so: every layer allocates the
    same buffers, sized for the largest range, so one recorded layer serves all), or under
    sequence parallelism against every rank's K/V shard, streamed by broadcast into receive
    slots of one piece each (graph/ring.py). A piece has at most as many rows as the largest
    rank's query chunk, so the lazy chunk search shrinks both together."""
    cfg = model.cfg
    if sh is None:
        kh = _heads(k[pad:], cfg.num_kv_heads, cfg.head_dim)               # [L - pad, Hkv, hd]
        vh = _heads(v[pad:], cfg.num_kv_heads, cfg.head_dim)
        if sparse is None:
            return lambda qh, row0: ctx.attention("attn_o", qh, kh, vh)
        b = sparse.block
        if sparse.estimate in ("minmax", "rows"):
            kpool = ctx.block_minmax("kpool", kh, b)                       # [2, Hkv, nkb, hd]
        else:
            kpool = ctx.block_means("kpool", kh, b)                        # [Hkv, nkb, hd]
        k_total = sparse.max_keep(kpool.shape[-2])
        rng = sparse.for_layer(layer)
        rows = sparse.estimate == "rows"
        return lambda qh, row0: ctx.attention_sparse("attn_o", qh, kh, vh, kpool, rng, b, k_total, row0 // b,
                                                     per_row=rows)
    piece = sh.piece(-(-sh.max_rows // num_chunks))
    kv_peer = ctx.new("kv_peer", (sh.slots, piece, 2 * cfg.kv_dim))      # pieces of a shard's K, V
    return lambda qh, row0: ctx.ring_attention(qh, k, v, kv_peer, sh, pad)


def ffn_block(ctx, model, lw, x, step: Step, pending=None, fused=None):
    """x += down(silu(gate(h)) * up(h)), h = norm(x), over row chunks in place. pending [n, d]:
    the attention's residual, added in the norm's pass (one chunk) or first. fused: the layer's
    fused matrices (models/fusion.py): gate|up as one GEMM whose halves are g and u."""
    cfg = model.cfg
    bounds = chunk_bounds(x.shape[0], step.chunks.ffn)
    if pending is not None and len(bounds) > 1:
        ctx.add_(x, pending)
        pending = None
    for s, e in ctx.loop(bounds):
        h = ctx.rmsnorm("h_ff", x[s:e], lw["ffn_norm"], cfg.rms_eps, add=pending)   # [n, d]
        if fused and "gate_up" in fused:
            F = fused["gate_up"].shape[0] // 2
            gu = ctx.linear("gate_up", h, fused["gate_up"], fused.get("gate_up_bias"))   # [n, 2F]
            g, u = gu[:, :F], gu[:, F:]
        else:
            g = _lin(ctx, model, "gate", h, lw, "gate")                    # [n, F]
            u = _lin(ctx, model, "up", h, lw, "up")                        # [n, F]
        ctx.silu_mul_(g, u)
        y = _lin(ctx, model, "down", g, lw, "down")                        # [n, d]
        ctx.add_(x[s:e], reduce_tp(ctx, model, y))


def reduce_tp(ctx, model, y):
    """Under tensor parallelism (model.tensor), a row-parallel projection's partial sums y [n, d]
    summed over the ranks in place (graph/tensor.py, one collective); else y as it is."""
    return y if model.tensor is None else ctx.tp_reduce(y, model.tensor)


def tail(ctx, model, x, body, step: Step):
    cfg = model.cfg
    ctx.set_phase("logits")
    if step.reducer is None:  # native: logits for every position
        h = ctx.rmsnorm("h_final", x, model.final_norm, cfg.rms_eps)
        return ctx.linear("logits_full", h, model.lm_head)                 # [N, V]
    ctx.rmsnorm("x", body, model.final_norm, cfg.rms_eps, out=body)        # x is dead after: in place
    if step.shard is not None and cfg.logit_shift:
        ctx.halo(x, body, step.shard, step.ids.shape[0])
    return ctx.masked_logits(x, step.rows, model.lm_head, step.reducer, step.chunks.logits,
                             step.rows_uncond)
