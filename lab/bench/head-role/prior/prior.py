"""Measurement only, not shipped (docs/benchmarks.md, "A head as a model role"): `trtspec bench` with
every request's draft top-1 prior (Values.top1) at a constant instead of 0.5.

    python prior.py 0.8 bench --config qwen2.5-coder-1.5b --engines F --threads 2 --peers none \
        --dataset humaneval-edit --limit 8 --max-new-tokens 128 --strategies staged
"""
import sys

from trtspec.runtime.budget import values as V

prior = float(sys.argv[1])
orig = V.Values.__init__


def init(self, calibrated=True):
    orig(self, calibrated)
    if calibrated:
        self.top1 = prior


V.Values.__init__ = init
from trtspec.cli import main  # noqa: E402

main(sys.argv[2:])
