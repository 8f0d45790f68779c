"""`python -m router`: serve one model colocated (prefill + decode in this process) over HTTP.

Flags are generated from the config dataclasses (engine/flags.py), defaults and help included:
RouterConfig's fields as `--port`, `--api-key`, ...; EngineArgs' as `--model`, `--dtype`,
`--num-blocks`, `--max-num-seqs`, ..., the same names as `LLM(...)` and the node CLIs take.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from engine.flags import add_dataclass_args, build_dataclass  # noqa: F401 -- this module's face


def main(argv: Sequence[str] | None = None) -> None:
    from engine.args import EngineArgs
    from engine.heap import freeze_heap
    from engine.llm_engine import LLMEngine
    from router.http.app import create_app
    from router.colocated import ColocatedBackend
    from router.config import RouterConfig, keys_from_environment
    from router.http.server import PortInUse, Server, bind_http

    parser = argparse.ArgumentParser(prog="python -m router", description=__doc__.splitlines()[0])
    add_dataclass_args(parser, RouterConfig)
    add_dataclass_args(parser, EngineArgs)
    args = vars(parser.parse_args(argv))
    try:
        config = build_dataclass(RouterConfig, keys_from_environment(args, os.environ))
    except ValueError as err:
        parser.error(str(err))
    try:
        sock = bind_http(config)
    except PortInUse as err:
        sys.exit(str(err))
    engine_args = build_dataclass(EngineArgs, args)
    backend = ColocatedBackend(LLMEngine(engine_args.engine_config()))
    app = create_app(backend, config)
    if engine_args.freeze_gc:
        freeze_heap("router (colocated)")
    try:
        Server(app, config, loop="uvloop").run(sockets=[sock])
    finally:
        ended = backend.close()
        sock.close()
    if not ended:   # a grammar compile thread still runs (close() gave up on it): leave without it
        leave_now(0)


def leave_now(status: int) -> None:
    """End the process at once with `status`, output flushed: no interpreter exit, which would
    wait for every compile thread (engine/grammar_jobs.py)."""
    import logging
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
