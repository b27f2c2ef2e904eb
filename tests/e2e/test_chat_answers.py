"""`trtspec run` answers: a chat answer runs to the end of its turn by default, a cut answer says so,
and finish reasons are `stop` or `length`.
"""
from __future__ import annotations


import json

from click.testing import CliRunner

from conftest import with_chat_template
from trtspec.cli import main
from trtspec.assembly.load import load_generator
from trtspec.runtime.generator import room_for
from trtspec.runtime.prompts import Prompt, encode

# ---------------------------------------------------------------------------------------------
# Chat answers run to the end of the turn; a cut answer says so
# ---------------------------------------------------------------------------------------------

def test_chat_default_runs_to_the_end_of_turn(torch_folder, tmp_path):
    eng = with_chat_template(torch_folder, tmp_path)
    res = CliRunner().invoke(main, ["run", "--engines", str(eng), "--prompt", "x = 1", "--chat", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    gen = load_generator(eng)
    strat = gen.strategy(gen.config.strategy)
    n_prompt = len(encode(Prompt(id="p", text="x = 1"), gen.tokenizer, chat=True))
    assert out["max_new_tokens"] == min(1024, room_for(n_prompt, strat, gen.config.max_seq_len)) > 128
    stopped = out["token_ids"][-1] in gen.stop_ids
    assert out["finish_reason"] == ("stop" if stopped else "length")
    if not stopped:
        assert out["stats"]["new_tokens"] == out["max_new_tokens"]
    res = CliRunner().invoke(main, ["run", "--engines", str(eng), "--prompt", "x = 1", "--chat"])
    assert res.exit_code == 0
    assert ("the answer was cut at" in res.output) == (not stopped)


def test_finish_reason_stop_and_length(llama_pair):
    prompt = [3, 17, 99, 250]
    ref = llama_pair.generator().generate(prompt, max_new_tokens=12).token_ids
    stop = ref[5]
    gen = llama_pair.generator(stop_ids={stop})
    res = gen.generate(prompt, strategy="chain", max_new_tokens=12)
    assert res.token_ids == ref[: ref.index(stop) + 1] and res.finish_reason == "stop"
    assert llama_pair.generator().generate(prompt, max_new_tokens=12).finish_reason == "length"


def test_plain_prompt_default_cap_says_so(torch_folder):
    res = CliRunner().invoke(main, ["run", "--engines", str(torch_folder), "--prompt", "x = 1", "--strategy", "ar"])
    assert res.exit_code == 0
    n = int(res.output.split("[ar] ")[1].split()[0])
    assert n <= 128 and ("default cap of 128 new tokens" in res.output) == (n == 128)
