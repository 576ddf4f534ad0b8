"""Mosaic's benchmark suites: `python -m bench --list`, `python -m bench <suite> [options]`.

bench/suites/ holds one module per suite (registered in bench/suites/__init__.py); bench/lib/ the
helpers they share (records, timing, memory meters, floors, the engine accessors). A suite
imports bench.lib and mosaic, never another suite (tests/test_bench_manifest.py checks it)."""
