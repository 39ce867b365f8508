"""Where and as whom a locally launched rank joins its group: a module of its
own, imported by the rank launcher (`group`, which must stay light: a
spawned rank imports it before anything heavy), by the collective that
joins the group, and by the rank bootstrap, none of which import each
other for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rendezvous:
    """Where and as whom a locally launched rank joins its group."""

    addr: str
    port: int
    rank: int
    world_size: int
