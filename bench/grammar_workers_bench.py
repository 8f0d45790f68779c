"""What compiling in worker processes (engine/grammar_workers.py) costs against compiling in this
process: a worker's start (spawn to ready) and memory, and per grammar the compile here, the
compile through a worker (request, compile, the compiled grammar's JSON back, loaded here), the
JSON's size, its load here, and the longest pause a ticking thread of this process saw meanwhile
(what the node's loop would see).

    python -m bench.grammar_workers_bench [--repeats 3] [--cache-dir DIR]

Tokenizer: bench/structured_model.py's byte-level BPE (32,000 ids). Each grammar is new to both
compilers (no cache) in every repeat.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

from bench.structured_model import BENCH_SCHEMA, prepare_structured_model
from pdwire.structured_output import GrammarKind, StructuredOutput

HERE = os.path.dirname(os.path.abspath(__file__))


def grammars(r: int) -> dict[str, StructuredOutput]:
    """Each kind, fresh for repeat r (a field length or a bound of its own)."""
    wide = {"type": "object", "properties": {f"f{i}": {"type": "string", "maxLength": 40 + r} for i in range(24)},
            "required": [f"f{i}" for i in range(24)], "additionalProperties": False}
    bench = {**BENCH_SCHEMA, "properties": {**BENCH_SCHEMA["properties"],
                                            "name": {"type": "string", "minLength": 1, "maxLength": 24 + r}}}
    return {"bench_schema": StructuredOutput.json_schema(bench), "wide_schema_24_strings": StructuredOutput.json_schema(wide),
            "regex_date": StructuredOutput(GrammarKind.REGEX, rf"20[0-9]{{2}}-[01][0-9]-[0-3][0-9]( r{r})?")}


class Ticker:
    """A thread that wakes every millisecond and keeps the longest gap between two wakes."""

    def __init__(self) -> None:
        self.longest, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(0.001):
            now = time.perf_counter()
            self.longest, last = max(self.longest, now - last), now

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.longest


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-dir", default=os.path.join(HERE, ".cache"))
    args = ap.parse_args()
    import xgrammar as xgr
    from transformers import AutoTokenizer
    from engine.grammar import GrammarCompiler
    from engine.grammar_limits import GrammarLimits
    from engine.grammar_specs import compile_spec
    tok = AutoTokenizer.from_pretrained(prepare_structured_model(args.cache_dir))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
    here = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id], GrammarLimits(max_compiles=1, timeout_s=60))
    compiler.compiled(StructuredOutput(GrammarKind.REGEX, "warm"))
    start_s = time.perf_counter() - t0
    worker = compiler._workers._all[0]._proc.pid        # noqa: SLF001 -- a benchmark's look inside
    rows: dict[str, dict[str, list[float]]] = {}
    for r in range(args.repeats):
        for name, spec in grammars(r).items():
            row = rows.setdefault(name, {k: [] for k in ("here_ms", "worker_ms", "json_kib", "load_ms", "pause_ms")})
            t = time.perf_counter()
            compiled_here = compile_spec(xgr, here, spec)
            row["here_ms"].append(1000 * (time.perf_counter() - t))
            ticker, t = Ticker(), time.perf_counter()
            compiler.compiled(spec)
            row["worker_ms"].append(1000 * (time.perf_counter() - t))
            row["pause_ms"].append(1000 * ticker.stop())
            text = compiled_here.serialize_json()
            t = time.perf_counter()
            xgr.CompiledGrammar.deserialize_json(text, info)
            row["load_ms"].append(1000 * (time.perf_counter() - t))
            row["json_kib"].append(len(text) / 1024)
    result = {"load": os.getloadavg(), "worker_start_ms": round(1000 * start_s), "worker_rss_mib": rss_kib(worker) // 1024,
              "this_process_rss_mib": rss_kib(os.getpid()) // 1024,
              "grammars": {n: {k: round(statistics.median(v), 2) for k, v in row.items()} for n, row in rows.items()}}
    compiler.close()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
