"""RequestDeltas (router/request_deltas.py): the part of a request's delta both backends share:
each choice's stop-hold delta, and the prompt's scores exactly once."""
from __future__ import annotations

from pdwire.sampling_params import SamplingParams
from router.request_deltas import RequestDeltas
from router.stop_hold import StopHold

SCORES = [None, {5: -0.5}]


def _holds() -> list[StopHold]:
    return [StopHold(i, SamplingParams(max_tokens=4)) for i in range(2)]


def test_scores_go_with_the_first_take_and_never_again():
    """The first take sends the scores (even with no choice delta); later ones never do, and a
    take with nothing new is None until the request finishes."""
    holds, sent = _holds(), RequestDeltas()
    assert sent.take(holds, SCORES, False) == ([], SCORES)
    holds[1].add([7], None, "a")
    delta = sent.take(holds, SCORES, False)
    assert ([(d.index, d.text, d.token_ids) for d in delta.outputs], delta.prompt_logprobs) == ([(1, "a", [7])], None)
    assert sent.take(holds, SCORES, False) is None
    assert sent.take(holds, SCORES, True) == ([], None)


def test_scores_missing_at_the_first_take_are_dropped_later():
    """A first take without scores marks them gone: scores that turn up later are not sent."""
    holds, sent = _holds(), RequestDeltas()
    holds[0].add([7], None, "a")
    assert sent.take(holds, None, False).prompt_logprobs is None
    holds[0].add([8], None, "b")
    assert sent.take(holds, SCORES, False).prompt_logprobs is None


def test_scored_from_the_start_sends_no_scores():
    """scored=True (none are due): no scores ever go, and nothing new is None."""
    sent = RequestDeltas(scored=True)
    assert sent.take(_holds(), SCORES, False) is None
