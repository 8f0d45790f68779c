"""CompileJobs and GrammarWaits with a stub compile (no model, no xgrammar): a queued compile
whose requests all left is cancelled and frees its place, a running one is abandoned and holds
its place until its thread is free; close() cancels the queued compiles and waits a bounded time
for the running ones (abandoned ones too); a process with a compile that never ends still
exits, with its own status; the kept results are bounded in bytes as well as in number; a grammar
that crashed its worker once is compiled again, and kept as failing at its second crash."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest

from engine import grammar_jobs
from engine.grammar_jobs import CompileJobs, GrammarBusy, GrammarCrashed
from engine.grammar_limits import GrammarLimits
from engine.grammar_waits import GrammarWaits


@pytest.fixture
def stub():
    """A compile that records each spec it starts; specs starting "held" wait for the gate."""
    gate, started = threading.Event(), []

    def compile_(spec):
        started.append(spec)
        if spec.startswith("held"):
            gate.wait(60)
        return SimpleNamespace(spec=spec, memory_size_bytes=0)
    yield SimpleNamespace(compile=compile_, gate=gate, started=started)
    gate.set()


def _settle_all(waits: GrammarWaits) -> list:
    out, deadline = [], time.monotonic() + 60
    while waits and time.monotonic() < deadline:
        out += waits.settled()
        time.sleep(0.005)
    assert not waits, "a wait never settled"
    return out


def test_queued_compiles_whose_requests_all_left_never_run(stub):
    """Two running, four queued: two queued requests are aborted, two wait out their time (busy).
    Then only the two running compiles count: a new grammar is taken, not busy, and none of the
    four queued ones is ever compiled (they all were, keeping the compiler busy for nobody)."""
    jobs = CompileJobs(stub.compile, GrammarLimits(timeout_s=0.2, max_compiles=2, max_queued=4))
    waits: GrammarWaits[str] = GrammarWaits()
    for name in ("held-a", "held-b", "q1", "q2", "q3", "q4"):
        waits.park(name, jobs.submit(name, name), name)
    with pytest.raises(GrammarBusy, match="--grammar-max-queued"):
        jobs.submit("new", "new")
    waits.drop("q1")
    waits.drop("q2")
    settled = {rid: error for rid, _, error in _settle_all(waits)}
    assert isinstance(settled["q3"], GrammarBusy) and isinstance(settled["q4"], GrammarBusy)
    assert isinstance(settled["held-a"], ValueError)        # past its time limit, still running
    assert jobs.pending == 2
    new = jobs.submit("new", "new")
    waits.park("new", new, "new")
    stub.gate.set()
    assert _settle_all(waits)[0].error is None and new.future.result().spec == "new"
    assert sorted(stub.started) == ["held-a", "held-b", "new"]


def test_a_queued_compile_shared_by_two_requests_runs_while_one_waits(stub):
    """The first request to leave a shared queued job does not cancel it; the second one's wait
    gets the result."""
    jobs = CompileJobs(stub.compile, GrammarLimits(timeout_s=30, max_compiles=1, max_queued=1))
    waits: GrammarWaits[str] = GrammarWaits()
    waits.park("held", jobs.submit("held", "held"), "held")
    shared = jobs.submit("q", "q")
    waits.park("r1", shared, "r1")
    waits.park("r2", jobs.submit("q", "q"), "r2")
    waits.drop("r1")
    stub.gate.set()
    settled = {rid: error for rid, _, error in _settle_all(waits)}
    assert settled == {"held": None, "r2": None} and shared.future.result().spec == "q"


def test_close_cancels_the_queued_compiles_and_waits_a_bounded_time(stub):
    jobs = CompileJobs(stub.compile, GrammarLimits(max_compiles=1, max_queued=2))
    running, queued = jobs.submit("held", "held"), jobs.submit("q", "q")
    while running.started is None:
        time.sleep(0.001)
    assert jobs.close(wait_s=0.05) is False and queued.future.cancelled() and not running.done
    with pytest.raises(GrammarBusy, match="closing"):
        jobs.submit("later", "later")
    stub.gate.set()
    assert jobs.close(wait_s=30) is True and stub.started == ["held"]


def test_an_abandoned_compile_holds_its_place_until_its_thread_is_free(stub):
    """A running job whose last waiter left is abandoned: it leaves pending (a new submit of its
    grammar is a new job), but it holds its place and close() waits for it until its thread is
    free (gram4's abandon dropped it: close() said True while its thread still compiled, and a
    colocated router's exit then waited for that thread forever)."""
    abandoned = []
    jobs = CompileJobs(stub.compile, GrammarLimits(max_compiles=1, max_queued=0),
                       abandoner=lambda: lambda: abandoned.append("held"))
    job = jobs.submit("held", "held")
    job.join()
    while job.started is None:
        time.sleep(0.001)
    job.leave()
    assert abandoned == ["held"] and jobs.pending == 1 and not job.done
    with pytest.raises(GrammarBusy, match="--grammar-max-queued"):
        jobs.submit("held", "held")
    assert jobs.close(wait_s=0.05) is False
    stub.gate.set()
    assert jobs.close(wait_s=30) is True and jobs.pending == 0 and abandoned == ["held"]


EXIT_WITH_A_HELD_COMPILE = textwrap.dedent("""
    import threading, time
    from engine.grammar_jobs import CompileJobs
    from engine.grammar_limits import GrammarLimits
    from router.cli import leave_now
    jobs = CompileJobs(lambda spec: threading.Event().wait(), GrammarLimits(max_compiles=1))
    running, queued = jobs.submit("held", 1), jobs.submit("queued", 2)
    while running.started is None:
        time.sleep(0.001)
    print(jobs.close(0.1), queued.future.cancelled(), flush=True)
    leave_now(0)
""")


def test_a_process_whose_compile_never_ends_exits_with_its_status():
    """close() gives up on the running compile after its bound and the colocated router's exit
    (router/cli.py leave_now) ends the process with status 0, without waiting for it (the
    interpreter's exit used to wait for every compile, the queued ones too)."""
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", EXIT_WITH_A_HELD_COMPILE], capture_output=True, text=True,
                          timeout=300, env=env)
    assert (done.returncode, done.stdout) == (0, "False True\n"), done.stderr[-2000:]


