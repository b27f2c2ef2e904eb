"""Perplexity of an engine folder's target over a text file, the way `llama-perplexity` computes it,
and (with `--llama-perplexity`) llama.cpp's own number on the same file in the same run.

    python -m trtspec.tools.perplexity --engines DIR --file TEXT [--ctx 512] [--chunks 16]
                                       [--llama-perplexity [BIN]] [--json OUT]

The text is tokenized once (with a BOS only where the tokenizer adds one, as llama.cpp does where the
GGUF asks: Qwen's adds none), cut into windows of `--ctx` tokens (each one's first token replaced by
the BOS, if there is one), and each window is run alone from an empty
cache in the engine's own prefill chunks; the first half of a window is context only, and every
later token's negative log-likelihood under the logits before it is summed (in fp64). PPL =
exp(mean NLL), with llama-perplexity's error estimate. This is llama-perplexity's method
(tools/perplexity in llama.cpp), so the two numbers compare the same tokens under the same rule.

`--llama-perplexity` runs that binary (default: beside `make llama-cpp`'s llama-server) on the
target's GGUF file with the same --ctx, --chunks, threads and batch size, and prints both; with
llama-tokenize beside it, it also says whether llama.cpp's tokens of the file are ours.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import click
import torch

from ..errors import TrtspecError
from ..options import PREFILL_CHUNK

LLAMA_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def windows(ids: list[int], ctx: int, chunks: int | None, bos: int | None = None) -> list[list[int]]:
    """llama-perplexity's windows: consecutive, non-overlapping, `ctx` tokens each, the tail dropped;
    with a `bos`, each window's first token is replaced by it."""
    n = len(ids) // ctx if chunks is None else min(chunks, len(ids) // ctx)
    return [([bos] if bos is not None else ids[i * ctx:i * ctx + 1]) + ids[i * ctx + 1:(i + 1) * ctx] for i in range(n)]


def tokenize(tok, text: str) -> tuple[list[int], int | None]:
    """The text's ids as llama.cpp's common_tokenize(text, add_special=true) gives them, and the BOS id
    if the tokenizer adds one (Qwen's adds none)."""
    plain, special = tok(text, add_special_tokens=False)["input_ids"], tok(text)["input_ids"]
    bos = tok.bos_token_id if len(special) > len(plain) and special[0] == tok.bos_token_id else None
    return special, bos


def window_nll(logits: torch.Tensor, ids: list[int]) -> tuple[float, float, int]:
    """(sum of NLL, sum of NLL^2, count) over a window's second half: logits[j] predicts ids[j + 1]
    for j in [ctx/2, ctx - 1)."""
    first = len(ids) // 2
    logp = torch.log_softmax(logits[first:len(ids) - 1].double(), -1)
    nll = -logp.gather(1, torch.tensor(ids[first + 1:]).unsqueeze(1)).squeeze(1)
    return float(nll.sum()), float((nll * nll).sum()), nll.numel()


def estimate(nll: float, nll2: float, count: int) -> tuple[float, float]:
    """(PPL, its error) as llama-perplexity prints them."""
    mean, mean2 = nll / count, nll2 / count
    err = math.sqrt(max(mean2 - mean * mean, 0.0) / max(count - 1, 1))
    ppl = math.exp(mean)
    return ppl, ppl * err


def engine_perplexity(runner, parts: list[list[int]], progress=None) -> dict:
    from ..runtime.effects import drive
    total = [0.0, 0.0, 0]
    for ids in parts:
        runner.reset()
        rows = []
        for i in range(0, len(ids), PREFILL_CHUNK):  # the prefill's own chunks, every row's logits kept
            part = ids[i:i + PREFILL_CHUNK]
            rows.append(drive(runner.extend(part, last_only=False, phase="prefill")).float().cpu())
            runner.cache.commit(range(len(part)))
        for k, v in enumerate(window_nll(torch.cat(rows), ids)):
            total[k] += v
        if progress:
            progress()
    ppl, err = estimate(*total)
    return {"ppl": ppl, "err": err, "tokens_scored": total[2]}


def find_llama_perplexity(given: str | None) -> Path:
    if given:
        if not Path(given).is_file():
            raise TrtspecError(f"--llama-perplexity {given} is not a file; point it at a llama-perplexity binary "
                               "or leave the value out to use the one `make llama-cpp` builds")
        return Path(given)
    from .llamacpp_peers import BUILD, find_server
    binary = find_server().parent / "llama-perplexity"
    if not binary.is_file():
        raise TrtspecError(f"llama-perplexity is not beside {find_server()}; {BUILD}")
    return binary


