"""GrammarWorkers: the child processes a grammar compiler compiles in (engine/grammar_child.py),
one per compile thread of engine/grammar_jobs.py (at most max_compiles), so that a compile past its
time limit is ended by killing its process: its core is free at once, and no thread is ever left
inside xgrammar's C++, which cannot be stopped (nor can a process wait for it at its exit).

    compile thread ──▶ its own CompileWorker (engine/grammar_worker.py: claimed at first use, its
                       child spawned at first use): abandoner(), ready(), compile()
    reaper thread (from the first claim to close()): a child its thread has not used for
    --grammar-worker-idle-timeout-s is killed (~270 MiB freed); its next compile starts another
    close(): every child killed; a thread waiting on one ends at once (GrammarBusy). The
    interpreter's exit closes the workers before it joins the compile threads, so no exit waits
    for a compile (an offline LLM's script that never calls close() included)
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import Callable

from engine.grammar_limits import GrammarLimits
from engine.grammar_worker import CompileWorker
from pdwire.structured_output import StructuredOutput


class GrammarWorkers:
    """max_compiles CompileWorkers; each compile thread claims one for good, and starts its process
    at its first compile (a thread is made only when no idle one is left: one compile at a time,
    one process)."""

    def __init__(self, tokenizer_info_json: str, limits: GrammarLimits):
        self._closed = threading.Event()
        self._idle_timeout_s = limits.worker_idle_timeout_s
        self._reaper: threading.Thread | None = None    # started at the first claim
        info = tokenizer_info_json.encode()
        self._free = [CompileWorker(info, limits, self._closed, self._note_ready) for _ in range(limits.max_compiles)]
        self._warm_at: float | None = None      # monotonic seconds the first worker was ready
        self._all = list(self._free)
        self._mine = threading.local()
        self._lock = threading.Lock()
        # CPython's hook to run before the interpreter's exit joins threads, as concurrent.futures'
        # own, which joins the compile threads: run in reverse order, this one comes first
        threading._register_atexit(_close_at_exit, weakref.ref(self))

    def ready(self) -> None:
        """This thread's worker started and loaded (CompileJobs' prepare: before a compile's clock)."""
        self._claim().ready()

    def compile(self, spec: StructuredOutput) -> memoryview:
        return self._claim().compile(spec)

    def abandoner(self) -> Callable[[], None]:
        """What abandons this thread's compile (CompileJobs: its job's last waiter left)."""
        return self._claim().abandoner()

    def warm_since(self) -> float | None:
        """When the first worker was ready (monotonic), or None: until then nothing queues."""
        return self._warm_at

    def _note_ready(self) -> None:
        if self._warm_at is None:
            self._warm_at = time.monotonic()

    def close(self) -> None:
        """Kill every child: the compiles running end at once, and none starts after."""
        self._closed.set()
        for worker in self._all:
            worker.stop()

    def _claim(self) -> CompileWorker:
        worker = getattr(self._mine, "worker", None)
        if worker is None:
            with self._lock:
                worker = self._mine.worker = self._free.pop()
                if self._reaper is None:
                    self._reaper = threading.Thread(target=self._reap, name="grammar-worker-reaper", daemon=True)
                    self._reaper.start()
        return worker

    def _reap(self) -> None:
        """The reaper: ends the children idle past the limit, waking when the next one is due (at
        most the limit apart: a child in use is due a limit after its use ends), until close()."""
        while True:
            now = time.monotonic()
            dues = [due for worker in self._all if (due := worker.reap_idle(now)) is not None]
            if self._closed.wait(min(dues, default=now + self._idle_timeout_s) - now):
                return


def _close_at_exit(ref: weakref.ref) -> None:
    """The interpreter exits: the compiles end now (GrammarBusy), so its join of their threads does
    not wait for them."""
    if (workers := ref()) is not None:
        workers.close()
