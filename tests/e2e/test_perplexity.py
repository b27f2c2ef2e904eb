"""The perplexity tool scores windows the way llama-perplexity does, through the engine's own prefill."""
import math

import torch
from click.testing import CliRunner
from conftest import one_line_error, reference_logits

from trtspec.engines.torch_engine import TorchEngine
from trtspec.export.tiny import tiny_pair, tiny_spec
from trtspec.runtime.runner import ModelRunner
from trtspec.tools.perplexity import engine_perplexity, estimate, main, window_nll, windows


def test_windows_are_llama_perplexity_s():
    ids = list(range(10, 33))
    assert windows(ids, 8, None) == [ids[0:8], ids[8:16]]          # the tail (7 tokens) is dropped
    assert windows(ids, 8, 1) == [ids[0:8]]
    assert windows(ids, 8, None, bos=1) == [[1] + ids[1:8], [1] + ids[9:16]]


def test_engine_perplexity_equals_a_plain_causal_forward():
    """Windows of 160 tokens (three prefill chunks each): the engine's NLL equals the one from a plain
    causal forward over the window (no cache), summed over the window's second half."""
    target, _ = tiny_pair(tiny_spec(vocab_size=128), seed=0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2 * 160 + 30,), generator=g).tolist()
    parts = windows(ids, 160, None)
    got = engine_perplexity(ModelRunner.alone(TorchEngine(target), 160), parts)
    nll = nll2 = n = 0
    for w in parts:
        logp = torch.log_softmax(reference_logits(target, w).double(), -1)
        x = torch.tensor([-logp[j, w[j + 1]] for j in range(80, 159)], dtype=torch.float64)
        nll, nll2, n = nll + float(x.sum()), nll2 + float((x * x).sum()), n + x.numel()
    assert got["tokens_scored"] == n == 2 * 79
    assert math.isclose(got["ppl"], math.exp(nll / n), rel_tol=1e-5)
    assert math.isclose(got["err"], estimate(nll, nll2, n)[1], rel_tol=1e-4)


def test_window_nll_of_a_certain_model_is_zero():
    ids = [3, 1, 4, 1, 5, 9]
    logits = torch.full((6, 10), -1e4)
    logits[torch.arange(5), torch.tensor(ids[1:])] = 0.0
    nll, nll2, n = window_nll(logits, ids)
    assert n == 2 and nll == 0.0 == nll2


def test_cli_scores_a_folder_and_refuses_a_short_file_in_one_line(torch_folder, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 40)
    res = CliRunner().invoke(main, ["--engines", str(torch_folder), "--file", str(text), "--ctx", "64",
                                    "--json", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    assert "trtspec         PPL = " in res.output and (tmp_path / "p.json").is_file()
    text.write_text("x = 1\n")
    res = CliRunner().invoke(main, ["--engines", str(torch_folder), "--file", str(text), "--ctx", "64"])
    assert res.exit_code == 2 and "fewer than one window of 64" in one_line_error(res)
