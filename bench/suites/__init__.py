"""The registry of benchmark suites: name -> one line (the module docstring's first line; a test
keeps them equal). `python -m bench --list` prints it without importing any suite.

A suite is a module bench/suites/<name>.py with
  - a docstring: its first line the one-line description, the rest the `--help` text;
  - add_arguments(parser): its options (`--out DIR` is added for every suite);
  - output(args) -> str (optional): the record's file name under --out (default '<name>.json');
  - run(args, rec) -> dict: measures, fills rec (a bench.lib.record.Record holding the header:
    date, commit, machine, GPU, versions, config) with the raw numbers, saves it after every
    part, returns it;
  - table(rec) -> str: the short table `python -m bench` prints last.
It imports bench.lib and mosaic only, never another suite."""

SUITES = {
    # speed and kernels (GPU)
    "speed": "Step speed, exact path vs native vs options, beside the compute floor (GPU).",
    "steps": "Steps on the full presets: native 4k, exactness and latency, PAR, end to end, memory plot (GPU).",
    "profile": "Where a step's time goes: a per-kernel breakdown of one denoising step (GPU).",
    "kernel": "The fused masked-logits kernel against the torch path and a bare cuBLAS matmul (GPU).",
    "attention": "Mosaic's Triton attention against PyTorch's SDPA (flash, cuDNN) and FlashInfer (GPU).",
    "sdpa": "Which SDPA kernels serve Mosaic's attention layouts, and the ring's partial attention (GPU).",
    "sparse": "Block-sparse attention: step time against dense at 128k/512k, quality on a long model.",
    "fast": "Fast-dLLM decoding on a GPU: cached step costs, NFE per token, end to end, the cache tier.",
    "everyday": "Everyday requests on one GPU: steps vs floors and native, chat-turn tok/s, batches, captures.",
    "families": "Each family's block step beside its byte floor at batch 1 and 32, and end-to-end tok/s (one H200).",
    "speculative": "Self-speculative decoding (exact) and the batch-invariant mode: forwards, acceptance, speed.",
    "design_probe": "Kernel alternatives behind this round's design choices, measured side by side (GPU).",
    # memory and capacity (GPU)
    "memory": "The virtual-memory arena and the budget on the GPU: map cycles, random steps, inflation.",
    "capacity": "L_max predicted by the capacity planner and verified on the GPU; depth check; chunking.",
    "baselines": "The baselines' L_max measured on the GPU by probing steps, not extrapolated.",
    "offload": "Weight offload, K/V streamed from host memory and FP8 on the GPU, with L_max verified.",
    "soak": "The memory budget holds by the device's own counter: random requests and L_max probes.",
    "serve_load": "A real load test of `mosaic serve`: concurrency 1/4/16/64 over loopback, TTFT and latency.",
    "join": "Chunked joining: the running requests' rounds while a long prompt joins, fills whole vs sliced.",
    "scenarios": "The paper's three scenarios on one GPU: long generation, code completion, 128-round chat.",
    "multi_gpu": "Sequence parallelism on several GPUs: L_max per GPU, step latency, agreement (torchrun).",
    "tensor_parallel": "Tensor parallelism on several GPUs: dual-cache block step, 1k+256 end to end, NVML per GPU "
                       "(torchrun).",
    # quality (CPU is enough)
    "cpu_soak": "Bounded state on the CPU: many requests through one engine, the process's RSS sampled.",
    "demo": "A new user's first contact on the CPU: the README's demo command and the first request's cost.",
    "eval_tiny": "Held-out accuracy of the bundled tiny models (exact answers), on the planned path.",
    "eval_long": "Held-out accuracy of a long-context model (tiny-long) through the engine.",
    "eval_fast": "Quality vs speed of Fast-dLLM decoding on the bundled models (CPU is enough).",
    "eval_fp8": "FP8 quality on the bundled models: logit KL, token agreement and held-out accuracy.",
    "structured": "Structured output: grammar libraries' mask costs, validity, accuracy and the GPU step cost.",
    # planning and tables (CPU)
    "planner": "Planner quality and speed on the presets' step templates (CPU, meta tensors).",
    "capacity_table": "The README's L_max table from `mosaic plan`'s own code path (CPU).",
    "curves": "Memory and time against length, dense vs the options of an engine config, as one PNG.",
    "report": "The L_max tables and plots of docs/RESULTS.md from the committed JSON (CPU).",
}


# suites that measure on a GPU and have no CPU mode: `python -m bench` refuses them on a machine
# without CUDA with one error line (they used to fail inside torch with an AssertionError)
GPU_ONLY = frozenset({"speed", "steps", "profile", "kernel", "sdpa", "fast", "everyday", "memory", "capacity",
                      "baselines", "offload"})


def load(name: str):
    """The suite module `name` (KeyError for an unknown name)."""
    import importlib
    if name not in SUITES:
        raise KeyError(name)
    return importlib.import_module(f"bench.suites.{name}")
