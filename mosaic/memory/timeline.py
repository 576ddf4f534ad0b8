"""Memory over one step, planned and measured, as data and as a PNG (matplotlib)."""

from __future__ import annotations

import time

import torch


def planned_series(tpl) -> list[int]:
    """Activation bytes per executed op of a plan: live planned buffers + bytes outside the plan."""
    live, ext = tpl.live_bytes(), tpl.external
    return [live[i] + ext[i] for i in tpl.execution_order()]


class Probe:
    """Samples device memory and time after every op (synchronising: for measurement only)."""

    def __init__(self, device, extra=lambda: 0):
        self.device, self.extra = torch.device(device), extra
        self.samples: list[tuple[float, int, str]] = []
        self.t0 = time.perf_counter()

    def __call__(self, ctx, name):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            used = torch.cuda.memory_allocated(self.device) + self.extra()
        else:
            used = 0
        self.samples.append((time.perf_counter() - self.t0, used, name))

    def par(self, base: int = 0, peak: int | None = None) -> float:
        """Peak / duration-weighted mean of activation bytes (device bytes minus `base`). `peak`
        is the allocator's true peak when work between ops (a sampler) may exceed the samples."""
        if len(self.samples) < 2:
            return 1.0
        times = [t for t, _, _ in self.samples]
        vals = [max(0, u - base) for _, u, _ in self.samples]
        durs = [b - a for a, b in zip([0.0] + times[:-1], times)]
        mean = sum(v * d for v, d in zip(vals, durs)) / max(sum(durs), 1e-12)
        top = max(max(vals), (peak - base) if peak is not None else 0)
        return top / mean if mean else 1.0


def plot(series: dict[str, list[float]], path: str, title: str) -> None:
    """series: label -> bytes per executed op (x is normalised to the step's progress)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, ys in series.items():
        if not ys:
            continue
        xs = [i / max(1, len(ys) - 1) for i in range(len(ys))]
        ax.step(xs, [y / 2**30 for y in ys], where="post", label=label)
    ax.set_xlabel("progress through one denoising step (ops)")
    ax.set_ylabel("activation memory (GiB)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_engine_step(engine, prompts, gen, path: str) -> dict:
    """The first step of this request: Mosaic's plan (and, on a GPU, both paths measured)."""
    from ..engine.runners import make_step
    from .budget import first_step
    x, valid, _ = engine._canvas(engine.encode(prompts), gen.max_new_tokens)
    step = first_step(engine, x.shape[0], x.shape[1], gen)
    planned = engine.planned.capped(step)
    chooser = engine.planned.chooser
    from ..models.layers import Chunks
    chunks = chooser(engine.planned, planned) if chooser else Chunks()
    tpl, _, _ = engine.planned.template(planned, chunks)
    series = {"Mosaic (planned)": planned_series(tpl)}
    native_step = make_step(engine.model, torch.empty(x.shape, dtype=torch.long, device="meta"), None)
    from ..graph.record import RecordCtx
    from ..models.layers import step_program
    rec = RecordCtx(engine.model.device, engine.model.dtype)
    step_program(rec, engine.model, native_step)
    series["native forward (recorded, no sampler)"] = planned_series(rec.template())
    if engine.model.device.type == "cuda":
        for native in (True, False):
            probe = Probe(engine.model.device)
            runner = engine.native if native else engine.planned
            runner.probe = probe
            try:
                engine.generate(prompts, config=gen, native=native, steps=1, progress=False,
                                max_new_tokens=gen.max_new_tokens, block_length=gen.max_new_tokens)
            finally:
                runner.probe = None
            base = torch.cuda.memory_allocated(engine.model.device)
            series[f"{'native' if native else 'Mosaic'} (measured)"] = [u - base + engine.arena.mapped_bytes
                                                                       * (not native)
                                                                       for _, u, _ in probe.samples]
    plot(series, path, f"{engine.model.name}: one step, N = {x.shape[1]:,} x {x.shape[0]}")
    return series
