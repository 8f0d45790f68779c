"""Grammar compiles off the caller's thread. A short grammar can compile for minutes (twenty
`r ::= [a-z]{1,1000} [0-9]{0,900}` rules: 80 s on a 32k vocabulary) and the caller is a node's
loop, whose heartbeats must not stop: it starts a compile here, parks the request
(engine/grammar_waits.py) and serves on.

    submit(spec) ──▶ recent (done, LRU) ──▶ CompileJob, done at once
                 └─▶ pending (same spec: shared) ──▶ CompileJob
                 └─▶ new job: max_compiles threads, max_queued waiting; past them GrammarBusy

A job counts the requests that wait for it (join, leave): when the last one leaves a job still
queued (aborted, refused busy, its wait ran out), the job is cancelled and its place freed; one
a thread took up is abandoned: it leaves pending (a new submit of its grammar starts another job),
its compile ends at its start or, running, its worker process is killed (it ends GrammarBusy, not
kept). No thread compiles on a grammar nobody waits for. An abandoned job still counts, and
close() still waits for it, until its thread is free.

A thread compiles in a worker process of its own (engine/grammar_workers.py; `prepare` readies it
before the job's clock starts): a job past its time limit fails its requests (the waits do), and
its process is killed at that limit, so its thread and core are free at once. A failure that is
the node's load, not the grammar's (GrammarBusy, GrammarTimeout), is not kept: a retry compiles
again. A grammar whose worker died compiling it (GrammarCrashed) is kept only at its second crash
(CRASHES_KEPT_AT): a one-off death (an OOM kill of a worker that was large already) lets the next
request compile it again, while one that kills every worker costs two deaths, not one a request.
close() cancels the queued compiles and waits at most CLOSE_WAIT_S for the running ones
(GrammarCompiler.close kills their processes first, so they end at once). The threads only wait
on a pipe, never inside xgrammar's C++, and the interpreter's exit kills their processes before it
joins them (engine/grammar_workers.py): no exit waits for a compile.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from engine.grammar_limits import GrammarLimits

RECENT = 64             # compiled grammars kept (done jobs, a grammar's own errors too)
RECENT_BYTES = 256 << 20    # and at most this many bytes of them (CompiledGrammar.memory_size_bytes)
CRASHES_KEPT_AT = 2      # a grammar whose worker died compiling it this many times running is kept as failing
CLOSE_WAIT_S = 2.0      # close(): how long it waits for the compiles running; past it the caller leaves


class GrammarBusy(Exception):
    """Too many grammars compile or wait here: try another node (retryable: a Busy, a 503)."""

    @classmethod
    def closing(cls) -> "GrammarBusy":
        return cls("this node's grammar compiler is closing: try again")


class GrammarTimeout(ValueError):
    """A compile ran past its time limit: a 400 where a grammar is judged (the decode node, the
    colocated engine); on a prefill node it is its load, a Busy: the router judges by the decode
    node's answer first (router/cluster/grammar_first.py), which compiled it in time."""

    @classmethod
    def after(cls, limit_s: float) -> "GrammarTimeout":
        return cls(f"invalid grammar: it did not compile within {limit_s} s (--grammar-compile-timeout-s)")


