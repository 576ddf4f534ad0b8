"""LLaDA2's MoE block (BailingMoeV2): bias-corrected, group-limited routing, normalised and
scaled top-k weights, shared experts.

As the published LLaDA2MoeGate / LLaDA2MoeSparseMoeBlock.moe_infer (inclusionAI/dFactory
models/llada2_moe/modeling_llada2_moe.py; docs/MODELS.md) compute it, per row of h = norm(x):

  logits = h.float() @ W.float()^T                        [n, E] float32
  scores = sigmoid(logits) (score_function 'softmax': softmax over E)
  route  = scores + expert_bias                           (chooses experts, never weighs them)
  groups: each of n_group groups scores the sum of its two best `route`; the topk_group best
          groups stay, the other experts are -inf; top_k experts by `route`, best first
  w      = scores at those experts; / (sum + 1e-20) when norm_topk_prob and top_k > 1; * routed_scaling_factor
  y      = sum over the k slots, in that order, of float32(expert_j(h)) * w_j, cast to the model
           dtype; + shared_experts(h) in the model dtype

Experts run grouped by expert id into a [n*k, d] buffer in (row, slot) order, then the slots are
summed in fp32 one after another from zero: bit for bit the published .sum(dim=1) (measured on
the CPU). Every buffer is sized for the worst case, so shapes never depend on the routing."""

from __future__ import annotations

import torch

from ..graph.shard import chunk_bounds
from ..kernels import invariant as INV
from ..kernels import reference as R

# measurement only (bench/bench_families.py): functions called with each MoE layer's top_i [n, k]
# as it is routed, to count the experts a step reaches (its weight bytes read). Empty: no cost.
route_observers: list = []


def route(logits: torch.Tensor, bias: torch.Tensor | None, cfg, invariant: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_i [n, k] int64, w [n, k] float32) from router logits [n, E] float32. invariant: the
    CPU's sigmoid independent of the row count (kernels/invariant.pointwise_rows)."""
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


def grouped_moe_block(ctx, model, lw, x, step):
    """x [N, d] += MoE(norm(x)) in row chunks, in place (see the module docstring)."""
    cfg = model.cfg
    E, k, d, F = cfg.num_experts, cfg.top_k, cfg.hidden, cfg.ffn
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
            for f in route_observers:
                f(top_i)

        with ctx.op("route"):
            ctx.use(h, writes=(logits, top_i, top_w))
            # h and the router weight in fp32, scores, the biased scores, the group masks and
            # the masked scores: ~5 [n, E] fp32 tensors and one [n, d] + [E, d] fp32 copy
            ctx.external(n * E * 4 * 5 + (n + E) * d * 4)
            ctx.pointwise_scratch(1)
            if ctx.compute:
                routing()
        xs = ctx.new("moe_x", (n, d))
        g, u = ctx.new("moe_g", (n, F)), ctx.new("moe_u", (n, F))
        slots = ctx.new("moe_slots", (n * k, d))                           # expert outputs, (row, slot) order
        acc32 = ctx.new("moe_acc32", (n, d), f32)
        acc = ctx.new("moe_acc", (n, d))

        def experts():
            flat = top_i.reshape(-1)                                       # [n*k]
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=E).tolist()            # one host sync
            r = 0
            for j, c in enumerate(counts):
                if c == 0:
                    continue
                idx = order[r:r + c]                                       # (row, slot) slots of expert j
                R.gather_rows(xs[:c], h, idx // k)
                ctx.matmul(g[:c], xs[:c], lw["experts_gate"][j])
                ctx.matmul(u[:c], xs[:c], lw["experts_up"][j])
                ctx.silu_mul_now(g[:c], u[:c])
                ctx.matmul(xs[:c], g[:c], lw["experts_down"][j])
                slots.index_copy_(0, idx, xs[:c])
                r += c
            acc32.zero_()
            per_slot = slots.view(n, k, d)
            for j in range(k):                                             # the published .sum(dim=1)
                acc32.add_(per_slot[:, j].float() * top_w[:, j:j + 1])
            acc.copy_(acc32)

        with ctx.op("experts"):
            ctx.use(h, top_i, top_w, writes=(xs, g, u, slots, acc32, acc))
            # sort and index lists (3 x 8 B per routed row + the sort's double buffers) and one
            # slot's fp32 product [n, d]
            ctx.external(n * k * (8 * 3 + 32) + n * d * 4 * 2)
            ctx.pointwise_scratch(2)
            if ctx.compute:
                experts()
        if cfg.shared_ffn:
            sg = ctx.linear("shared_g", h, lw["shared_gate"])              # [n, S]
            su = ctx.linear("shared_u", h, lw["shared_up"])
            ctx.silu_mul_(sg, su)
            sy = ctx.linear("shared_y", sg, lw["shared_down"])             # [n, d]
            ctx.add_(acc, sy)
        ctx.add_(x[s:e], acc)
