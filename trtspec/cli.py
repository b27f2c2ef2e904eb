"""`trtspec` command line: build engines, run generation.

Every user error (bad config, missing model, tampered engines, too long a prompt) ends in one
line naming the problem and the fix, never a traceback: the project's errors (`TrtspecError`) are
caught here and nothing else, so a real bug still shows its traceback. `run` checks everything that
needs no engine (options, strategy vs draft, capacity) before it builds or loads one.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

import click

from .assembly.backends import NAMES as BACKENDS
from .assembly.config import load_config
from .errors import Terminated, TrtspecError
from .runtime.strategies import STRATEGIES, split_spec

PLAIN_MAX_NEW_TOKENS = 128     # plain (non-chat) prompts: a completion has no end-of-turn to wait for
CHAT_MAX_NEW_TOKENS = 1024     # chat: answer to the end of the turn; this only stops a runaway loop


def user_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TrtspecError as e:
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)
        except Terminated:
            click.echo("\nterminated", err=True)
            sys.exit(143)
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="trtspec")
def main() -> None:
    """trtspec: lossless speculative decoding, compiled.

    \b
    Typical use:
      trtspec run --prompt "def quicksort(a):"            # default config, engines built on first use
      trtspec build --config configs/smollm2-135m.yaml --output engines/smol
      trtspec run --engines engines/smol --strategy ngram --prompt-file p.txt --json

    Every strategy is lossless: greedy output is token-for-token the target's own greedy output,
    and sampled output is distributed exactly as the target's.
    """


@main.command()
@click.option("--config", "config_path", required=True, help="YAML config (path, or a shipped name such as tiny-random).")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Engine folder to write.")
@click.option("--backend", type=click.Choice(BACKENDS), default=None,
              help="torch: safetensors weights only. onnxruntime: also ONNX + ORT-optimized graphs. "
                   "tensorrt: also TensorRT plans (needs TensorRT and a CUDA GPU). Default: the config's.")
@click.option("--force", is_flag=True, help="Replace an existing output folder.")
@user_errors
def build(config_path: str, output: str, backend: str | None, force: bool) -> None:
    """Export the config's target (and draft) and compile engines into OUTPUT.

    Writes manifest.json with the sha256 of every artifact; `trtspec run` refuses a folder that
    no longer matches it.

    \b
    Memory: weights are read, converted and written one tensor at a time (the default
    Qwen 1.5B + 0.5B pair peaks near 5 GB). The peak and the folder's size are estimated from the
    sources' headers first; a build that cannot fit the memory available (or TRTSPEC_MEMORY_LIMIT
    bytes) or the output's disk is refused in one line before any work. Exported graphs are kept
    under $TRTSPEC_CACHE/graphs, so a rebuild skips the export."""
    from .assembly.build import build_engines
    cfg = load_config(config_path)
    out = build_engines(cfg, output, backend=backend, force=force)
    click.echo(f"engines written to {out}")


@main.command()
@click.option("--engines", "engines_dir", type=click.Path(), default=None, help="Engine folder from `trtspec build`.")
@click.option("--config", "config_path", default=None,
              help="Config to build (once, into the cache) and run. Default: the Qwen2.5-Coder 1.5B/0.5B pair.")
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), default=None, help="Read the prompt from a file.")
@click.option("--strategy", default=None, callback=lambda ctx, param, v: _strategy_spec(v),
              metavar="NAME[:KEY=VALUE...]",
              help="ar: plain decoding. chain: k draft-model tokens. ngram: prompt/output n-gram copies. "
                   "staged: best-first draft tree + n-gram-reviewed draft. dyspec: dynamic tree (heap or "
                   "threshold). gsd: top-k graph with merged repeats. cascade: draft reviews n-gram drafts "
                   "(CS Drafting). All lossless. Options per strategy live in the config; override one here, "
                   "e.g. staged:budget=12 (a fixed tree instead of budget: auto), or staged:drafter=suffix+ngram "
                   "(its free drafters, in order: suffix-trie candidates, then n-gram chains where the tries "
                   "have none). Default: the config's.")
@click.option("--max-new-tokens", default=None, type=click.IntRange(1),
              help=f"Cap on new tokens. Default: with --chat, until the model ends its turn (at most "
                   f"{CHAT_MAX_NEW_TOKENS}, and what fits max_seq_len); without, {PLAIN_MAX_NEW_TOKENS}. "
                   "A run cut by the cap says so.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0), help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(0), help="0 = off.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True), help="1 = off.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--presence-penalty", default=0.0, show_default=True, type=float,
              help="Subtracted from a token's logit once it occurs in the output (OpenAI's).")
@click.option("--frequency-penalty", default=0.0, show_default=True, type=float,
              help="Subtracted from a token's logit per occurrence in the output (OpenAI's).")
@click.option("--repetition-penalty", default=1.0, show_default=True, type=float,
              help="Divides a seen token's (prompt or output) positive logit, multiplies a negative one (vLLM's); 1 = off.")
@click.option("--min-tokens", default=0, show_default=True, type=click.IntRange(0),
              help="Stop tokens are masked until this many tokens were generated.")
@click.option("--json-schema", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The output is JSON valid against this JSON schema file (structured output).")
@click.option("--regex", default=None, help="The output matches this regular expression (structured output).")
@click.option("--grammar", "grammar_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The output matches this Lark grammar file (structured output).")
@click.option("--logprobs", type=click.IntRange(0, 20), default=None,
              help="With --json: each token's log-probability under the target and this many alternatives.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template and answer to the end of "
                                           "the turn.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object: text, token_ids, finish_reason (stop | length), stats, steps.")
@click.option("--backend", type=click.Choice(BACKENDS), default=None,
              help="Default: the backend the engine folder was built for (--engines) or the config's.")
@click.option("--threads", type=click.IntRange(0), default=None, help="CPU threads (0 = library default).")
@click.option("--show-tree", type=click.Path(dir_okay=False), default=None,
              help="Render one step's token tree (accepted path highlighted) to this .png or .svg file.")
@click.option("--tree-step", type=click.IntRange(0), default=0, show_default=True,
              help="Which target step --show-tree renders.")
@user_errors
def run(engines_dir, config_path, prompt, prompt_file, strategy, max_new_tokens, temperature, top_k, top_p,
        seed, presence_penalty, frequency_penalty, repetition_penalty, min_tokens, json_schema, regex, grammar_file,
        logprobs, chat, as_json, backend, threads, show_tree, tree_step) -> None:
    """Generate text, streaming it to the terminal (or as JSON with --json).

    Every strategy is lossless under every option here: penalties, --min-tokens and a grammar
    (--json-schema, --regex, --grammar) shape the target's distribution at each drafted token as
    plain decoding would, so the output is the one `--strategy ar` gives (greedy), or distributed
    as its samples are."""
    from .assembly.load import load_generator, load_tokenizer
    from .runtime.generator import check_capacity, decode_pieces, room_for
    from .runtime.prompts import Prompt, PromptError, encode  # one prompt encoder for run, serve and bench
    from .runtime.sampling import SamplingParams
    from .runtime.strategies import strategy as make

    # Everything that needs no engine is checked first: a bad option never waits for a build.
    if engines_dir and config_path:
        raise click.UsageError("give --engines DIR or --config PATH, not both")
    if show_tree and Path(show_tree).suffix.lower() not in (".png", ".svg"):
        raise click.UsageError("--show-tree needs a .png or .svg file name")
    text = _prompt_text(prompt, prompt_file)
    if logprobs is not None and not as_json:
        raise click.UsageError("--logprobs goes with --json (the values are printed there)")
    sampling = SamplingParams(temperature, top_k, top_p, repetition_penalty=repetition_penalty,
                              frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                              min_tokens=min_tokens, grammar=_grammar(json_schema, regex, grammar_file),
                              logprobs=logprobs)
    log = functools.partial(click.echo, err=True)
    opened, cfg = _settle(engines_dir, config_path, backend)
    name = strategy or cfg.strategy
    strat = make(name, cfg.strategies, **cfg.runs_with())
    check_capacity(1, max_new_tokens or 1, strat, cfg.max_seq_len)

    folder, opened = _engines(engines_dir, opened, cfg, log)
    tok = load_tokenizer(folder, opened[0])
    try:
        ids = encode(Prompt(id="prompt", text=text), tok, chat=chat)
    except PromptError as e:
        raise click.UsageError(str(e)) from None
    room = room_for(len(ids), strat, cfg.max_seq_len)
    limit = max_new_tokens or (max(1, min(CHAT_MAX_NEW_TOKENS, room)) if chat else PLAIN_MAX_NEW_TOKENS)
    check_capacity(len(ids), limit, strat, cfg.max_seq_len)
    kwargs = dict(strategy=strat, max_new_tokens=limit, sampling=sampling, seed=seed, record_trees=bool(show_tree))
    # closed on the way out, success or not: the scheduler joined, the engines' sessions released
    # one request: one slot, and nothing to share a prefix with
    with load_generator(folder, threads=threads, opened=opened, tokenizer=tok, slots=1, prefix_cache=0) as gen:
        if as_json:
            result = gen.generate(ids, **kwargs)
            click.echo(json.dumps(_json_result(result, tok, limit, name, gen.backend)))
        else:
            handle = gen.submit(ids, **kwargs)
            try:
                for piece in decode_pieces(tok, handle):
                    click.echo(piece, nl=False)
            finally:
                handle.cancel()                      # a no-op once done; Ctrl-C frees the slot
            click.echo()
            result = handle.result()
    if show_tree:
        _render_tree(result, tree_step, tok, show_tree, name)
    if as_json:
        return
    if result.finish_reason == "length":
        log(_why_cut(limit, bool(max_new_tokens), chat, cfg.max_seq_len))
    s = result.stats
    log(f"[{name}] {s['new_tokens']} tokens in {s['seconds']:.2f}s = {s['tokens_per_s']:.2f} tok/s, "
        f"{s['mean_accepted']:.2f} tokens per target step")


def _grammar(json_schema: str | None, regex: str | None, grammar_file: str | None):
    """The output's grammar from `run`'s options (at most one), checked before anything loads."""
    from .runtime.grammar import Grammar

    given = [(k, v) for k, v in (("json_schema", json_schema), ("regex", regex), ("lark", grammar_file)) if v]
    if len(given) > 1:
        raise click.UsageError("give at most one of --json-schema, --regex and --grammar")
    if not given:
        return None
    kind, value = given[0]
    if kind != "regex":
        try:
            value = Path(value).read_text()
        except UnicodeDecodeError as e:
            raise click.UsageError(f"{value} is not UTF-8 text ({e.reason})") from None
    return Grammar(kind, value).check()


def _prompt_text(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt of `run`: --prompt or the UTF-8 text of --prompt-file, exactly one, not empty."""
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt TEXT or --prompt-file FILE")
    try:
        text = prompt if prompt is not None else Path(prompt_file).read_text()
    except UnicodeDecodeError as e:
        raise click.UsageError(f"--prompt-file {prompt_file} is not UTF-8 text ({e.reason})") from None
    if not text:
        raise click.UsageError("the prompt is empty" + (f" ({prompt_file})" if prompt_file else ""))
    return text


