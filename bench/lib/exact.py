"""The planned path's masked-row logits against the native forward's, for the exactness checks of
the speed suites (0 = bit for bit), and the eager step functions of the capacity baselines."""

from __future__ import annotations

import torch

from . import engine as E


class Capture:
    """A reducer that keeps the masked rows' logits (the buffer path) in `store` [M, V] float32."""

    def __init__(self, store):
        self.store, self.fused = store, None

    def outputs(self, dtype):
        return [("x0", torch.int64)]

    def signature(self):
        return ("capture",)

    def transient_bytes(self, m, V, dtype):
        return 0

    def __call__(self, lg, lu, a, b, outs):
        self.store[a:b] = lg.float()
        outs["x0"].copy_(lg.argmax(-1))


def masked_rows(cfg, x: torch.Tensor) -> torch.Tensor:
    """Flat row indices whose logits predict the masked positions of x [batch, N] (the row
    before, for families whose logits are shifted by one)."""
    pos = (x == cfg.mask_id).reshape(-1).nonzero().squeeze(1)
    if cfg.logit_shift:
        pos = torch.where(pos % x.shape[1] == 0, pos, pos - 1)
    return pos


def masked_logits_err(engine, x: torch.Tensor) -> float:
    """‖planned − native‖ / ‖native‖ over the masked rows' logits of canvas x (Frobenius)."""
    from mosaic.models.step import make_step
    cfg = engine.model.cfg
    rows = masked_rows(cfg, x)
    full = E.native_forward(engine)(x, None).reshape(-1, cfg.vocab)[rows].float()
    store = torch.empty_like(full)
    E.execute(engine, make_step(cfg, x, None, rows=rows, reducer=Capture(store)))
    err = float((store - full).norm() / full.norm())
    del full, store
    return err


def baseline_step_fn(engine, x: torch.Tensor, native: bool, conf: str):
    """One native step with confidence dtype `conf` ('model' or 'float64'; Dream has one), or
    Mosaic's program (mask-only logits) run with PyTorch's allocator for every buffer: no arena,
    no chunking."""
    from mosaic.graph.ctx import EagerCtx
    from mosaic.models.layers import step_program
    from mosaic.models.step import make_step
    from mosaic.policy.probe import probe_step
    model = engine.model
    cfg = model.cfg
    if native and cfg.family != "dream":
        return lambda: E.step(engine, x, native=True, config={"confidence_dtype": conf})
    if native:
        return E.step_fn(engine, x, native=True)

    def run():
        rows = masked_rows(cfg, x)
        real = make_step(cfg, x, None, rows=rows,
                         reducer=probe_step(model, x.shape[1], int((x == cfg.mask_id).sum())).reducer)
        return step_program(EagerCtx(model.device, model.dtype), model, real)
    return run
