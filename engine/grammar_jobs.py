"""Grammar compiles off the caller's thread. A short grammar can compile for minutes (twenty
`r ::= [a-z]{1,1000} [0-9]{0,900}` rules: 80 s on a 32k vocabulary) and the caller is a node's
loop, whose heartbeats must not stop: it starts a compile here, parks the request
(engine/grammar_waits.py) and serves on.

    submit(spec) ──▶ recent (done, LRU) ──▶ CompileJob, done at once
                 └─▶ pending (same spec: shared) ──▶ CompileJob
                 └─▶ new job: max_compiles threads, max_queued waiting; past them GrammarBusy

A compile cannot be stopped once it runs (xgrammar's C++ has no cancel): a job past its time limit
fails its requests (the waits do), runs to its end on its thread and lands in `recent`. The
threads are not daemons: a process exiting mid-compile waits for it (a daemon thread left inside
C++ at interpreter exit aborts the process, SIGABRT); nodes end with os._exit and do not wait.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from engine.grammar_limits import GrammarLimits

RECENT = 64         # compiled grammars kept (done jobs, their errors too); xgrammar caches more below


class GrammarBusy(Exception):
    """Too many grammars compile or wait here: try another node (retryable: a Busy, a 503)."""


@dataclass(slots=True)
class CompileJob:
    limit_s: float                                      # the time limit (GrammarLimits.timeout_s)
    future: Future = field(default_factory=Future)     # the compiled grammar, or its ValueError
    started: float | None = None                        # monotonic seconds its thread took it up

    @property
    def done(self) -> bool:
        return self.future.done()

    def expired(self, since: float) -> Exception | None:
        """Why a request waiting for this job since `since` (monotonic) waits no longer, or None:
        its compile ran the time limit (ValueError: too costly for any node, a 400), or it waited
        that long for a thread (GrammarBusy: another node may be free)."""
        now, limit_s = time.monotonic(), self.limit_s
        if self.started is not None:
            return ValueError(f"invalid grammar: it did not compile within {limit_s} s "
                              "(--grammar-compile-timeout-s)") if now - self.started >= limit_s else None
        return GrammarBusy(f"the grammar waited {limit_s} s for this node's compiler, busy with "
                           "others: try again") if now - since >= limit_s else None


class CompileJobs:
    def __init__(self, compile_fn: Callable[[Any], Any], limits: GrammarLimits):
        self._compile = compile_fn
        self._limits = limits
        self._pool = ThreadPoolExecutor(limits.max_compiles, thread_name_prefix="grammar-compile")
        self._pending: dict[Hashable, CompileJob] = {}
        self._recent: OrderedDict[Hashable, CompileJob] = OrderedDict()
        self._lock = threading.Lock()       # pending and recent: the caller's thread and the compiles'

    def submit(self, key: Hashable, spec: Any) -> CompileJob:
        """The job compiling `spec` (keyed by `key`): a recent or a pending one, else a new one.
        Raises GrammarBusy when max_compiles + max_queued jobs are pending."""
        with self._lock:
            if (job := self._recent.get(key)) is not None:
                self._recent.move_to_end(key)
                return job
            if (job := self._pending.get(key)) is not None:
                return job
            if len(self._pending) >= self._limits.max_compiles + self._limits.max_queued:
                raise GrammarBusy(f"{len(self._pending)} grammars are compiling or queued on this node "
                                  "(--grammar-max-compiles, --grammar-max-queued): try again")
            job = self._pending[key] = CompileJob(self._limits.timeout_s)
        self._pool.submit(self._run, key, job, spec)
        return job

    def _run(self, key: Hashable, job: CompileJob, spec: Any) -> None:
        job.started = time.monotonic()
        try:
            job.future.set_result(self._compile(spec))
        except BaseException as err:     # noqa: BLE001 -- handed to whoever waits on the job
            job.future.set_exception(err)
        with self._lock:
            self._recent[key] = job
            self._pending.pop(key, None)
            while len(self._recent) > RECENT:
                self._recent.popitem(last=False)
