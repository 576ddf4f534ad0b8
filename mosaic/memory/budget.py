"""The device-memory budget: account, predict, admit or refuse."""

from __future__ import annotations


def admit(engine, shape, gen) -> None:
    if engine.config.memory_budget is None:
        return
