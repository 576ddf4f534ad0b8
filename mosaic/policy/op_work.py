"""On a CPU, each op's work bounded, so that a cancelled request stops within about a second.

A step is interrupted between two ops (graph/ctx.Ctx.interrupt asks after every op), never
inside one. On a GPU an op lasts milliseconds, but on a CPU an op runs for as long as its work:
one 16,384-row attention chunk over 200,000 keys of tiny-llada (q_dim 192) took 356 s on this
project's 2-core machine (7-10 GFLOP/s per thread under load), so a client that left, a
--request-timeout or a SIGTERM waited minutes. Here every phase of a plain step (attention query
chunks, FFN row chunks, logits row chunks) is split so that no op does more than CPU_OP_FLOPS,
~0.4-0.6 s at those rates. Splitting rows never splits a reduction: the tokens are unchanged."""

from __future__ import annotations

import math

from ..models.step import Chunks

CPU_OP_FLOPS = 4e9


def op_chunks(step, cfg, op_flops: float | None, max_chunks: int = 4096) -> Chunks:
    """The least chunk counts (attention, FFN, logits) whose ops each do at most op_flops
    multiply-adds x 2 (None: no bound). Plain steps only: a block or cache step runs a block of
    rows. Flops per row: attention 4 x keys x q_dim (scores and values) + the q/k/v/o
    projections; FFN 6 x d x F (x top_k routed experts for a MoE); logits 2 x d x V."""
    if op_flops is None or step.cache is not None:
        return Chunks()
    B, L, d = step.batch, int(step.ids.shape[1]), cfg.hidden
    attn_row = 4 * L * cfg.q_dim + 2 * d * (2 * cfg.q_dim + 2 * cfg.kv_dim)
    ffn_row = 6 * d * cfg.ffn * max(1, cfg.top_k)
    logits_row = 2 * d * cfg.vocab

    def count(units: int, per_unit: float) -> int:
        per_op = max(1, int(op_flops // max(per_unit, 1)))
        return max(1, min(max_chunks, units, math.ceil(units / per_op)))
    return Chunks(count(L, attn_row * B), count(B * L, ffn_row), count(max(step.num_masked, 1), logits_row))
