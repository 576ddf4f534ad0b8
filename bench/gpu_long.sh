#!/usr/bin/env bash
# One H200, ~7 minutes: train tiny-long (the long-context quality oracle), evaluate it dense, then
# the accuracy of block-sparse attention on it (keep 0.1/0.2 x dense_steps 0/1 at 8k). Written for
# the device tool's limits (at most 8 files come back, 16 MiB each, two folders deep): the model
# folder's six files, the sparse-quality JSON and one archive of the logs.
#     bash bench/gpu_long.sh            # OUT=<folder> on a machine without the device tool
# then here: copy $OUT/tiny-long/* to mosaic/assets/tiny-long/ and bench_sparse.json to
# bench/results/gpu/, and add their rows to bench/results/gpu/MANIFEST.md.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT}
mkdir -p "$OUT/tiny-long" /tmp/long_logs
timeout 330 python tools/train_long.py --device cuda --out /tmp/tiny-long --time-budget-s 235 --deadline-s 320 \
    --eval-n 30 --workers 12 > /tmp/long_logs/train_long.log 2>&1
for f in model.safetensors config.json tokenizer.json tokenizer_config.json generation_config.json long_accuracy.json; do
    cp /tmp/tiny-long/$f "$OUT/tiny-long/" 2>/dev/null
done
cp /tmp/tiny-long/training.json /tmp/long_logs/ 2>/dev/null
timeout 200 python bench/bench_sparse.py --out /tmp/sparse --full --per-layer --long-model /tmp/tiny-long \
    --quality-n 30 --quality-lengths 8192 > /tmp/long_logs/bench_sparse.log 2>&1
cp /tmp/sparse/bench_sparse.json "$OUT/bench_sparse_quality.json" 2>/dev/null
tar czf "$OUT/logs.tgz" -C /tmp long_logs
tail -8 /tmp/long_logs/train_long.log
tail -12 /tmp/long_logs/bench_sparse.log
