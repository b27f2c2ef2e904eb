"""Hidden rows (export/contract.py; issue 42, deliverable 3, the graph's part): a step graph exported
with them returns, for its logit rows, the rows its LM head reads, so a head that applies the target's
own LM head to them gets the target's logits and argmax; the streamed build's graph equals the
in-memory export's; a graph without them is unchanged; the ONNX Runtime and torch engines hand each
call of a batch its rows (`Call.hidden`, the runner's `run(..., hidden=True)`); and a drafter
registered from this file reads each request's rows (`DecodeState.hidden`), its LM head naming the
root at every step; a build
asks for them with `target.hidden_rows: true` (a step contract v4 folder, on ONNX Runtime and torch),
and a strategy whose drafter reads them is refused, in one line, where the target has none."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from trtspec.engines.cuda_graphs import GraphedTorchEngine
from trtspec.engines.onnxruntime_engine import OrtEngine
from trtspec.engines.torch_engine import TorchEngine
from trtspec.engines.stream import build_graph
from trtspec.engines.weights import StateWeights
from trtspec.export.contract import io_names, io_spec
from trtspec.export.onnx_export import _probe_outputs, export_onnx
from trtspec.export.tiny import tiny_pair, tiny_spec
from trtspec.runtime.batch import Batcher, Call
from trtspec.runtime.drafters import Drafter
from trtspec.runtime.effects import drive
from trtspec.runtime.runner import ModelRunner


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(spec, model with hidden rows on, its graph, the graph without them): exported once per module."""
    spec = tiny_spec(arch="llama")
    model, _ = tiny_pair(spec, seed=3)
    folder = tmp_path_factory.mktemp("hidden")
    plain = export_onnx(model, folder / "plain.onnx")
    model.hidden_rows = True
    return spec, model, export_onnx(model, folder / "hidden.onnx"), plain


def step_inputs(spec, gen: torch.Generator):
    """A batch of two rows: a 5-token prefill over 3 past rows, every row's logits asked for."""
    b, c, t = 2, 3, 5
    ids = torch.randint(0, spec.vocab_size, (b, t), generator=gen)
    pos = torch.arange(c, c + t).repeat(b, 1)
    mask = torch.ones(b, t, c + t, dtype=torch.bool).tril(c)
    rows = torch.arange(t).repeat(b, 1)
    past = [torch.randn(b, c, spec.head_dim, generator=gen) for _ in range(2 * spec.num_layers * spec.num_kv_heads)]
    return ids, pos, mask, rows, past


@pytest.mark.parametrize("arch,exporter", [("llama", "dynamo"), ("qwen2", "torchscript")])
def test_hidden_rows_are_what_the_lm_head_reads(arch, exporter, tmp_path, llama):
    if arch == "llama":
        spec, model, path, _ = llama
    else:
        spec = tiny_spec(arch=arch, tie=True)
        model, _ = tiny_pair(spec, seed=3)
        model.hidden_rows = True
        path = export_onnx(model, tmp_path / "h.onnx", opset=17, exporter=exporter)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ins, outs = io_names(spec.num_layers, spec.num_kv_heads, hidden=True)
    assert [o.name for o in sess.get_outputs()] == outs and outs[-1] == "hidden"
    assert [o["name"] for o in io_spec(spec, "fp32", hidden=True)["outputs"]] == outs
    ids, pos, mask, rows, past = step_inputs(spec, torch.Generator().manual_seed(0))
    feed = dict(zip(ins, [x.numpy() for x in (ids, pos, mask, rows, *past)]))
    got = sess.run(None, feed)
    logits, hidden = got[0], got[-1]
    assert hidden.shape == (2, 5, spec.hidden_size) and hidden.dtype == np.float32
    with torch.no_grad():
        ref_logits, _, ref_hidden = model(ids, pos, mask, rows, past)
    np.testing.assert_allclose(hidden, ref_hidden.numpy(), rtol=1e-4, atol=1e-5)
    head = hidden @ model.lm_head.weight.detach().numpy().T          # the target's own LM head, re-applied
    np.testing.assert_allclose(head, logits, rtol=1e-4, atol=1e-4)
    assert (head.argmax(-1) == logits.argmax(-1)).all() and (logits.argmax(-1) == ref_logits.numpy().argmax(-1)).all()


