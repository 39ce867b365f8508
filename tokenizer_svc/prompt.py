"""Prompt text → token ids, with each media marker expanded exactly as the
model's own processor expands it, and the placeholder runs of every item.

Fidelity: the expanded text is tokenized in one call of the tokenizer, the
way transformers' processors do it, so the ids equal the processor's for the
same text and media (tested per family). The expansion rule is the family's
(`mmsplit.families`), the same code the scheduler checks items with.

Control tokens: user text may not contain the text of any special or added
token of the tokenizer (``</s>``, ``<|im_start|>``, ...) except the media
markers, which must then match the media sent. Such text would otherwise be
tokenized into the control token itself; it is refused (INVALID_REQUEST)
rather than silently altered.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mmsplit.families import Family
from tokenizer_svc.errors import InternalError, InvalidRequest


@dataclass(frozen=True)
class Media:
    modality: int
    tokens: int  # placeholders this item fills (the family's rule)


@dataclass(frozen=True)
class BuiltPrompt:
    input_ids: list[int]
    # Per media item, in request order: its placeholder runs (offset, length).
    runs: list[list[tuple[int, int]]]


_NAMES = {1: "image", 2: "video", 3: "audio"}


def _names(modalities: list[int]) -> str:
    return ", ".join(_NAMES.get(m, "?") for m in modalities) or "none"


class PromptBuilder:
    def __init__(self, family: Family, tokenizer: Any) -> None:
        self.family = family
        self.tokenizer = tokenizer
        self.holders = family.placeholders
        markers = {p.token for p in self.holders.values()}
        self._marker_re = re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)))
        self._by_marker = {p.token: m for m, p in self.holders.items()}
        specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
        specials |= {str(t) for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()}
        specials -= markers
        for p in self.holders.values():
            specials -= {p.before, p.after}
        self._control = sorted((s for s in specials if s), key=len, reverse=True)
        wrapped = {p.before + p.token + p.after: p.token for p in self.holders.values() if p.before or p.after}
        self._wrapped = wrapped
        # The vision start/end tokens are allowed only around a marker.
        self._structural = sorted({t for p in self.holders.values() for t in (p.before, p.after) if t})

    def build(self, prompt: str, media: list[Media]) -> BuiltPrompt:
        """`media` in request order (images, then videos); each marker in the
        text takes the next item of its modality."""
        text = prompt
        for whole, marker in self._wrapped.items():
            text = text.replace(whole, marker)
        bare = self._marker_re.sub("", text)
        for token in (*self._control, *self._structural):
            if token in bare:
                raise InvalidRequest(
                    f"the prompt contains {token!r}, a control token of this model; it cannot be sent as text"
                )
        found = [self._by_marker[m] for m in self._marker_re.findall(text)]
        if not found and media:
            # No markers: the images first, then the videos, one per line.
            order = sorted(m.modality for m in media)
            text = "".join(self.holders[m].token + "\n" for m in order) + text
            found = order
        if sorted(found) != sorted(m.modality for m in media):
            raise InvalidRequest(
                f"the prompt's media markers ({_names(found)}) do not match the media sent "
                f"({_names([m.modality for m in media])}); mark each with {' or '.join(sorted(self._by_marker))}, "
                "or use no markers at all"
            )
        # The k-th marker of a modality takes the k-th item of that modality.
        queues = {m: [item for item in media if item.modality == m] for m in set(found)}
        pieces = self._marker_re.split(text)
        expanded = [pieces[0]]
        for modality, piece in zip(found, pieces[1:], strict=True):
            expanded.append(self.holders[modality].expand(queues[modality].pop(0).tokens))
            expanded.append(piece)
        ids: list[int] = list(self.tokenizer("".join(expanded))["input_ids"])
        return BuiltPrompt(ids, self._runs(ids, media))

    def _runs(self, ids: list[int], media: list[Media]) -> list[list[tuple[int, int]]]:
        """Each item's placeholder positions, taken in order per modality, as
        runs (in the order of `media`)."""
        positions: dict[int, list[int]] = {m: [] for m in self.holders}
        by_id = {p.token_id: m for m, p in self.holders.items()}
        for i, token in enumerate(ids):
            if token in by_id:
                positions[by_id[token]].append(i)
        taken = dict.fromkeys(positions, 0)
        runs: list[list[tuple[int, int]]] = []
        for item in media:
            start = taken[item.modality]
            mine = positions[item.modality][start : start + item.tokens]
            taken[item.modality] = start + item.tokens
            if len(mine) != item.tokens:
                raise InternalError("the tokenized prompt lost placeholder tokens")
            item_runs: list[tuple[int, int]] = []
            for p in mine:
                if item_runs and item_runs[-1][0] + item_runs[-1][1] == p:
                    item_runs[-1] = (item_runs[-1][0], item_runs[-1][1] + 1)
                else:
                    item_runs.append((p, 1))
            runs.append(item_runs)
        if any(taken[m] != len(positions[m]) for m in positions):
            raise InternalError("the tokenized prompt has more placeholder tokens than its media")
        return runs