def _json_result(result, tok, limit: int, strategy: str, backend: str) -> dict:
    """`run --json`: the text, ids, finish reason, stats and every step's record (without its tree)."""
    steps = [{k: v for k, v in dataclasses.asdict(st).items() if k != "extra"}
             | {k: v for k, v in st.extra.items() if k != "tree"} for st in result.steps]
    out = {"text": tok.decode(result.token_ids, skip_special_tokens=True), "token_ids": result.token_ids,
           "finish_reason": result.finish_reason, "max_new_tokens": limit, "stats": result.stats,
           "steps": steps, "strategy": strategy, "backend": backend}
    if result.logprobs is not None:
        out["logprobs"] = [{"token": lp.token, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                           for lp in result.logprobs]
    return out


def _why_cut(limit: int, asked: bool, chat: bool, max_seq_len: int) -> str:
    """The line `run` prints when an answer ended at its token limit rather than at a stop token."""
    if asked:
        return f"[stopped at --max-new-tokens {limit}, before an end-of-{'turn' if chat else 'text'} token]"
    if chat and limit < CHAT_MAX_NEW_TOKENS:
        return (f"[the answer was cut at {limit} tokens, all that fits max_seq_len {max_seq_len} after the "
                "prompt; raise max_seq_len in the config]")
    if chat:
        return (f"[the answer was cut at the default cap of {limit} tokens for a chat answer; raise it with "
                "--max-new-tokens]")
    return f"[stopped at the default cap of {limit} new tokens; raise it with --max-new-tokens]"


@main.command()
@click.option("--config", "config_path", default=None, help="Config (engines built once into the cache unless --engines).")
@click.option("--engines", "engines_dir", type=click.Path(), default=None, help="Prebuilt engine folder of that config.")
@click.option("--dataset", required=True,
              help="humaneval | mtbench | mtbench-turn2 (the second turn, after the model's own first answer) | "
                   "humaneval-edit (code editing: the answer repeats its input) | "
                   "humaneval-json (one JSON instruction over many inputs) | FILE.jsonl of {id, prompt} or "
                   "{id, messages}.")
@click.option("--strategies", default="ar,chain,staged,gsd,dyspec,cascade", show_default=True,
              help="Comma-separated; ar is always added (the baseline).")
@click.option("--peers", default="hf,hf-assisted,hf-lookup", show_default=True,
              help="Peers, comma-separated, or 'none': hf, hf-assisted, hf-lookup (transformers on the same "
                   "weights); llama.cpp, llama.cpp-spec, llama.cpp-ngram-{simple,map-k,map-k4v,mod,cache} "
                   "(llama-server on the same GGUF files: plain, with the draft, with each draftless n-gram "
                   "mode; build it once with `make llama-cpp`); ortgenai, ortgenai-fp32 (ONNX Runtime GenAI: its "
                   "builder's int4 for the CPU, or fp32, from the folder's target weights; needs `pip install "
                   "onnxruntime-genai`).")
@click.option("--limit", type=click.IntRange(1), default=None, help="First N prompts (default: all).")
@click.option("--stride", type=click.IntRange(1), default=1, show_default=True,
              help="Every N-th prompt, before --limit (MT-Bench is sorted by category: --stride 4 "
                   "--limit 20 covers all 8).")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0), help="0 = greedy.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--chat", is_flag=True, help="Chat template for plain-text prompts (MT-Bench always uses it).")
