"""`mosaic plan` plans for the device it is asked about and says so; a budget above all of the
device's memory is refused when the engine starts."""

import json

import pytest
import torch
from conftest import random_model

from mosaic import MosaicEngine
from mosaic.cli import main
from mosaic.errors import InputError
from mosaic.memory.accounting import check_budget_total, device_total_bytes


def plan(capsys, *args):
    assert main(["plan", "--model", "tiny-llada", "--budget", "0.4GiB", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_defaults_to_the_device_present_and_names_it(capsys):
    here = "cuda" if torch.cuda.is_available() else "cpu"
    rep = plan(capsys)
    assert rep["device"] == here
    cpu = plan(capsys, "--device", "cpu")
    assert cpu["device"] == "cpu" and cpu["context_bytes"] == 0 and cpu["l_max"] > 30_000
    assert main(["plan", "--model", "tiny-llada", "--budget", "0.4GiB"]) == 0
    if here == "cpu":
        assert capsys.readouterr().out.startswith("planned for cpu")


def test_plan_for_cuda_charges_the_h200(capsys):
    assert main(["plan", "--model", "tiny-llada", "--budget", "0.4GiB", "--device", "cuda"]) == 2
    assert "context and workspace" in capsys.readouterr().err       # the H200's context does not fit
    rep = plan(capsys, "--device", "cuda", "--budget", "2GiB")
    assert rep["device"] == "cuda" and rep["context_bytes"] > 0


def test_a_budget_above_the_machine_is_refused_at_engine_start():
    total = device_total_bytes(torch.device("cpu"))
    assert total and total > 2**28
    check_budget_total(total, torch.device("cpu"))
    with pytest.raises(InputError, match="more than this machine's RAM holds") as e:
        MosaicEngine(random_model("llada"), {"device": "cpu", "progress": False, "memory_budget": "1024TiB"})
    # what it suggests is accepted on this machine (a fraction of a card it has not: no)
    assert "fraction" not in str(e.value)
    suggested = str(e.value).split("--budget ")[1].split(")")[0]
    MosaicEngine(random_model("llada"), {"device": "cpu", "progress": False, "memory_budget": suggested}).close()
