"""Memory over one step, planned and measured, as data and as a PNG (matplotlib)."""

from __future__ import annotations

import time

import torch

from ..graph.record import RecordCtx
from ..models.layers import step_program
from ..models.step import make_step


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


def native_series(model, batch: int, length: int) -> list[int]:
    """Activation bytes per executed op of the native forward (recorded on meta tensors; the
    sampler's full-vocabulary tensors after it are not included)."""
    ids = torch.empty(batch, length, dtype=torch.long, device="meta")
    rec = RecordCtx(model.device, model.dtype)
    step_program(rec, model, make_step(model.cfg, ids, None))
    return planned_series(rec.template())