@click.option("--output", type=click.Path(file_okay=False), default=None,
              help="Results folder. Default: out/bench/CONFIG-DATASET-TIME.")
@click.option("--backend", type=click.Choice(BACKENDS), default=None, help="Override the config's runtime backend.")
@click.option("--threads", type=click.IntRange(0), default=None, help="CPU threads (0 = library default).")
@click.option("--concurrency", default=None, metavar="LEVELS",
              help="e.g. 1,2,4,8: serve the prompts with that many concurrent requests instead (closed-loop "
                   "clients, batched steps); reports total tok/s, latency p50/p95 and TTFT per level against "
                   "level 1 (one after another). No HF peers in this mode.")
@click.option("--grammar", default=None, metavar="json_object|SCHEMA.json",
              help="Structured outputs: every run of ours is constrained to any JSON object, or to this JSON "
                   "schema (e.g. humaneval-json with docs/bench/function-schema.json); compare with a run "
                   "without it for the grammar's effect on speed and acceptance. Needs --peers none.")
@click.option("--until-stop", is_flag=True,
              help="Answers end at the model's stop token, as in serving (default: stop tokens are ignored and every "
                   "answer is exactly --max-new-tokens long); implied by --grammar. Needs --peers none.")
@click.option("--shared-prefix", type=click.IntRange(1), default=None, metavar="TOKENS",
              help="Prefix caching: each prompt follows the same ~TOKENS-token block (the dataset's other prompts, "
                   "as a system message with --chat); reports time to first token with the prefix cache cold and "
                   "warm, and that the outputs are equal. Uses the first of --strategies. No peers in this mode.")
