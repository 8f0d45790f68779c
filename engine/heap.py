"""A serving process's start-up heap, out of the cyclic garbage collector's way.

Once a node, a colocated router or an offline LLM has started, the collector tracks ~350k objects
(torch's and transformers' modules, the model, the block manager's blocks) that live as long as
the process, and each full (generation 2) collection traverses them all while the engine's loop
waits: ~290 ms here against 0.5 ms with them frozen (bench/README.md, "Fourteenth session (helper
gcf)"). Such a collection is rare (none ran in a decode node's 1,600 steps), so this is about a
stall in a long-running process's tail, not about throughput. freeze_heap() moves every object
alive at start-up into the collector's permanent generation (gc.freeze()): later collections
traverse only what was made since. vLLM freezes its engine core's heap the same way once started
(vllm/utils/gc_utils.py, freeze_gc_heap) and undoes it at shutdown; SGLang offers it as a call
(POST /freeze_gc). EngineArgs.freeze_gc (--no-freeze-gc) turns it off.

The permanent generation is the process's. thaw_heap() gives every frozen object back to the
collector: LLM.close() calls it, and so does the interpreter's exit, whose last collection would
otherwise leave frozen extension objects unfinalized (nanobind reports them as leaks).
"""
from __future__ import annotations

import atexit
import gc
import logging

log = logging.getLogger(__name__)


def freeze_heap(who: str) -> int:
    """Collect the young generations, then freeze every live object; returns how many are frozen.
    The oldest generation is not collected first: a full collection costs ~0.3-0.7 s at start-up
    here and found 62 unreachable objects, which stay frozen (once per process)."""
    gc.collect(1)
    gc.freeze()
    atexit.unregister(thaw_heap)        # once, however often frozen
    atexit.register(thaw_heap)
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects frozen out of the garbage collector's reach (--no-freeze-gc: none)", who, frozen)
    return frozen


def thaw_heap() -> None:
    """Undo freeze_heap: every frozen object is the collector's again (freed by its next full
    collection if unreachable)."""
    gc.unfreeze()
