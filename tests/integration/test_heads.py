"""Head roles (issue 42, deliverable 3): a head's own weights as a model role (`heads:` in the config,
export/head.py), built into the folder beside the target and draft, in the manifest, the memory check,
the costs and `inspect`; the `medusa` drafter (drafters/medusa.py) asks it once per step, the batch's
requests' rows in one forward (heads.py); every output equals `ar`'s (greedy) and is distributed as
the target's (sampled); a head that does not fit the target, or a drafter without its head, is
refused in one line."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from trtspec.engines.torch_engine import TorchEngine
from trtspec.export.head import HeadSpec, MedusaHead, read_head
from trtspec.export.spec import SpecError
from trtspec.export.tiny import tiny_pair, tiny_spec
from trtspec.runtime import heads as heads_mod
from trtspec.runtime.generator import Generator


def head_state(hidden: int, lm: torch.Tensor, depth: int = 3, seed: int | None = None) -> dict:
    """A head file's tensors: zero blocks (each head reads the row itself: h + SiLU(0) = h) under the
    LM head `lm`, or random blocks with `seed`."""
    g = torch.Generator().manual_seed(seed or 0)
    scale = 0.0 if seed is None else 1.0
    state = {}
    for k in range(depth):
        state[f"blocks.{k}.weight"] = scale * torch.randn(hidden, hidden, generator=g) / hidden ** 0.5
        state[f"blocks.{k}.bias"] = scale * torch.randn(hidden, generator=g)
    state["lm_head.weight"] = lm.detach().float().contiguous()
    return state


def medusa(state: dict) -> MedusaHead:
    return MedusaHead(HeadSpec.of(state), state)


def test_a_medusa_head_is_its_formula():
    """Head k: h + SiLU(W_k h + b_k), read by its LM head; `top` maps LM head rows to token ids."""
    state = head_state(8, torch.randn(5, 8, generator=torch.Generator().manual_seed(1)), depth=2, seed=3)
    state["ids"] = torch.tensor([40, 3, 17, 9, 2])
    head = medusa(state)
    rows = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    w, b = (torch.stack([state[f"blocks.{k}.{p}"] for k in range(2)]) for p in ("weight", "bias"))
    want = torch.stack([(rows + torch.nn.functional.silu(rows @ w[k].T + b[k])) @ state["lm_head.weight"].T
                        for k in range(2)], 1)
    torch.testing.assert_close(head(rows), want)
    probs, toks = head.top(rows, 2)
    best = want.softmax(-1).topk(2, -1)
    torch.testing.assert_close(probs, best.values)
    assert torch.equal(toks, state["ids"][best.indices])


def test_a_head_file_that_does_not_fit_is_one_line(tmp_path):
    lm = torch.randn(32, 16)
    good = head_state(16, lm, depth=2)
    cases = [({k: v for k, v in good.items() if k != "blocks.1.bias"}, "has no blocks.1.bias"),
             ({**good, "blocks.0.weight": torch.zeros(16, 8)},
              r"blocks.0.weight is \[16, 8\], the target's hidden size 16"),
             ({**good, "ids": torch.arange(32) + 100}, "ids must be distinct token ids below the target's vocabulary"),
             ({**good, "ids": torch.zeros(32, dtype=torch.int64)}, "distinct"),
             ({**good, "extra": torch.zeros(1)}, "unexpected tensor extra")]
    for i, (state, why) in enumerate(cases):
        path = tmp_path / f"h{i}.safetensors"
        save_file(state, str(path))
        with pytest.raises(SpecError, match=why) as e:
            read_head(path, 16, 64)
        assert "\n" not in str(e.value)
    (tmp_path / "junk.safetensors").write_bytes(b"not a head")
    with pytest.raises(SpecError, match="cannot be read as safetensors"):
        read_head(tmp_path / "junk.safetensors", 16, 64)
    save_file(good, str(tmp_path / "ok.safetensors"))
    spec, state = read_head(tmp_path / "ok.safetensors", 16, 64)
    assert spec == HeadSpec("medusa", 16, 2, 32) and set(state) == set(good)


@pytest.fixture(scope="module")
def hidden_pair():
    """A tiny target with hidden rows, its draft, and a zero-block head under the target's own LM head:
    its guess at every depth is the target's argmax on the row that chose the root, i.e. the root."""
    spec = tiny_spec(arch="llama")
    target, draft = tiny_pair(spec, seed=0)
    target.hidden_rows = True
    return target, draft, MedusaHead.echo(target.lm_head.weight)


