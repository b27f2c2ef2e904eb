"""Regenerate trtspec/assets/tiny-tokenizer: a 512-token byte-level BPE for the tiny random models.

Trained on the Python standard library's own source of a few modules (shipped with every Python),
so the tokenizer is real (it splits code the way a BPE does) yet small enough for vocab-512 models.
Run: python -m lab.make_tiny_tokenizer
"""
from __future__ import annotations

import inspect
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "assets" / "tiny-tokenizer"


def main() -> None:
    import argparse, collections, dataclasses, functools, json  # noqa: E401  corpus modules
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [inspect.getsource(m) for m in (argparse, collections, dataclasses, functools, json)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    OUT.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(OUT)
    print(f"wrote {OUT} ({tok.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
