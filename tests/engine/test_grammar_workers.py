"""Grammar compiles run in worker processes (engine/grammar_workers.py): a compile past its time
limit, or one nobody waits for any more, is killed there, its core and its place freed at once;
a worker that crashes on a grammar fails it (kept at its second crash); an idle worker ends; close() ends a running compile
at once; a compiled grammar comes back whole (the same masks as one compiled in this process)."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from engine.grammar import GrammarCompiler
from engine.grammar_jobs import GrammarBusy, GrammarTimeout
from engine.grammar_limits import GrammarLimits
from engine.grammar_worker import CompileWorker
from engine.grammar_workers import GrammarWorkers
from pdwire.structured_output import GrammarKind, StructuredOutput
from tests.engine.slow_grammar import SLOW, wide_tokenizer
from tests.tiny_chat_model import tiny_chat_model_folder

HANG_S = 300        # bounds a hang only: a starved machine may take many times what it takes here


@pytest.fixture(scope="module")
def tok():
    return wide_tokenizer()


def _workers() -> set[int]:
    """The pids of this process's grammar compile workers (alive, not reaped)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"engine.grammar_child" in cmdline:
            pids.add(int(entry.name))
    return pids


def test_a_compile_past_its_time_limit_is_killed_and_its_place_is_free(tok):
    """A grammar that compiles for minutes ends GrammarTimeout at the time limit, its worker
    process killed (its core free; the thread that ran it used to compile on to the end), and the
    one compile place serves the next grammar at once, in a new worker. The timeout is not kept:
    the same grammar submitted again compiles again."""
    others = _workers()
    compiler = GrammarCompiler(tok, len(tok), [2], GrammarLimits(timeout_s=1.0, max_compiles=1))
    try:
        slow = compiler.submit(SLOW)
        _started(slow)
        assert len(first := _workers() - others) == 1      # started with the first compile
        assert isinstance(slow.future.exception(timeout=HANG_S), GrammarTimeout)
        assert _workers() - others == set()         # killed and reaped
        quick = compiler.submit(StructuredOutput(GrammarKind.REGEX, "[0-9]{3}"))
        assert quick.future.exception(timeout=HANG_S) is None
        assert len(second := _workers() - others) == 1 and second != first
        assert compiler.submit(SLOW) is not slow
    finally:
        assert compiler.close() is True
    assert _workers() - others == set()


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGKILL])
def test_a_grammar_its_worker_dies_compiling_fails_invalid_and_is_kept_at_the_second_death(tok, sig):
    """A worker that dies while it compiles a grammar (a crash, an OOM kill: here a signal) fails
    that grammar as invalid (a ValueError, a 400; it used to be GrammarBusy, retried at once in a
    new worker, 2.8 s and 276 MiB each time). One death may be the node's (an OOM kill): the same
    grammar submitted again compiles again, in a new worker (it was kept at once, failing for
    good); the second death is kept: a third submit is answered by that job, no worker started."""
    others = _workers()
    compiler = GrammarCompiler(tok, len(tok), [2], GrammarLimits(timeout_s=600, max_compiles=1))
    try:
        first = _killed_compiling(compiler, others, sig)
        second = compiler.submit(SLOW)
        assert second is not first
        _killed_compiling(compiler, others, sig, second)
        assert compiler.submit(SLOW) is second and _workers() - others == set()
        with pytest.raises(ValueError, match="crashed"):
            compiler.compiled(SLOW)
    finally:
        assert compiler.close() is True


def test_a_compiling_worker_leaves_faults_to_their_default_action(tok):
    """xgrammar's import installs a SIGSEGV handler (a backtrace printer) that could deadlock in a
    crashed worker and leave its compile hung to the time limit: a worker compiling catches none of
    SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT (their default action kills it at once)."""
    others = _workers()
    compiler = GrammarCompiler(tok, len(tok), [2], GrammarLimits(timeout_s=600, max_compiles=1))
    try:
        _started(compiler.submit(SLOW))
        (worker,) = _workers() - others
        caught = next(int(line.split()[1], 16) for line in Path(f"/proc/{worker}/status").read_text().splitlines()
                      if line.startswith("SigCgt:"))
        faults = (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT)
        assert [s.name for s in faults if caught >> (s - 1) & 1] == []
    finally:
        assert compiler.close() is True