def test_the_head_s_forwards_are_batched_across_requests(hidden_pair, monkeypatch):
    """Requests running together ask their head in one forward per phase (several rows in one call),
    each gets its own rows' answer, and every output equals `ar`'s; the head at depth 1 names the
    root at every step (it reads the row that chose it)."""
    target, draft, head = hidden_pair
    calls: list[int] = []
    run = heads_mod.run_heads

    def spy(cs):
        calls.extend(sum(len(c.rows) for c in cs if c.head is h) for h in {id(c.head): c.head for c in cs}.values())
        return run(cs)

    monkeypatch.setattr(heads_mod, "run_heads", spy)
    monkeypatch.setattr("trtspec.runtime.effects.run_heads", spy)
    gen = Generator(TorchEngine(target), TorchEngine(draft), capacity=128, heads={"medusa": head})
    try:
        prompts = [[3, 17, 99, 250, 401, 7] * 2, [5, 6, 7], [42, 43, 44, 45, 46], [9, 9, 9]]
        refs = [gen.generate(p, strategy="ar", max_new_tokens=12).token_ids for p in prompts]
        assert not calls                                          # ar asks no head
        for strategy in ("ngram:drafter=medusa", "staged:drafter=medusa+ngram"):
            calls.clear()
            handles = [gen.submit(p, strategy=strategy, max_new_tokens=12, record_trees=True) for p in prompts]
            results = [h.result() for h in handles]
            assert [r.token_ids for r in results] == refs, strategy
            assert max(calls) > 1 and len(calls) < sum(calls), calls        # batched: fewer forwards than rows
            asked = sum(len(r.steps) for r in results)
            assert sum(calls) == asked                                      # one row per request per step
            if strategy.startswith("ngram"):             # a chain of its top-1s: after the first step
                trees = [s.extra["tree"] for r in results for s in r.steps[1:]]     # (the prompt's) it names the root
                assert all(t["tokens"][1] == t["tokens"][0] and t["source"][1] == "medusa" for t in trees)
    finally:
        gen.close()


def test_medusa_sampled_first_two_tokens_are_the_target_s(hidden_pair):
    """Under sampling, the medusa drafter's chains (deterministic: q = one-hot) leave the first two
    tokens distributed as the target's own (chi-square, the joint of the first two)."""
    from conftest import make_pair, reference_logits
    from test_sampling_exact import PASS_P, T1, exact_first_two, fit, reference_probs, sample_first

    pair = make_pair("llama", vocab_size=16, num_layers=2, seed=0, noise=0.3)
    head = MedusaHead.echo(pair.target.lm_head.weight)

    def guessed(x: int, y: int) -> float:   # the target's probability of the root the head names after [x, y]
        guess = int(reference_logits(pair.target, [x, y])[-1].argmax())
        return reference_probs(reference_logits(pair.target, [x, y, y])[-1], T1)[guess]

    prompt = next(([x, y, y] for x in range(16) for y in range(16) if 0.2 <= guessed(x, y) <= 0.8), None)
    assert prompt is not None           # its drafts are accepted and rejected often
    joint = exact_first_two(pair.target, prompt, T1)
    pair.target.hidden_rows = True      # (the reference forwards above return logits and KV only)
    gen = Generator(TorchEngine(pair.target), TorchEngine(pair.draft), capacity=64, heads={"medusa": head})
    try:
        accepted = [s.accepted for i in range(30) for s in gen.generate(
            prompt, strategy="ngram:drafter=medusa:k=2", max_new_tokens=4, sampling=T1, seed=i).steps]
        assert 0 in accepted and max(accepted) >= 1          # its drafts are accepted and rejected
        counts = sample_first(gen, prompt, "ngram:drafter=medusa:k=2", T1, 1500, 30_000)
    finally:
        gen.close()
    p_first, p_joint = fit(counts, joint)
    print(f"[pvalue] e2e medusa: first {p_first:.3g} joint {p_joint:.3g}")
    assert p_first > PASS_P and p_joint > PASS_P, (p_first, p_joint)


