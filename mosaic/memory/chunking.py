"""Chunk-count choice per step: fixed counts, or the lazy bottleneck-driven search."""

from __future__ import annotations

from ..models.layers import Chunks


def make_chooser(engine):
    fixed = engine.config.chunks
    if fixed is not None:
        chunks = Chunks(*fixed)
        return lambda runner, step: chunks
    return None
