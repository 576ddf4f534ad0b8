"""The MoE blocks of LLaDA-MoE and LLaDA2.x over one routed-experts op with static shapes.

Per row of h = norm(x), as the published modeling code computes it (docs/MODELS.md):

LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B, modeling_lladamoe.py, OLMoE-derived):
  logits = h @ W^T in the model dtype; p = softmax(logits) in fp32; top_k experts by p, no
  renormalisation, weights cast to the model dtype; y = sum over the row's experts in expert-id
  order of expert_j(h) * w_j, every product and sum in the model dtype (the published loop over
  experts index_adds each expert's rows into a zeroed sum).
LLaDA2.x (BailingMoeV2: inclusionAI/dFactory models/llada2_moe/modeling_llada2_moe.py,
LLaDA2MoeGate / LLaDA2MoeSparseMoeBlock.moe_infer):
  logits = h.float() @ W.float()^T                        [n, E] float32
  scores = sigmoid(logits) (score_function 'softmax': softmax over E)
  route  = scores + expert_bias                           (chooses experts, never weighs them)
  groups: each of n_group groups scores the sum of its two best `route`; the topk_group best
          groups stay, the other experts are -inf; top_k experts by `route`, best first
  w      = scores at those experts; / (sum + 1e-20) when norm_topk_prob and top_k > 1; * routed_scaling_factor
  y      = sum over the k slots, in that order, of float32(expert_j(h)) * w_j, cast to the model
           dtype; + shared_experts(h) in the model dtype

Both run the routed experts through `routed_experts`: every (row, slot) pair is one of n*k rows,
sorted by expert without a host sync and multiplied by one grouped GEMM per projection (or the
per-expert loop, the reference; or the Triton kernel: kernels.moe_kernel chooses), into a
[n*k, d] buffer in (row, slot) order; the combine then sums each row's slots in the published
order (LLaDA-MoE's slots are sorted by expert id per row at routing). Every buffer is sized for
the worst case, so shapes never depend on the routing and a step can be captured as a graph."""

from __future__ import annotations

import torch

from .. import kernels
from ..graph.shard import chunk_bounds
from ..kernels import invariant as INV
from ..kernels import moe as MK

# measurement only (bench/suites/families.py): functions called with each MoE layer's top_i
# [n, k] as it is routed, to count the experts a step reaches (its weight bytes read). Empty: no
# cost. Called inside the op on eager steps only (a captured step's replay runs no Python).
route_observers: list = []


