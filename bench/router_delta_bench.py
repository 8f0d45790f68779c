"""Router CPU for one long choice of the disaggregated backend (issue #22): each decode delta is
merged into the choice and what goes to the client is taken, as generate() does per message.

    flock /work/bench.lock python -m bench.router_delta_bench [--tokens 8000 16000 32000]

Runs against whichever tree is on PYTHONPATH: before deltas, a choice's text grew by one copy
per merge (quadratic in the output's length); after, a choice keeps only its unreleased tail.
"""
from __future__ import annotations

import argparse
import time

from pdwire.sampling_params import SamplingParams
from router.cluster.disagg_request import Attempt, Choice, PendingRequest, merge

PIECE = "word "     # each decode delta: one token, this text


def seconds(tokens: int, stop: tuple[str, ...]) -> float:
    params = SamplingParams(max_tokens=None, stop=stop)
    choice = Choice(0, "r", params)
    request = PendingRequest("r", [1, 2, 3], [choice])
    attempt = Attempt("r", [1, 2, 3], params, 0, 0)
    take = getattr(request, "take", None) or request.output     # before: a snapshot per message
    start = time.perf_counter()
    for i in range(tokens):
        merge(choice, attempt, i, (7,), len(PIECE) * i, PIECE, None, "")
        take()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[8000, 16000, 32000])
    args = parser.parse_args()
    for tokens in args.tokens:
        for stop in ((), ("</answer>",)):
            best = min(seconds(tokens, stop) for _ in range(3))
            print(f"tokens {tokens:6d}  stop {stop!s:15}  {best * 1e3:8.1f} ms  "
                  f"{best / tokens * 1e6:6.2f} us/token")


if __name__ == "__main__":
    main()