def _killed_compiling(compiler: GrammarCompiler, others: set[int], sig: int, job=None):
    """SLOW's job (submitted unless given) once its worker, killed by `sig` while it compiles,
    failed it (the worker reaped)."""
    job = job or compiler.submit(SLOW)
    _started(job)
    (worker,) = _workers() - others
    os.kill(worker, sig)
    error = job.future.exception(timeout=HANG_S)
    assert isinstance(error, ValueError) and "crashed" in str(error)
    assert _workers() - others == set()
    _until(lambda: compiler._jobs.pending == 0, "the crashed job stayed pending")
    return job


def test_a_grammar_compiled_over_the_size_limit_fails_invalid(tok):
    """A compiled grammar larger than --grammar-max-compiled-mib fails as invalid (a ValueError,
    kept); its worker stays and compiles the next grammar, under the limit."""
    others = _workers()
    small, large = StructuredOutput(GrammarKind.REGEX, "a"), StructuredOutput(GrammarKind.REGEX, "[0-9]{1,40}")
    compiler = GrammarCompiler(tok, len(tok), [2], GrammarLimits(max_compiles=1, max_compiled_mib=0.02))
    try:
        with pytest.raises(ValueError, match="grammar-max-compiled-mib"):
            compiler.compiled(large)
        worker = _workers() - others
        assert compiler.compiled(small) is not None and _workers() - others == worker
        assert compiler.submit(large).future.exception() is not None
    finally:
        assert compiler.close() is True


def test_a_compile_its_last_waiter_leaves_is_killed(tok):
    """The last request waiting for a running compile leaves (aborted, its wait ran out): its
    worker is killed at once (it used to compile on to the time limit, 600 s here), the job ends
    GrammarBusy and is not kept; the same grammar submitted again is a new job."""
    others = _workers()
    compiler = GrammarCompiler(tok, len(tok), [2], GrammarLimits(timeout_s=600, max_compiles=1))
    try:
        job = compiler.submit(SLOW)
        job.join()
        _started(job)
        assert len(_workers() - others) == 1
        job.leave()
        assert isinstance(job.future.exception(timeout=HANG_S), GrammarBusy)
        assert _workers() - others == set()
        again = compiler.submit(SLOW)
        assert again is not job and not again.done
    finally:
        assert compiler.close() is True


def test_a_compile_abandoned_while_its_worker_starts_ends_at_its_start(tok, monkeypatch):
    """A job whose last waiter leaves while its worker starts never compiles: it ends GrammarBusy
    once the worker is ready, and that worker is kept (the next grammar compiles in it)."""
    readying, go, real_ready = threading.Event(), threading.Event(), GrammarWorkers.ready

    def held_ready(self):
        readying.set()
        go.wait(HANG_S)
        real_ready(self)
    monkeypatch.setattr(GrammarWorkers, "ready", held_ready)
    others = _workers()
    compiler = GrammarCompiler(tok, len(tok), [2], GrammarLimits(timeout_s=600, max_compiles=1))
    try:
        job = compiler.submit(SLOW)
        job.join()
        assert readying.wait(HANG_S)
        job.leave()
        go.set()
        error = job.future.exception(timeout=HANG_S)
        assert isinstance(error, GrammarBusy) and "abandoned" in str(error) and job.started is not None
        assert len(worker := _workers() - others) == 1
        assert compiler.compiled(StructuredOutput(GrammarKind.REGEX, "[0-9]{3}")) is not None
        assert _workers() - others == worker
    finally:
        assert compiler.close() is True


def test_an_idle_worker_ends_and_the_next_compile_starts_another(tok):
    """A worker that compiled nothing for --grammar-worker-idle-timeout-s ends (its memory freed;
    it used to live as long as its node), and the next grammar compiles in a new one."""
    others = _workers()
    compiler = GrammarCompiler(tok, len(tok), [2], GrammarLimits(max_compiles=1, worker_idle_timeout_s=0.2))
    try:
        assert compiler.compiled(StructuredOutput(GrammarKind.REGEX, "[0-9]{3}")) is not None
        _until(lambda: _workers() - others == set(), "the idle worker never ended")
        assert compiler.compiled(StructuredOutput(GrammarKind.REGEX, "[a-z]{3}")) is not None
    finally:
        assert compiler.close() is True


