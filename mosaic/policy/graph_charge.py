"""What captured steps cost a request under a budget, decided at admission (docs/MEMORY.md,
"Captured steps under a budget").

A captured step's transients come from the guard's pool, which admission already charges (the
step's out-of-plan peak: memory/transient.py), and a replay allocates nothing. What graphs add:
  - their executables, outside PyTorch (the driver's kernel nodes and parameters; about 10 KiB
    a kernel node by NVIDIA's account, cccl#3768): measured at each graph's first replay and
    estimated for a new one from the most bytes per op measured so far (the engine's warm-up
    captures one step to measure it), with a quarter more;
  - each step shape's static inputs (ids, positions, rows and a batched step's index; one
    tensor), inside PyTorch: at most the segment it opens, one set per graph.
A request runs captured when, after its steps fit the budget as they always did, what is left
holds at least GRAPHS_LEAST graphs of its largest step with their input sets; it is then
charged for up to GRAPHS_WANTED of them (runtime/graphs.py keeps what it holds under that by
dropping the least recently used). A running batch of several requests is charged the same way
for its stacked step (engine/batch_memory.py). When they do not fit, the request runs eager and says so
(Generation.stats["graphs"]); admission never refuses a request for its graphs. Idle K/V pool
buffers a request starts next to are kept only in what its admission leaves after the graphs'
charge (engine/run.py idle_pool_beyond), so they never turn a request eager. Without a budget
nothing is charged."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import gib
from ..runtime.graph_rules import DEFAULT_BYTES_PER_OP, executed_ops, input_set_bytes

KiB = 2**10
# graphs kept at most: a request alone uses a few (a dual cache's fill and block steps, a plain
# step), a running batch a shape per batch bucket for its stacked block steps and fills, joins'
# fills alone, refills of part of it. The graphs of a batch stay when a request next runs alone:
# under a lone request's charge of 16 graphs and 3 input sets the batch's were evicted and
# captured again at every lull (H200, 16 served clients: 41 of 44 captures in one level)
GRAPHS_WANTED = 32
GRAPHS_LEAST = 2       # fewer (a block cache's fill step and one block step) would recapture every step


@dataclass(frozen=True)
class GraphCharge:
    """captured: the request's steps may be captured; driver_bytes: charged for executables
    (outside PyTorch); inputs_bytes: for static inputs (inside PyTorch); note: why not, when not."""
    captured: bool
    driver_bytes: int = 0
    inputs_bytes: int = 0
    note: str | None = None

    @property
    def total_bytes(self) -> int:
        return self.driver_bytes + self.inputs_bytes


def request_problem(step, layout=None) -> str | None:
    """Why no step of a request shaped like `step` (its admitted first step) with a block cache
    laid out as `layout` (None: no cache) can be captured."""
    if step.shard is not None:
        return "sequence parallel"
    if step.offload is not None:
        return "offload (layers streamed from host memory)"
    if step.rows_uncond is not None:
        return "cfg"
    if layout is not None and layout.hot < layout.num_layers:
        return "host-tier block store (layers' K/V streamed from host memory)"
    return None


def per_graph_bytes(prepared, bytes_per_op: float) -> int:
    """The executable of one graph of this step, estimated (module docstring)."""
    per_op = bytes_per_op or DEFAULT_BYTES_PER_OP
    return int(1.25 * per_op * executed_ops(prepared.template)) + 64 * KiB


def charge(graphs, prepared, spare: int | None, layout=None) -> GraphCharge:
    """The graph charge of a request whose admitted first step is `prepared` (its block store
    laid out as `layout`; or a running batch's stacked step), with `spare` bytes of its
    activation limit unused (None: no budget). graphs: the engine's StepGraphs (None: steps are
    never captured)."""
    if graphs is None:
        return GraphCharge(False)
    problem = request_problem(prepared.step, layout)
    if problem is not None:
        return GraphCharge(False, note=f"eager: {problem}")
    if spare is None:
        return GraphCharge(True)
    per = per_graph_bytes(prepared, graphs.bytes_per_op)
    one_set = input_set_bytes(tuple(prepared.step.ids.shape), prepared.step.num_masked)
    n = min(GRAPHS_WANTED, max(0, spare) // max(1, per + one_set))
    if n < GRAPHS_LEAST:
        return GraphCharge(False, note=f"eager: captured steps need {gib(GRAPHS_LEAST * (per + one_set))} for "
                                       f"their graphs and the budget leaves {gib(max(0, spare))} after the steps")
    return GraphCharge(True, n * per, n * one_set)