def test_a_streamed_graph_with_hidden_rows_is_the_exported_graph(tmp_path, llama):
    spec, model, memory, _ = llama
    build_graph(StateWeights(spec, model.state_dict()), tmp_path / "stream.onnx", torch.float32, hidden=True)
    a, b = _probe_outputs(memory), _probe_outputs(tmp_path / "stream.onnx")
    assert len(a) == len(b) == 2 + 2 * spec.num_layers * spec.num_kv_heads
    assert all(x.shape == y.shape and (x == y).all() for x, y in zip(a, b))


def test_without_hidden_rows_the_graph_is_unchanged(llama):
    spec, _, _, plain = llama
    assert [o.name for o in ort.InferenceSession(str(plain)).get_outputs()] == io_names(2, 2)[1]
    assert "hidden" not in io_names(2, 2)[1] and "hidden" not in str(io_spec(spec, "fp32"))
    engine = OrtEngine(plain, spec)
    assert not engine.hidden_rows
    runner = ModelRunner.alone(engine, capacity=64)
    assert drive(runner.extend([1, 2, 3], hidden=True))[1] is None
    engine.close()


def test_the_engines_hand_each_call_its_hidden_rows(llama):
    """ONNX Runtime (a graph with them) and torch (a model with them): each call of a batch gets the rows
    its LM head read, the same as alone; re-applying the LM head gives the call's logits."""
    spec, model, hidden, plain = llama
    plain = OrtEngine(plain, spec)
    head = model.lm_head.weight.detach()
    for engine in (OrtEngine(hidden, spec), TorchEngine(model)):
        assert engine.hidden_rows
        alone, ref = [], []
        for prompt in ([5, 6, 7, 8], [9, 10]):
            runner, other = ModelRunner.alone(engine, capacity=64), ModelRunner.alone(plain, capacity=64)
            logits, rows = drive(runner.extend(prompt, last_only=False, hidden=True))
            ref.append(drive(other.extend(prompt, last_only=False)))
            assert rows.shape == (len(prompt), spec.hidden_size)
            torch.testing.assert_close(rows @ head.T, logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(logits, ref[-1], rtol=1e-4, atol=1e-4)   # the same step as without them
            assert (logits.argmax(-1) == ref[-1].argmax(-1)).all()
            alone.append(rows)
        batcher = Batcher(engine, max_batch=2, capacity=64)
        pool = engine.new_pool(2, 64 + batcher.headroom)
        calls = [Call(batcher, pool.caches[i], torch.tensor(p), torch.arange(len(p)),
                      torch.ones(len(p), len(p), dtype=torch.bool).tril(), None)
                 for i, p in enumerate(([5, 6, 7, 8], [9, 10]))]
        batcher.run(calls)
        for call, rows in zip(calls, alone):
            torch.testing.assert_close(call.hidden, rows, rtol=1e-5, atol=1e-5)
        engine.close()
    plain.close()


class Echo(Drafter):
    """A test head: the target's own LM head re-applied to the last of `st.hidden`. After a step that row
    chose the root, so the head must name the root, every greedy step; at the first step it is the
    prompt's last prefilled row, so the head names the target's own guess of the prompt's last token.
    It proposes no chain: the root's own row comes with the next verification."""
    name = "echo"
    reads_hidden = True
    head: torch.Tensor | None = None
    seen: list[tuple[int, int, list[int] | None]] = []     # (the head's token, the root, the prompt if first)

    def chain(self, st, context, n: int) -> list[int]:
        if st.hidden is not None:
            first = st.tokens()[: st.prompt_len].tolist() if not st.steps else None
            self.seen.append((int((st.hidden[-1] @ self.head.T).argmax()), st.root, first))
        return []


@pytest.mark.parametrize("graphed", [False, True])
def test_a_head_drafter_reads_each_request_s_hidden_rows(monkeypatch, graphed):
    """A target with hidden rows (the torch engine, and its CUDA-graph engine on bucketed static buffers,
    run eagerly on a CPU): a drafter registered from this file reads each request's rows
    (DecodeState.hidden: the prompt's last prefilled row, then each accepted path's), alone and with
    other requests in the batch, under `ngram` and `staged`; its LM head names the root at every step,
    and every output equals `ar`'s."""
    from conftest import GPU_LIKE, reference_logits

    from trtspec.runtime.drafters import DRAFTERS
    from trtspec.runtime.generator import Generator
    spec = tiny_spec(arch="llama")
    target, draft = tiny_pair(spec, seed=0)
    target.hidden_rows = True
    monkeypatch.setitem(DRAFTERS, "echo", Echo)
    monkeypatch.setattr(Echo, "head", target.lm_head.weight.detach())
    monkeypatch.setattr(Echo, "seen", [])
    engine = GraphedTorchEngine if graphed else TorchEngine
    buckets = {"tokens": [1, 4, 8, 16, 32], "cache": [32, 64, 128]} if graphed else None
    gen = Generator(engine(target, "cpu"), engine(draft, "cpu"), capacity=128, costs=GPU_LIKE, buckets=buckets)
    try:
        prompts = [[3, 17, 99, 250, 401, 7] * 3, [5, 6, 7], [42, 43, 44, 45, 46]]
        refs = [gen.generate(p, strategy="ar", max_new_tokens=12).token_ids for p in prompts]
        out = gen.generate(prompts[0], strategy="ngram:drafter=echo", max_new_tokens=12)
        assert out.token_ids == refs[0] and len(Echo.seen) == len(out.steps)       # every step read its rows
        handles = [gen.submit(p, strategy=s, max_new_tokens=12)
                   for p in prompts for s in ("ngram:drafter=echo", "staged:drafter=echo+ngram")]
        assert [h.result(timeout=120).token_ids for h in handles] == [r for r in refs for _ in range(2)]
    finally:
        gen.close()
    later = [(a, b) for a, b, first in Echo.seen if first is None]
    assert len(later) > 3 * 12 and all(a == b for a, b in later), later          # it chose the root
    firsts = [(a, first) for a, _, first in Echo.seen if first is not None]
    assert len(firsts) == 1 + 2 * len(prompts)                                   # every request's first step
    target.hidden_rows = False              # (the reference forward returns logits and KV only)
    for a, prompt in firsts:                # the target's guess of the prompt's last token, from its own logits
        assert a == int(reference_logits(target, prompt[:-1])[-1].argmax()), (a, prompt)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_a_build_with_hidden_rows(backend, tmp_path, monkeypatch):
    """`target.hidden_rows: true`: a step contract v4 folder whose target returns its hidden rows (the
    draft's graph is unchanged); the echo head reads them from the loaded folder and names the root at
    every step after the first; every output equals `ar`'s."""
    from conftest import QUIET, tiny_dict

    from trtspec.assembly.build import build_engines
    from trtspec.assembly.config import Config
    from trtspec.assembly.load import load_generator, torch_model
    from trtspec.engines.manifest import verify
    from trtspec.runtime.drafters import DRAFTERS
    from trtspec.tools.inspect_engines import describe
    monkeypatch.setitem(DRAFTERS, "echo", Echo)
    d = tiny_dict()
    d["target"]["hidden_rows"] = True
    d["strategies"]["ngram"]["drafter"] = "echo"            # a configured head: the folder loads with it
    folder = build_engines(Config.from_dict(d), tmp_path / backend, backend=backend, **QUIET)
    m = verify(folder)
    assert m["contract_version"] == 4 and any(line.startswith("  hidden ") for line in describe(folder))
    assert [o["name"] for o in m["models"]["target"]["io"]["outputs"]][-1] == "hidden"
    assert "hidden" not in [o["name"] for o in m["models"]["draft"]["io"]["outputs"]]
    head = torch_model(folder, "target", m["models"]["target"], m["config"]).lm_head.weight.detach()
    monkeypatch.setattr(Echo, "head", head)
    monkeypatch.setattr(Echo, "seen", [])
    gen = load_generator(folder)
    try:
        assert gen.target_engine.hidden_rows and not gen.draft_engine.hidden_rows
        for prompt in ([3, 17, 99, 250, 401, 7] * 2, [5, 6, 7]):
            ref = gen.generate(prompt, strategy="ar", max_new_tokens=10).token_ids
            for s in ("ngram", "staged:drafter=echo+ngram"):
                seen = len(Echo.seen)
                out = gen.generate(prompt, strategy=s, max_new_tokens=10)
                assert out.token_ids == ref, s
                if s.startswith("ngram"):              # it asks for a chain every step (staged: at its stage 2)
                    assert len(Echo.seen) - seen == len(out.steps)
    finally:
        gen.close()
    later = [(a, b) for a, b, first in Echo.seen if first is None]
    assert len(later) > 4 and all(a == b for a, b in later), later


def test_a_quantized_exact_target_keeps_its_logits_with_hidden_rows(tmp_path, llama):
    """The default target's kind of graph (int4 weights, int8 activations, exact attention): asking for
    the hidden rows adds an output and changes no logit."""
    spec, model, _, _ = llama
    weights = StateWeights(spec, model.state_dict())
    engines = []
    for hidden in (False, True):
        path = tmp_path / f"hidden-{hidden}.onnx"
        build_graph(weights, path, torch.float32, exact=True, quantize="int4", accuracy_level=4, hidden=hidden)
        engines.append(OrtEngine(path, spec))
    assert [e.hidden_rows for e in engines] == [False, True]
    got = []
    for engine in engines:
        runner = ModelRunner.alone(engine, capacity=64)
        logits, rows = drive(runner.extend([5, 6, 7, 8, 9], last_only=False, hidden=True))
        got.append(logits)
        assert (rows is None) == (engine is engines[0])
        engine.close()
    assert torch.equal(got[0], got[1])


def test_hidden_rows_refused_where_they_cannot_be(tmp_path, monkeypatch, torch_folder):
    """One line each: a draft's rows, a backend that does not bind them, a drafter that reads them from
    a target without them (in the config, and asked of a loaded folder); a config without the key keeps
    its digest (folders built before it)."""
    from conftest import tiny_dict

    from trtspec.assembly.config import Config
    from trtspec.assembly.load import load_generator
    from trtspec.errors import ConfigError, RequestError
    from trtspec.runtime.drafters import DRAFTERS
    monkeypatch.setitem(DRAFTERS, "echo", Echo)

    def config(**changes):
        d = tiny_dict()
        for key, value in changes.items():
            d[key] = {**d[key], **value} if isinstance(value, dict) else value
        return Config.from_dict(d)

    refused = [({"draft": {"hidden_rows": True}}, "draft.hidden_rows: true: a head reads the target's rows"),
               ({"target": {"hidden_rows": True}, "backend": "tensorrt"}, "TensorRT plans do not bind"),
               ({"target": {"hidden_rows": True}, "backend": "onnxruntime", "device": "cuda", "cuda_graphs": True},
                "ONNX Runtime's CUDA graphs do not bind"),
               ({"strategies": {"ngram": {"drafter": "echo"}}},
                "drafts with echo, which reads the target's hidden rows, .* set target.hidden_rows: true")]
    for changes, why in refused:
        with pytest.raises(ConfigError, match=why) as e:
            config(**changes)
        assert "\n" not in str(e.value)
    config(target={"hidden_rows": True}, strategies={"ngram": {"drafter": "echo"}})
    config(target={"hidden_rows": True}, device="cuda", cuda_graphs=True)        # torch's graphs bind them
    assert config().digest() == config(target={"hidden_rows": False}).digest() != config(
        target={"hidden_rows": True}).digest()
    gen = load_generator(torch_folder)
    try:
        with pytest.raises(RequestError, match="set target.hidden_rows: true in the config and rebuild"):
            gen.generate([1, 2, 3], strategy="staged:drafter=echo+ngram", max_new_tokens=4)
    finally:
        gen.close()
