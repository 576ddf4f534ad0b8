"""`mosaic generate --gpus K` on the CPU (K gloo processes): a refused or invalid request ends
as on one process, with one `error:` line from rank 0, exit code 2 and no traceback."""

import subprocess
import sys

import pytest
from conftest import bundled


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "mosaic", *args], capture_output=True, text=True,
                          timeout=timeout)


def refused(out, *words):
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2, out.stderr
    assert len(errors) == 1, out.stderr
    assert "Traceback" not in out.stderr and "ChildFailedError" not in out.stderr, out.stderr
    assert all(w in errors[0] for w in words), errors[0]
    return errors[0]


def test_over_budget_request_is_refused_once_with_the_longest_that_fits():
    bundled("tiny-llada")
    # the bundled model's weights and workspace take ~329 MiB: 331 MiB holds a few hundred tokens
    out = run_cli("generate", "--gpus", "2", "--budget", "331MiB", "--prompt", "sort 31415926=",
                  "--gen-length", "3000", "--steps", "1")
    refused(out, "per GPU", "longest that fits on 2 GPUs")


def test_tensor_parallel_refusal_is_one_line():
    bundled("tiny-llada")
    out = run_cli("generate", "--gpus", "2", "--parallel", "tensor", "--budget", "331MiB", "--prompt",
                  "sort 31415926=", "--gen-length", "3000", "--steps", "1")
    refused(out, "per GPU", "longest that fits on 2 GPUs")


@pytest.mark.slow
def test_tensor_parallel_heads_that_do_not_divide():
    bundled("tiny-dream")
    out = run_cli("generate", "--gpus", "3", "--parallel", "tensor", "--model", "tiny-dream", "--prompt", "57+384=")
    refused(out, "2 K/V heads and 448 FFN columns (not divisible by 3); use 1 or 2 processes")


@pytest.mark.slow
def test_tensor_parallel_prints_the_answer_once():
    bundled("tiny-dream")
    out = run_cli("generate", "--gpus", "2", "--parallel", "tensor", "--no-progress", "--model", "tiny-dream",
                  "--prompt", "57+384=")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "57+384=441"


@pytest.mark.parametrize("args, words", [
    (["--gpus", "3", "--gen-length", "8", "--block-length", "3"], ["not divisible by --block-length 3"]),
    pytest.param(["--gpus", "2", "--native"], ["native path runs on one process"], marks=pytest.mark.slow),
    pytest.param(["--gpus", "2", "--prompt", "x", "--gen-length", "1", "--steps", "1", "--memory-plot", "m.png"],
                 ["--memory-plot"], marks=pytest.mark.slow),
])
def test_invalid_requests_under_several_processes(args, words):
    bundled("tiny-llada")
    refused(run_cli("generate", "--no-progress", *args), *words)


@pytest.mark.slow
def test_no_processes_and_plans_for_none():
    refused(run_cli("generate", "--gpus", "0"), "--gpus", "at least 1")
    refused(run_cli("plan", "--gpus", "0", "--budget", "40GiB"), "--gpus", "at least 1")


@pytest.mark.slow
def test_two_processes_print_the_answer_once():
    bundled("tiny-llada")
    out = run_cli("generate", "--gpus", "2", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "sort 31415926=11234569"
    assert out.stderr.count("steps in") == 1