def test_kept_results_are_bounded_in_bytes(monkeypatch):
    """Past RECENT_BYTES of compiled grammars, the oldest are dropped (the newest always stays)."""
    monkeypatch.setattr(grammar_jobs, "RECENT_BYTES", 250)
    jobs = CompileJobs(lambda spec: SimpleNamespace(memory_size_bytes=100), GrammarLimits(max_compiles=1))
    firsts = [jobs.submit(k, k) for k in ("a", "b", "c")]
    for job in firsts:
        job.future.result(timeout=30)
    deadline = time.monotonic() + 30
    while jobs.pending and time.monotonic() < deadline:
        time.sleep(0.001)
    assert jobs.submit("c", "c") is firsts[2] and jobs.submit("b", "b") is firsts[1]
    assert jobs.submit("a", "a") is not firsts[0]       # dropped: compiled again
    jobs.close()


def test_a_result_kept_twice_under_one_key_counts_its_bytes_once(monkeypatch, stub):
    """An abandoned job that still ends with a result, after the new job of its grammar did,
    replaces that one in the kept results and its bytes count once (they were counted twice:
    the bound in bytes dropped results that fit)."""
    monkeypatch.setattr(grammar_jobs, "RECENT_BYTES", 250)
    jobs = CompileJobs(lambda spec: stub.compile(spec) and SimpleNamespace(memory_size_bytes=100),
                       GrammarLimits(max_compiles=2), abandoner=lambda: lambda: None)
    old = jobs.submit("held", "held-x")
    old.join()
    while old.started is None:
        time.sleep(0.001)
    old.leave()         # abandoned: a stub compile cannot be stopped, it ends when the gate opens
    new = jobs.submit("held", "y")
    assert new is not old and new.future.result(timeout=30).memory_size_bytes == 100
    _until_idle(jobs, 1)
    stub.gate.set()
    old.future.result(timeout=30)
    _until_idle(jobs, 0)
    assert jobs.submit("held", "held-x") is old
    a = jobs.submit("a", "a")
    a.future.result(timeout=30)
    _until_idle(jobs, 0)
    assert jobs.submit("held", "held-x") is old and jobs.submit("a", "a") is a     # 200 bytes kept, not 300
    jobs.close()


def test_a_grammar_is_kept_as_crashing_only_at_its_second_crash():
    """A worker's death while it compiles a grammar fails that job, but a one-off (an OOM kill)
    does not poison the grammar: the next submit compiles it again; the second crash in a row is
    kept (a retry gets it at once, no compile)."""
    crashing, compiled = {"bad", "flaky"}, []

    def compile_(spec):
        compiled.append(spec)
        if spec in crashing:
            raise GrammarCrashed("invalid grammar: the grammar compiler crashed on it")
        return SimpleNamespace(spec=spec, memory_size_bytes=0)
    jobs = CompileJobs(compile_, GrammarLimits(max_compiles=1))
    first = _ended(jobs, "bad")
    assert isinstance(first.future.exception(), GrammarCrashed)
    second = _ended(jobs, "bad")
    assert second is not first and isinstance(second.future.exception(), GrammarCrashed)
    assert jobs.submit("bad", "bad") is second and compiled == ["bad", "bad"]
    _ended(jobs, "flaky")
    crashing.discard("flaky")
    good = _ended(jobs, "flaky")
    assert good.future.result().spec == "flaky" and compiled == ["bad", "bad", "flaky", "flaky"]
    jobs.close()


def _ended(jobs: CompileJobs, key: str):
    """`key` submitted, once its job ended and left pending (kept or not)."""
    job = jobs.submit(key, key)
    job.future.exception(timeout=30)
    _until_idle(jobs, 0)
    return job


def _until_idle(jobs: CompileJobs, pending: int) -> None:
    deadline = time.monotonic() + 60
    while jobs.pending != pending and time.monotonic() < deadline:
        time.sleep(0.001)
    assert jobs.pending == pending
