"""A grammar compile worker: a child process of a grammar compiler (engine/grammar_worker.py)
that compiles one grammar at a time, so that a compile past its time limit ends when the process
is killed (a thread inside xgrammar's C++ cannot be stopped).

    python -P -c "...; from engine.grammar_child import run; run(max_compiled_mib)"   (CompileWorker starts it)

Frames on stdin and stdout, each a 4-byte big-endian length and that many bytes; nothing else goes
to stdout (fd 1 is pointed at stderr, so no library's print can break a frame):

    parent -> child: the tokenizer's xgrammar TokenizerInfo as JSON (once), then per compile
                     the StructuredOutput's [kind, spec] as JSON
    child -> parent: READY once the tokenizer is loaded; per compile COMPILED + the
                     CompiledGrammar's JSON (serialize_json), or FAILED + the ValueError's text
                     (a compiled grammar over max_compiled_mib, --grammar-max-compiled-mib, too)

It ends when its stdin closes, or within PARENT_POLL_S of its parent's end (os._exit included).
"""
from __future__ import annotations

import json
import os
import signal
import struct
import sys
import threading
import time
from typing import BinaryIO

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 30       # a frame from the parent (the tokenizer's info); replies: max_compiled_mib
READY, COMPILED, FAILED = b"=", b"+", b"-"
PARENT_POLL_S = 0.5


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame, or None at the end of the stream. Raises ValueError past MAX_FRAME_BYTES."""
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes, over {MAX_FRAME_BYTES}")
    body = stream.read(size)
    return body if len(body) == size else None


def write_frame(stream: BinaryIO, payload: bytes) -> None:
    stream.write(HEADER.pack(len(payload)))
    stream.write(payload)
    stream.flush()


def main(max_compiled_mib: float) -> None:
    from engine.grammar_limits import GrammarLimits
    limits = GrammarLimits(max_compiled_mib=max_compiled_mib)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _watch_parent(os.getppid())
    import xgrammar as xgr
    _die_on_faults()
    from engine.grammar_specs import compile_spec
    from pdwire.structured_output import StructuredOutput

    stdin = sys.stdin.buffer
    if (info := read_frame(stdin)) is None:
        return
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info.decode()), max_threads=1,
                                   cache_enabled=False)
    write_frame(out, READY)
    while (frame := read_frame(stdin)) is not None:
        try:
            reply = COMPILED + compile_spec(xgr, compiler, StructuredOutput.from_wire(json.loads(frame))) \
                .serialize_json().encode()
        except ValueError as err:
            reply = FAILED + str(err).encode()
        if len(reply) > limits.max_compiled_bytes + 1:
            reply = FAILED + str(limits.too_large()).encode()
        write_frame(out, reply)


def _die_on_faults() -> None:
    """A fault kills this worker at once, as the default action does: xgrammar's import installs
    a SIGSEGV handler of its own (a backtrace printer), which, entered while another thread holds a
    lock it needs, left a crashed worker alive and its compile hung until the time limit (seen
    under load in the suite; tests/engine/test_grammar_workers.py). The parent then fails the
    grammar at once as crashed (engine/grammar_jobs.py)."""
    for sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT):
        signal.signal(sig, signal.SIG_DFL)


def _watch_parent(parent: int) -> None:
    """Leave at once when the parent is gone (a killed or os._exit-ed node leaves no compile behind)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run(max_compiled_mib: float) -> None:
    """The worker's life: main(), and a quiet end when its parent goes first."""
    try:
        main(max_compiled_mib)
    except (BrokenPipeError, KeyboardInterrupt):
        os._exit(0)
