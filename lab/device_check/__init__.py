"""The GPU device check: one unattended command that says what the CUDA path does, measured.

    python -m lab.device_check --out DIR            # on a GPU box, about 8 minutes
    python -m lab.device_check --out DIR --tiny     # CPU, tiny shapes, seconds (CI)

Sections (each its own file; each bounded in time, each failure one line in the report, never the
end of the run): `machine` (the card, the software, the two ceilings: copy bandwidth and bf16
matmul rate), `exact` (random-weight models of two architectures under each exactness setting:
trees vs one token per forward bit for bit, every strategy's greedy output vs `ar`, batches of
1-8, CUDA graphs vs eager, a chi-square of sampled `staged`), `costs` (the step-cost curve of a
Llama-3-8B-shaped bf16 target and a 1B-shaped draft, eager vs CUDA graphs, CUDA events) and `e2e`
(forced acceptance: the target as its own draft, intact and corrupted at fixed rates, against
`ar` in the same run). DIR gets device_check.json and device_check.md, rewritten after every
section, so a run cut short still leaves what it measured. docs/gpu.md says how to carry it to an
air-gapped GPU box.
"""
