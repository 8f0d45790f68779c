"""Every serving process (offline LLM, node, colocated router) freezes its start-up heap out of the
garbage collector's reach unless told --no-freeze-gc, and what requests make is still freed."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest

from pdwire.sampling_params import SamplingParams
from tests.http_server import free_port
from tests.tiny_chat_model import tiny_chat_model_folder

HANG_S = 300        # bounds a hang only: a starved machine takes long to import torch

NODE = textwrap.dedent("""
    import gc, sys
    from node_shell import runtime

    class Started:      # a node service that closes at once, saying how much of the heap is frozen
        def should_stop(self):
            return True

        def close(self, reason):
            print("frozen", gc.get_freeze_count(), flush=True)
            return True
    runtime.main("decode", lambda config: Started(), sys.argv[1:])
""")

ROUTER = textwrap.dedent("""
    import gc, sys
    from router.http.server import Server
    Server.run = lambda self, sockets: print("frozen", gc.get_freeze_count(), flush=True)   # started: stop
    from router.cli import main
    main(sys.argv[1:])
""")


def _frozen_in(script: str, argv: list[str]) -> int:
    """Runs script in a fresh interpreter with argv; returns the freeze count it printed."""
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("PDSERVE_API_KEY", None)
    out = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env,
                         timeout=HANG_S)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split("frozen ")[-1].split()[0])


def test_an_llm_freezes_its_heap_and_close_gives_it_back(model_dir, make_llm):
    """Once an LLM has started, its engine is frozen (the collector no longer sees its block
    manager) until close(); freeze_gc=False freezes nothing."""
    path, _ = model_dir
    llm = make_llm(path, num_blocks=64)
    assert gc.get_freeze_count() > 0
    assert not any(o is llm.engine.block_manager for o in gc.get_objects())
    llm.close()
    assert gc.get_freeze_count() == 0
    assert any(o is llm.engine.block_manager for o in gc.get_objects())
    make_llm(path, num_blocks=64, freeze_gc=False)
    assert gc.get_freeze_count() == 0


def test_what_requests_make_is_still_freed_under_a_frozen_heap(model_dir, make_llm):
    """With the heap frozen, rounds of requests leave nothing behind: after a full collection the
    collector tracks fewer new objects over eight rounds than there were rounds. Each round makes
    four requests, so a leak of anything per request adds at least 32; another thread may add a
    few, which is why the count is not held exactly: one that goes back to waiting on a Condition
    (tqdm's monitor, every 10 s) holds a new waiter lock and a bound __exit__, +2 (CI: 36 -> 38)."""
    path, _ = model_dir
    llm = make_llm(path, num_blocks=64, max_num_seqs=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tracked = []
    for r in range(10):
        llm.generate([[3 + r, 5 + i, 7, 11 + r, 13] for i in range(4)], params)
        gc.collect()
        tracked.append(len(gc.get_objects()))
    assert gc.get_freeze_count() > 0
    assert tracked[-1] - tracked[1] < 8, tracked
    llm.engine.check_integrity()


@pytest.mark.parametrize("flags, frozen", [([], True), (["--no-freeze-gc"], False)])
def test_a_node_freezes_its_heap_once_started(flags, frozen):
    """`python -m decode_node`'s main freezes the heap after making its service, before serving;
    --no-freeze-gc leaves it."""
    argv = ["--router", "tcp://127.0.0.1:1", "--node-id", "decode-0", *flags]
    assert (_frozen_in(NODE, argv) > 0) == frozen


def test_a_colocated_router_freezes_its_heap_before_serving(tmp_path):
    """`python -m router` freezes the heap once its engine and app are made, before serving."""
    tiny_chat_model_folder(tmp_path)
    argv = ["--model", str(tmp_path), "--port", str(free_port()), "--num-blocks", "64"]
    assert _frozen_in(ROUTER, argv) > 0