@dataclass(slots=True, eq=False)
class CompileJob:
    """One grammar's compile: its result (or error) to come, when a thread took it up and when its
    compile began, and how many requests wait for it (a queued job nobody waits for is cancelled)."""
    limits: GrammarLimits                               # its time limits (timeout_s, worker_start_timeout_s)
    warm_since: Callable[[], float | None] = lambda: 0.0    # when its compiler first could compile (None: not yet)
    future: Future = field(default_factory=Future)     # the compiled grammar, or its ValueError
    readying: float | None = None                       # monotonic seconds its thread took it up (its worker starting)
    started: float | None = None                        # monotonic seconds its compile began
    waiters: int = 0                                    # requests parked on it (join, leave)
    on_idle: Callable[["CompileJob"], None] | None = None   # called when the last waiter leaves
    abandon: Callable[[], None] | None = None           # ends its compile (set by the thread that took it up)

    @property
    def done(self) -> bool:
        return self.future.done()

    def join(self) -> None:
        """A request waits for this job (the caller's thread: a node's loop, an engine thread)."""
        self.waiters += 1

    def leave(self) -> None:
        """A request waits no more (compiled, aborted, refused, its wait ran out); the last one
        to leave a job not done cancels it, or abandons its compile."""
        self.waiters -= 1
        if self.waiters <= 0 and self.on_idle is not None and not self.done:
            self.on_idle(self)

    def expired(self, since: float) -> Exception | None:
        """Why a request waiting for this job since `since` (monotonic) waits no longer, or None:
        its compile ran the time limit (ValueError: too costly for any node, a 400), its worker
        process did not start in its own limit, or it waited the time limit for a thread
        (GrammarBusy: another node may be free)."""
        now, limits = time.monotonic(), self.limits
        if self.started is not None:
            return GrammarTimeout.after(limits.timeout_s) if now - self.started >= limits.timeout_s else None
        if self.readying is not None:
            return worker_late(limits) if now - self.readying >= limits.worker_start_timeout_s else None
        if (warm := self.warm_since()) is None:     # the compiler's first worker still starts: no queue yet
            return worker_late(limits) if now - since >= limits.worker_start_timeout_s else None
        return GrammarBusy(f"the grammar waited {limits.timeout_s} s for this node's compiler, busy with "
                           "others: try again") if now - max(since, warm) >= limits.timeout_s else None


class GrammarCrashed(ValueError):
    """The worker process died compiling the grammar (a crash, an OOM kill): a 400, kept as the
    grammar's fault only once it happened CRASHES_KEPT_AT times (CompileJobs)."""


def worker_late(limits: GrammarLimits) -> GrammarBusy:
    return GrammarBusy(f"the grammar compile worker did not start within {limits.worker_start_timeout_s} s "
                       "(--grammar-worker-start-timeout-s): try again")


