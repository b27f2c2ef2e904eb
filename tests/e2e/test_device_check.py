"""The GPU device check (lab/device_check) in its tiny CPU mode, so it never rots: every
section runs and reports, and what it measures on CPU holds: fixed step shapes with fp64 attention
give a tree row exactly the logits of the same path fed one token per forward (plain shapes do
not), every strategy equals `ar` alone and batched, sampled requests batched equal themselves alone,
graph-bucket runs equal eager ones, sampled `staged` passes its chi-square, a target with hidden
rows and a head role (eager and graph buckets) keeps the medusa drafter's outputs equal to `ar`'s,
and forced acceptance keeps every output equal to `ar`'s."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from lab.device_check.__main__ import main
from lab.device_check.e2e import STRATEGIES
from lab.device_check.exact import RUNS


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check")
    res = CliRunner().invoke(main, ["--out", str(out), "--tiny", "--device", "cpu", "--budget-s", "600"])
    assert res.exit_code == 0, res.output
    return json.loads((out / "device_check.json").read_text()), (out / "device_check.md").read_text(), out


def test_every_section_ran_and_is_reported(report):
    res, md, out = report
    assert list(res["sections"]) == ["machine", "exact", "costs", "settings", "profile", "e2e"]
    assert all("result" in s for s in res["sections"].values()), res["sections"]
    for head in ("## machine", "## exact", "## costs", "## settings", "## profile", "## e2e", "Goals (target, B = 1)"):
        assert head in md
    m = res["sections"]["machine"]["result"]
    assert m["copy_gb_per_s"] > 0 and m["matmul_tflop_per_s"] > 0
    rows = res["sections"]["costs"]["result"]["rows"]
    assert len(rows) == 2 * 2 * 2 * 3 and all(r["eager_ms"] > 0 for r in rows)
    from trtspec.tools.bench import read_costs
    plan = read_costs(str(out / "device_costs.json"))         # what `bench --plan-costs` plans with
    assert plan.target.tokens == [1, 2, 4] and plan.target.cached == [16, 64] and set(plan.rows["target"]) == {2}
    costs = res["sections"]["settings"]["result"]["rows"]        # what each exactness setting costs a step
    expected = [("plain", 1)] * 2 + [("fixed", 16)] * 2 + [("fixed-fp64", 16)] * 2
    assert [(r["setting"], r.get("T")) for r in costs] == expected[:4] + [("logical", None)] + expected[4:]
    assert costs[4]["skipped"] == "needs a GPU"                  # the Triton kernel: on a GPU only
    costs = [r for r in costs if "skipped" not in r]
    assert all(r["ms"] > 0 and r["buffer"] == r["C"] + (r["T"] > 1) * 16 for r in costs), costs
    prof = res["sections"]["profile"]["result"]                  # where a step's time goes, op by op
    assert [s["shape"] for s in prof["shapes"]] == [{"B": 1, "T": 1, "C": 64}, {"B": 2, "T": 1, "C": 64}]
    for s in prof["shapes"]:
        for r in (s, s["reference"]):                              # the Decoder's step, the fused yardstick's
            assert r["step_ms"] > 0 and r["kernels_per_step"] > 20 and r["top"], r
            assert r["groups"]["matmul"]["kernels"] >= 2 * prof["layers"] and r["groups"]["other"]["kernels"] > 0
        assert s["reference"]["groups"]["matmul"]["kernels"] < s["groups"]["matmul"]["kernels"]   # joined GEMMs


def test_fixed_shapes_with_fp64_attention_are_exact_and_plain_shapes_are_not(report):
    archs = report[0]["sections"]["exact"]["result"]["archs"]
    assert set(archs) == {"llama", "qwen2"}
    for arch, runs in archs.items():
        assert tuple(n for n in runs if n != "model") == RUNS[arch]
        gpu_only = [n for n in RUNS[arch] if n.startswith("logical")]
        assert gpu_only and all(runs[n]["skipped"].startswith("needs a GPU") for n in gpu_only)
        runs = {n: r for n, r in runs.items() if n not in gpu_only}
        for name in ("fixed-fp64", "fixed-fp64+graphs"):
            assert runs[name]["trees"]["differ"] == 0 and runs[name]["trees"]["nodes"] > 50, runs[name]["trees"]
        assert runs["plain"]["trees"]["differ"] > 0          # the check can fail: shapes as they come differ
        ran = [n for n in RUNS[arch][1:] if n not in gpu_only]
        for name in ran:                                      # a target row: the same in any batch
            assert all(d == 0 for d, _ in runs[name]["batch_rows"]["target"].values()), runs[name]["batch_rows"]
        assert all(d > 0 for d, _ in runs["plain"]["batch_rows"]["target"].values())   # (and it can fail)
        for name in ran:                          # a draft padded like the target: its rows too, on the CPU
            rows = runs[name]["batch_rows"]
            assert all(d == 0 for d, _ in rows["draft, fixed rows"].values()), rows
            assert any(d > 0 for d, _ in rows["draft"].values()), rows             # one-row calls alone: a GEMV
            if name.startswith("fixed-fp64"):
                assert runs[name]["sampled_batch_fixed_draft"] == {"requests": 8, "differ": 0}
        for name, r in runs.items():
            if name == "model":
                continue
            assert r["strategies"]["differ"] == [] and r["strategies"]["checked"] == 7, (name, r["strategies"])
            assert r["batch"] == {"1": 0, "2": 0, "4": 0, "8": 0}, (name, r["batch"])
            assert r["sampled_batch"] == {"requests": 8, "differ": 0}, (name, r["sampled_batch"])
            if name.endswith("+graphs"):
                assert r["graphs_equal_eager"] is True
    chi = report[0]["sections"]["exact"]["result"]["chi_square"]
    assert chi["passes"] and chi["samples"] == 150
    head = report[0]["sections"]["exact"]["result"]["head"]              # hidden rows and a head role
    assert set(head) == {"fixed-fp64", "fixed-fp64+graphs"}
    for r in head.values():
        named, steps = map(int, r["root_named"].split(" of "))
        assert r["strategies_differ"] == [] and r["checked"] == 4 and r["batch4_differ"] == 0, r
        assert named == steps > 10, r                           # exact on the CPU: the head names every root
    assert "Hidden rows and a Medusa head role" in report[1]


def test_forced_acceptance_keeps_every_output_equal_to_ar(report):
    runs = report[0]["sections"]["e2e"]["result"]["runs"]
    assert len(runs) == 2 * (1 + 2 * 3)
    assert all(r["equal_to_ar"] for r in runs), [r for r in runs if not r["equal_to_ar"]]
    for setting in ("plain", "fixed-fp64"):
        per_step = {(r["strategy"], r["rate"]): r["tokens_per_step"] for r in runs if r["setting"] == setting}
        assert all(per_step[(s, 0.0)] > 3 for s in STRATEGIES)            # all accepted
        for s in STRATEGIES:
            assert per_step[(s, 0.5)] < per_step[(s, 0.0)]         # corrupted rows are rejected


def test_the_full_check_without_a_gpu_is_refused_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    res = CliRunner().invoke(main, ["--out", str(tmp_path / "dc")])
    assert res.exit_code == 1 and "no CUDA device here" in res.output and "--tiny" in res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "dc").exists()
    bad = CliRunner().invoke(main, ["--out", str(tmp_path / "dc"), "--tiny", "--sections", "machine,gpu"])
    assert bad.exit_code == 2 and "unknown section 'gpu'" in bad.output


def test_a_failing_section_is_one_line_and_the_run_goes_on(tmp_path, monkeypatch):
    from lab.device_check import machine
    monkeypatch.setattr(machine, "ceilings", lambda *a: 1 / 0)
    res = CliRunner().invoke(main, ["--out", str(tmp_path), "--tiny", "--device", "cpu", "--sections", "machine,costs"])
    assert res.exit_code == 1 and "machine FAILED: ZeroDivisionError" in res.output
    data = json.loads((tmp_path / "device_check.json").read_text())
    assert "error" in data["sections"]["machine"] and "result" in data["sections"]["costs"]
    assert "FAILED: ZeroDivisionError" in (tmp_path / "device_check.md").read_text()


def _tiny_gguf(path) -> None:
    """A 2-layer llama GGUF of random f32 weights (the layout llama.cpp's converter writes)."""
    import gguf
    import numpy as np
    rng = np.random.default_rng(0)
    hidden, inter, vocab, heads, kv, layers = 64, 96, 97, 4, 2, 2
    d = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(d)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_eos_token_id(2)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv * d, hidden),
                       f"blk.{i}.attn_v.weight": (kv * d, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                       f"blk.{i}.ffn_gate.weight": (inter, hidden), f"blk.{i}.ffn_up.weight": (inter, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, inter), f"blk.{i}.attn_norm.weight": (hidden,),
                       f"blk.{i}.ffn_norm.weight": (hidden,)})
    for name, shape in shapes.items():
        a = 1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else 0.3 * rng.standard_normal(shape)
        w.add_tensor(name, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_real_model_from_its_gguf(tmp_path):
    """`--sections real --gguf F`: the GGUF read by trtspec's loader, the exact section's checks on it
    under the product's setting (on a GPU: SmolLM2 carried in parts, docs/gpu.md); the default
    sections leave it out."""
    path = tmp_path / "tiny.gguf"
    _tiny_gguf(path)
    out = tmp_path / "dc"
    res = CliRunner().invoke(main, ["--out", str(out), "--tiny", "--device", "cpu", "--sections", "real",
                                    "--gguf", str(path)])
    assert res.exit_code == 0, res.output
    sec = json.loads((out / "device_check.json").read_text())["sections"]["real"]["result"]
    assert sec["model"]["layers"] == 2 and sec["model"]["vocab"] == 97
    run = sec["runs"]["fixed-fp64"]
    assert run["trees"]["run"] == 3 and run["trees"]["differ"] == 0 and run["trees"]["nodes"] > 10, run["trees"]
    assert run["strategies"]["differ"] == [] and run["strategies"]["checked"] > 5, run["strategies"]
    assert set(run["batch"].values()) == {0} and run["sampled_batch"]["differ"] == 0
    assert "| llama | fixed-fp64 | 3: 0 /" in (out / "device_check.md").read_text()
