"""CompileWorker: one grammar compile worker process (engine/grammar_child.py) and the pipe its
compile thread talks to it on. GrammarWorkers (engine/grammar_workers.py) gives each compile
thread of engine/grammar_jobs.py one, for good.

    ready()    the child spawned (unless it runs: it loads xgrammar meanwhile), sent the
               TokenizerInfo, READY awaited within --grammar-worker-start-timeout-s (else
               GrammarBusy, the child killed)
    compile()  [kind, spec] ─▶ child ─▶ the compiled grammar's JSON, within the time limit
               past the limit: the child is killed (GrammarTimeout); a new one starts at this
                 thread's next compile
               over --grammar-max-compiled-mib: the child fails it; a larger frame is refused
                 before it is read, the child killed
               the child dies while it compiles, and not by our hand (a crash, an OOM kill): the
                 grammar's fault, GrammarCrashed (a ValueError: kept at its second crash, then a
                 retry gets its 400 at once and starts no worker)
    abandoner() on the thread, before a job's ready(): what abandons that job's compile (its last
               request left): it ends at its start, or, running, its child is killed (a signal,
               no wait: the caller may be a node's loop) and it ends at once (GrammarBusy, not
               kept), not at the time limit
    reap_idle() any thread (GrammarWorkers' reaper): the child of a worker its thread has not used
               for --grammar-worker-idle-timeout-s killed (its memory freed); the next ready()
               starts another. In use means from ready() to compile()'s end, so a compile's
               child is never reaped
    stop()     any thread (close()): the child killed; its thread, if it waits on it, ends
               GrammarBusy

The thread only waits on a pipe here (select), so the GIL is free while a grammar compiles.
"""
from __future__ import annotations

import functools
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, NoReturn

from engine.grammar_child import COMPILED, FAILED, HEADER, READY
from engine.grammar_jobs import GrammarBusy, GrammarCrashed, GrammarTimeout, worker_late
from engine.grammar_limits import GrammarLimits
from pdwire.structured_output import StructuredOutput

CLOSED_POLL_S = 0.2       # how often a waiting thread looks whether the workers closed (a killed child wakes it at once)
_ROOT = str(Path(__file__).resolve().parent.parent)     # where the child finds this package, first
# -P: the current directory is not put on sys.path (its own `engine/` could shadow this one)
_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from engine.grammar_child import run; run(float(sys.argv[2]))"
CRASHED = "invalid grammar: the grammar compiler crashed on it"
ABANDONED = "the grammar's compile was abandoned: no request waits for it"


class WorkerEnded(GrammarBusy):
    """The child ended by itself (it crashed, or the system killed it): busy while it starts or
    waits for a grammar; while it compiles one, that grammar is blamed (CRASHED)."""


