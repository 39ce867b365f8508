"""What the conformance kit's checks are made of (stdlib only): a check is
a name and a function that returns a detail or raises; running it gives a
Result (PASS, FAIL, or SKIP with the reason); `table` is the report.
`mmsplit.conformance` (gRPC) and `mmsplit.conformance_http` (the
OpenAI-compatible API) both build on it."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Result:
    name: str
    verdict: str  # PASS, FAIL or SKIP
    detail: str = ""


class Failed(Exception):
    """A check's expectation did not hold; the message says which."""


class Skipped(Exception):
    """A check that cannot run with what it was given; the message says why."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise Failed(message)


# The structured-output checks' schema (both kits), and what an answer must be.
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


def expect_a_document_of_the_schema(text: str) -> None:
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        raise Failed(f"not JSON: {text!r}") from None
    expect(
        isinstance(document, dict)
        and set(document) == {"color", "ok"}
        and document["color"] in ("red", "blue")
        and isinstance(document["ok"], bool),
        f"not a document of the schema: {text!r}",
    )


def run_check(
    name: str, check: Callable[[], str | None], describe: Callable[[Exception], str | None] = lambda exc: None
) -> Result:
    """Run one check. An unexpected exception is a failed check, reported,
    not a crash of the kit; `describe` may say what an exception of its
    kind means (None: its type and message)."""
    try:
        return Result(name, "PASS", check() or "")
    except Skipped as exc:
        return Result(name, "SKIP", str(exc))
    except Failed as exc:
        return Result(name, "FAIL", str(exc))
    except Exception as exc:
        return Result(name, "FAIL", describe(exc) or f"{type(exc).__name__}: {exc}")


def table(results: Sequence[Result]) -> str:
    width = max(len(r.name) for r in results)
    lines = [f"{'check':<{width}}  verdict  detail", f"{'-' * width}  -------  ------"]
    lines += [f"{r.name:<{width}}  {r.verdict:<7}  {r.detail}" for r in results]
    counts = {v: sum(r.verdict == v for r in results) for v in ("PASS", "FAIL", "SKIP")}
    lines.append(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return "\n".join(lines)
