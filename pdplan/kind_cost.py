"""A step cost priced at three speeds: one for a step's decoding rows, one for its short prompt chunks
and one for its long prompt chunks.

A serving node's steps do not all run at one speed against the profile's bare steps. In quiet12
(bench/validation/quiet12, each node's recorded steps: bench/simulate/node_steps.py) a decode-only
step's thread CPU was 1.03-1.29x its price, a step whose prompt rows (>= 256 new tokens) made it
0.89-1.10x, on the same node in the same point (mixed colocated 0.5 req/s: 1.12 against 0.98;
bench/README.md, sim22). One factor for both prices a long prompt's chunks at the decode steps'
slowness, which holds the decode batch behind it longer than the node did.

Prompt chunks are not of one kind either. A long chunk (LONG_CHUNK new tokens or more: a cold
prompt's 2,048-token pieces) is bound by its matrix products over its own rows; a short one over a
long cached context (a RAG question: 13-63 tokens over 2-3.7k cached) mostly reads that context, as a
decode row does. The profile's one linear fit errs differently on the two: in quiet13's RAG points the
questions' steps took 0.79-0.88x their price and the cold chunks 0.99-1.17x (bench/README.md, sim24),
and one factor for both (their median, set by the many questions) priced the cold prompts that set
the TTFT p90 20-30% short.

    t(step) = decode * base(fixed + the rows with n == 1)
              + prompt * base(the rows with 1 < n < LONG_CHUNK) + long * base(the rows with n >= LONG_CHUNK)

(base is linear in the rows, so the three parts add up to base(step); with decode == prompt == long
== k this is base.scaled(k).)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pdplan.profile import StepCost

LONG_CHUNK = 256        # a chunk of this many new tokens or more is a long one (sim22's "prompt steps")


class KindSpeed(NamedTuple):
    decode: float       # the step's fixed cost and its decoding rows (n == 1), this many times the price
    prompt: float       # what its short chunks' rows (1 < n < LONG_CHUNK) add, this many times theirs
    long: float | None = None   # what its long chunks' rows (n >= LONG_CHUNK) add; None: at `prompt`

    @property
    def long_factor(self) -> float:
        return self.prompt if self.long is None else self.long

    def __str__(self) -> str:
        tail = "" if self.long is None else f"/{self.long:.2f}"
        return f"{self.decode:.2f}/{self.prompt:.2f}" + tail


class KindParts(NamedTuple):
    """A step's price split by the kind of its rows (seconds, at the profile's speed)."""
    decode: float       # the fixed cost and the decoding rows
    short: float        # the short chunks' rows
    long: float         # the long chunks' rows

    @property
    def prompt(self) -> float:
        return self.short + self.long


@dataclass(frozen=True, slots=True)
class KindCost:
    base: "StepCost"
    speed: KindSpeed

    def of(self, shapes: list[tuple[int, int]]) -> float:
        """Seconds for one step that schedules `shapes`: [(new tokens, context before them), ...]."""
        d, s, lg = self.parts(shapes)
        return self.speed.decode * d + self.speed.prompt * s + self.speed.long_factor * lg

    def parts(self, shapes: list[tuple[int, int]]) -> KindParts:
        """The base price's parts that each factor multiplies."""
        decode = self.base.of([s for s in shapes if s[0] == 1])
        upto_short = self.base.of([s for s in shapes if s[0] < LONG_CHUNK])
        return KindParts(decode, upto_short - decode, self.base.of(shapes) - upto_short)