class CompileWorker:
    """One child process, used by one compile thread at a time; other threads only end it
    (abandon, reap_idle, stop)."""

    def __init__(self, info: bytes, limits: GrammarLimits, closed: threading.Event, on_ready: Callable[[], None]):
        self._info, self._limits, self._closed, self._on_ready = info, limits, closed, on_ready
        self._proc: subprocess.Popen | None = None
        self._ready = False
        self._ticket: threading.Event | None = None     # the job using it (abandoner() to compile()'s end): set, abandoned
        self._compiling = False     # compile() waits on the child
        self._in_use = False        # its thread uses the child: from ready() to compile()'s end
        self._idle_since = time.monotonic()     # when its thread last stopped using it
        self._lock = threading.Lock()       # the process, ticket and flags: its thread, and the others' ends

    def start(self) -> None:
        """Spawn the child unless it runs (it loads xgrammar meanwhile); never waits for it."""
        with self._lock:
            if self._closed.is_set():
                raise GrammarBusy.closing()
            self._in_use = True
            if self._proc is None:
                try:
                    self._proc = subprocess.Popen([sys.executable, "-P", "-c", _BOOT, _ROOT,
                                                   repr(self._limits.max_compiled_mib)], stdin=subprocess.PIPE,
                                                  stdout=subprocess.PIPE)
                except OSError as err:      # out of processes, descriptors or memory: the node's load, not the grammar's
                    self._in_use = False
                    raise GrammarBusy(f"could not start a grammar compile worker: {err}") from err
                os.set_blocking(self._proc.stdin.fileno(), False)
                self._ready = False

    def ready(self) -> None:
        """Until the child has loaded the tokenizer; raises GrammarBusy if it has not within the
        start limit (--grammar-worker-start-timeout-s), or died."""
        self.start()
        if self._ready:
            return
        deadline = time.monotonic() + self._limits.worker_start_timeout_s
        try:
            started = self._send(self._info, deadline) and self._receive(deadline) == READY
        except BaseException:
            self.kill()         # a frame half sent or read: this child is not spoken to again
            raise
        if not started:
            self.kill()
            raise worker_late(self._limits)
        self._ready = True
        self._on_ready()

    def compile(self, spec: StructuredOutput) -> memoryview:
        """`spec` compiled, as the CompiledGrammar's JSON (UTF-8). Raises ValueError if it does not
        compile, compiled it is over max_compiled_mib, or the child died compiling it (GrammarCrashed),
        GrammarTimeout past the time limit (the child killed), GrammarBusy if closing or abandoned."""
        with self._lock:
            ticket = self._ticket
            abandoned = ticket is not None and ticket.is_set()
            self._compiling = not abandoned
        try:
            if abandoned:
                raise GrammarBusy(ABANDONED)
            return self._compile(spec)
        finally:
            with self._lock:
                self._compiling, self._ticket, self._in_use = False, None, False
                self._idle_since = time.monotonic()
                late = not abandoned and ticket is not None and ticket.is_set()
            if late:        # abandoned while it ran: its child, signalled, is not kept for the next
                self.kill()

    def abandoner(self) -> Callable[[], None]:
        """On its thread, before ready(): what abandons the compile to come, from any thread."""
        ticket = threading.Event()
        with self._lock:
            self._ticket = ticket
        return functools.partial(self._abandon, ticket)

    def _abandon(self, ticket: threading.Event) -> None:
        """Nobody waits for the compile `ticket` names: it ends at its start, or, running, its child
        is killed (its thread meets the end of its pipe, reaps it and ends it GrammarBusy); nothing
        once it is over. Only signals: the caller may be a node's loop."""
        with self._lock:
            ticket.set()
            if self._ticket is ticket and self._compiling and self._proc is not None:
                self._proc.kill()

    def _compile(self, spec: StructuredOutput) -> memoryview:
        deadline = time.monotonic() + self._limits.timeout_s
        reply = None
        try:
            if self._send(json.dumps(spec.to_wire()).encode(), deadline):
                try:
                    reply = self._receive(deadline)
                except WorkerEnded as err:
                    raise GrammarCrashed(CRASHED) from err
        except (ValueError, GrammarBusy):
            raise
        except BaseException:
            self.kill()         # e.g. no memory for the reply's buffer: its rest would be the next compile's answer
            raise
        if reply is None:
            self.kill()
            raise GrammarTimeout.after(self._limits.timeout_s)
        if reply[:1] == COMPILED:
            return memoryview(reply)[1:]
        if reply[:1] == FAILED:
            raise ValueError(reply[1:].decode(errors="replace"))
        self.kill()
        raise GrammarBusy("the grammar compile worker answered out of turn: try again")

    def kill(self) -> None:
        """End the child and close its pipes (its thread only; idempotent): the next compile
        starts another."""
        with self._lock:
            proc, self._proc, self._ready = self._proc, None, False
        if proc is not None:
            _end(proc)

    def reap_idle(self, now: float) -> float | None:
        """Any thread: end the child if its thread has not used it for the idle limit; else when it
        is due (monotonic), or None while there is no child or it is in use."""
        with self._lock:
            if self._proc is None or self._in_use:
                return None
            if (due := self._idle_since + self._limits.worker_idle_timeout_s) > now:
                return due
            proc, self._proc, self._ready = self._proc, None, False
        _end(proc)      # its thread is not using it: the pipes are this thread's to close
        return None

    def stop(self) -> None:
        """End the child (any thread: close()); its thread, if it waits on it, meets the end of its
        pipe and closes it (closing a pipe under another thread's wait could wake it on another file)."""
        with self._lock:
            proc = self._proc
        if proc is not None:
            proc.kill()
            proc.wait()

    def _send(self, payload: bytes, deadline: float) -> bool:
        """Write a frame; False if the deadline came first."""
        data = memoryview(HEADER.pack(len(payload)) + payload)
        fd = self._fd("stdin")
        while data:
            if not self._wait(fd, deadline, write=True):
                return False
            try:
                data = data[os.write(fd, data):]
            except BlockingIOError:
                continue
            except OSError:     # the child ended
                self._gone()
        return True

    def _receive(self, deadline: float) -> bytearray | None:
        """The next frame; None if the deadline came first. A frame over a compiled grammar's
        limit (and its tag) is not read: the child killed, the grammar too large (ValueError)."""
        head = self._read(HEADER.size, deadline)
        if head is None:
            return None
        (size,) = HEADER.unpack(head)
        if size > self._limits.max_compiled_bytes + 1:
            self.kill()
            raise self._limits.too_large()
        return self._read(size, deadline)

    def _read(self, size: int, deadline: float) -> bytearray | None:
        """`size` bytes read into one buffer (no copy after), or None if the deadline came first."""
        fd, out, got = self._fd("stdout"), bytearray(size), 0
        view = memoryview(out)
        while got < size:
            if not self._wait(fd, deadline, write=False):
                return None
            if not (count := os.readv(fd, [view[got:]])):
                self._gone()
            got += count
        return out

    def _wait(self, fd: int, deadline: float, write: bool) -> bool:
        """Until `fd` is ready (True) or the deadline (False), looking every CLOSED_POLL_S whether the
        workers closed (GrammarBusy)."""
        while True:
            if self._closed.is_set():
                self.kill()
                raise GrammarBusy.closing()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            poller = select.poll()
            poller.register(fd, select.POLLOUT if write else select.POLLIN)
            if poller.poll(1000 * min(left, CLOSED_POLL_S)):
                return True     # ready, or the child's end (the read or write that follows sees it)

    def _fd(self, name: str) -> int:
        proc = self._proc
        if proc is None:
            raise GrammarBusy.closing()
        return getattr(proc, name).fileno()

    def _gone(self) -> NoReturn:
        """The child ended (it crashed, or was killed by close() or abandon())."""
        with self._lock:
            abandoned = self._ticket is not None and self._ticket.is_set()
        closing = self._closed.is_set()
        self.kill()
        if closing:
            raise GrammarBusy.closing()
        if abandoned:
            raise GrammarBusy(ABANDONED)
        raise WorkerEnded("the grammar compile worker ended: try again")


def _end(proc: subprocess.Popen) -> None:
    """Kill a child no thread waits on, reap it and close its pipes."""
    proc.kill()
    proc.wait()
    proc.stdin.close()
    proc.stdout.close()
