"""Structured output: a JSON Schema, a regular expression, a list of
choices or a context-free grammar the generated text must match
(`SamplingParams.json_schema`, `regex`, `choice`, `grammar`: a `Spec`),
compiled by llguidance.

Both services compile a request's schema when they check it (`grammar`:
a schema it cannot compile is the client's error; the last 64 schemas'
grammars are kept, so an application sending one schema compiles it once);
rank 0 of the scheduler then gives each such request a `Constraint`, which
says before every step which tokens may come next (a bit per token of the
vocabulary) and follows the tokens drawn. Compiling takes 0.1 ms for a
small schema here, ~19 ms for a 48 KB one of 600 patterned properties, and
making the matcher 0.3 and ~22 ms (bench/structured.py; the 64 KiB cap
bounds both): both services compile off their event loops
(`compile_off_loop`), and rank 0 makes matchers ahead in a thread
(`Grammars`).
Whitespace inside the JSON is off unless the schema's own "x-guidance"
options turn it on: the document is compact, and a model cannot spend its
tokens on blanks.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mmsplit_server import strict_json

MAX_SCHEMA_BYTES = 64 * 1024
# Applied before the schema's own "x-guidance" options.
COMPILE_DEFAULTS = {"whitespace_flexible": False}


# What a request's output must match: (the contract's field, its text):
# ("json_schema", a JSON Schema), ("regex", a pattern), ("choice", a JSON
# list of the strings), ("grammar", Lark or GBNF). `spec` makes one.
Spec = tuple[str, str]
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024


def spec(json_schema: str = "", regex: str = "", choice: Sequence[str] = (), grammar: str = "") -> Spec | None:
    """The structure a request's sampling fields ask for (None: none);
    ValueError, naming the field, when more than one is set or choice is
    out of its bounds."""
    fields = (("json_schema", json_schema), ("regex", regex), ("choice", choice), ("grammar", grammar))
    given = [name for name, value in fields if value]
    if len(given) > 1:
        raise ValueError(f"sampling.{given[1]} cannot go with sampling.{given[0]}: at most one structure")
    if json_schema:
        return "json_schema", json_schema
    if regex:
        return "regex", regex
    if grammar:
        return "grammar", grammar
    if not choice:
        return None
    if len(choice) > MAX_CHOICES or not all(0 < len(c) <= MAX_CHOICE_CHARS for c in choice):
        raise ValueError(f"sampling.choice must be 1 to {MAX_CHOICES} strings of 1 to {MAX_CHOICE_CHARS} characters")
    return "choice", json.dumps(list(choice))


def of(sampling: Any) -> Spec | None:
    """`spec` of the contract's SamplingParams."""
    return spec(sampling.json_schema, sampling.regex, tuple(sampling.choice), sampling.grammar)


def grammar(structure: Spec) -> str:
    """The llguidance grammar of `structure`; ValueError with the reason
    (after the field's name) when it cannot be compiled (or the server
    lacks llguidance: a pinned requirement, but a hand-made environment,
    such as a GPU machine's, may miss it). The last 64 structures'
    outcomes are kept, refusals too: a service that compiled one in a
    thread finds it here on its event loop. One over MAX_SCHEMA_BYTES is
    refused before it is kept: the cache's keys are the texts, and 64 of a
    client's 10 MB schemas would have stayed alive."""
    if len(structure[1].encode()) > MAX_SCHEMA_BYTES:
        raise ValueError(f"is over {MAX_SCHEMA_BYTES} bytes")
    compiled = _compiled(structure)
    if isinstance(compiled, ValueError):
        raise ValueError(str(compiled))
    return compiled


@functools.lru_cache(maxsize=64)
def _compiled(structure: Spec) -> str | ValueError:
    kind, text = structure
    try:
        import llguidance
    except ImportError:
        return ValueError("cannot be honoured: this server lacks the llguidance package")

    if kind == "regex":
        compiled = llguidance.LLMatcher.grammar_from_regex(text)
    elif kind == "choice":
        # Lark's string literals take JSON's escapes.
        compiled = llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in strict_json.loads(text))
        )
    elif kind == "grammar":
        try:
            # Lark as it is; GBNF (`root ::= ...`) converted to Lark first.
            compiled = llguidance.grammar_from("grammar", text)
        except ValueError as exc:
            return ValueError(f"cannot be compiled: {exc}")
    else:
        try:
            schema = strict_json.loads(text)
        except json.JSONDecodeError as exc:
            return ValueError(f"is not JSON ({exc})")
        if not isinstance(schema, dict):
            return ValueError("must be a JSON object (a schema)")
        compiled = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPILE_DEFAULTS)  # type: ignore[arg-type]
    error = llguidance.LLMatcher.validate_grammar(compiled)
    if error:
        return ValueError(f"cannot be compiled: {error}")
    return compiled


async def compile_off_loop(structure: Spec) -> None:
    """Compile `structure` in a thread (22 ms for a 48 KB schema), so that
    `grammar` then finds it on the event loop at once, whatever the
    outcome (a refusal says why there)."""
    if len(structure[1].encode()) <= MAX_SCHEMA_BYTES:  # (`grammar` refuses the others, uncached)
        await asyncio.to_thread(_compiled, structure)


