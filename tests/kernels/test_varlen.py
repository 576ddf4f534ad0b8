"""Batched (varlen) attention over a ragged K/V pool (kernels/varlen.py): the loop reference
against a float64 oracle written here, the gather kernel against the loop, the entry checks, and
the one place that chooses the kernel (kernels.varlen_kernel)."""

import math

import pytest
import torch

from mosaic import kernels
from mosaic.errors import InputError
from mosaic.kernels import reference as R
from mosaic.kernels import varlen as VL


def _oracle(q, k, v, q0, nq, k0, nk):
    """softmax(q k^T / sqrt(hd)) v of one entry in float64, grouped-query heads by repetition."""
    g = q.shape[1] // k.shape[1]
    qq = q[q0:q0 + nq].double()
    kk = k[k0:k0 + nk].double().repeat_interleave(g, dim=1)
    vv = v[k0:k0 + nk].double().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", qq, kk) / math.sqrt(q.shape[2])
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv).reshape(nq, -1)


def _ragged(seed=0, hq=4, hkv=2, hd=8, nq=5):
    """A pool of 200 rows with four entries at scattered starts (gaps between them: other
    requests' rows and free pages), of different key counts."""
    g = torch.Generator().manual_seed(seed)
    starts, counts = [7, 120, 40, 150], [30, 17, 61, 44]
    q = torch.randn(len(starts) * nq, hq, hd, generator=g)
    k = torch.randn(200, hkv, hd, generator=g)
    v = torch.randn(200, hkv, hd, generator=g)
    return q, k, v, VL.entries([nq] * len(starts), starts, counts, "cpu")


def test_the_loop_equals_each_entry_alone_and_the_float64_oracle():
    q, k, v, ent = _ragged()
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2])
    VL.attention_into(out, q, k, v, ent, "loop")
    for q0, nq, k0, nk in zip(ent.q_first, ent.q_count, ent.k_first, ent.k_count):
        alone = torch.empty(nq, out.shape[1])
        R.attention(alone, q[q0:q0 + nq], k[k0:k0 + nk], v[k0:k0 + nk])
        assert torch.equal(out[q0:q0 + nq], alone)                        # the same call as alone
        torch.testing.assert_close(out[q0:q0 + nq].double(), _oracle(q, k, v, q0, nq, k0, nk), atol=1e-5, rtol=1e-5)


def test_the_gather_kernel_reads_only_device_tensors_and_agrees_with_the_loop():
    q, k, v, ent = _ragged(seed=1)
    k[103:120], v[103:120] = float("nan"), float("inf")                    # rows no entry owns: never used
    k[196:], v[196:] = float("nan"), float("inf")
    want = torch.empty(q.shape[0], q.shape[1] * q.shape[2])
    VL.attention_into(want, q, k, v, ent, "loop")
    bounded = VL.entries(ent.q_count, ent.k_first, ent.k_count, "cpu", max_k=128)   # a key bucket
    got = torch.empty_like(want)
    VL.attention_into(got, q, k, v, bounded, "gather")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the host offsets are not read: other entries in the same device tensors give their values
    moved = VL.entries(ent.q_count, [s + 1 for s in ent.k_first], ent.k_count, "cpu", max_k=128)
    bounded.k_start.copy_(moved.k_start)
    VL.attention_into(got, q, k, v, bounded, "gather")
    VL.attention_into(want, q, k, v, moved, "loop")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_an_entry_without_keys_reads_nothing():
    q, k, v, _ = _ragged()
    ent = VL.entries([5, 5, 5, 5], [7, 0, 40, 150], [30, 0, 61, 44], "cpu")
    out = torch.full((20, 32), float("nan"))
    VL.attention_into(out, q, k, v, ent, "loop")
    assert torch.equal(out[5:10], torch.zeros(5, 32)) and not out.isnan().any()