def test_a_drafter_without_its_head_is_one_line(hidden_pair):
    from trtspec.errors import RequestError
    target, draft, _ = hidden_pair
    gen = Generator(TorchEngine(target), TorchEngine(draft), capacity=64)
    try:
        with pytest.raises(RequestError, match="drafts with a medusa head and there is none: add heads") as e:
            gen.generate([1, 2, 3], strategy="ngram:drafter=medusa", max_new_tokens=4)
        assert "\n" not in str(e.value)
    finally:
        gen.close()


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_a_build_with_a_head_role(backend, tmp_path):
    """`heads: {medusa: {model: FILE}}`: the folder holds the head as a role of its own (manifest kind
    head, no KV in the memory check, its forward in costs.json, a line in `inspect`); the loaded
    generator drafts with it on either backend and every output equals `ar`'s."""
    from conftest import QUIET, tiny_dict

    from trtspec.assembly.build import build_engines
    from trtspec.assembly.config import Config
    from trtspec.assembly.load import load_generator
    from trtspec.assembly.memory import need
    from trtspec.assembly.sources import load_model
    from trtspec.engines.manifest import verify
    from trtspec.runtime.costs import load
    from trtspec.tools.inspect_engines import describe
    d = tiny_dict()
    d["target"]["hidden_rows"] = True
    target = load_model(Config.from_dict(d).target, "target")
    save_file(head_state(target.spec.hidden_size, target.lm_head.weight, depth=2), str(tmp_path / "head.safetensors"))
    d["heads"] = {"mine": {"model": str(tmp_path / "head.safetensors")}}
    d["strategies"]["ngram"]["drafter"] = "medusa"              # configured: the folder loads with it
    folder = build_engines(Config.from_dict(d), tmp_path / backend, backend=backend, **QUIET)
    m = verify(folder)
    info = m["models"]["mine"]
    assert info["kind"] == "head" and info["spec"] == {"kind": "medusa", "hidden_size": target.spec.hidden_size,
                                                       "depth": 2, "rows": target.spec.vocab_size}
    assert info["artifacts"] == {"weights": "mine/head.safetensors"}
    n = need(folder, m, 128, 2)
    assert n.weights["mine"] == m["files"]["mine/head.safetensors"]["bytes"] > 0 and "mine" not in n.row_bytes
    assert any(line.startswith("mine: ") and "medusa head role" in line for line in describe(folder))
    gen = load_generator(folder)
    try:
        assert set(gen.heads) == {"mine"}
        for prompt in ([3, 17, 99, 250, 401, 7] * 2, [5, 6, 7]):
            ref = gen.generate(prompt, strategy="ar", max_new_tokens=10).token_ids
            for s in ("ngram", "staged:drafter=medusa"):
                out = gen.generate(prompt, strategy=s, max_new_tokens=10)
                assert out.token_ids == ref, s
                assert sum(st.extra.get("sources", {}).get("medusa", [0])[0] for st in out.steps) > 0, s
    finally:
        gen.close()
    assert set(load(folder).heads) == {"medusa"}                # measured with the folder's costs
    if backend == "torch":                                      # the command line runs it (and refuses a typo)
        from click.testing import CliRunner

        from trtspec.cli import main
        run = ["run", "--engines", str(folder), "--prompt", "x = 1", "--max-new-tokens", "8", "--json"]
        res = CliRunner().invoke(main, run + ["--strategy", "staged:drafter=medusa"])
        assert res.exit_code == 0, res.output
        assert len(json.loads(res.output.strip().splitlines()[-1])["token_ids"]) == 8
        res = CliRunner().invoke(main, run + ["--strategy", "staged:drafter=medusae"])
        assert res.exit_code != 0 and "unknown drafter; choose one of: ngram, suffix, medusa" in res.output