def test_a_compiling_worker_is_never_reaped_as_idle(tok, monkeypatch):
    """The reaper passes over a worker whose compile runs however long it runs (it wakes every
    idle limit meanwhile): only the time limit or close() ends it."""
    rounds, reap_idle = [], CompileWorker.reap_idle

    def counted(self, now):
        rounds.append(now)
        return reap_idle(self, now)
    monkeypatch.setattr(CompileWorker, "reap_idle", counted)
    others = _workers()
    compiler = GrammarCompiler(tok, len(tok), [2], GrammarLimits(timeout_s=600, max_compiles=1,
                                                                 worker_idle_timeout_s=0.05))
    try:
        job = compiler.submit(SLOW)
        _started(job)
        (worker,) = _workers() - others
        seen = len(rounds)
        _until(lambda: len(rounds) >= seen + 3, "the reaper stopped")
        assert not job.done and _workers() - others == {worker}
    finally:
        assert compiler.close() is True


def test_close_ends_a_running_compile_at_once(tok):
    """close() kills the worker a compile runs in: True (nothing runs any more) within its short
    wait, the job ended GrammarBusy (it used to be False, the compile running on for minutes in a
    thread that kept the process from exiting)."""
    others = _workers()
    compiler = GrammarCompiler(tok, len(tok), [2], GrammarLimits(timeout_s=600, max_compiles=1))
    job = compiler.submit(SLOW)
    _started(job)
    assert not job.done
    assert compiler.close() is True
    assert isinstance(job.future.exception(timeout=HANG_S), GrammarBusy) and _workers() - others == set()


def test_a_worker_ignores_an_engine_package_in_the_current_directory(tok, tmp_path, monkeypatch):
    """The worker imports this tree's engine, not one in the node's current directory (`python -c`
    put the current directory first on sys.path: a fake `engine/` there broke every compile)."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text("raise SystemExit('the fake engine')\n")
    monkeypatch.chdir(tmp_path)
    compiler = GrammarCompiler(tok, len(tok), [2], GrammarLimits(max_compiles=1))
    try:
        assert compiler.compiled(StructuredOutput(GrammarKind.REGEX, "[0-9]{3}")) is not None
    finally:
        assert compiler.close() is True


def test_a_grammar_compiled_in_a_worker_masks_as_one_compiled_here(tmp_path):
    """The worker's compiled grammar, loaded here, allows exactly the tokens an in-process compile
    of the same JSON schema allows, step by step along the output of its first allowed tokens
    (the tiny chat model's byte-level tokenizer, which spells JSON)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer
    from engine.grammar_specs import compile_spec
    tiny_chat_model_folder(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    spec = StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id], GrammarLimits(max_compiles=1))
    try:
        ours = compiler.matcher(compiler.compiled(spec))
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
        here = xgr.GrammarMatcher(compile_spec(xgr, xgr.GrammarCompiler(info, max_threads=1), spec))
        masks = xgr.allocate_token_bitmask(2, len(tok))         # [2, ceil(vocab / 32)] int32
        for step in range(6):
            ours.fill(masks, 0)
            here.fill_next_token_bitmask(masks, 1)
            assert torch.equal(masks[0], masks[1]) and masks[0].any(), f"step {step}"
            token = _first_allowed(masks[1])
            assert ours.accept(token) and here.accept_token(token)
    finally:
        compiler.close()


def _started(job) -> None:
    """Until the job's compile began in its worker (its worker started)."""
    deadline = time.monotonic() + HANG_S
    while job.started is None and not job.done and time.monotonic() < deadline:
        time.sleep(0.005)
    assert job.started is not None, job.future.exception() if job.done else "its worker never started"


def _until(condition, why: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition(), why


def _first_allowed(row: torch.Tensor) -> int:
    """The smallest token id a bitmask row allows (bit i of word w: token 32 w + i)."""
    word = int(torch.nonzero(row)[0])
    bits = int(row[word]) & 0xFFFFFFFF
    return 32 * word + (bits & -bits).bit_length() - 1