@click.option("--plan-costs", type=click.Path(exists=True, dir_okay=False), default=None, metavar="COSTS_JSON",
              help="budget: auto plans with this step-cost table (costs.json format) instead of the one measured "
                   "here, e.g. docs/bench/gpu-like-costs.json: shows the trees it would choose on that machine; "
                   "results.md then adds the speedup projected from the table's times (a projection, not a "
                   "measurement).")
@user_errors
def bench(**options) -> None:
    """Benchmark strategies and HF peers: tokens/s, speedups, acceptance, time split, ceiling.

    Writes results.json, results.md and PNG plots; see trtspec/tools/bench.py for the method.
    An interrupted run keeps the prompts it finished in OUTPUT/partial.json."""
    from .tools.bench import bench_main
    # Record the invocation as given (also under a test runner, where sys.argv is the runner's).
    flags = {p.name: p.opts[0] for p in click.get_current_context().command.params}
    argv = ["trtspec", "bench"] + [f"{flags[k]}={v}" if v is not True else flags[k]
                                   for k, v in options.items() if v not in (None, False)]
    bench_main(**options, log=functools.partial(click.echo, err=True), command=" ".join(argv))


@main.command()
@click.option("--engines", "engines_dir", required=True, type=click.Path(), help="Engine folder to inspect.")
@click.option("--compare", is_flag=True,
              help="Run one identical random tree step through every backend available here and report "
                   "logit differences vs torch (plus polygraphy TensorRT-vs-ONNX Runtime where both exist).")