class CompileJobs:
    """The compiles of one compiler: at most max_compiles at once on threads of their own, at most
    max_queued more waiting, the same spec compiled once, the last RECENT results kept.
    `prepare()` runs on a job's thread before its clock starts (its worker process loading);
    `warm_since()` says when the compiler first could compile: a queued job's wait counts from
    then, so the first requests do not turn busy while the first workers start; `abandoner()`, on
    a job's thread before it runs, gives what ends that job's compile when nobody waits for it
    any more (from any thread; it must not wait)."""

    def __init__(self, compile_fn: Callable[[Any], Any], limits: GrammarLimits,
                 prepare: Callable[[], None] = lambda: None, warm_since: Callable[[], float | None] = lambda: 0.0,
                 abandoner: Callable[[], Callable[[], None] | None] = lambda: None):
        self._compile = compile_fn
        self._abandoner = abandoner
        self._prepare = prepare
        self._warm_since = warm_since
        self._limits = limits
        self._pool = ThreadPoolExecutor(limits.max_compiles, thread_name_prefix="grammar-compile")
        self._pending: dict[Hashable, CompileJob] = {}     # queued or running
        self._recent: OrderedDict[Hashable, CompileJob] = OrderedDict()
        self._abandoned: set[CompileJob] = set()   # abandoned jobs whose thread is not free yet
        self._recent_bytes = 0
        self._crashed: OrderedDict[Hashable, int] = OrderedDict()     # key -> crashes, not kept yet (LRU, RECENT)
        self._lock = threading.Lock()       # pending, abandoned and recent: the caller's thread and the compiles'
        self._closed = False

    @property
    def pending(self) -> int:
        """Jobs queued or running (an abandoned one until its thread is free)."""
        return len(self._pending) + len(self._abandoned)

    def submit(self, key: Hashable, spec: Any) -> CompileJob:
        """The job compiling `spec` (keyed by `key`): a recent or a pending one, else a new one.
        Raises GrammarBusy when max_compiles + max_queued jobs are pending, or once closed."""
        with self._lock:
            if (job := self._recent.get(key)) is not None:
                self._recent.move_to_end(key)
                return job
            if (job := self._pending.get(key)) is not None:
                return job
            if self._closed:
                raise GrammarBusy.closing()
            if self.pending >= self._limits.max_compiles + self._limits.max_queued:
                raise GrammarBusy(f"{self.pending} grammars are compiling or queued on this node "
                                  "(--grammar-max-compiles, --grammar-max-queued): try again")
            job = self._pending[key] = CompileJob(self._limits, self._warm_since)
            job.on_idle = lambda j: self._cancel(key, j)
        self._pool.submit(self._run, key, job, spec)
        return job

    def close(self, wait_s: float = CLOSE_WAIT_S) -> bool:
        """Cancel the queued compiles and wait at most `wait_s` for the running ones; True if none
        runs any more (else the caller leaves without them: see the module's docstring)."""
        with self._lock:
            self._closed = True
            for key, job in list(self._pending.items()):
                if job.future.cancel():
                    del self._pending[key]
            running = [job.future for job in (*self._pending.values(), *self._abandoned)]
        self._pool.shutdown(wait=False, cancel_futures=True)
        return not wait(running, timeout=wait_s).not_done

    def _cancel(self, key: Hashable, job: CompileJob) -> None:
        """The last waiter left `job`: drop it if no thread took it up yet, else abandon it (its
        compile ends; a new submit of its grammar starts another job). The abandon is called
        outside the lock: it only signals the worker, and never waits."""
        with self._lock:
            if job.future.cancel():
                if self._pending.get(key) is job:
                    del self._pending[key]
                return
            if job.done or job.abandon is None or self._pending.get(key) is not job:
                return
            del self._pending[key]
            self._abandoned.add(job)
        job.abandon()

    def _run(self, key: Hashable, job: CompileJob, spec: Any) -> None:
        with self._lock:    # before it runs: once it does, its last waiter leaving abandons it
            job.abandon = self._abandoner()
        if not job.future.set_running_or_notify_cancel():
            return      # cancelled while queued: nobody waits for it
        job.readying = time.monotonic()
        try:
            self._prepare()
            job.started = time.monotonic()
            job.future.set_result(self._compile(spec))
        except BaseException as err:     # noqa: BLE001 -- handed to whoever waits on the job
            job.future.set_exception(err)
        with self._lock:
            if self._pending.get(key) is job:
                del self._pending[key]
            self._abandoned.discard(job)
            if self._kept(key, job.future.exception()):
                self._keep(key, job)

    def _kept(self, key: Hashable, error: BaseException | None) -> bool:
        """Whether a job ended with `error` is kept: a result, or a grammar that does not compile
        (not the node's state: an OSError, no memory, a timeout), or crashed its worker again."""
        if isinstance(error, GrammarCrashed):
            crashes = self._crashed.pop(key, 0) + 1
            if crashes < CRASHES_KEPT_AT:
                self._crashed[key] = crashes
                while len(self._crashed) > RECENT:
                    self._crashed.popitem(last=False)
                return False
            return True
        if kept := error is None or (isinstance(error, ValueError) and not isinstance(error, GrammarTimeout)):
            self._crashed.pop(key, None)    # its crash was a one-off: a later one counts from one
        return kept

    def _keep(self, key: Hashable, job: CompileJob) -> None:
        """`job` (done) in `recent`, the oldest dropped past RECENT entries or RECENT_BYTES (held).
        It replaces one of the same key (an abandoned job ends after the new job of its grammar)."""
        if (old := self._recent.pop(key, None)) is not None:
            self._recent_bytes -= _size(old)
        self._recent[key] = job
        self._recent_bytes += _size(job)
        while len(self._recent) > RECENT or (self._recent_bytes > RECENT_BYTES and len(self._recent) > 1):
            self._recent_bytes -= _size(self._recent.popitem(last=False)[1])


def _size(job: CompileJob) -> int:
    """Bytes a done job's compiled grammar holds (0 for an error or a result without a size)."""
    if job.future.exception() is not None:
        return 0
    return int(getattr(job.future.result(), "memory_size_bytes", 0) or 0)
