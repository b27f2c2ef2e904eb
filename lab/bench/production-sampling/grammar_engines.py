"""llguidance vs xgrammar on our vocabularies: tokenizer build, JSON-schema compile, per-token mask.

    python lab/bench/production-sampling/grammar_engines.py TOKENIZER_FOLDER VOCAB_SIZE

Walks one valid 49-51-token JSON document through each engine's matcher, timing the mask before
every token. xgrammar is not a dependency of trtspec (its wheel pulls triton); to rerun this:
pip install --no-deps xgrammar apache-tvm-ffi. Results: docs/benchmarks.md, "Production sampling".
"""
import json, time, sys
import torch
from transformers import AutoTokenizer
tokdir, V = sys.argv[1], int(sys.argv[2])
tok = AutoTokenizer.from_pretrained(tokdir)
schema = {"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},
  "tags":{"type":"array","items":{"type":"string"}},"address":{"type":"object","properties":{"city":{"type":"string"},"zip":{"type":"string","pattern":"^[0-9]{5}$"}},"required":["city","zip"]}},
  "required":["name","age","tags","address"],"additionalProperties":False}
doc = json.dumps({"name":"Ada Lovelace","age":36,"tags":["math","poetry","engines"],"address":{"city":"London","zip":"12345"}})
ids = tok.encode(doc, add_special_tokens=False)
print("doc tokens", len(ids))
res = {}
# llguidance
import llguidance, llguidance.hf, llguidance.torch as lt
t=time.perf_counter(); ltok = llguidance.hf.from_tokenizer(tok, n_vocab=V); t_tok=time.perf_counter()-t
t=time.perf_counter(); g = llguidance.LLMatcher.grammar_from_json_schema(schema); m = llguidance.LLMatcher(ltok, g); t_c=time.perf_counter()-t
assert not m.is_error(), m.get_error()
bm = lt.allocate_token_bitmask(1, V); times=[]
for i in ids:
    t=time.perf_counter(); lt.fill_next_token_bitmask(m, bm, 0); times.append(time.perf_counter()-t)
    assert m.consume_token(i), (i, m.get_error())
times.sort(); print(f"llguidance: tokenizer {t_tok*1e3:.0f} ms, compile {t_c*1e3:.1f} ms, mask median {times[len(times)//2]*1e6:.0f} us p95 {times[int(len(times)*.95)]*1e6:.0f} us max {times[-1]*1e6:.0f} us")
# xgrammar
import xgrammar as xgr
t=time.perf_counter(); info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V); t_tok=time.perf_counter()-t
comp = xgr.GrammarCompiler(info, cache_enabled=False)
t=time.perf_counter(); cg = comp.compile_json_schema(json.dumps(schema)); m = xgr.GrammarMatcher(cg); t_c=time.perf_counter()-t
bm = xgr.allocate_token_bitmask(1, V); times=[]
for i in ids:
    t=time.perf_counter(); m.fill_next_token_bitmask(bm); times.append(time.perf_counter()-t)
    assert m.accept_token(i), i
times.sort(); print(f"xgrammar: tokenizer {t_tok*1e3:.0f} ms, compile {t_c*1e3:.1f} ms, mask median {times[len(times)//2]*1e6:.0f} us p95 {times[int(len(times)*.95)]*1e6:.0f} us max {times[-1]*1e6:.0f} us")
