"""What a planned request allocates outside its arena, traced on the CPU (every tensor an aten op
returns, through a TorchDispatchMode): the request's per-token tensors stay within
INPUT_BYTES_PER_TOKEN, and every op's transients within the bytes it declares with
ctx.external (plus the small row statistics the small-pool allowance covers on a GPU)."""

import weakref
from contextlib import contextmanager

import pytest
import torch
from conftest import random_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mosaic import MosaicEngine
from mosaic.graph import ctx as ctx_mod
from mosaic.kernels.reference import ROW_TILE
from mosaic.memory.accounting import INPUT_BYTES_PER_TOKEN
from mosaic.memory.kv_store import StoreLayout

# rmsnorm's [rows, 1] mean and rsqrt, RoPE's fp32 positions, argmax/topk index scratch: at most
# a few [ROW_TILE] fp32 vectors per op, what SMALL_POOL_BYTES holds on a GPU
SMALL_OP_BYTES = 8 * ROW_TILE * 4


class Live(TorchDispatchMode):
    """Live bytes of storages created while active, split by whether an op was running."""

    def __init__(self, exclude_ptrs):
        super().__init__()
        self.exclude = set(exclude_ptrs)
        self.tracked = {}            # storage ptr -> [nbytes, in_op, op index, [weakrefs]]
        self.in_op = None
        self.op_peak = {}            # op index -> most bytes born in it and alive at once
        self.request_peak = 0

    def _alive(self):
        for ptr in [p for p, rec in self.tracked.items() if not any(r() is not None for r in rec[3])]:
            del self.tracked[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr in self.exclude or st.nbytes() == 0:
                continue
            rec = self.tracked.get(ptr)
            if rec is None:
                rec = self.tracked[ptr] = [st.nbytes(), self.in_op is not None, self.in_op, []]
            rec[3].append(weakref.ref(t))
        self._alive()
        if self.in_op is not None:
            born = sum(r[0] for r in self.tracked.values() if r[2] == self.in_op)
            self.op_peak[self.in_op] = max(self.op_peak.get(self.in_op, 0), born)
        req = sum(r[0] for r in self.tracked.values() if not r[1])
        self.request_peak = max(self.request_peak, req)
        return out


def trace(engine, prompt, **opts):
    arena_ptrs = set()
    seen_ops = []
    live = None
    orig_op = ctx_mod.Ctx.op

    @contextmanager
    def op(self, name):
        with orig_op(self, name) as i:
            if type(self).__name__ == "PlannedCtx":
                key = len(seen_ops)
                seen_ops.append((name, self.t.external[i] if i < len(self.t.external) else 0))
                live.in_op = key
                arena_ptrs.add(self.arena.untyped_storage().data_ptr())
                live.exclude |= arena_ptrs
            try:
                yield i
            finally:
                live.in_op = None
    weights = {p.untyped_storage().data_ptr() for p in _tensors(engine.model)}
    # the arena exists before the trace when the engine has run once at this size
    engine.generate(prompt, progress=False, **opts)
    weights.add(engine.arena.tensor().untyped_storage().data_ptr())
    pool = engine.executor.kv_pool     # the paged K/V pool's buffers, grown by the first request
    if pool is not None and pool.storage.t.numel():
        weights.add(pool.storage.t.untyped_storage().data_ptr())
    live = Live(weights)
    ctx_mod.Ctx.op = op
    try:
        with live:
            engine.generate(prompt, progress=False, **opts)
    finally:
        ctx_mod.Ctx.op = orig_op
    return live, seen_ops


def _tensors(model):
    out = [model.embed, model.final_norm, model.lm_head, model.inv_freq]
    for lw in model.layers:
        out += list(lw.values())
    return [t for t in out if isinstance(t, torch.Tensor)]


CASES = [
    ("llada", {}),
    ("llada", {"temperature": 0.5}),
    ("llada", {"cfg_scale": 1.0}),
    ("llada", {"remasking": "random", "confidence_dtype": "float64"}),
    ("dream", {"alg": "entropy"}),
    ("dream", {"alg": "origin", "temperature": 0.4, "top_p": 0.9}),
    ("llada_moe", {}),
    ("llada_moe", {"moe_kernel": "loop"}),
    ("llada2", {}),
    ("llada2", {"moe_kernel": "loop"}),
]


@pytest.mark.parametrize("family, opts", CASES)
def test_request_and_op_bytes_stay_within_their_charges(family, opts):
    model = random_model(family)
    engine_opts = {k: v for k, v in opts.items() if k == "moe_kernel"}
    opts = {k: v for k, v in opts.items() if k != "moe_kernel"}
    eng = MosaicEngine(model, {"progress": False, "logits_kernel": "torch", **engine_opts})
    n_prompt, gen = 1536, 512
    prompt = [1 + i % 20 for i in range(n_prompt)]
    if family != "dream":
        opts = {"block_length": gen, **opts}
    live, ops = trace(eng, prompt, max_new_tokens=gen, steps=2, **opts)
    batch = 2 if opts.get("cfg_scale") else 1
    allowed = INPUT_BYTES_PER_TOKEN * batch * (n_prompt + gen)
    if family == "llada2":   # + the request's block K/V store (block admission charges it)
        allowed += StoreLayout.of(model.cfg, 1, -(-(n_prompt + gen) // gen) * gen, 4).device_bytes
    assert 0 < live.request_peak <= allowed
    assert live.op_peak and max(live.op_peak.values()) > 0
    over = {f"{ops[k][0]}#{k}": (peak, ops[k][1]) for k, peak in live.op_peak.items()
            if peak > ops[k][1] + SMALL_OP_BYTES}
    assert not over, f"ops allocating more than they declare (bytes, declared): {over}"
