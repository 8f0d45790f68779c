"""Grammar compile workers failing for reasons that are not the grammar's (engine/grammar_worker.py):
a spawn refused by the system is busy (retried, never kept), not a broken engine; a reply whose read
fails half way never becomes the next compile's answer."""
from __future__ import annotations

import asyncio
import errno
import subprocess

import pytest

from engine import LLM, SamplingParams, grammar_worker
from engine.grammar import GrammarCompiler
from engine.grammar_jobs import GrammarBusy
from engine.grammar_limits import GrammarLimits
from pdwire.structured_output import GrammarKind, StructuredOutput
from tests.engine.slow_grammar import wide_tokenizer
from tests.engine.test_grammar_compiles import OTHER, _colocated
from tests.tiny_chat_model import tiny_chat_model_folder


@pytest.fixture
def spawn_fails_once(monkeypatch):
    """The first worker spawn fails as with too many open files (or no memory, or no pids)."""
    real, calls = subprocess.Popen, []

    def popen(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(*args, **kwargs)
    monkeypatch.setattr(grammar_worker.subprocess, "Popen", popen)


def test_a_worker_that_cannot_spawn_is_busy_and_not_kept(spawn_fails_once):
    """The job fails GrammarBusy (retryable), and the next submit compiles afresh: before, the
    OSError was kept as the grammar's own result, refusing it on that node for good."""
    tok = wide_tokenizer()
    spec = StructuredOutput(GrammarKind.REGEX, "[0-9]{3}")
    compiler = GrammarCompiler(tok, len(tok), [2], GrammarLimits(max_compiles=1))
    try:
        first = compiler.submit(spec)
        assert isinstance(first.future.exception(timeout=60), GrammarBusy)
        again = compiler.submit(spec)
        assert again is not first
        assert "0-9" in str(compiler.compiled(spec).grammar)
    finally:
        compiler.close()


def test_one_failed_worker_spawn_does_not_break_the_colocated_engine(tmp_path, spawn_fails_once):
    """The structured request is refused as busy; a plain request after it is served (the OSError
    escaped add_request and marked the engine broken: every later request refused)."""
    tiny_chat_model_folder(tmp_path)
    engine = LLM(str(tmp_path), block_size=16, num_blocks=64).engine
    backend, collect = _colocated(engine)
    try:
        async def outcome(rid, params):
            try:
                return await asyncio.wait_for(collect(rid, params), 60)
            except Exception as e:      # noqa: BLE001 -- the request's own failure, looked at below
                return e
        structured = asyncio.run(outcome("s", SamplingParams(temperature=0, max_tokens=5, structured=OTHER)))
        plain = asyncio.run(outcome("p", SamplingParams(max_tokens=3, ignore_eos=True)))
        assert not isinstance(plain, Exception), plain
        assert not isinstance(structured, Exception) or "busy" in str(structured).lower() or "worker" in str(structured)
    finally:
        backend.close()


@pytest.mark.parametrize("where", ["body", "header"])
def test_a_failed_read_does_not_poison_the_next_compile(monkeypatch, where):
    """No memory for a reply's buffer (its body, or its 4-byte header) half way through reading it:
    the child is killed, so the next grammar on that worker gets its own answer, not the rest of
    the previous one's (a wrong 'over 64 MiB' 400, or the previous grammar compiled)."""
    tok = wide_tokenizer()
    compiler = GrammarCompiler(tok, len(tok), [2], GrammarLimits(max_compiles=1))
    try:
        compiler.compiled(StructuredOutput(GrammarKind.REGEX, "x"))         # the worker is up
        armed = [True]

        def buffer(size):
            if armed[0] and (size > 64 if where == "body" else size == 4):
                armed[0] = False
                raise MemoryError("no memory for the reply")
            return bytearray(size)
        monkeypatch.setattr(grammar_worker, "bytearray", buffer, raising=False)
        with pytest.raises(MemoryError):
            compiler.compiled(StructuredOutput(GrammarKind.REGEX, "[0-9]{3}"))
        grammar = str(compiler.compiled(StructuredOutput(GrammarKind.REGEX, "[a-z]{3}")).grammar)
        assert "a-z" in grammar and "0-9" not in grammar
    finally:
        compiler.close()
