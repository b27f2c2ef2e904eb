"""Shared fixtures: seeded tiny random target/draft pairs wrapped as TorchEngines in Generators.

The tests come in three tiers, a directory each: unit/ (one module at a time, no generation),
integration/ (tiny pairs run through the runtime in this process, and golden/: the recorded runs),
e2e/ (the build path: exported graphs and engine folders; the CLI, servers, Ray, the real packs, the
wheel, llama.cpp). `make test-fast` runs the first two; `make test` all three. A test file may
import another's helpers by its name (`from test_sampling_exact import fit`), whatever its tier:
every tier is on sys.path.

Everything here is built once per session: a tiny model costs ~1 ms per forward and ~1-2 s to
build, so sharing the Generators (whose KV buffers are allocated once and reset per request) keeps
the suite fast. Tests that need a private Generator (e.g. other stop ids) build one over the same
engines with `generator_for`.

Torch is pinned to one intra-op thread (override with TRTSPEC_TEST_THREADS): these models are far
too small to gain from threading, and on a loaded 2-core machine two threads make each forward
10-30x slower through contention.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:          # run from anywhere without installing the package
    sys.path.insert(0, str(ROOT))
TIERS = ("unit", "integration", "e2e")
sys.path[1:1] = [str(ROOT / "tests" / t) for t in TIERS if str(ROOT / "tests" / t) not in sys.path]

torch.set_num_threads(int(os.environ.get("TRTSPEC_TEST_THREADS", "1")))

from trtspec.assembly.config import CONFIGS_DIR  # noqa: E402
from trtspec.engines.torch_engine import TorchEngine  # noqa: E402
from trtspec.export.model import Decoder  # noqa: E402
from trtspec.export.tiny import tiny_pair, tiny_spec  # noqa: E402
from trtspec.runtime.costs import CostModel, CostTable  # noqa: E402
from trtspec.runtime.generator import Generator  # noqa: E402

# `make test` runs the files on 2 pytest-xdist workers, each file whole on one (--dist loadfile):
# the longest files are handed out first, so no worker is left running one alone at the end.
FIRST = ("test_smollm2.py", "test_structured_smollm2.py", "test_serve_ray.py", "test_serve.py")


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite tests/integration/golden/golden.json from this checkout's runs (a change made on purpose)")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))     # stable: files stay whole


# Small vocabulary pair for the statistical tests. noise=0.15 puts the draft's next-token
# distribution at a total-variation distance of roughly 0.3-0.5 from the target's: drafts are
# accepted and rejected often, and a wrong acceptance rule produces a large, detectable bias.
SMALL_VOCAB = 16
SMALL_NOISE = 0.15

# Step costs the tiny Generators plan budget: auto with (seconds; N = 1 and 64 new tokens): a GPU's
# shape (flat verify, cheap draft), fixed so that auto trees are drafted and reproducible. Timed on
# a tiny pair, a draft forward costs what a target one does and auto would mostly choose ar steps.
# Measured costs are tested on built folders (test_budget.py).
GPU_LIKE = CostModel(CostTable([1, 64], [0], [[0.010, 0.0105]]), CostTable([1, 64], [0], [[0.0012, 0.0013]]))
# The Qwen 1.5B fp32 target and int4 draft measured on this CPU (costs.json), 64 cached tokens.
CPU_LIKE = CostModel(CostTable([1, 2, 4, 8, 16, 32, 64], [0], [[0.165, 0.179, 0.204, 0.217, 0.304, 0.417, 0.692]]),
                     CostTable([1, 2, 4, 8, 16, 32, 64], [0], [[0.019, 0.020, 0.026, 0.036, 0.055, 0.094, 0.196]]))


@dataclass
class TinyPair:
    arch: str
    target: Decoder
    draft: Decoder
    target_engine: TorchEngine
    draft_engine: TorchEngine

    @property
    def spec(self):
        return self.target.spec

    def generator(self, capacity: int = 256, **kwargs) -> Generator:
        kwargs.setdefault("costs", GPU_LIKE)
        return Generator(self.target_engine, self.draft_engine, capacity=capacity, **kwargs)


def make_pair(arch: str = "llama", vocab_size: int = 512, num_layers: int = 2, seed: int = 0,
              noise: float = 0.05) -> TinyPair:
    # phi3: rotary over 3/4 of each head, as Phi-4-mini's partial_rotary_factor
    spec = tiny_spec(arch=arch, vocab_size=vocab_size, num_layers=num_layers, rotary_dim=12 if arch == "phi3" else None)
    target, draft = tiny_pair(spec, seed=seed, noise=noise)
    return TinyPair(arch, target, draft, TorchEngine(target), TorchEngine(draft))


@torch.no_grad()
def reference_logits(model: Decoder, tokens: list[int]) -> torch.Tensor:
    """Logits [T, V] of a plain causal forward over `tokens`, no KV cache (the independent reference)."""
    t = len(tokens)
    logits, _ = model(torch.tensor([tokens], dtype=torch.int64), torch.arange(t)[None],
                      torch.ones(1, t, t, dtype=torch.bool).tril_(), torch.arange(t)[None], model.zero_past())
    return logits[0]


@pytest.fixture(scope="session")
def llama_pair() -> TinyPair:
    return make_pair("llama", vocab_size=512, num_layers=2, seed=0)


@pytest.fixture(scope="session")
def arch_pairs(llama_pair) -> dict[str, TinyPair]:
    """llama, qwen2 (attention bias), mistral, qwen3 (q/k norms), phi3 (partial rotary), gemma3 (a
    windowed layer over 12 keys beside a global one) and qwen3_moe (2 of 4 experts per token) tiny
    pairs, vocab 512."""
    return {"llama": llama_pair,
            "qwen2": make_pair("qwen2", vocab_size=512, num_layers=2, seed=1),
            "mistral": make_pair("mistral", vocab_size=512, num_layers=2, seed=2),
            "qwen3": make_pair("qwen3", vocab_size=512, num_layers=2, seed=3),
            "phi3": make_pair("phi3", vocab_size=512, num_layers=2, seed=4),
            "gemma3": make_pair("gemma3", vocab_size=512, num_layers=2, seed=5),
            "qwen3_moe": make_pair("qwen3_moe", vocab_size=512, num_layers=2, seed=6)}


@pytest.fixture(scope="session")
def llama_gen(llama_pair) -> Generator:
    return llama_pair.generator(capacity=256)


@pytest.fixture(scope="session")
def arch_gens(arch_pairs) -> dict[str, Generator]:
    return {name: pair.generator(capacity=256) for name, pair in arch_pairs.items()}


@pytest.fixture(scope="session")
def small_pair() -> TinyPair:
    return make_pair("llama", vocab_size=SMALL_VOCAB, num_layers=2, seed=0, noise=SMALL_NOISE)


@pytest.fixture(scope="session")
def small_gen(small_pair) -> Generator:
    return small_pair.generator(capacity=64)


CHAT_TEMPLATE = "{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def with_chat_template(folder: Path, tmp_path: Path) -> Path:
    """A copy of an engine folder whose tokenizer has a (made-up) chat template, manifest re-hashed."""
    import json
    import shutil

    from trtspec.engines.manifest import write_manifest
    eng = tmp_path / "chat"
    shutil.copytree(folder, eng)
    cfg = eng / "tokenizer" / "tokenizer_config.json"
    data = json.loads(cfg.read_text())
    data["chat_template"] = CHAT_TEMPLATE
    cfg.write_text(json.dumps(data))
    m = json.loads((eng / "manifest.json").read_text())
    write_manifest(eng, {k: v for k, v in m.items() if k not in ("format", "contract_version", "created", "versions",
                                                                 "files")})
    return eng


# -- configs and the CLI's one-line errors (test_config, test_draft_model, test_engine_folders, ...) --
TINY = CONFIGS_DIR / "tiny-random.yaml"
QUIET = dict(log=lambda *a, **k: None)


def tiny_dict() -> dict:
    return yaml.safe_load(TINY.read_text())


def write_config(tmp_path: Path, d: dict, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d))
    return p


def one_line_error(res) -> str:
    """The CLI refused: non-zero exit, no traceback, a single message line. Returns it."""
    assert res.exit_code != 0, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    err = [line for line in lines if line.startswith(("Error:", "Usage:", "Try "))]
    assert err, res.output
    return next(line for line in lines if line.startswith("Error:"))


@pytest.fixture(scope="session")
def torch_folder(tmp_path_factory) -> Path:
    """The tiny-random config built for the torch backend (tests that run `trtspec run` on a folder)."""
    from trtspec.assembly.build import build_engines
    from trtspec.assembly.config import load_config
    out = tmp_path_factory.mktemp("tiny") / "torch"
    build_engines(load_config(TINY), out, backend="torch", **QUIET)
    return out


def shared_build(tmp_path_factory, cfg, backend: str) -> Path:
    """One build of `cfg` for `backend` per test session, shared by the pytest-xdist workers: the
    folder is keyed by the config's digest under the session's common temp folder, and the build's
    own lock makes a second worker wait for the first one's build and reuse it."""
    from trtspec.assembly.build import build_engines
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent                  # pytest-of-USER/pytest-N: the workers' common parent
    out = root / "shared-builds" / f"{cfg.name}-{backend}-{cfg.with_backend(backend).digest()}"
    return build_engines(cfg, out, backend=backend, reuse=True, **QUIET)
