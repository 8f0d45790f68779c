"""Structured output with xgrammar: compile a request's grammar for this engine's tokenizer,
keep one matcher per sequence, and mask a whole batch's logits in one call.

Why xgrammar (bench/README.md, `python -m bench.grammar_bench`): on this project's 32,000-token
tokenizer its per-row mask fill costs tens of microseconds where llguidance's costs ~0.1 ms, and a
batch of 32 constrained rows fills in under 1 ms in a plain loop (its own thread pool is slower on
a few cores). vLLM and SGLang default to it, and it masks logits on CPU and CUDA alike.

A matcher holds the grammar's state after the tokens generated so far; it is never sent between
nodes. A node builds it from the request's StructuredOutput and replays the tokens that came
before (a decode node: the prefill node's first token; a moved request: every prior output), so
the state is the same wherever the request runs.
"""
from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import wait
from typing import Any, Iterable

import torch

from engine.grammar_jobs import CLOSE_WAIT_S, CompileJob, CompileJobs
from engine.grammar_limits import GrammarLimits
from engine.grammar_specs import JSON_LAYOUT, library_error
from engine.grammar_workers import GrammarWorkers
from pdwire.structured_output import GrammarKind, StructuredOutput


def parse_grammar(spec: StructuredOutput) -> None:
    """Raises ValueError if the spec does not parse (no tokenizer needed: the router's check)."""
    import xgrammar as xgr
    try:
        if spec.kind is GrammarKind.JSON_SCHEMA:
            xgr.Grammar.from_json_schema(spec.spec, **JSON_LAYOUT)
        elif spec.kind is GrammarKind.REGEX:
            xgr.Grammar.from_regex(spec.spec)
        elif spec.kind is GrammarKind.GRAMMAR:
            xgr.Grammar.from_ebnf(spec.spec)
    except Exception as err:    # noqa: BLE001 -- xgrammar raises RuntimeError and its own types
        raise library_error(spec, err) from err


class GrammarMatcher:
    """One sequence's grammar state."""

    def __init__(self, matcher: Any):
        self._m = matcher

    def accept(self, token: int) -> bool:
        return self._m.accept_token(token)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token (EOS) was accepted."""
        return self._m.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer, off the caller's thread (engine/grammar_jobs.py:
    bounded in time, in compiles and in queue by GrammarLimits) and in worker processes
    (engine/grammar_workers.py: killed at the time limit), and makes matchers from the compiled
    grammars, which a request keeps (its n sequences' matchers come from it)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 limits: GrammarLimits = GrammarLimits()):
        import xgrammar as xgr
        self._xgr = xgr
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=list(stop_token_ids))
        self.vocab_size = vocab_size
        self.limits = limits
        self._workers = GrammarWorkers(self._info.serialize_json(), limits)
        weakref.finalize(self, self._workers.close)     # a compiler dropped unclosed ends its processes
        self._jobs = CompileJobs(self._compile, limits, self._workers.ready, self._workers.warm_since,
                                 self._workers.abandoner)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._lock = threading.Lock()       # the bitmask buffer is shared by one engine's steps

    def submit(self, spec: StructuredOutput) -> CompileJob:
        """Start compiling `spec` (or find it compiled or compiling); never waits. Raises
        GrammarBusy when too many compiles are pending."""
        return self._jobs.submit((spec.kind, spec.spec), spec)

    def compiled(self, spec: StructuredOutput) -> Any:
        """`spec` compiled: at once if its job is done, else waiting for it at most the time limit
        (a caller that must not wait parks its request on submit()'s job first). Raises
        ValueError for a grammar that does not compile, or not in time; GrammarBusy when too many
        compiles are pending, or it waited the time limit for a compile to start."""
        job, since = self.submit(spec), time.monotonic()
        job.join()
        try:
            while not job.done:
                if (error := job.expired(since)) is not None:
                    raise error
                wait([job.future], timeout=0.01)
        finally:
            job.leave()     # the last waiter of a job still queued cancels it
        return job.future.result()

    def close(self, wait_s: float = CLOSE_WAIT_S) -> bool:
        """Kill the compile workers (the running compiles end at once), cancel the queued compiles
        and wait at most `wait_s` for the compile threads; True if none runs any more."""
        self._workers.close()
        return self._jobs.close(wait_s)

    def _compile(self, spec: StructuredOutput) -> Any:
        """On a compile thread: compiled in its worker process, loaded here."""
        compiled = self._workers.compile(spec)
        try:
            return self._xgr.CompiledGrammar.deserialize_json(str(compiled, "utf-8"), self._info)
        except Exception as err:    # noqa: BLE001 -- xgrammar's own types; never seen: one library, both ends
            raise ValueError(f"invalid {spec.kind.value}: its compiled form did not load: {str(err)[:200]}") from err

    def matcher(self, compiled: Any, prior_tokens: list[int] = ()) -> GrammarMatcher:
        """A matcher of a compiled grammar past `prior_tokens` (the tokens generated before this
        node took the request). Raises ValueError if it refuses one of them, or allows no token
        after them (its language is empty, or this vocabulary cannot spell it)."""
        m = GrammarMatcher(self._xgr.GrammarMatcher(compiled))
        for i, token in enumerate(prior_tokens):
            if not m.accept(token):
                raise ValueError(f"prior output token {i} ({token}) does not follow the request's grammar")
        if not m.terminated and not self._allows_any(m):
            raise ValueError("invalid grammar: it allows no token (its language is empty, or this model's "
                             "vocabulary cannot spell it)")
        return m

    def _allows_any(self, m: GrammarMatcher) -> bool:
        with self._lock:
            m.fill(self._bitmask, 0)
            return bool(self._bitmask[0].any())

    def mask(self, logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> None:
        """Set to -inf, in place, every token a row's grammar forbids. logits: [R, vocab], one row
        per entry of `matchers`; rows without a matcher are not touched (no work for them)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        with self._lock:
            if self._bitmask.shape[0] < logits.shape[0]:
                self._bitmask = self._xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
            bitmask = self._bitmask[:logits.shape[0]]          # [R, ceil(vocab / 32)] int32
            for i in rows:
                matchers[i].fill(bitmask, i)
            self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                                  vocab_size=self.vocab_size, indices=rows)
