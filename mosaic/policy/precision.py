"""Choosing each layer's precision: explicit ranges from the config, or the FP8 layers of least
total sensitivity that bring the weights under a byte target (docs/FP8.md).

The choice is a covering knapsack: x_i = 1 puts layer i in FP8, saving s_i bytes at cost c_i
(its sensitivity, policy/sensitivity.py); minimise sum c_i x_i subject to sum s_i x_i >= the
bytes to save. Solved exactly with scipy.optimize.milp (HiGHS; 32 binaries take milliseconds);
if the solver fails, greedily by cost per byte saved (optimal when all layers
save the same bytes, as in every dense model here). Summing per-layer costs assumes layer
errors add, which the KL measure approximates for small perturbations.
"""

from __future__ import annotations

import numpy as np

from ..config import PrecisionConfig, parse_bytes
from ..errors import InputError, gib
from ..models.precision import FP8_NAME, embed_bytes_as, layer_bytes_as
from .sensitivity import layer_sensitivity


def choose_fp8(costs: list[float], savings: list[int], need: int) -> list[bool]:
    """Which items to quantize: the least total cost whose savings reach `need` bytes.
    Raises InputError when even every item falls short."""
    n = len(costs)
    if need <= 0:
        return [False] * n
    if sum(savings) < need:
        raise InputError(f"the precision target needs {gib(need)} saved, but FP8 everywhere saves "
                         f"only {gib(sum(savings))}")
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp  # 1.5 s of import: only when FP8 is planned
        res = milp(c=np.asarray(costs, dtype=float), integrality=np.ones(n),
                   bounds=Bounds(0, 1), constraints=LinearConstraint(np.asarray([savings], float), lb=need))
        if res.success:
            return [bool(round(v)) for v in res.x]
    except ValueError:
        pass
    order = sorted(range(n), key=lambda i: costs[i] / max(savings[i], 1))
    pick, saved = [False] * n, 0
    for i in order:
        if saved >= need:
            break
        pick[i], saved = True, saved + savings[i]
    return pick


def resolve_target(target, bytes16: int) -> int:
    """target_weight_bytes: a fraction 0 < f <= 1 of the 16-bit weights, or bytes."""
    if isinstance(target, float) and 0 < target <= 1:
        return int(target * bytes16)
    return parse_bytes(target)


def plan_precision(model, pc: PrecisionConfig) -> dict:
    """Per-layer dtypes for `model` under `pc`, and the report behind them (bytes, sensitivity).
    Raises InputError for ranges past the model's layers or an unreachable target."""
    L = len(model.layers)
    top = max((r.layers[1] for r in pc.ranges), default=-1)
    if top >= L:
        raise InputError(f"precision ranges reach layer {top}, but {model.name} has layers 0-{L - 1}")
    bytes16 = [layer_bytes_as(lw, "model") for lw in model.layers]
    bytes8 = [layer_bytes_as(lw, FP8_NAME) for lw in model.layers]
    other = model.weight_bytes(layers=False)
    rep = {"method": None, "sensitivity": None, "target_bytes": None,
           "weight_bytes_16bit": other + sum(bytes16)}
    if pc.embed == FP8_NAME and "embed_scale" not in model.extra:
        other += embed_bytes_as(model, FP8_NAME) - embed_bytes_as(model, "model")
    if not pc.auto:
        dtypes = [pc.for_layer(i) for i in range(L)]
    else:
        target = resolve_target(pc.target_weight_bytes, rep["weight_bytes_16bit"])
        sens = layer_sensitivity(model, pc.method, pc.calibration)
        pick = choose_fp8(sens, [a - b for a, b in zip(bytes16, bytes8)], other + sum(bytes16) - target)
        dtypes = [FP8_NAME if p else "model" for p in pick]
        rep |= {"method": pc.method, "sensitivity": sens, "target_bytes": target,
                "sensitivity_cost": sum(s for s, p in zip(sens, pick) if p)}
    rep["dtypes"] = dtypes
    rep["embed"] = pc.embed
    rep["weight_bytes"] = other + sum(b8 if d == FP8_NAME else b16 for d, b8, b16 in zip(dtypes, bytes8, bytes16))
    return rep