def llama_tokens(binary: Path, gguf: Path, text: Path) -> list[int] | None:
    """The file's ids under llama.cpp's tokenizer (llama-tokenize beside `binary`), or None without it."""
    tool = binary.parent / "llama-tokenize"
    if not tool.is_file():
        return None
    done = subprocess.run([str(tool), "-m", str(gguf), "-f", str(text), "--ids", "--log-disable", "--no-escape"],
                          capture_output=True, text=True)
    if done.returncode:
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_perplexity(binary: Path, gguf: Path, text: Path, ctx: int, chunks: int, threads: int) -> dict:
    # --no-escape: score the file as it is (llama.cpp turns a prompt's "\\n" into a newline by default,
    # which would change a source file's tokens)
    args = [str(binary), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "--chunks", str(chunks),
            "-t", str(threads), "-tb", str(threads), "--no-escape"]
    done = subprocess.run(args, capture_output=True, text=True)
    found = LLAMA_FINAL.search(done.stdout + done.stderr)
    if done.returncode or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise TrtspecError(f"llama-perplexity exited {done.returncode} without a final estimate: {tail[0]}")
    return {"ppl": float(found.group(1)), "err": float(found.group(2)), "command": " ".join(args[1:])}


@click.command()
@click.option("--engines", "engines_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="An engine folder; its target is scored.")
@click.option("--file", "text", required=True, type=click.Path(exists=True, dir_okay=False),
              help="The text (UTF-8), e.g. a few Python standard-library sources concatenated.")
@click.option("--ctx", default=512, show_default=True, type=click.IntRange(16),
              help="Tokens per window; the second half of each is scored.")
@click.option("--chunks", default=None, type=click.IntRange(1), help="Windows to score (default: all that fit).")
@click.option("--threads", default=2, show_default=True, type=click.IntRange(1))
@click.option("--llama-perplexity", "llama", is_flag=False, flag_value="", default=None,
              help="Also run llama.cpp's llama-perplexity on the target's GGUF (optional: its path).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write the numbers here.")
def main(engines_dir, text, ctx, chunks, threads, llama, json_out):
    """Perplexity of the folder's target over TEXT, beside llama-perplexity's on the same GGUF."""
    from tqdm import tqdm

    from ..assembly.load import load_role, load_tokenizer, open_folder
    from ..runtime.runner import ModelRunner
    torch.set_num_threads(threads)
    try:
        manifest, cfg, backend = open_folder(engines_dir)
        if ctx > cfg.max_seq_len:
            raise click.BadParameter(f"{ctx} is longer than the folder's max_seq_len {cfg.max_seq_len}",
                                     param_hint="--ctx")
        binary = gguf = None
        if llama is not None:
            from .llamacpp_peers import gguf_sources
            binary, gguf = find_llama_perplexity(llama or None), gguf_sources(cfg.to_dict(), ["llama.cpp"])["target"]
        tok = load_tokenizer(engines_dir, manifest)
        ids, bos = tokenize(tok, Path(text).read_text(encoding="utf-8"))
        parts = windows(ids, ctx, chunks, bos)
        if not parts:
            raise click.BadParameter(f"{text} has {len(ids)} tokens, fewer than one window of {ctx}", param_hint="--file")
        engine = load_role(Path(engines_dir), "target", manifest, cfg, backend, threads)
        try:
            runner = ModelRunner.alone(engine, capacity=ctx)
            with tqdm(total=len(parts), desc="trtspec windows", unit="window", leave=False) as bar:
                ours = engine_perplexity(runner, parts, bar.update)
        finally:
            engine.close()
        out = {"file": str(text), "tokens": len(ids), "ctx": ctx, "windows": len(parts), "threads": threads,
               "trtspec": {"engines": str(engines_dir), "backend": backend, **ours}}
        click.echo(f"trtspec         PPL = {ours['ppl']:.4f} +/- {ours['err']:.5f}  "
                   f"({len(parts)} windows of {ctx}, {ours['tokens_scored']} tokens scored)")
        if binary:
            same = llama_tokens(binary, gguf, Path(text))
            out["same_tokens_as_llama_cpp"] = None if same is None else same == ids
            if same is not None:
                click.echo(f"tokens: {len(ids)} ours, {len(same)} llama.cpp's: "
                           + ("identical" if same == ids else "DIFFERENT (the two numbers score different tokens)"))
            theirs = llama_perplexity(binary, gguf, Path(text), ctx, len(parts), threads)
            out["llama.cpp"] = theirs
            out["relative_difference"] = ours["ppl"] / theirs["ppl"] - 1
            click.echo(f"llama-perplexity PPL = {theirs['ppl']:.4f} +/- {theirs['err']:.5f}  "
                       f"(ours / theirs - 1 = {out['relative_difference']:+.2%})")
    except TrtspecError as e:
        raise click.ClickException(str(e)) from None
    if json_out:
        from ..export.packs import write_atomic
        write_atomic(Path(json_out), json.dumps(out, indent=2) + "\n")     # never a half-written file


if __name__ == "__main__":
    main()
