"""StopHold (router/stop_hold.py): one choice's unsent output, cut into deltas that never show
any part of a stop string; only text is held, never tokens."""
from __future__ import annotations

from pdwire.outputs import CompletionOutput
from pdwire.sampling_params import SamplingParams
from router.stop_hold import StopHold


def new(stop=(), logprobs: bool = False, include: bool = False) -> StopHold:
    return StopHold(0, SamplingParams(stop=stop, logprobs=0 if logprobs else None, include_stop_str_in_output=include))


def whole(text, token_ids, logprobs=None, finish_reason=None) -> CompletionOutput:
    return CompletionOutput(0, text, token_ids, logprobs, finish_reason)


def step(hold: StopHold, output: CompletionOutput):
    """Feeds an engine's cumulative output; the delta taken after it, as a tuple."""
    hold.advance_to(output)
    d = hold.take()
    return None if d is None else (d.index, d.text, d.token_ids, d.logprobs, d.finish_reason)


def test_sends_only_new_text_and_tokens():
    """Each take is the unsent suffix; a token whose text is not out yet goes at once, without it."""
    h = new()
    assert step(h, whole("he", [1, 2])) == (0, "he", [1, 2], None, None)
    assert step(h, whole("he", [1, 2, 3])) == (0, "", [3], None, None)    # no text yet (a partial character)
    assert step(h, whole("he", [1, 2, 3])) is None
    assert step(h, whole("hello", [1, 2, 3, 4])) == (0, "llo", [4], None, None)
    assert step(h, whole("hello", [1, 2, 3, 4], None, "stop")) == (0, "", [], None, "stop")
    assert step(h, whole("hello", [1, 2, 3, 4], None, "stop")) is None


def test_holds_back_a_possible_stop_string_start():
    """hold = longest stop - 1: released text is always a prefix of the final, stop-cut text."""
    h = new(("\n\n",))
    assert step(h, whole("Hi", [1])) == (0, "H", [1], None, None)
    assert step(h, whole("Hi\n", [1, 2])) == (0, "i", [2], None, None)   # "\n" held
    assert step(h, whole("Hi\n", [1, 2, 3])) == (0, "", [3], None, None)  # a token with no text yet
    assert step(h, whole("Hi", [1, 2, 3, 4], None, "stop")) == (0, "", [4], None, "stop")
    h = new(("\n\n", "x"))
    assert step(h, whole("a\n", [1, 2])) == (0, "a", [1, 2], None, None)
    assert step(h, whole("a\nb", [1, 2, 3])) == (0, "\n", [3], None, None)   # not a stop after all
    assert step(h, whole("a\nbc", [1, 2, 3, 4], None, "length")) == (0, "bc", [4], None, "length")


def test_slices_logprobs_with_tokens():
    """Logprobs go with the token ids they belong to."""
    h = new(logprobs=True)
    step(h, whole("a", [1], [{1: -0.1}]))
    assert step(h, whole("ab", [1, 2], [{1: -0.1}, {2: -0.2}]))[3] == [{2: -0.2}]


def test_a_cut_never_takes_back_released_text():
    """A cut below what was released stops at the released text: a client is never told less."""
    h = new(("abc",))
    h.add([1], None, "xyzab")
    assert h.take().text == "xyz" and h.cut(1) == 3 and h.length == 3


def test_keeps_only_the_unreleased_tail():
    """A long choice keeps at most hold characters between takes, and each delta is only its
    new text: nothing grows with the length of the output."""
    h = new(("STOP!",))
    for i in range(10_000):
        h.add([i], None, "word ")
        d = h.take()
        assert len(h.tail) <= h.hold and len(d.text) <= 5 + h.hold and len(d.token_ids) <= 1
    assert h.length == 50_000 and h.sent == 50_000 - h.hold


def test_no_hold_when_the_stop_string_stays_in_the_text():
    """include_stop_str_in_output: nothing is cut, so nothing is held."""
    h = new(("\n\n",), include=True)
    assert step(h, whole("Hi\n", [1, 2])) == (0, "Hi\n", [1, 2], None, None)
    assert step(h, whole("Hi\n\n", [1, 2, 3], None, "stop")) == (0, "\n", [3], None, "stop")
