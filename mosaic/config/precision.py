"""Weight precision per layer range (FP8 is opt-in and lossy; docs/FP8.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError
from .values import check_choice, check_int, coerce, disjoint_ranges, layer_range, parse_bytes, range_for

PRECISION_DTYPES = ("model", "bf16", "fp8")


@dataclass(frozen=True)
class PrecisionRange:
    """The weight precision of a range of layers. layers: (first, last), inclusive, 0-based;
    dtype: model (the model dtype) | bf16 (the same on a bf16 model) | fp8 (e4m3 weights with a
    scale per output channel, activations quantized per token at run time: opt-in, lossy)."""
    layers: tuple[int, int]
    dtype: str = "fp8"

    def __post_init__(self):
        object.__setattr__(self, "layers", layer_range("precision", self.layers))
        check_choice("precision ", "dtype", self.dtype, PRECISION_DTYPES)


@dataclass(frozen=True)
class PrecisionConfig:
    """Weight precision per layer (FP8 is opt-in and lossy; docs/FP8.md).

    ranges: explicit dtypes by layer range (layers without a range keep the model dtype);
    auto: choose the FP8 layers by sensitivity (policy/precision.py) so that the weights fit
    target_weight_bytes ('8GiB', bytes, or a fraction 0 < f <= 1 of the 16-bit weights) with the
    least total sensitivity; method: kl (each layer quantized alone, KL of the masked logits on
    calibration canvases) | local (each layer's own output error, one forward pass);
    calibration: canvases used; embed: model | fp8 (the embedding table, per-row scales)."""
    ranges: tuple[PrecisionRange, ...] = ()
    auto: bool = False
    target_weight_bytes: str | int | float | None = None
    method: str = "kl"
    calibration: int = 16
    embed: str = "model"

    def __post_init__(self):
        rs = tuple(r if isinstance(r, PrecisionRange) else coerce(PrecisionRange, r) for r in self.ranges)
        object.__setattr__(self, "ranges", rs)
        disjoint_ranges("precision", rs)
        if self.auto and rs:
            raise InputError("precision: give either ranges or auto: true (with target_weight_bytes), not both")
        if self.auto and self.target_weight_bytes is None:
            raise InputError("precision auto: true needs target_weight_bytes ('8GiB', bytes, or a fraction "
                             "0 < f <= 1 of the 16-bit weights)")
        if self.target_weight_bytes is not None:
            t = self.target_weight_bytes
            if isinstance(t, bool) or not (isinstance(t, float) and 0 < t <= 1) and \
                    parse_bytes(t if not isinstance(t, float) else int(t)) <= 0:
                raise InputError(f"precision target_weight_bytes={t!r}: bytes ('8GiB') or a fraction 0 < f <= 1")
        check_choice("precision ", "method", self.method, ("kl", "local"))
        check_int("precision ", "calibration", self.calibration, 1)
        check_choice("precision ", "embed", self.embed, ("model", "fp8"))

    def for_layer(self, layer: int) -> str:
        """'fp8' or 'model' for one layer under the explicit ranges (auto: decided elsewhere)."""
        r = range_for(self.ranges, layer)
        return "fp8" if r is not None and r.dtype == "fp8" else "model"

    @classmethod
    def coerce(cls, value) -> PrecisionConfig | None:
        """None, a PrecisionConfig, a mapping of its fields, or a list of ranges (YAML's
        `precision: [{layers: [0, 3], dtype: bf16}, ...]`)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, (list, tuple)):
            return cls(ranges=tuple(value))
        return coerce(cls, value)

