"""Threads that do the router's heavy CPU work off the event loop: tokenizing prompts, rendering
chat templates, building and serializing large responses. A 1 MB prompt then never stalls other
streams (Hugging Face's fast tokenizers release the GIL while they encode).

Each thread holds its own copy of the tokenizer: a fast tokenizer must not be used by two threads
at once (its encode options are per-object state).
"""
from __future__ import annotations

import asyncio
import copy
import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class Workers:
    def __init__(self, tokenizer: Any, threads: int):
        self._tokenizer = tokenizer
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="pdserve-http")

    @property
    def tokenizer(self) -> Any:
        """The tokenizer for the event loop's own (small) work; threads use their copies."""
        return self._tokenizer

    async def run(self, fn: Callable[..., T], *args: Any, large: bool = False) -> T:
        """`fn(tokenizer, *args)` on a worker thread, with that thread's own tokenizer. `large`
        work (a prompt of megabytes) gives its freed memory back to the system when it ends."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._call, fn, args, large)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _call(self, fn: Callable[..., T], args: tuple, large: bool) -> T:
        if not hasattr(self._local, "tokenizer"):
            self._local.tokenizer = copy.deepcopy(self._tokenizer)
        try:
            return fn(self._local.tokenizer, *args)
        finally:
            if large:
                _trim_heap()


def _trim_heap() -> None:
    """Returns freed heap pages of every malloc arena to the system (glibc); elsewhere a no-op.
    Without it a 4 MB prompt's tokenization leaves the router ~300 MB larger for good."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