async def ready(sampling: Any) -> None:
    """Before a service checks `sampling` (the contract's SamplingParams)
    on its event loop: the structure it asks for, if any, compiled in a
    thread (`compile_off_loop`), so that the check finds it. Whatever is
    wrong with the fields, the check meets it again and says so."""
    with contextlib.suppress(Exception):
        structure = of(sampling)
        if structure is not None:
            await compile_off_loop(structure)


class Grammars:
    """Rank 0's maker of constraints. A request's matcher is made ahead, in
    a thread of its own, when the scheduler admits it (`prepare`: llguidance
    drops the GIL while it builds one), and taken as the request joins
    (`constraint`), so the step thread does not wait for it (22 ms for a
    48 KB schema, bench/structured.py). The model's tokenizer as llguidance
    needs it is built on the first such request (0.3-1 s), once, in that
    thread too. A request that ends before it joins has its matcher
    forgotten (`forget`); at most `keep` wait to be taken, the oldest pushed
    out beyond that; one not prepared, or pushed out, is made at join."""

    def __init__(self, model_dir: Path, eos_token_ids: frozenset[int], keep: int = 1024) -> None:
        self._model_dir = model_dir
        self._eos = sorted(eos_token_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()  # the prepared matchers
        self._building = threading.Lock()  # the tokenizer, built once (apart: admissions must not wait for it)
        self._keep = keep
        self._prepared: collections.OrderedDict[str, concurrent.futures.Future[Constraint]] = collections.OrderedDict()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # made on first use

    def prepare(self, request_id: str, structure: Spec) -> None:
        """Start making `request_id`'s matcher (from any thread)."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammars")
            self._prepared[request_id] = self._pool.submit(self._make, structure)
            while len(self._prepared) > self._keep:
                self._prepared.popitem(last=False)[1].cancel()

    def forget(self, request_id: str) -> None:
        """`request_id` will not join (cancelled, refused, or failed while
        waiting): its prepared matcher, if any, goes."""
        with self._lock:
            prepared = self._prepared.pop(request_id, None)
        if prepared is not None:
            prepared.cancel()

    def constraint(self, structure: Spec, request_id: str = "") -> Constraint:
        """The matcher prepared for `request_id` (waiting for it if it is
        being made), or one made now; raises what making it raised."""
        with self._lock:
            prepared = self._prepared.pop(request_id, None)
        if prepared is not None and not prepared.cancelled():
            return prepared.result()
        return self._make(structure)

    def _make(self, structure: Spec) -> Constraint:
        import llguidance

        tokenizer = self._llg_tokenizer()
        return Constraint(llguidance.LLMatcher(tokenizer, grammar(structure), log_level=0), tokenizer.vocab_size)

    def _llg_tokenizer(self) -> Any:
        with self._building:
            if self._tokenizer is None:
                import llguidance.hf
                from transformers import AutoTokenizer

                hf = AutoTokenizer.from_pretrained(self._model_dir)
                # A slow (sentencepiece-only) tokenizer raises ValueError here: its requests fail alone.
                self._tokenizer = llguidance.hf.from_tokenizer(hf, eos_token=self._eos or None)  # type: ignore[arg-type]
            return self._tokenizer


class Constraint:
    """One request's matcher: which tokens may come next, and the tokens drawn."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the tokenizer's, as llguidance counts it (its masks' bits)

    def failure(self) -> str | None:
        """Why the row can go no further (its output no longer matches), or None."""
        if self.matcher.is_error():
            return f"the output no longer matches the structure: {self.matcher.get_error()}"
        return None

    def took(self, token: int) -> None:
        """A token drawn (an error, if it did not match, shows at the next `failure`)."""
        self.matcher.consume_token(token)


class Broken:
    """A constraint that could not be made: its row fails at its first token."""

    def __init__(self, message: str) -> None:
        self.message = message

    def failure(self) -> str:
        return self.message

    def took(self, token: int) -> None:
        pass


def banned(rows: Sequence[tuple[int, Constraint]], shape: tuple[int, int]) -> np.ndarray:
    """Which tokens may not come next: a ``shape`` ([rows, vocab]) bool
    array, for each (row index, constraint) in `rows` (none of whose
    matchers failed: `Constraint.failure`) its banned tokens, other rows
    none. llguidance fills the rows' bitmasks at once, in threads of its
    own without the GIL; tokens past the tokenizer's own vocabulary (a
    padded LM head) are banned too. bench/structured.py measures it."""
    import llguidance.numpy

    size = rows[0][1].vocab_size
    bitmask = np.empty((len(rows), (size + 31) // 32), dtype=np.int32)
    llguidance.numpy.fill_next_token_bitmask_par(
        _executor(), [(c.matcher, k) for k, (_, c) in enumerate(rows)], bitmask
    )
    # A token's bit is bit t % 32 of word t // 32: in little-endian memory, bit t % 8 of byte t // 8.
    bits = np.unpackbits(~bitmask.view(np.uint8), axis=1, bitorder="little")
    at = [i for i, _ in rows]
    n = min(shape[1], size)
    out = np.zeros(shape, dtype=bool)
    out[at, :n] = bits[:, :n].view(bool)
    out[at, n:] = True
    return out


@functools.cache
def _executor() -> Any:
    """The pool that fills masks (llguidance's own threads): as many as
    this process may use, up to 8."""
    import llguidance

    return llguidance.LLExecutor(min(8, len(os.sched_getaffinity(0))))