@click.option("--trees", type=click.IntRange(1), default=None,
              help="With --compare: also run N random trees (2-16 nodes) at random cached lengths from 16 to "
                   "--longest through the folder's own backend and count the nodes whose logits differ, bit for "
                   "bit, from the same path fed one token per forward (what `ar` computes). 0 means strategies "
                   "reproduce `ar` on those trees.")
@click.option("--longest", type=click.IntRange(17), default=None,
              help="With --trees: the longest cached length a tree is drawn at (default 2,000; at most the "
                   "folder's max_seq_len - 24). The sweep prefills one random prompt this long first.")
@click.option("--role", type=click.Choice(["target", "draft"]), default="target", show_default=True)
@click.option("--measure-costs", is_flag=True,
              help="Measure the step costs budget: auto plans with (one target / draft forward over 1..64 new "
                   "tokens at two cache lengths) on this machine again, and store them in the folder's costs.json.")
@click.option("--threads", type=click.IntRange(0), default=None, help="With --measure-costs: threads (default: the config's).")
@user_errors
def inspect(engines_dir: str, compare: bool, trees: int | None, longest: int | None, role: str, measure_costs: bool,
            threads: int | None) -> None:
    """Show an engine folder's models, artifacts, versions (verifying every hash) and step costs."""
    if trees and not compare:
        raise click.UsageError("--trees goes with --compare")
    if longest is not None and not trees:
        raise click.UsageError("--longest goes with --trees")
    from .tools.inspect_engines import compare as run_compare
    from .tools.inspect_engines import describe
    if measure_costs:
        from .assembly.load import measure_costs as measure
        measure(Path(engines_dir), threads=threads, log=lambda m: click.echo(m, err=True))
    for line in describe(Path(engines_dir)):
        click.echo(line)
    if compare:
        for line in run_compare(Path(engines_dir), role):
            click.echo(line)
    if trees:
        from .tools.inspect_engines import sweep
        for line in sweep(Path(engines_dir), role, trees, longest=longest):
            click.echo(line)


def _strategy_spec(value: str | None) -> str | None:
    """--strategy NAME[:KEY=VALUE...]: the name must be a strategy (options are checked when it is made)."""
    if value is None:
        return None
    try:
        name = split_spec(value)[0]
    except TrtspecError as e:
        raise click.BadParameter(str(e)) from None
    if name not in STRATEGIES:
        raise click.BadParameter(f"{name!r} is not one of {', '.join(STRATEGIES)}")
    return value


def _settle(engines_dir: str | None, config_path: str | None, backend: str | None):
    """(opened engine folder or None, config), with the backend/device checked runnable here; no build."""
    from .assembly.load import check_runnable, open_folder
    opened = open_folder(engines_dir, backend) if engines_dir else None
    cfg = opened[1] if opened else load_config(config_path).with_backend(backend)
    check_runnable(cfg)
    return opened, cfg


def _engines(engines_dir: str | None, opened, cfg, log):
    """(folder, opened): the given engine folder, or the config's cached one (built on first use)."""
    from .assembly.cache import engines_for_config
    from .assembly.load import open_folder
    folder = Path(engines_dir) if engines_dir else engines_for_config(cfg, log=log)
    return folder, opened or open_folder(folder, None, cfg)


@main.command()
@click.option("--engines", "engines_dir", type=click.Path(), default=None, help="Engine folder from `trtspec build`.")
@click.option("--config", "config_path", default=None,
              help="Config to build (once, into the cache) and serve. Default: the Qwen2.5-Coder 1.5B/0.5B pair.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 for every interface: then set --api-key).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0 = any free port.")
@click.option("--max-batch", type=click.IntRange(1, 256), default=None,
              help="Requests served at once (KV slots; one target forward verifies all their trees). "
                   "Default: the config's slots.")
