"""A block-diffusion request in flight (LLaDA2.x): a RequestRun over the aligned block canvas
(runtime/block_canvas.py) and the request's block K/V store.

The sampler (runtime/samplers/block_diffusion.py) yields a BlockCall per step: canvas columns
[a, hi) run against the store (models/block_cache.py: finished blocks' K/V computed once, the
current block recomputed), the rest of the run is a RequestRun's: admitted once by the
Admitter with the store charged, the guard around it, the same Generation."""

from __future__ import annotations

import torch

from ..memory.accounting import INPUT_BYTES_PER_TOKEN
from ..memory.kv_pool import held_bytes
from ..memory.kv_store import KVStore, StoreLayout
from ..models.batched_attention import varlen_kernel
from ..models.block_cache import BlockCacheStep, block_step
from ..prompts import pad_filler
from ..runtime.block_canvas import block_canvas
from .result import Generation
from .run import RequestRun, cancel_check, constraint_for, progress_bar
from .steps import RowsState


class BlockRun(RequestRun):
    """One block-diffusion request (module docstring)."""

    def _make(self) -> None:
        request, executor = self.request, self.executor
        gen, sampler, model = request.gen, request.sampler, executor.model
        self.pad = pad_filler(model.cfg)
        self.canvas = c = block_canvas([list(p) for p in request.prompts], gen.max_new_tokens, sampler.block(gen),
                                       model.cfg.mask_id, self.pad, model.device)
        hot = self.admission.layout.hot if self.admission is not None and self.admission.layout is not None else None
        if hot is None and executor.config.kv_tier == "host":
            hot = 0
        self.layout = StoreLayout.of(model.cfg, c.batch, c.width, model.dtype.itemsize, hot)
        # a device-tier store lives in the engine's paged pool when it has one (memory/kv_pool.py):
        # several requests' block steps then stack into one step over the pool
        pool = executor.kv_pool if self.layout.hot >= self.layout.num_layers else None
        store = pool.store(self.layout) if pool is not None else KVStore(self.layout, model.device, model.dtype)
        self.state = RowsState(None, store, None, self.probe, interrupt=cancel_check(self.cancel_event, self.cancelled),
                               deferred=True)
        self.x, self.prompt_len = c.ids, 0
        self.generator = None if gen.seed is None else torch.Generator(device=model.device).manual_seed(gen.seed)
        self.constraint = constraint_for(request, model.cfg, [c.answer(b) for b in range(c.batch)])
        self.loop = sampler.loop_blocks(c, gen, self.generator, self.constraint)
        # a batch runs its block steps batched (models/block_cache.py): this attention kernel
        econf = executor.config
        self.kernel = varlen_kernel(model.cfg, model.device, model.dtype, econf.batch_invariant, econf.varlen_kernel) \
            if c.batch > 1 else None
        self.bar = progress_bar(self.total_steps, self.progress)

    def _step_done(self, masked: int) -> bool:
        self.steps_done += 1
        if self.bar is not None:
            self.bar.set_postfix(masked=masked)
            self.bar.update(1)
        return bool(self.on_step(self.steps_done, self.canvas.standard(self.pad))) if self.on_step else False

    def execute_pending(self):
        call = self.pending
        self.check_cancelled()
        c, store = self.canvas, self.state.store
        resident = held_bytes([store]) + INPUT_BYTES_PER_TOKEN * c.batch * (c.width - (call.hi - call.a))
        step = block_step(c.ids, c.pads, BlockCacheStep(call.a, call.hi, c.block, c.width, store, resident),
                          self.kernel, rows=call.rows, reducer=call.reducer)
        store.begin("block", call.a, c.width)          # cold layers: prefetch the stored columns [0, a)
        if step.cache.index is not None:               # a batch's attention kernel (Generation.lossy)
            store.read_by(step.cache.index.kernel)
        with self.interruptible():
            outs = self.executor.execute(step, self.state)
        store.finish()
        return outs

    def result(self) -> Generation:
        req, model, cfg = self.request, self.executor.model, self.executor.model.cfg
        tokens = self.canvas.answers().cpu()
        lay, store = self.layout, self.state.store
        stats = dict(self.loop_stats or {}) | {
            "kv_tier": lay.tier, "hot_layers": lay.hot, "kv_device_bytes": lay.device_bytes,
            "kv_host_bytes": lay.host_bytes, "kv_transfer_bytes": store.transfer_bytes,
            "kv_bytes_per_token": 2 * cfg.num_layers * cfg.kv_dim * model.dtype.itemsize}
        base = super().result()
        for key in ("graphs", "structured"):
            if key in base.stats:
                stats[key] = base.stats[key]
        return Generation([self.requests.decode(t) for t in tokens], tokens, self.canvas.standard(self.pad).cpu(),
                          "planned", stats.get("nfe", self.steps_done), self.seconds, base.peak_device_bytes,
                          req.gen, base.lossy, stats, "resident", list(model.precision), base.predicted_bytes,
                          self.stopped_early, self.steps_done,
                          beyond_trained_length=req.beyond_trained_length)