def test_bad_entries_are_refused():
    q, k, v, ent = _ragged()
    with pytest.raises(ValueError, match="max_k"):
        VL.entries([5], [0], [40], "cpu", max_k=10)
    with pytest.raises(ValueError, match="non-negative"):
        VL.entries([5], [-1], [4], "cpu")
    with pytest.raises(ValueError, match="key rows up to"):
        VL.attention_into(torch.empty(20, 32), q, k, v, VL.entries([5] * 4, [190] * 4, [20] * 4, "cpu"), "loop")
    with pytest.raises(ValueError, match="query rows"):
        VL.attention_into(torch.empty(20, 32), q, k, v, VL.entries([4] * 4, [0] * 4, [9] * 4, "cpu"), "loop")
    with pytest.raises(ValueError, match="unknown varlen kernel"):
        VL.attention_into(torch.empty(20, 32), q, k, v, ent, "paged")


def test_the_kernel_choice():
    bf = torch.bfloat16
    assert kernels.varlen_kernel("cpu", bf, 32, 32, 128) == "loop"          # the CPU path: the reference
    assert kernels.varlen_kernel("cpu", bf, 32, 32, 128, batch_invariant=True) == "loop"
    assert kernels.varlen_kernel("cpu", torch.float32, 4, 2, 8, setting="gather") == "gather"
    with pytest.raises(InputError, match="not batch-invariant"):
        kernels.varlen_kernel("cpu", torch.float32, 4, 2, 8, batch_invariant=True, setting="gather")
    for forced in ("flash", "efficient"):
        if not torch.cuda.is_available():
            with pytest.raises(InputError, match=f"kernel '{forced}' cannot run"):
                kernels.varlen_kernel("cpu", bf, 32, 32, 128, setting=forced)
    with pytest.raises(InputError, match="unknown"):
        kernels.varlen_kernel("cpu", bf, 32, 32, 128, setting="paged")


def test_the_engine_config_carries_the_kernel_choice():
    """EngineConfig.varlen_kernel is the setting kernels.varlen_kernel gets: an unknown name is
    refused when the config is built, a kernel the device cannot run when the engine is."""
    from conftest import random_model

    from mosaic import MosaicEngine
    from mosaic.config import EngineConfig
    assert EngineConfig().varlen_kernel == "auto"
    with pytest.raises(InputError, match="varlen_kernel='paged'"):
        EngineConfig(varlen_kernel="paged")
    model = random_model("llada")
    assert MosaicEngine(model, {"progress": False, "varlen_kernel": "gather"}).config.varlen_kernel == "gather"
    with pytest.raises(InputError, match="not batch-invariant"):
        MosaicEngine(model, {"progress": False, "varlen_kernel": "gather", "batch_invariant": True})
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="kernel 'flash' cannot run"):
            MosaicEngine(model, {"progress": False, "varlen_kernel": "flash"})


def test_external_bytes_cover_the_kernels_outputs():
    # flash/efficient: output [T, Hq, hd] in the dtype + an fp32 lse padded per entry to 128 rows
    got = VL.external_bytes("flash", 512, 16, 32, 32, 128, 2)
    assert got >= 512 * 32 * 128 * 2 + 32 * 16 * 32 * 4
    assert VL.external_bytes("loop", 512, 16, 32, 32, 128, 2, per_entry=12345) == 12345


def test_the_triton_kernel_equals_the_loop_and_is_batch_invariant(monkeypatch):
    """Under the interpreter (CPU, fp32): query rows across several tiles, keys across several
    tiles with a partial last one, grouped heads, an entry without keys; an entry's values are the
    same bits alone as among others (batch-invariant mode's property)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3 * 20, 2, 8, generator=g)
    k, v = torch.randn(300, 1, 8, generator=g), torch.randn(300, 1, 8, generator=g)
    ent = VL.entries([20] * 3, [5, 200, 0], [37, 40, 0], "cpu", max_k=64)
    want, got = torch.empty(60, 16), torch.full((60, 16), float("nan"))
    VL.attention_into(want, q, k, v, ent, "loop")
    VL.attention_into(got, q, k, v, ent, "triton")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    alone = torch.empty(20, 16)
    VL.attention_into(alone, q[20:40], k, v, VL.entries([20], [200], [40], "cpu", max_k=64), "triton")
    assert torch.equal(alone, got[20:40])
