"""What other live engines of the process hold (engine/device_memory._others_bytes), charged to a
new engine's budget as 'others': each model's resident weights once, however many live engines
share it (two engines over one model were charged its weights twice)."""

import types

import torch

from mosaic.engine import device_memory as dm


class _Live:
    """A live DeviceMemory as _others_bytes reads it."""

    def __init__(self, model, host_bytes=0):
        self.model, self.device, self.closed = model, model.device, False
        self.arena = types.SimpleNamespace(kind="host" if host_bytes else "vmm", mapped_bytes=host_bytes)


def test_engines_sharing_a_model_are_charged_its_weights_once(monkeypatch):
    cuda = torch.device("cuda", 0)
    mine, other = (types.SimpleNamespace(device=cuda, name=n) for n in ("mine", "other"))
    monkeypatch.setattr(dm.warmup, "resident_weight_bytes", lambda m: 3 * 2**30)
    live = [_Live(other), _Live(other, host_bytes=5), _Live(mine)]
    monkeypatch.setattr(dm, "_LIVE", live)
    assert dm._others_bytes(mine) == 3 * 2**30 + 5      # `other` once, its host arena, not `mine`
    live[0].closed = live[1].closed = True
    assert dm._others_bytes(mine) == 0
