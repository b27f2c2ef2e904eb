"""The lab: measurement instruments, apart from the product (not shipped in the wheel).

Run from a checkout of the repository, with the project's venv (`make install`):

    .venv/bin/python -m lab.stepcost --engines ENGINES --threads 2 --profile prof/
    .venv/bin/python -m lab.prefill_rate --engines ENGINES --tokens 1024,4096
    .venv/bin/python -m lab.host_reads --batch 4
    .venv/bin/python -m lab.load_split --engines ENGINES --concurrency 2 --repeat 2
    .venv/bin/python -m lab.device_check --help          # the GPU device check (docs/gpu.md)

`lab/bench/<topic>/` holds the one-off scripts behind docs/benchmarks.md; their records stay in
docs/bench/<topic>/. The lab may import trtspec; nothing in trtspec imports the lab
(tests/unit/test_layers.py). It observes the runtime through its hooks (runtime/hooks.py), never by
replacing a product function at run time.
"""
