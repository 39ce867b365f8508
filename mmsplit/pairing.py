"""Whether a tokenizer and a scheduler serve one model, as far as what
passes between them goes: token ids, and items of pixel tensors with their
placeholder runs.

The tokenizer sends the scheduler token ids, never text: a scheduler that
loaded another model's vocabulary would take every request and generate
from ids that name other tokens, with no error anywhere (two checkpoints
of one architecture with the same vocabulary size and different
tokenizers, a Service pointed at the wrong group). And a scheduler of
another family (LLaVA-NeXT behind a LLaVA-1.5 tokenizer), or of the same
family with another vision config, refuses every request with an image as
INVALID_REQUEST, which blames the client for a deployment's mistake.

So each service publishes two digests in `ServerInfo`, and the tokenizer
sends nothing to a scheduler whose digests differ from its own; it also
sends its digests with each request (`METADATA`), and the scheduler refuses
one whose digests differ from its own (SCHEDULER_UNAVAILABLE: the tokenizer
tries another backend):

- `vocabulary`: the vocabulary only (every token and its id, added tokens
  included), not config.json nor the bytes of the tokenizer's files: a
  quantized copy of a checkpoint, or its tokenizer files saved again by
  another version of transformers, still pair; another tokenizer does not.
- `item_rules`: the family's rules for items (`Family.rules`): its name,
  placeholder tokens, the tensors an item carries, and the config values
  a placeholder count follows from.

A digest a server does not publish (an older one; a scheduler whose
checkpoint has no tokenizer files) is not compared: that pairing is taken
on trust, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mmsplit.common.v1 import common_pb2

if TYPE_CHECKING:  # the servers' own package; this module ships in the light client
    from mmsplit_server.families import Family

log = logging.getLogger(__name__)


# The request metadata a tokenizer sends its digests in: the scheduler checks
# each request too, which closes the moment between a scheduler's replacement
# by another model's and the tokenizer's next look at it (2 s).
METADATA = ("mmsplit-vocabulary", "mmsplit-item-rules")


@dataclass(frozen=True)
class Pairing:
    """A server's two digests ("" where it publishes none)."""

    vocabulary: str = ""
    item_rules: str = ""

    @classmethod
    def of(cls, info: common_pb2.ServerInfo) -> Pairing:
        return cls(info.vocabulary, info.item_rules)

    @classmethod
    def from_metadata(cls, metadata: Sequence[tuple[str, str | bytes]] | None) -> Pairing:
        """The digests a caller sent with its request (`metadata`)."""
        got = {key: value for key, value in metadata or () if key in METADATA and isinstance(value, str)}
        return cls(got.get(METADATA[0], ""), got.get(METADATA[1], ""))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Request metadata that carries these digests (the ones there are)."""
        return tuple(
            (key, value) for key, value in zip(METADATA, (self.vocabulary, self.item_rules), strict=True) if value
        )

    def differences(self, theirs: Pairing) -> list[str]:
        """What differs between ours and theirs, in words (empty: nothing
        that both publish)."""
        return [name for name, ours, other in self._beside(theirs) if ours and other and ours != other]

    def unpublished(self, theirs: Pairing) -> list[str]:
        """The digests we have that they do not publish, in words."""
        return [name for name, ours, other in self._beside(theirs) if ours and not other]

    def _beside(self, theirs: Pairing) -> list[tuple[str, str, str]]:
        return [
            ("vocabulary", self.vocabulary, theirs.vocabulary),
            ("rules for images and videos", self.item_rules, theirs.item_rules),
        ]


# A server that publishes no digest (trusted, see the module's docstring).
UNKNOWN = Pairing()


def of_checkpoint(model_dir: Path, family: Family) -> Pairing:
    """This server's digests: of the vocabulary in `model_dir`, and of its family's rules."""
    return Pairing(vocabulary(model_dir), item_rules(family))


def item_rules(family: Family) -> str:
    """Hex digest of `family.rules()`."""
    canonical = json.dumps(family.rules(), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


def vocabulary_digest(vocab: Mapping[str, int]) -> str:
    """Hex digest of a vocabulary: its (token, id) pairs in id order, each
    token's UTF-8 bytes (surrogates kept as they are) and its id."""
    h = hashlib.blake2b(digest_size=16)
    for token, token_id in sorted(vocab.items(), key=lambda pair: (pair[1], pair[0])):
        h.update(b"%d\0" % token_id)
        h.update(token.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def vocabulary(model_dir: Path) -> str:
    """The digest of the vocabulary in `model_dir`: as its tokenizer.json
    lists it, added tokens included (0.1 s: the `tokenizers` library alone),
    else as transformers loads it (seconds: a checkpoint with only a
    SentencePiece model, say); "" when no tokenizer loads from it (a
    scheduler's checkpoint may ship without one: it is then paired on trust,
    and says so). Both services call this on their own directory."""
    path = model_dir / "tokenizer.json"
    try:
        if path.is_file():
            from tokenizers import Tokenizer

            return vocabulary_digest(Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True))
        from transformers import AutoTokenizer

        return vocabulary_digest(AutoTokenizer.from_pretrained(model_dir).get_vocab())
    except Exception as exc:  # unreadable, malformed, or no tokenizer class fits
        log.warning("no tokenizer loads from %s (%s): this server publishes no vocabulary digest", model_dir, exc)
        return ""
