"""Timestamps of each request's path through a real deployment, for the simulator's validation
(bench/simulate/trace.py): every pdserve process of a traced run imports this at start-up
(bench/simulate/tracehook/sitecustomize.py) and appends one JSON line per event to
$PDSERVE_TRACE_DIR/<pid>.jsonl; nothing in pdserve itself changes.

    router   gen_start (request id), yield (tokens, the delta's text length), send / recv (message, rid, node)
    nodes    recv / send (message, rid), step (start, end, sequences, tokens, prompt chunks; its thread's
             CPU and the process's CPU at its end)
    colocated  gen_start, the engine thread's turn (its CPU: the step, adding requests, cutting and
             handing over deltas), work (an HTTP worker thread's call: tokenizing, its CPU)
    client   c_req (send time, TTFT, first gaps), the load generator's own record

Times are time.monotonic() (CLOCK_MONOTONIC: one clock for every process on the machine).
"""
from __future__ import annotations

import functools
import importlib.abc
import json
import os
import sys
import time

_out = None
_out_dir = ""
_role = ""
_SKIP = {"NodeStatus", "KVEvents"}      # heartbeats and cache events: not a request's path


def emit(event: str, **fields) -> None:
    global _out, _out_dir, _role
    if _out_dir != os.environ["PDSERVE_TRACE_DIR"]:     # the client process traces one run after another
        _role = _role or _guess_role()
        _out_dir = os.environ["PDSERVE_TRACE_DIR"]
        _out = open(os.path.join(_out_dir, f"{os.getpid()}.jsonl"), "a", buffering=1)
    _out.write(json.dumps({"t": time.monotonic(), "p": _role, "e": event, **fields}) + "\n")


def _msg(msg) -> dict:
    out = {"m": type(msg).__name__, "rid": getattr(msg, "rid", None)}
    if hasattr(msg, "token_ids") and hasattr(msg, "index"):
        out |= {"i": msg.index, "n": len(msg.token_ids), "txt": len(msg.text)}
    if type(msg).__name__ == "FirstToken":
        out["txt"] = len(msg.text)
    return out


def _router_link(mod) -> None:
    cls = mod.RouterLink
    send, poll = cls.send, cls.poll

    @functools.wraps(send)
    def traced_send(self, msg):
        if type(msg).__name__ not in _SKIP:
            emit("send", **_msg(msg))
        return send(self, msg)

    @functools.wraps(poll)
    def traced_poll(self, *args):
        msgs = poll(self, *args)
        for m in msgs:
            emit("recv", **_msg(m))
        return msgs
    cls.send, cls.poll = traced_send, traced_poll


def _timed(cls, name: str, event: str, fields) -> None:
    """Wraps cls.name: one `event` per call with its start, its thread's CPU time and fields(self, out)."""
    method = getattr(cls, name)

    @functools.wraps(method)
    def timed(self, *args):
        t0, c0 = time.monotonic(), time.thread_time()
        out = method(self, *args)
        emit(event, t0=t0, cpu=time.thread_time() - c0, **fields(self, out))
        return out
    setattr(cls, name, timed)


def _engine(mod) -> None:
    def fields(engine, outputs) -> dict:
        shapes, chunks = getattr(engine.scheduler, "_traced_plan", ([], []))
        engine.scheduler._traced_plan = ([], [])
        ship = getattr(engine.observer, "_traced_cpu", None)    # a prefill node's shipper inside the step
        if ship is not None:
            engine.observer._traced_cpu = {}
        return {"seqs": len(shapes), "tokens": sum(n for n, _ in shapes), "shapes": shapes, "chunks": chunks,
                "out": [o.request_id for o in outputs], "ship_cpu": ship, "proc": time.process_time()}
    _timed(mod.LLMEngine, "step", "step", fields)


def _scheduler(mod) -> None:
    cls = mod.Scheduler
    schedule = cls.schedule

    @functools.wraps(schedule)
    def traced_schedule(self, *a, **k):
        plan = schedule(self, *a, **k)     # (new tokens, context before) per sequence; prompt chunks by request
        self._traced_plan = ([[s.num_new_tokens, s.seq.num_computed_tokens] for s in plan.scheduled],
                             [[s.group.request_id, s.num_new_tokens] for s in plan.scheduled if s.num_new_tokens > 1])
        return plan
    cls.schedule = traced_schedule


def _control_server(mod) -> None:
    cls = mod.ControlServer
    send = cls.send

    @functools.wraps(send)
    def traced_send(self, node_id, msg):
        emit("send", node=node_id, **_msg(msg))
        return send(self, node_id, msg)
    cls.send = traced_send


def _backend(mod) -> None:
    cls = mod.DisaggregatedBackend
    on_msg, generate = cls.on_request_message, cls.generate

    @functools.wraps(on_msg)
    def traced_on_msg(self, node_id, msg):
        emit("recv", node=node_id, **_msg(msg))
        return on_msg(self, node_id, msg)

    @functools.wraps(generate)
    async def traced_generate(self, request_id, prompt, params):
        emit("gen_start", rid=request_id)
        n = 0
        async for out in generate(self, request_id, prompt, params):
            if n < 3:
                c = out.outputs[0] if out.outputs else None
                emit("yield", rid=request_id, n=len(c.token_ids) if c else 0, txt=len(c.text) if c else 0)
            n += 1
            yield out
    cls.on_request_message, cls.generate = traced_on_msg, traced_generate


