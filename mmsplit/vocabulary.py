"""Whether two services mean the same tokens by the same ids.

The tokenizer sends the scheduler token ids, never text: a scheduler that
loaded another model's vocabulary would take every request and generate
from ids that name other tokens, with no error anywhere. Where the two
models differ in their multimodal rules too (placeholder token, image
size), the scheduler's own checks refuse each request; where only the
vocabulary differs (two checkpoints of one architecture with the same
vocabulary size and different tokenizers, a Service pointed at the wrong
group), nothing would. So each service publishes a digest of its
vocabulary (`ServerInfo.vocabulary`), and the tokenizer sends nothing to a
scheduler whose digest differs from its own.

The digest covers the vocabulary only (every token and its id, added
tokens included), not config.json or the tokenizer's files: a quantized
copy of a checkpoint, or its tokenizer files saved again by another
version of transformers, still pair; a different tokenizer does not.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)


def digest(vocab: Mapping[str, int]) -> str:
    """Hex digest of a vocabulary: its (token, id) pairs in id order, each
    token's UTF-8 bytes (surrogates kept as they are) and its id."""
    h = hashlib.blake2b(digest_size=16)
    for token, token_id in sorted(vocab.items(), key=lambda pair: (pair[1], pair[0])):
        h.update(b"%d\0" % token_id)
        h.update(token.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def of_checkpoint(model_dir: Path) -> str:
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

            return digest(Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True))
        from transformers import AutoTokenizer

        return digest(AutoTokenizer.from_pretrained(model_dir).get_vocab())
    except Exception as exc:  # unreadable, malformed, or no tokenizer class fits
        log.warning("no tokenizer loads from %s (%s): this server publishes no vocabulary digest", model_dir, exc)
        return ""
