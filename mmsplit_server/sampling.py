"""Sampling parameters: the contract's limits, checked the same way at both
services (the proto comments of `SamplingParams` document them).

`Sampling.from_pb` turns a `SamplingParams` message into a validated, plain,
picklable value or raises `InvalidSampling` (INVALID_REQUEST) naming the
field. The tokenizer checks what it can know (it has no vocabulary size of
the scheduler's model and leaves max_tokens 0 to the scheduler's default);
the scheduler checks everything again, because direct clients exist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mmsplit.common.v1 import common_pb2
from mmsplit.errors import E, MmsplitError
from mmsplit_server import structured

MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 100.0
MAX_STOP_TOKEN_IDS = 32
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 128
MAX_TOP_LOGPROBS = 20
MAX_PENALTY = 2.0  # presence and frequency: [-2, 2], as OpenAI's; repetition: (0, 2], as vLLM's
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ALLOWED_TOKEN_IDS = 262_144
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 128
# What the tokenizer makes of them (scheduler GenerateRequest.bad_words):
# a word's token ids alone and, at most, after a space; each at most this long.
MAX_BAD_WORD_SEQUENCES = 2 * MAX_BAD_WORDS
MAX_BAD_WORD_TOKENS = 64


class InvalidSampling(MmsplitError):
    """A sampling parameter is outside the contract's limits (client, not
    retriable). Every message starts with the field it is about
    ("sampling.temperature ..."), which the error names as its "param"."""

    code = E.ERROR_CODE_INVALID_REQUEST

    def __init__(self, message: str) -> None:
        super().__init__(message, metadata={"param": message.split(" ", 1)[0].rstrip(":")})


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), by id
    # Structured output (mmsplit_server.structured): what the text must match, or None.
    structure: structured.Spec | None = None
    min_p: float = 0.0
    ignore_eos: bool = False
    # The prompt tokens' log probabilities with this many alternatives each, or None.
    prompt_logprobs: int | None = None
    # The only tokens that may be drawn, sorted; () for any.
    allowed_token_ids: tuple[int, ...] = ()
    # Words never generated (the tokenizer service turns them into token ids).
    bad_words: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether logit_bias or a penalty changes this request's logits."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )

    @classmethod
    def from_pb(
        cls,
        pb: common_pb2.SamplingParams,
        *,
        max_tokens_limit: int,
        default_max_tokens: int = 0,
        vocab_size: int | None = None,
    ) -> Sampling:
        """Validate `pb`. `default_max_tokens` replaces a max_tokens of 0
        (the tokenizer passes 0 and keeps it 0); `vocab_size` None skips the
        checks that need the model's vocabulary."""
        max_tokens = pb.max_tokens or default_max_tokens
        if max_tokens > max_tokens_limit:
            raise InvalidSampling(f"sampling.max_tokens {max_tokens} is over the limit {max_tokens_limit}")

        temperature = pb.temperature
        if not math.isfinite(temperature) or not (
            temperature == 0.0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE
        ):
            raise InvalidSampling(
                f"sampling.temperature {temperature!r} must be 0 (greedy) or within "
                f"[{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}]"
            )

        top_p = pb.top_p if pb.HasField("top_p") else 1.0
        if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
            raise InvalidSampling(f"sampling.top_p {top_p!r} must be within (0, 1]")

        if max_tokens and pb.min_tokens > max_tokens:
            raise InvalidSampling(f"sampling.min_tokens {pb.min_tokens} is over max_tokens {max_tokens}")
        if pb.min_tokens > max_tokens_limit:
            raise InvalidSampling(f"sampling.min_tokens {pb.min_tokens} is over the limit {max_tokens_limit}")

        stop_ids = tuple(int(t) for t in pb.stop_token_ids)
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidSampling(f"sampling.stop_token_ids has {len(stop_ids)} ids, at most {MAX_STOP_TOKEN_IDS}")
        if vocab_size is not None and stop_ids and max(stop_ids) >= vocab_size:
            raise InvalidSampling(f"sampling.stop_token_ids: {max(stop_ids)} is outside the vocabulary of {vocab_size}")

        stop = tuple(pb.stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidSampling(f"sampling.stop has {len(stop)} strings, at most {MAX_STOP_STRINGS}")
        if any(not 1 <= len(s) <= MAX_STOP_CHARS for s in stop):
            raise InvalidSampling(f"sampling.stop: each string must have 1 to {MAX_STOP_CHARS} characters")

        if pb.top_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidSampling(f"sampling.top_logprobs {pb.top_logprobs} is over the limit {MAX_TOP_LOGPROBS}")
        if pb.top_logprobs and not pb.logprobs:
            raise InvalidSampling("sampling.top_logprobs needs logprobs")

        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(pb, name)
            if not math.isfinite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidSampling(f"sampling.{name} {value!r} must be within [{-MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        repetition = pb.repetition_penalty or 1.0
        if not math.isfinite(repetition) or not 0.0 < repetition <= MAX_PENALTY:
            raise InvalidSampling(
                f"sampling.repetition_penalty {repetition!r} must be within (0, {MAX_PENALTY:g}] (1: off)"
            )
        if not math.isfinite(pb.min_p) or not 0.0 <= pb.min_p <= 1.0:
            raise InvalidSampling(f"sampling.min_p {pb.min_p!r} must be within [0, 1]")
        prompt_logprobs = pb.prompt_logprobs if pb.HasField("prompt_logprobs") else None
        if prompt_logprobs is not None and prompt_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidSampling(f"sampling.prompt_logprobs {prompt_logprobs} is over the limit {MAX_TOP_LOGPROBS}")
        bias = _logit_bias(pb, vocab_size)
        allowed = _allowed(pb, vocab_size)
        bad_words = tuple(pb.bad_words)
        if len(bad_words) > MAX_BAD_WORDS:
            raise InvalidSampling(f"sampling.bad_words has {len(bad_words)} words, at most {MAX_BAD_WORDS}")
        if any(not 1 <= len(w.strip()) <= MAX_BAD_WORD_CHARS for w in bad_words):
            raise InvalidSampling(
                f"sampling.bad_words: each word must have 1 to {MAX_BAD_WORD_CHARS} characters besides spaces"
            )
        structure = _structure(pb)
        if structure is not None and pb.ignore_eos:
            raise InvalidSampling(
                f"sampling.ignore_eos cannot go with sampling.{structure[0]} (the structure ends at EOS)"
            )

        return cls(
            max_tokens=max_tokens,
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=int(pb.top_k),
            seed=int(pb.seed),
            min_tokens=int(pb.min_tokens),
            stop_token_ids=stop_ids,
            stop=stop,
            logprobs=bool(pb.logprobs),
            top_logprobs=int(pb.top_logprobs),
            presence_penalty=float(pb.presence_penalty),
            frequency_penalty=float(pb.frequency_penalty),
            repetition_penalty=float(repetition),
            logit_bias=bias,
            structure=structure,
            min_p=float(pb.min_p),
            ignore_eos=bool(pb.ignore_eos),
            prompt_logprobs=prompt_logprobs,
            allowed_token_ids=allowed,
            bad_words=bad_words,
        )


def _structure(pb: common_pb2.SamplingParams) -> structured.Spec | None:
    """json_schema, regex, choice or grammar (at most one), compiled."""
    try:
        structure = structured.of(pb)
    except ValueError as exc:
        raise InvalidSampling(str(exc)) from None
    if structure is None:
        return None
    field = structure[0]
    if pb.min_tokens:
        raise InvalidSampling(f"sampling.{field} cannot go with min_tokens (the structure decides the end)")
    try:
        structured.grammar(structure)
    except ValueError as exc:
        raise InvalidSampling(f"sampling.{field} {exc}") from None
    return structure


def _allowed(pb: common_pb2.SamplingParams, vocab_size: int | None) -> tuple[int, ...]:
    count = len(pb.allowed_token_ids)
    if count > MAX_ALLOWED_TOKEN_IDS:
        raise InvalidSampling(f"sampling.allowed_token_ids has {count} ids, at most {MAX_ALLOWED_TOKEN_IDS}")
    allowed = tuple(sorted(set(pb.allowed_token_ids)))
    if vocab_size is not None and allowed and allowed[-1] >= vocab_size:
        raise InvalidSampling(f"sampling.allowed_token_ids: {allowed[-1]} is outside the vocabulary of {vocab_size}")
    return allowed


def _logit_bias(pb: common_pb2.SamplingParams, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    if len(pb.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidSampling(f"sampling.logit_bias has {len(pb.logit_bias)} entries, at most {MAX_LOGIT_BIAS_ENTRIES}")
    for token, bias in pb.logit_bias.items():
        if not math.isfinite(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidSampling(
                f"sampling.logit_bias: {bias!r} for token {token} must be within "
                f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            )
        if vocab_size is not None and token >= vocab_size:
            raise InvalidSampling(f"sampling.logit_bias: {token} is outside the vocabulary of {vocab_size}")
    return tuple(sorted((int(t), float(b)) for t, b in pb.logit_bias.items()))