def route(logits: torch.Tensor, bias: torch.Tensor | None, cfg, invariant: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA2: (top_i [n, k] int64, w [n, k] float32) from router logits [n, E] float32.
    invariant: the CPU's sigmoid independent of the row count (kernels/invariant.pointwise_rows)."""
    n, E = logits.shape
    if cfg.route_score == "sigmoid":
        scores = INV.sigmoid(logits) if invariant else torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits, dim=-1)
    routing = scores + bias if bias is not None else scores
    G = cfg.num_groups
    if G > 1:
        group_scores = routing.view(n, G, -1).topk(2, dim=-1)[0].sum(dim=-1)          # [n, G]
        group_idx = torch.topk(group_scores, k=cfg.topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(n, G, E // G).reshape(n, -1)
        routing = routing.masked_fill(~keep.bool(), float("-inf"))
    top_i = torch.topk(routing, k=cfg.top_k, dim=-1)[1]
    w = torch.gather(scores, 1, top_i)
    if cfg.route_norm and cfg.top_k > 1:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return top_i, w * cfg.route_scale


def _observe(top_i) -> None:
    """Call the observers, except while a CUDA graph is captured (top_i holds no values yet, and
    an observer that reads them would break the capture)."""
    if route_observers and not (top_i.is_cuda and torch.cuda.is_current_stream_capturing()):
        for f in route_observers:
            f(top_i)


def held_experts(model, lw) -> tuple[int, int]:
    """(lo, held): this rank holds routed experts [lo, lo + held) (tensor parallelism), else all."""
    held = lw["experts_gate"].shape[0]
    return (0 if model.tensor is None else model.tensor.rank * held), held


def routed_experts(ctx, model, lw, h, top_i):
    """slots [n*k, d] in (row, slot) order: slot (t, j) = expert top_i[t, j] applied to h[t]
    ([n, d]) with its SwiGLU. Slots of experts another rank holds are zero (the combine also
    masks them). Kernel: ctx.moe_kernel (kernels/moe.py, kernels/moe_triton.py)."""
    cfg = model.cfg
    n, k, d, F = h.shape[0], cfg.top_k, cfg.hidden, cfg.ffn
    lo, held = held_experts(model, lw)
    rows = n * k
    path = kernels.moe_kernel(ctx.device.type, ctx.dtype, ctx.moe_kernel, ctx.batch_invariant, (d, F))
    slots = ctx.new("moe_slots", (rows, d))
    if path == "loop":   # one expert at a time: its rows (at most n) in planned scratch
        scratch = (ctx.new("moe_x", (n, d)), ctx.new("moe_g", (n, F)), ctx.new("moe_u", (n, F)))
        extra = 0
    elif path == "grouped":
        scratch = (ctx.new("moe_x", (rows, d)),)
        extra = MK.grouped_bytes(rows, d, F, h.element_size())
    else:   # the fused kernel's activations [R, F] and block table (kernels/moe_triton.py)
        table = ctx.new("moe_blocks", MK.triton_table_shape(rows, held, ctx.dtype), torch.int32)
        scratch = (ctx.new("moe_act", (rows, F)), table)
        extra = MK.triton_bytes(held, table.shape[1])
    wg, wu, wd = lw["experts_gate"], lw["experts_up"], lw["experts_down"]

    def run():
        _observe(top_i)
        order, offs = MK.sort_by_expert(top_i, lo, held, cfg.num_experts)
        if path == "loop":
            MK.experts_loop(slots, h, order, offs, k, wg, wu, wd, *scratch, ctx.matmul, ctx.silu_mul_now)
        elif path == "grouped":
            MK.experts_grouped(slots, h, order, offs, k, wg, wu, wd, *scratch, ctx.silu_mul_now)
        else:
            MK.experts_triton(slots, h, order, offs, k, wg, wu, wd, *scratch)
        if model.tensor is not None:
            # the kernels leave the slots of experts another rank holds unspecified (grouped_mm's
            # rows past the last group are uninitialised memory): zero them, one [n*k, d] pass
            # under tensor parallelism only, so no step reads stale bytes (the combine masks them)
            slots.masked_fill_(~_held_mask(model, lw, top_i).reshape(-1, 1), 0)

    with ctx.op("experts"):
        ctx.use(h, top_i, writes=(slots, *scratch))
        ctx.external(MK.index_bytes(rows, held) + extra)
        ctx.pointwise_scratch(2)
        if ctx.compute:
            run()
    return slots


def _held_mask(model, lw, top_i):
    """[n, k] bool: the slots whose expert this rank holds (None: every slot, no tensor parallelism)."""
    if model.tensor is None:
        return None
    lo, held = held_experts(model, lw)
    return (top_i >= lo) & (top_i < lo + held)


def grouped_moe_block(ctx, model, lw, x, step):
    """LLaDA2: x [N, d] += MoE(norm(x)) in row chunks, in place (module docstring)."""
    cfg = model.cfg
    E, k, d = cfg.num_experts, cfg.top_k, cfg.hidden
    f32 = torch.float32
    for s, e in ctx.loop(chunk_bounds(x.shape[0], step.chunks.ffn)):
        n = e - s
        h = ctx.rmsnorm("h_ff", x[s:e], lw["ffn_norm"], cfg.rms_eps)       # [n, d]
        logits = ctx.new("router_logits", (n, E), f32)
        top_i = ctx.new("top_i", (n, k), torch.int64)
        top_w = ctx.new("top_w", (n, k), f32)

        def routing():
            ctx.matmul(logits, h.float(), lw["router"].float())       # h @ W^T in fp32
            i, w = route(logits, lw.get("router_bias"), cfg, ctx.batch_invariant)
            top_i.copy_(i)
            top_w.copy_(w)

        with ctx.op("route"):
            ctx.use(h, writes=(logits, top_i, top_w))
            # h and the router weight in fp32, scores, the biased scores, the group masks and
            # the masked scores: ~5 [n, E] fp32 tensors and one [n, d] + [E, d] fp32 copy
            ctx.external(n * E * 4 * 5 + (n + E) * d * 4)
            ctx.pointwise_scratch(1)
            if ctx.compute:
                routing()
        slots = routed_experts(ctx, model, lw, h, top_i)                  # [n*k, d]
        acc32 = ctx.new("moe_acc32", (n, d), f32)
        acc = ctx.new("moe_acc", (n, d))
        with ctx.op("combine"):   # the published .sum(dim=1) over the slots in top-k order, in fp32
            ctx.use(slots, top_w, writes=(acc32, acc))
            ctx.external(MK.combine_bytes(n, d, acc.element_size(), True))
            if ctx.compute:
                MK.combine(acc, slots, top_w, True, acc32, setting=ctx.elementwise_kernel)
        if cfg.shared_ffn:
            sg = ctx.linear("shared_g", h, lw["shared_gate"])              # [n, S]
            su = ctx.linear("shared_u", h, lw["shared_up"])
            ctx.silu_mul_(sg, su)
            sy = ctx.linear("shared_y", sg, lw["shared_down"])             # [n, d]
            ctx.add_(acc, sy)
        ctx.add_(x[s:e], acc)


def moe_block(ctx, model, lw, x, step, reduce=None):
    """LLaDA-MoE: x [N, d] += MoE(norm(x)) in row chunks, in place (module docstring). reduce(ctx,
    model, y): tensor parallelism's sum of the ranks' partial outputs (layers.reduce_tp)."""
    cfg = model.cfg
    E, k, d = cfg.num_experts, cfg.top_k, cfg.hidden
    for s, e in ctx.loop(chunk_bounds(x.shape[0], step.chunks.ffn)):
        n = e - s
        h = ctx.rmsnorm("h_ff", x[s:e], lw["ffn_norm"], cfg.rms_eps)       # [n, d]
        logits = ctx.linear("router", h, lw["router"])                     # [n, E]
        probs = ctx.new("router_p", (n, E), torch.float32)
        top_w = ctx.new("top_w", (n, k), torch.float32)
        top_i = ctx.new("top_i", (n, k), torch.int64)
        w16 = ctx.new("top_w16", (n, k))

        def routing():   # each row's experts sorted by id: the order the published loop sums them in
            probs.copy_(torch.softmax(logits, dim=1, dtype=torch.float32))
            torch.topk(probs, k, dim=-1, out=(top_w, top_i))
            ids, by_id = top_i.sort(dim=1)
            top_i.copy_(ids)
            w16.copy_(top_w.gather(1, by_id))

        with ctx.op("route"):
            ctx.use(logits, writes=(probs, top_w, top_i, w16))
            # softmax(bf16, dtype=fp32) converts its input to an fp32 copy first and then
            # writes a new fp32 output (only fp16 input has a fused path): 2 x n*E*4 bytes
            # live at once (270k rows x 64 experts: 138 MB). Charging one of them let
            # LLaDA-MoE at its 24 GiB L_max run out of memory (bench/results/gpu/probes_*).
            # The per-row sort: ids, positions and the gathered weights (8 + 8 + 4 B a slot).
            ctx.external(2 * n * E * 4 + n * k * 20)
            if ctx.compute:
                routing()
        slots = routed_experts(ctx, model, lw, h, top_i)                  # [n*k, d]
        acc = ctx.new("moe_acc", (n, d))
        with ctx.op("combine"):   # in expert-id order, every product and sum in the model dtype
            ctx.use(slots, top_i, w16, writes=(acc,))
            ctx.external(MK.combine_bytes(n, d, acc.element_size(), False))
            if ctx.compute:
                MK.combine(acc, slots, w16, False, held=_held_mask(model, lw, top_i), setting=ctx.elementwise_kernel)
        ctx.add_(x[s:e], acc if reduce is None else reduce(ctx, model, acc))
