"""The step-cost tool measures every requested step size and leaves the cache as it found it."""
from trtspec.engines.torch_engine import TorchEngine
from trtspec.export.tiny import tiny_pair, tiny_spec
from trtspec.runtime.runner import ModelRunner
from trtspec.tools.stepcost import step_costs


def test_step_costs_shape_and_cache_untouched():
    target, _ = tiny_pair(tiny_spec(vocab_size=128), seed=0)
    runner = ModelRunner.alone(TorchEngine(target), 128)
    rows = step_costs(runner, [1, 2, 8], cached=32, repeats=2)
    assert [r["T"] for r in rows] == [1, 2, 8]
    assert all(0 < r["min_s"] <= r["median_s"] for r in rows)
    assert runner.cache.length == 32 and runner.cache.scratch == 0
