"""Shape buckets of captured batched steps: a batched block step is padded to a batch bucket
and its key bound to a key bucket, so one captured graph serves every round of that bucket
whoever runs in it (the sequences' rows are graph inputs: models/batched_attention.BatchIndex).

The pattern is nano-vllm's `capture_cudagraph` (nanovllm/engine/model_runner.py): graphs per
batch size bucket, inputs padded up to the bucket with dummy rows whose outputs are dropped.
Here a dummy is a sequence of the block's n rows that writes and reads only the pool's scratch
rows (models/stacked_cache.py). Padding costs the dummies' rows through the GEMMs (at most
2x - 1 sequences of work at a bucket's lower edge: 17 sequences run as 32); it is done only
where a step can be captured (a CUDA engine with graphs on), never on the CPU path.

The key bucket is the bound on keys per sequence given to the varlen kernel (`max_seqlen_k`):
FlashAttention-2's varlen grid and loop depend on each sequence's own key count, not on it, so a
power of two costs nothing and keeps one graph per doubling of the prompt length."""

from __future__ import annotations

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_KEY_BUCKET = 256


def batch_bucket(sequences: int) -> int | None:
    """The smallest bucket holding `sequences` (None above the largest: the step runs unpadded)."""
    return next((b for b in BATCH_BUCKETS if b >= sequences), None)


def key_bucket(max_keys: int) -> int:
    """The power of two (at least MIN_KEY_BUCKET) at or above max_keys."""
    b = MIN_KEY_BUCKET
    while b < max_keys:
        b *= 2
    return b