def _colocated(mod) -> None:
    """The colocated server (router/colocated.py): its requests' start, and each turn of its engine
    thread (the step, the requests it added, the deltas it cut: all on the engine's core)."""
    cls = mod.ColocatedBackend
    generate = cls.generate

    @functools.wraps(generate)
    async def traced_generate(self, request_id, prompt, params):
        emit("gen_start", rid=request_id, n=len(prompt))
        async for out in generate(self, request_id, prompt, params):
            yield out
    cls.generate = traced_generate
    _timed(cls, "_serve_once", "turn", lambda self, out: {"proc": time.process_time()})


def _workers(mod) -> None:
    """The HTTP worker threads' calls (tokenizing a prompt, building a large response): each one's
    function, start, CPU and, for prompts, their tokens."""
    cls = mod.Workers
    call = cls._call

    @functools.wraps(call)
    def traced_call(self, fn, args, large):
        t0, c0 = time.monotonic(), time.thread_time()
        out = call(self, fn, args, large)
        tokens = sum(len(p) for p in out if isinstance(p, list)) if isinstance(out, list) else 0
        emit("work", t0=t0, cpu=time.thread_time() - c0, fn=getattr(fn, "__name__", ""), tokens=tokens)
        return out
    cls._call = traced_call


def _client(mod, loadgen) -> None:
    """The load generator's requests: each one's send time, TTFT and first gaps (loadgen imported
    send by name: patched there too)."""
    send = mod.send

    @functools.wraps(send)
    async def traced_send(client, endpoint, prompt, record):
        t0 = time.monotonic()
        await send(client, endpoint, prompt, record)
        emit("c_req", t0=t0, ttft=record.ttft, itl=list(record.itl[:3]), out=record.output_tokens)
    mod.send = loadgen.send = traced_send


def _shipper(mod) -> None:
    """A prefill node's shipments: closed (first token sent) and released (every byte left)."""
    cls = mod.BlockShipper
    close, release = cls.close, cls.release_sent

    @functools.wraps(close)
    def traced_close(self, rid):
        emit("ship_close", rid=rid, open=len(self.shipments))
        return close(self, rid)

    @functools.wraps(release)
    def traced_release(self):
        before = set(self.shipments)
        out = release(self)
        for rid in before - set(self.shipments):
            emit("ship_sent", rid=rid, cpu=time.process_time())
        return out
    cls.close, cls.release_sent = traced_close, traced_release
    for name in ("before_forward", "on_computed", "_ship_layers"):     # inside the engine's step: its CPU
        _cpu_into(cls, name)


def _cpu_into(cls, name: str) -> None:
    """Adds each call's thread CPU time to self._traced_cpu[name] (the step event takes and resets it)."""
    method = getattr(cls, name)

    @functools.wraps(method)
    def timed(self, *args):
        c0 = time.thread_time()
        try:
            return method(self, *args)
        finally:
            cpu = self.__dict__.setdefault("_traced_cpu", {})
            cpu[name] = cpu.get(name, 0.0) + time.thread_time() - c0
    setattr(cls, name, timed)


def _metrics(mod) -> None:
    """The router's /metrics page, rendered on its event loop (the load generator asks every second)."""
    _timed(mod.RouterMetrics, "render", "render", lambda _, out: {"size": len(out)})


def _scraper(mod) -> None:
    cls = mod.Scraper
    scrape = cls.scrape_once

    @functools.wraps(scrape)
    async def traced_scrape(self):
        t0 = time.monotonic()
        await scrape(self)
        emit("scrape", t0=t0)
    cls.scrape_once = traced_scrape


PATCHES = {"node_shell.shipper": _shipper, "router.http.metrics": _metrics, "node_shell.router_link": _router_link, "engine.llm_engine": _engine, "engine.scheduler": _scheduler,
           "router.cluster.control_server": _control_server, "router.cluster.disaggregated": _backend,
           "router.colocated": _colocated, "router.http.workers": _workers}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches a module of `patches` (PATCHES or some of them) right after it is first executed."""

    def __init__(self, patches: dict):
        self.patches = patches

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            self.patches[name](module)
        spec.loader.exec_module = exec_module
        return spec


def install(role: str = "", only: str = "") -> None:
    """In this process: patch what is imported from now on (and the load generator, if asked).
    only: a comma-separated list of PATCHES' modules to patch, the rest left alone (placement.py:
    the router's control messages alone); empty: all."""
    global _role
    _role = role
    patches = {name: patch for name, patch in PATCHES.items() if not only or name in only.split(",")}
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _AfterImport(patches))


def install_client() -> None:
    from bench.serving import client, loadgen, prometheus
    if getattr(client.send, "__wrapped__", None) is not None:
        return
    global _role
    _role = "client"
    _client(client, loadgen)
    _scraper(prometheus)
    _gc_pauses()


def _gc_pauses(longer_than_s: float = 0.002) -> None:
    """The collector's pauses in this process (the load generator's event loop stops meanwhile)."""
    import gc
    started = {}

    def note(phase, info):
        if phase == "start":
            started["t"] = time.monotonic()
        elif "t" in started and time.monotonic() - started["t"] > longer_than_s:
            emit("gc", t0=started["t"], generation=info["generation"], collected=info["collected"])
    gc.callbacks.append(note)


def _guess_role() -> str:
    argv = " ".join(sys.argv)
    for tag in ("--node-id",):
        if tag in argv:
            return argv.split(tag, 1)[1].split()[0]
    return "router" if "router" in argv or "launcher" in argv or "pdserve" in argv else os.path.basename(sys.argv[0])
