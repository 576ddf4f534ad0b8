"""Block-causal attention (block diffusion: LLaDA2): the op the block step program attends with.

Query rows come in whole blocks of `block` rows; a block whose first canvas column is c attends
the keys of columns [key_lo, c + block): every earlier block and its own, bidirectionally inside
it, never a later one (the published generate's block-diffusion mask). A block that lies wholly
left of key_lo (left padding, which starts on a block boundary) attends nothing: its rows are
zero. Each block is one SDPA call over a contiguous key range, no mask built."""

from __future__ import annotations

from ..kernels import reference as R


class BlockOps:
    """Mixed into graph.ctx.Ctx."""

    def attention_blocks(self, name, q, k, v, block: int, q_col: int, key_lo: int):
        """out [nq, Hq*hd] for q [nq, Hq, hd] (nq a multiple of block; its first row is canvas
        column q_col) over k, v [Nk, Hkv, hd] (canvas columns 0..Nk-1), keys from key_lo on."""
        nq, hq, hd = q.shape
        with self.op("attention"):
            out = self.new(name, (nq, hq * hd))
            self.use(q, k, v, writes=(out,))
            groups = 2 if hq != k.shape[1] else 1
            # per block: SDPA's output and the regrouped q, its log-sum-exp rows (as ctx.attention)
            rows = min(block, nq)
            self.external(groups * rows * hq * hd * q.element_size() + hq * (rows + 32) * 4)
            if self.compute:
                for s in range(0, nq, block):
                    end = q_col + s + block                    # keys up to this block's end
                    if end <= key_lo:
                        out[s:s + block].zero_()
                        continue
                    R.attention(out[s:s + block], q[s:s + block], k[key_lo:end], v[key_lo:end])
        return out
