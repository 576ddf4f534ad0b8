"""attention_ref's gathered block-sparse path (a layout with the same number of kept blocks per
query block, as sparse_select makes) against its masked dense path and a plain softmax: GQA,
layouts per query head and per key/value head, partial last blocks, lse, tiles of query blocks."""

import pytest
import torch

from mosaic.kernels.attention_layout import layout_from_mask, random_layout
from mosaic.kernels.attention_ref import _uniform, attention_ref


def plain(q, k, v, lay):
    nq, hq, hd = q.shape
    nk, hkv = k.shape[:2]
    kk, vv = (t.repeat_interleave(hq // hkv, 1).float() for t in (k, v))
    bm = lay.block_mask()
    if bm.shape[0] != hq:
        bm = bm.repeat_interleave(hq // bm.shape[0], 0)
    allowed = bm[:, torch.arange(nq) // lay.block_q][:, :, torch.arange(nk) // lay.block_k]
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) / hd ** 0.5
    s.masked_fill_(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv).reshape(nq, hq * hd), s.logsumexp(-1)


@pytest.mark.parametrize("heads", ["q", "kv"])
@pytest.mark.parametrize("nq, nk, tile", [(45, 83, 1 << 24), (64, 64, 1 << 24), (70, 100, 600)])
def test_gathered_path_equals_masked_and_plain(heads, nq, nk, tile):
    hq, hkv, hd, b = 4, 2, 8, 16
    g = torch.Generator().manual_seed(nq + nk)
    q, k, v = (torch.randn(n, h, hd, generator=g) for n, h in ((nq, hq), (nk, hkv), (nk, hkv)))
    lay = random_layout(hq if heads == "q" else hkv, nq, nk, b, b, 0.4, heads, diagonal=False, seed=nk)
    assert _uniform(lay) is not None
    outs = {}
    for gather in (True, False):
        o, lse = torch.empty(nq, hq * hd), torch.empty(hq, nq)
        attention_ref(o, q, k, v, lse=lse, layout=lay, tile_elems=tile, gather=gather)
        outs[gather] = (o, lse)
    want, want_lse = plain(q, k, v, lay)
    for o, lse in outs.values():
        torch.testing.assert_close(o, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_irregular_layouts_take_the_masked_path():
    mask = torch.zeros(1, 2, 3, dtype=torch.bool)
    mask[0, 0, 0] = mask[0, 1, 1] = mask[0, 1, 2] = True        # 1 then 2 blocks kept
    lay = layout_from_mask(mask, 16, 16, "q")
    assert _uniform(lay) is None
    q, k, v = torch.randn(30, 1, 8), torch.randn(40, 1, 8), torch.randn(40, 1, 8)
    o = torch.empty(30, 8)
    attention_ref(o, q, k, v, layout=lay)
    torch.testing.assert_close(o, plain(q, k, v, lay)[0], atol=1e-5, rtol=1e-5)
