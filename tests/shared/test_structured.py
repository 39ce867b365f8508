"""Structured output's matchers (mmsplit_server/structured.py): made ahead
of the join in a thread of their own, taken once, bounded, and made at
join when not prepared; a schema that cannot be made raises where it is
taken (the engine fails that request alone)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

from mmsplit_server import structured
from mmsplit_server.structured import Constraint, Grammars

SCHEMA = ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}))


def test_a_prepared_matcher_is_made_off_the_caller_s_thread_and_taken_once(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    grammars = Grammars(tiny_model, frozenset([2]), keep=2)
    made_on: list[str] = []
    make = grammars._make

    def recording(json_schema: str) -> Constraint:
        made_on.append(threading.current_thread().name)
        return make(json_schema)

    monkeypatch.setattr(grammars, "_make", recording)
    grammars.prepare("r1", SCHEMA)
    first = grammars.constraint(SCHEMA, "r1")
    assert made_on == [made_on[0]]
    assert made_on[0].startswith("grammars"), made_on
    assert not structured.banned([(0, first)], (1, first.vocab_size)).all()
    # Taken: asking again makes a new one, here.
    assert grammars.constraint(SCHEMA, "r1") is not first
    assert made_on[1] == threading.current_thread().name
    # At most `keep` wait: the oldest is pushed out and made at join instead.
    for rid in ("a", "b", "c"):
        grammars.prepare(rid, SCHEMA)
    grammars.constraint(SCHEMA, "c")
    assert len(grammars._prepared) == 1
    assert "a" not in grammars._prepared


def test_a_schema_that_cannot_be_made_raises_where_it_is_taken(tiny_model: Path) -> None:
    grammars = Grammars(tiny_model, frozenset([2]))
    grammars.prepare("bad", ("json_schema", "[1]"))
    with pytest.raises(ValueError, match="must be a JSON object"):
        grammars.constraint(("json_schema", "[1]"), "bad")
    assert structured.grammar(SCHEMA) is structured.grammar(SCHEMA), "kept, not compiled again"


def test_preparing_does_not_wait_for_the_tokenizer_being_built(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first matcher builds llguidance's tokenizer (0.3-1 s); the frontend
    prepares the next requests' matchers on its event loop meanwhile."""
    import time

    import llguidance.hf

    building, release = threading.Event(), threading.Event()
    build = llguidance.hf.from_tokenizer

    def slow(*args: object, **kwargs: object) -> object:
        building.set()
        release.wait(30)
        return build(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", slow)
    grammars = Grammars(tiny_model, frozenset([2]))
    grammars.prepare("first", SCHEMA)
    assert building.wait(30)
    began = time.monotonic()
    grammars.prepare("second", SCHEMA)
    took = time.monotonic() - began
    release.set()
    assert took < 1.0, f"prepare waited {took:.1f} s for the build"
    second = grammars.constraint(SCHEMA, "second")
    assert not structured.banned([(0, second)], (1, second.vocab_size)).all()


def test_a_request_that_ends_before_joining_leaves_no_matcher(tiny_model: Path) -> None:
    """Cancelled (or refused, or failed) before it joins: the scheduler's
    frontend forgets its prepared matcher, rather than keep it until 1,024
    newer ones push it out."""
    from types import SimpleNamespace

    from scheduler_svc.frontend import Frontend

    grammars = Grammars(tiny_model, frozenset([2]))
    aborted: list[str] = []
    loop = SimpleNamespace(abort=aborted.append, engine=SimpleNamespace(grammars=grammars))
    frontend = Frontend(loop, None, None)  # type: ignore[arg-type]
    grammars.prepare("gone", SCHEMA)
    grammars.prepare("stays", SCHEMA)
    frontend.end("gone")
    assert aborted == ["gone"]
    assert list(grammars._prepared) == ["stays"]
    frontend.end("never seen")  # harmless
    assert list(grammars._prepared) == ["stays"]


def test_the_scheduler_compiles_a_new_schema_off_its_event_loop(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Frontend.ready` (awaited before `admit` by both RPCs) compiles a
    request's schema in a thread while the event loop serves the others
    (~19 ms for a 48 KB schema); `admit`'s check then finds it compiled,
    and a refusal is kept as well."""
    import asyncio
    import functools

    from mmsplit.common.v1 import common_pb2
    from mmsplit.scheduler.v1 import scheduler_pb2
    from mmsplit_server.sampling import InvalidSampling, Sampling
    from scheduler_svc.frontend import Frontend

    compiling, release = threading.Event(), threading.Event()
    threads: list[str] = []
    compile_ = structured._compiled.__wrapped__

    # This test's own schemas (another test's matcher thread may compile SCHEMA meanwhile).
    mine = json.dumps({"type": "object", "properties": {"held": {"type": "integer"}}})
    bad = json.dumps({"type": "object", "properties": {"a": {"type": "no such type"}}})

    def held(structure: tuple[str, str]) -> object:
        if structure[1] in (mine, bad):
            threads.append(threading.current_thread().name)
            compiling.set()
            release.wait(10)
        return compile_(structure)

    monkeypatch.setattr(structured, "_compiled", functools.lru_cache(maxsize=64)(held))
    frontend = Frontend(None, None, None)  # type: ignore[arg-type]

    def message(schema: str) -> scheduler_pb2.GenerateRequest:
        sampling = common_pb2.SamplingParams(max_tokens=4, json_schema=schema)
        return scheduler_pb2.GenerateRequest(request_id="r", input_ids=[1, 2], sampling=sampling)

    async def main() -> int:
        ready = asyncio.create_task(frontend.ready(message(mine)))
        assert await asyncio.to_thread(compiling.wait, 30)
        turns = 0
        for _ in range(5):  # the loop goes round while the schema compiles
            await asyncio.sleep(0)
            turns += 1
        done = ready.done()
        release.set()
        await ready
        assert not done
        return turns

    assert asyncio.run(main()) == 5
    assert threads
    assert threads[0] != threading.current_thread().name
    Sampling.from_pb(message(mine).sampling, max_tokens_limit=64)
    assert len(threads) == 1, "admission's check found it compiled"
    asyncio.run(frontend.ready(message(bad)))
    with pytest.raises(InvalidSampling, match="cannot be compiled"):
        Sampling.from_pb(message(bad).sampling, max_tokens_limit=64)
    assert len(threads) == 2, "the refusal was kept too"


def test_the_rows_masks_made_together_are_each_matcher_s_own(tiny_model: Path) -> None:
    """`banned` (llguidance's parallel fill of every row's mask) bans, for
    each row, exactly what its matcher alone does not allow (its own
    `compute_bitmask`), at different places of their documents, and every
    column past the tokenizer's vocabulary (a padded LM head)."""
    import numpy as np

    grammars = Grammars(tiny_model, frozenset([2]))
    rows = [grammars.constraint(SCHEMA) for _ in range(5)]
    for k, row in enumerate(rows):  # row k is k tokens into a document
        for _ in range(k):
            alone = np.unpackbits(np.frombuffer(row.matcher.compute_bitmask(), np.uint8), bitorder="little")
            row.took(int(np.flatnonzero(alone)[0]))
    vocab = rows[0].vocab_size + 40
    # Rows 0, 2, 4, 6, 8 of 9 constrained; the odd ones are not.
    every = structured.banned([(2 * k, row) for k, row in enumerate(rows)], (9, vocab))
    assert every.shape == (9, vocab)
    assert not every[1::2].any(), "a row that asks for nothing bans nothing"
    bans = every[::2]
    for row, got in zip(rows, bans, strict=True):
        alone = np.unpackbits(np.frombuffer(row.matcher.compute_bitmask(), np.uint8), bitorder="little")
        expected = np.ones(vocab, dtype=bool)
        expected[: row.vocab_size] = alone[: row.vocab_size] == 0
        assert (got == expected).all()
        assert not got.all(), "something may come next"
    assert len({bans[k].tobytes() for k in range(5)}) > 1, "the rows are at different places"


def test_a_structure_over_the_size_limit_is_refused_before_the_cache_keeps_it() -> None:
    """The compiled structures' cache is keyed by their texts: one over
    MAX_SCHEMA_BYTES is refused without being kept (64 of a client's 10 MB
    schemas would have stayed alive), in the thread and on the loop."""
    structured._compiled.cache_clear()
    big = ("json_schema", json.dumps({"type": "object", "description": "x" * structured.MAX_SCHEMA_BYTES}))
    asyncio.run(structured.compile_off_loop(big))
    with pytest.raises(ValueError, match=f"is over {structured.MAX_SCHEMA_BYTES} bytes"):
        structured.grammar(big)
    assert structured._compiled.cache_info().currsize == 0
    small = ("json_schema", json.dumps({"type": "object"}))
    assert structured.grammar(small)
    assert structured._compiled.cache_info().currsize == 1