@click.option("--max-queue", type=click.IntRange(0), default=64, show_default=True,
              help="Requests waiting for a slot before new ones get 429 Too Many Requests.")
@click.option("--api-key", envvar="TRTSPEC_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on every endpoint but /health (env TRTSPEC_API_KEY).")
@click.option("--model-name", default=None, help="The model id clients send. Default: the config's name.")
@click.option("--strategy", type=click.Choice(list(STRATEGIES)), default=None,
              help="For requests that name none (a client picks with extra_body={'speculative': {'strategy': "
                   "...}}). Default: the config's.")
@click.option("--allow-strategies", default=None, metavar="LIST",
              help="Strategies clients may choose, comma-separated (e.g. ar,ngram: a client cannot pick a "
                   "tree that costs the batch more than it gains). Default: all.")
@click.option("--timeout", type=click.FloatRange(0, min_open=True), default=None,
              help="Deadline per request, seconds (a client may ask for a shorter one: extra_body={'timeout': s}).")
@click.option("--max-body-mb", type=click.FloatRange(0, min_open=True), default=4.0, show_default=True,
              help="Largest request body, MiB: a larger one gets 413 before it is read or parsed.")
@click.option("--body-timeout", type=click.FloatRange(0, min_open=True), default=30.0, show_default=True,
              help="Seconds a request's body may take to arrive (408 after; a slow client never holds a slot).")
@click.option("--history", type=click.Choice(["shared", "user", "off"]), default="shared", show_default=True,
              help="What suffix drafts (suffix, staged) learn from: every finished request (shared: the "
                   "config's scope), only the same OpenAI `user`'s (user: one trie per user, the 64 most "
                   "recent kept), or a request's own tokens (off). Outputs never change; speed can hint "
                   "whether a text resembles others', so serve untrusted tenants with user or off.")
@click.option("--prefix-cache", type=click.IntRange(0), default=None, metavar="TOKENS",
              help="Prompt tokens per model kept across requests, so a shared system prompt or earlier chat "
                   "turns are not computed again (0 = off). Default: the config's prefix_cache, else max_seq_len.")
@click.option("--drain-timeout", type=click.FloatRange(0), default=30.0, show_default=True,
              help="On SIGTERM / Ctrl-C: seconds running requests get to finish before they are cancelled.")
@click.option("--backend", type=click.Choice(BACKENDS), default=None,
              help="Default: the backend the engine folder was built for (--engines) or the config's.")
@click.option("--threads", type=click.IntRange(0), default=None, help="CPU threads (0 = library default).")
@click.option("--log-level", type=click.Choice(["warning", "info", "debug"]), default="warning", show_default=True,
              help="uvicorn's log level (info adds an access log line per request).")
@click.option("--replicas", type=click.IntRange(1), default=None,
              help="Serve on Ray Serve with N engine replicas, each loading the folder with its own scheduler "
                   "and slots (needs `pip install 'trtspec[ray]'`); --threads is then per replica. Default: "
                   "one process, no Ray.")
@click.option("--min-replicas", type=click.IntRange(0), default=None,
              help="With --max-replicas: autoscale (Ray Serve) between them on ongoing requests per replica.")
@click.option("--max-replicas", type=click.IntRange(1), default=None, help="See --min-replicas.")
@click.option("--target-ongoing-requests", type=click.FloatRange(0, min_open=True), default=None,
              help="Autoscaling: ongoing requests per replica to aim at. Default: a replica's slots (--max-batch).")
@click.option("--ray-address", default=None, metavar="ADDR",
              help="Join this Ray cluster (e.g. auto, or HOST:6379 from `ray start --head`) instead of starting a "
                   "local Ray instance for the command; the engine folder must be at the same path on every node.")
