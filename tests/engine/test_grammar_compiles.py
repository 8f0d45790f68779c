"""Grammar compiles never hold the loop that takes a request: a grammar compiles on a thread of
its own while its request waits parked; a cached grammar is served while another compiles; n > 1
forks its matchers from the request's compiled grammar (nothing compiles inside a step); too many
compiles is a retryable busy, never a 400; a process exits cleanly while a compile runs."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import pytest

from engine import SamplingParams
from engine.grammar_jobs import GrammarBusy
from pdwire.structured_output import GrammarKind, StructuredOutput
from router.backend import NoNodeAvailable
from router.colocated import ColocatedBackend
from tests.engine.test_structured_output import REGEX, _check, _run
from tests.tiny_chat_model import tiny_chat_model_folder

HELD = StructuredOutput(GrammarKind.REGEX, "held-[0-9]")     # its compile waits for the test (conftest.held)
OTHER = StructuredOutput(GrammarKind.REGEX, REGEX)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-chat")
    tiny_chat_model_folder(path)
    return str(path)


def test_n2_forks_a_cached_grammar_while_another_compile_is_past_its_time(chat_dir, make_llm, held):
    """With one compile past its time limit and still running, a request with n = 2 and a cached
    grammar runs to its end: its children's matchers come from its compiled grammar (the fork
    used to compile, was refused, failed half-done and broke block integrity)."""
    engine = make_llm(chat_dir, block_size=16, num_blocks=64, grammar_compile_timeout_s=0.2).engine
    first = _run(engine, "first", [5, 6], SamplingParams(temperature=0, max_tokens=30, structured=OTHER), 0)
    _check(first.text, OTHER)
    with pytest.raises(ValueError, match="did not compile within 0.2 s"):
        engine.add_request("slow", [5, 6], SamplingParams(structured=HELD))
    engine.add_request("pair", [5, 7], SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=30, structured=OTHER))
    finals = {}
    while engine.has_unfinished_requests():
        outs, failed = engine.safe_step()
        assert not failed
        finals.update((o.request_id, o) for o in outs if o.finished)
    assert [c.finish_reason for c in finals["pair"].outputs] == ["stop", "stop"]
    for c in finals["pair"].outputs:
        _check(c.text, OTHER)
    engine.check_integrity()


def _colocated(engine):
    backend = ColocatedBackend(engine)

    async def collect(rid, params):
        """(the whole text, the finish reason, the token count) of one completion's deltas"""
        outs = [o.outputs[0] async for o in backend.generate(rid, [5, 6], params) if o.outputs]
        return "".join(o.text for o in outs), outs[-1].finish_reason, sum(len(o.token_ids) for o in outs)
    return backend, collect


def test_a_valid_grammar_is_served_while_another_compiles(chat_dir, make_llm, held):
    """Colocated: a request whose grammar compiles waits parked; the engine thread serves a plain
    request and another grammar's meanwhile, and the parked one runs once its compile ends."""
    engine = make_llm(chat_dir, block_size=16, num_blocks=64).engine
    backend, collect = _colocated(engine)

    async def test():
        slow = asyncio.create_task(collect("slow", SamplingParams(temperature=0, max_tokens=30, structured=HELD)))
        other = await collect("other", SamplingParams(temperature=0, max_tokens=30, structured=OTHER))
        plain = await collect("plain", SamplingParams(max_tokens=3, ignore_eos=True))
        assert not slow.done()
        held.set()
        return await slow, other, plain
    try:
        slow, other, plain = asyncio.run(asyncio.wait_for(test(), 60))
    finally:
        backend.close()
    _check(slow[0], HELD)
    _check(other[0], OTHER)
    assert slow[1] == other[1] == "stop" and plain[2] == 3


def test_too_many_compiles_is_busy_never_a_400(chat_dir, make_llm, held):
    """Past --grammar-max-compiles running and --grammar-max-queued waiting, a new grammar is
    GrammarBusy (colocated: a 503, NoNodeAvailable; a node: Busy or a retryable failure), and so
    is one that waited the time limit for a thread; a grammar compiled already is still served."""
    engine = make_llm(chat_dir, block_size=16, num_blocks=64, grammar_max_compiles=1, grammar_max_queued=1,
                      grammar_compile_timeout_s=0.3).engine
    _run(engine, "warm", [5, 6], SamplingParams(temperature=0, max_tokens=30, structured=OTHER), 0)
    assert not engine.grammar_job(SamplingParams(structured=HELD)).done
    queued = StructuredOutput.choice(["queued"])
    with pytest.raises(GrammarBusy, match="waited 0.3 s"):
        engine.add_request("queued", [5, 6], SamplingParams(structured=queued))
    # the queued compile, its only request gone, was cancelled: its place goes to the next grammar
    assert not engine.grammar_job(SamplingParams(structured=StructuredOutput.choice(["third"]))).done
    with pytest.raises(GrammarBusy, match="--grammar-max-queued"):
        engine.grammar_job(SamplingParams(structured=StructuredOutput.choice(["fourth"])))
    backend, collect = _colocated(engine)
    try:
        with pytest.raises(NoNodeAvailable, match="--grammar-max-queued"):
            asyncio.run(collect("busy", SamplingParams(structured=StructuredOutput.choice(["fifth"]))))
        out = asyncio.run(collect("cached", SamplingParams(temperature=0, max_tokens=30, structured=OTHER)))
        _check(out[0], OTHER)
    finally:
        held.set()
        backend.close()


EXIT_DURING_COMPILE = textwrap.dedent("""
    import atexit, sys, time
    from engine.grammar import GrammarCompiler
    from engine.grammar_limits import GrammarLimits
    from tests.engine.slow_grammar import SLOW, wide_tokenizer
    tok = wide_tokenizer()
    compiler = GrammarCompiler(tok, len(tok), [2], GrammarLimits(timeout_s=600))
    job = compiler.submit(SLOW)
    while job.started is None:
        time.sleep(0.001)
    print("compiling", flush=True)
    atexit.register(lambda: print(type(job.future.exception()).__name__ if job.done else "running", flush=True))
    sys.exit(0)     # no close(), as a script that forgets it
""")


def test_a_process_exits_at_once_while_a_grammar_compiles():
    """A process (an offline LLM's script) that exits while a compile runs exits with its own
    status and does not wait for the compile: the compile's thread sees the main thread gone,
    kills its worker process, and the job ends GrammarBusy before the atexit hooks run (the exit
    used to wait for the compile to end: minutes for this grammar). Nothing is left inside
    xgrammar's C++ (a daemon thread there aborted the process: "terminate called")."""
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", EXIT_DURING_COMPILE], capture_output=True, text=True,
                          timeout=600, env=env)
    assert (done.returncode, done.stdout) == (0, "compiling\nGrammarBusy\n"), done.stderr[-2000:]
    assert "terminate called" not in done.stderr


def test_closing_the_colocated_backend_cancels_queued_compiles_and_does_not_wait_on_a_held_one(
        chat_dir, make_llm, held):
    """close() stops the engine thread, cancels the queued compile and says the held one still
    runs (False: router/cli.py then leaves with os._exit instead of waiting at interpreter exit)."""
    engine = make_llm(chat_dir, block_size=16, num_blocks=64, grammar_max_compiles=1).engine
    backend, _ = _colocated(engine)
    running = engine.grammar_job(SamplingParams(structured=HELD))
    queued = engine.grammar_job(SamplingParams(structured=StructuredOutput.choice(["queued"])))
    while running.started is None:
        time.sleep(0.001)
    assert backend.close() is False
    assert queued.future.cancelled() and not running.done and not backend.is_healthy()
