"""ONNX Runtime GenAI as a peer (`bench --peers ortgenai`): the same engine as ours, with its own
model builder and generation loop.

Its builder takes a Hugging Face folder (or an fp16/fp32 GGUF, not the Q4_K_M files the model packs
ship), so the peer writes the engine folder's own target weights out as one
(`hf_peers.hf_model_from_engine`: the weights our target runs), builds it with the builder's CPU
defaults (`ortgenai`: `-p int4 -e cpu`, MatMulNBits weights; `ortgenai-fp32`: the same weights as
ours, unquantized), and deletes the copy. The built model lives in a
temporary folder that closing the peer removes: nothing is left on disk. Decoding runs exactly
`max_new_tokens` (min_length = max_length, so stop tokens never end it), greedy unless a
temperature is given (then sampled from the whole vocabulary: top-k = its size, top-p 1), with ONNX
Runtime's intra-op threads set to bench's `--threads`.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import RequestError

PEERS = ("ortgenai", "ortgenai-fp32")
PRECISION = {"ortgenai": "int4",            # the builder's weight-only int4 for the CPU (its defaults otherwise)
             "ortgenai-fp32": "fp32"}       # our target's own weights, unquantized: the same model as ours


def _genai():
    try:
        import onnxruntime_genai
    except ImportError:
        raise RequestError("the ortgenai peers need ONNX Runtime GenAI: pip install onnxruntime-genai") from None
    return onnxruntime_genai


class OrtGenAIPeers:
    """The target of an engine folder built by ONNX Runtime GenAI's builder, once per asked peer
    (precision); `run(peer, ids, ...)` like HFPeers."""

    def __init__(self, folder: Path, peers: list[str], threads: int, log_dir: Path):
        og = _genai()
        bad = [p for p in peers if p not in PEERS]
        if bad:
            raise RequestError(f"unknown peer(s) {bad}; choose from {', '.join(PEERS)}")
        self.og, self.threads = og, threads
        self.version = getattr(og, "__version__", None)
        spec = json.loads((Path(folder) / "manifest.json").read_text())["models"]["target"]["spec"]
        self.vocab = int(spec["vocab_size"])        # sampling: top-k over the whole vocabulary (no filter)
        self.models: dict = {}
        self.build_seconds: dict[str, float] = {}
        self.tmp = tempfile.TemporaryDirectory(prefix="trtspec-ortgenai-")
        try:
            from tqdm import tqdm
            tmp = Path(self.tmp.name)
            with tqdm(total=1 + len(peers), desc="ortgenai peers", unit="stage") as bar:
                bar.set_postfix_str("export the target's weights")
                hf = self._export(Path(folder), tmp / "hf")
                bar.update()
                log_dir.mkdir(parents=True, exist_ok=True)
                for peer in peers:
                    bar.set_postfix_str(f"build {peer} (-p {PRECISION[peer]})")
                    out = tmp / peer
                    self.build_seconds[peer] = self._build(hf, out, PRECISION[peer], tmp / "cache",
                                                           log_dir / f"{peer}-build.log")
                    config = og.Config(str(out))
                    config.clear_providers()             # the CPU
                    self.models[peer] = og.Model(config)
                    bar.update()
            shutil.rmtree(hf, ignore_errors=True)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _export(folder: Path, hf: Path) -> Path:
        """The folder's target weights (fp32) and tokenizer as a Hugging Face folder."""
        import torch

        from .hf_peers import hf_model_from_engine
        model = hf_model_from_engine(folder, "target", dtype=torch.float32)
        model.save_pretrained(hf)
        del model
        for f in (folder / "tokenizer").iterdir():
            shutil.copy(f, hf / f.name)
        return hf

    def _build(self, hf: Path, out: Path, precision: str, cache: Path, log: Path) -> float:
        t0 = time.perf_counter()
        with log.open("w") as fh:
            done = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
                                   "-p", precision, "-e", "cpu", "-c", str(cache)],
                                  stdout=fh, stderr=subprocess.STDOUT, check=False)
        seconds = time.perf_counter() - t0
        shutil.rmtree(cache, ignore_errors=True)
        if done.returncode != 0:
            raise RequestError(f"ONNX Runtime GenAI's builder failed (exit {done.returncode}); see {log}")
        cfg_path = out / "genai_config.json"                 # ORT's intra-op threads: bench's --threads
        cfg = json.loads(cfg_path.read_text())
        cfg["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = self.threads
        cfg_path.write_text(json.dumps(cfg, indent=2))
        return seconds

    def settings(self) -> dict:
        return {"version": self.version, "threads": self.threads,
                "build": {p: f"python -m onnxruntime_genai.models.builder -p {PRECISION[p]} -e cpu, from the folder's "
                             f"fp32 target weights ({s:.0f} s)" for p, s in self.build_seconds.items()},
                "tokens_per_s": "wall time of append_tokens (prefill) and the generate_next_token loop",
                "eos": "disabled (min_length = max_length)"}

    def run(self, peer: str, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
            seed: int = 0) -> tuple[list[int], dict]:
        og = self.og
        model = self.models[peer]
        params = og.GeneratorParams(model)
        length = len(prompt_ids) + max_new_tokens
        search = {"max_length": length, "min_length": length, "do_sample": temperature > 0}
        if temperature > 0:
            search.update(temperature=temperature, top_k=self.vocab, top_p=1.0, random_seed=seed)
        params.set_search_options(**search)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(list(prompt_ids))                  # the prompt's forward
        t1 = time.perf_counter()
        while not gen.is_done():
            gen.generate_next_token()
        seconds = time.perf_counter() - t0
        tokens = [int(t) for t in gen.get_sequence(0)[len(prompt_ids):]]
        del gen
        if len(tokens) != max_new_tokens:
            raise RequestError(f"ortgenai returned {len(tokens)} tokens, not the {max_new_tokens} asked")
        return tokens, {
            "new_tokens": len(tokens), "seconds": seconds,
            "tokens_per_s": len(tokens) / seconds if seconds > 0 else 0.0,
            "target_steps": max_new_tokens, "mean_accepted": 1.0,
            "draft_seconds": 0.0, "verify_seconds": seconds - (t1 - t0), "prefill_seconds": t1 - t0,
            "draft_forwards": 0, "draft_tokens": 0,
        }

    def close(self) -> None:
        self.models = {}
        if getattr(self, "tmp", None) is not None:
            self.tmp.cleanup()
            self.tmp = None