@user_errors
def serve(engines_dir, config_path, host, port, max_batch, max_queue, api_key, model_name, strategy,
          allow_strategies, timeout, max_body_mb, body_timeout, history, prefix_cache, drain_timeout, backend,
          threads, log_level, replicas, min_replicas, max_replicas, target_ongoing_requests, ray_address) -> None:
    """Serve the engines over an OpenAI-compatible HTTP API (completions, chat, streaming).

    \b
      trtspec serve --config smollm2-135m --port 8000
      curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
           -d '{"model": "smollm2-135m", "prompt": "def fib(n):", "max_tokens": 64, "temperature": 0}'

    Every request is lossless whatever shares its batch. Speculation per request (extensions, e.g.
    the openai client's extra_body): {"speculative": {"strategy": "staged", "stats": true}, "top_k": 40}.
    /metrics is Prometheus text; /health answers without the API key.

    \b
    On Ray Serve (replicas restarted when they die, autoscaled on load, one endpoint; docs/ray.md):
      trtspec serve --config smollm2-135m --replicas 2 --threads 1
      trtspec serve --engines /shared/engines/pair --min-replicas 1 --max-replicas 8 --ray-address auto"""
    from .assembly.load import load_generator
    from .runtime.strategies import strategy as make
    from .serve.app import Service
    from .serve.server import bind
    from .serve.server import serve as run_server
    from .serve.worker import Worker

    if engines_dir and config_path:
        raise click.UsageError("give --engines DIR or --config PATH, not both")
    log = functools.partial(click.echo, err=True)
    opened, cfg = _settle(engines_dir, config_path, backend)
    name = strategy or cfg.strategy
    allowed = tuple(dict.fromkeys(s.strip() for s in allow_strategies.split(","))) if allow_strategies else tuple(
        s for s in STRATEGIES if cfg.draft is not None or not STRATEGIES[s].needs_draft)
    for s in allowed:
        if s not in STRATEGIES:
            raise click.UsageError(f"--allow-strategies: unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}")
    if name not in allowed:
        raise click.UsageError(f"the default strategy {name!r} is not in --allow-strategies {','.join(allowed)}")
    for s in dict.fromkeys((name, *allowed)):
        make(s, cfg.strategies, **cfg.runs_with())
    on_ray = replicas is not None or min_replicas is not None or max_replicas is not None or ray_address is not None
    if on_ray:
        if min_replicas is not None and max_replicas is not None and min_replicas > max_replicas:
            raise click.UsageError(f"--min-replicas {min_replicas} is more than --max-replicas {max_replicas}")
        if ray_address is None:      # a local instance: Ray's own servers on loopback only (as Ray does on macOS)
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        try:
            from .serve.ray_serve import Settings
            from .serve.ray_serve import run as run_on_ray
        except ImportError as e:
            raise TrtspecError(f"--replicas / --ray-address need Ray Serve ({e.name} is not installed): "
                               "pip install 'trtspec[ray]'") from None
    sock = bind(host, port)
    folder, opened = _engines(engines_dir, opened, cfg, log)
    if on_ray:
        port = sock.getsockname()[1]             # --port 0: the free port found; Ray's proxy listens on it
        sock.close()
        settings = Settings(engines=str(Path(folder).resolve()), model=model_name or cfg.name, backend=backend,
                            threads=threads or 1, max_batch=max_batch, max_queue=max_queue, prefix_cache=prefix_cache,
                            strategy=name, allowed=allowed, timeout=timeout, history=history, api_key=api_key,
                            max_body=int(max_body_mb * (1 << 20)), body_timeout=body_timeout,
                            drain_timeout=drain_timeout, replicas=replicas or 1, min_replicas=min_replicas,
                            max_replicas=max_replicas, target_ongoing=target_ongoing_requests)
        return run_on_ray(settings, host, port, ray_address, log)
    log(f"loading {folder}")
    gen = load_generator(folder, threads=threads, opened=opened, slots=max_batch, max_queue=max_queue,
                         prefix_cache=prefix_cache)
    with gen:                                    # closed after the drain, or if serving fails
        worker = Worker(gen, strategy=name, allowed=allowed, timeout=timeout, history=history)
        svc = Service(worker, model=model_name or cfg.name, api_key=api_key, backend=gen.backend,
                      max_body=int(max_body_mb * (1 << 20)), body_timeout=body_timeout)
        run_server(svc, sock, drain_timeout, log, log_level)


def _render_tree(result, step: int, tok, path: str, strategy: str) -> None:
    from .tools.render_tree import render_tree
    if step >= len(result.steps):
        raise click.UsageError(f"--tree-step {step}: the run only had {len(result.steps)} target steps")
    render_tree(result.steps[step].extra["tree"], path, decode=lambda t: tok.decode([t]),
                title=f"{strategy}: target step {step}")
    click.echo(f"tree of step {step} written to {path}", err=True)


if __name__ == "__main__":
    main()