def test_head_roles_refused_where_they_cannot_be(tmp_path):
    """One line each: a head on a target without hidden rows, a head named like another role, two of
    one kind, a medusa drafter without a head; a head that does not fit the target is refused by the
    build before it builds anything (and leaves nothing behind); a config without heads keeps its digest."""
    from conftest import QUIET, tiny_dict

    from trtspec.assembly.build import build_engines
    from trtspec.assembly.config import Config
    from trtspec.errors import ConfigError
    save_file(head_state(8, torch.zeros(4, 8), depth=1), str(tmp_path / "small.safetensors"))
    head = {"model": str(tmp_path / "small.safetensors")}

    def config(hidden=True, **changes):
        d = tiny_dict()
        d["target"]["hidden_rows"] = hidden
        d.update(changes)
        return Config.from_dict(d)

    refused = [(dict(hidden=False, heads={"medusa": head}), "heads.medusa: a head reads the target's hidden rows"),
               (dict(heads={"draft": head}), "'draft' names another part of an engine folder"),
               (dict(heads={"a": head, "b": head}), "two heads of kind medusa"),
               (dict(strategies={"ngram": {"drafter": "medusa"}}), "drafts with a medusa head and there is none"),
               (dict(heads={"Bad-Name": head}), "heads")]
    for changes, why in refused:
        with pytest.raises(ConfigError, match=why) as e:
            config(**changes)
        assert "\n" not in str(e.value)
    assert config(hidden=False).digest() == Config.from_dict({**tiny_dict(), "heads": {}}).digest()
    with pytest.raises(SpecError, match=r"blocks.0.weight is \[8, 8\], the target's hidden size 64"):
        build_engines(config(heads={"medusa": head}), tmp_path / "out", backend="torch", **QUIET)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.partial-*"))


def test_the_budget_charges_a_head_s_forward_in_every_rate():
    """A head's forward is made every step its strategy runs (before the plan), so the budget puts it
    in both sides: a tree's rate and the batch's ar rate. A costly head makes more nodes pay (its
    forward is paid anyway), and a strategy without a head is priced as before."""
    from conftest import CPU_LIKE

    from trtspec.runtime.budget import AutoBudget, Round
    from trtspec.runtime.costs import CostModel, CostTable
    known = [0.3, 0.02, 0.015, 0.01, 0.01, 0.01, 0.01]
    taken = {}
    for h in (0.0, 1.0):
        costs = CostModel(CPU_LIKE.target, CPU_LIKE.draft, heads={"medusa": CostTable([1, 8], [0], [[h, h]])})
        for heads in ((), ("medusa",)):
            b = AutoBudget(costs, 32, heads=heads)
            b.begin(64)
            one = CPU_LIKE.target(1, 64) + (h if heads else 0.0)
            assert b.costs.all_ar_rate() == pytest.approx(1 / one)
            assert b.costs.rate(0.5, 1, 0.0) == pytest.approx(1.5 / (CPU_LIKE.target(2, 64) + (h if heads else 0.0)))
            taken[h, bool(heads)] = b.plan(Round(known=known, free=True)).take
    assert taken[0.0, False] == taken[0.0, True] == taken[1.0, False] == 1 and taken[1.0, True] == len(known)
