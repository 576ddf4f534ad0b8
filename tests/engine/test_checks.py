"""What an engine sets once at construction: torch's CPU threads, with one warning for more
threads than the process's cores (QA: --threads 1000 on 2 cores was accepted silently and ran
~200x slower)."""

import types
import warnings

import pytest
import torch

from mosaic.engine.checks import set_threads, usable_cores

CPU_MODEL = types.SimpleNamespace(device=torch.device("cpu"), weight_bytes=lambda: 0)


@pytest.fixture
def threads_back():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_more_threads_than_cores_warns_once_and_is_set_as_asked(threads_back):
    cores = usable_cores()
    with pytest.warns(UserWarning, match=rf"threads={cores + 1} \(--threads\) is more than the {cores} CPU") as w:
        set_threads(cores + 1, CPU_MODEL)
    assert len(w) == 1 and torch.get_num_threads() == cores + 1


def test_threads_within_the_cores_are_set_silently(threads_back):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_threads(usable_cores(), CPU_MODEL)
        set_threads(None, CPU_MODEL)
    assert torch.get_num_threads() == 1      # None on a small model: one thread
