"""A step cost priced at two speeds, one for a step's decoding rows and one for its prompt rows.

A serving node's steps do not all run at one speed against the profile's bare steps. In quiet12
(bench/validation/quiet12, each node's recorded steps: bench/simulate/node_steps.py) a decode-only
step's thread CPU was 1.03-1.29x its price, a step whose prompt rows (>= 256 new tokens) made it
0.89-1.10x, on the same node in the same point (mixed colocated 0.5 req/s: 1.12 against 0.98;
bench/README.md, sim22). One factor for both prices a long prompt's chunks at the decode steps'
slowness, which holds the decode batch behind it longer than the node did.

    t(step) = decode * base(fixed + the rows with n == 1) + prompt * base(the rows with n > 1)

(base is linear in the rows, so the two parts add up to base(step); with decode == prompt == k this
is base.scaled(k).)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pdplan.profile import StepCost


class KindSpeed(NamedTuple):
    decode: float       # the step's fixed cost and its decoding rows (n == 1), this many times the price
    prompt: float       # what its prompt rows (n > 1) add, this many times theirs

    def __str__(self) -> str:
        return f"{self.decode:.2f}/{self.prompt:.2f}"


@dataclass(frozen=True, slots=True)
class KindCost:
    base: "StepCost"
    speed: KindSpeed

    def of(self, shapes: list[tuple[int, int]]) -> float:
        """Seconds for one step that schedules `shapes`: [(new tokens, context before them), ...]."""
        decode = self.base.of([s for s in shapes if s[0] == 1])
        return self.speed.decode * decode + self.speed.prompt * (self.base.of(shapes) - decode)

    def parts(self, shapes: list[tuple[int, int]]) -> tuple[float, float]:
        """(decode part, prompt part) of the base price: what each factor multiplies."""
        decode = self.base.of([s for s in shapes if s[0] == 1])
        return decode, self.base.of(shapes) - decode
