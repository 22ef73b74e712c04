"""The terms between a policy and a run: when the policy compresses (`Schedule`), and what the run asks of it
(`Demand`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal, NamedTuple


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When a policy compresses, which is what its budget bounds (the record's `budget_scope`), and how often while
    decoding."""

    # none: keeps every entry (full, a storage policy alone), a budget means nothing to it; prefill: compresses the
    # prompt, the cache grows while decoding; decode: compresses the prompt and keeps evicting while decoding, the
    # budget holds throughout; read: keeps every entry, each decode step reads a budget's worth of them (sparse)
    when: Literal["none", "prefill", "decode", "read"]
    # decode tokens between two evictions that the policy's definition fixes (R-KV's buffer); None: the run's
    # `evict_every`
    every: int | None = None

    NONE: ClassVar[Schedule]
    PREFILL: ClassVar[Schedule]
    DECODE: ClassVar[Schedule]
    READ: ClassVar[Schedule]

    @property
    def evicts(self) -> bool:
        return self.when in ("prefill", "decode")

    @property
    def decodes(self) -> bool:
        """Whether it keeps evicting while decoding."""
        return self.when == "decode"

    def each(self, tokens: int) -> Schedule:
        """This schedule, evicting every `tokens` decode tokens."""
        return dataclasses.replace(self, every=tokens)


Schedule.NONE, Schedule.PREFILL = Schedule("none"), Schedule("prefill")
Schedule.DECODE, Schedule.READ = Schedule("decode"), Schedule("read")


class Demand(NamedTuple):
    """What a run asks of a policy, as far as it is known: `budget` tokens per KV head (None: none yet, a ratio
    before its prompt), whether that budget is a `threshold`, and whether the prompt is fed `chunked`."""

    budget: int | None = None
    threshold: bool = False
    chunked: bool = False
