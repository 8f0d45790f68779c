"""A colocated router (`python -m router`) asked to stop while a grammar compiles, one more
queued behind it, exits with status 0 within the bound of engine/grammar_jobs.py (CLOSE_WAIT_S)
and its HTTP shutdown; the compile here never ends, so the interpreter's exit, which waited for
every compile thread, never came."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request

from tests.http_server import free_port
from tests.tiny_chat_model import tiny_chat_model_folder

ROUTER_WITH_A_HELD_COMPILE = textwrap.dedent("""
    import sys, threading
    from engine.grammar import GrammarCompiler
    real = GrammarCompiler._compile

    def compile_(self, spec):       # a grammar "held-..." compiles forever
        if spec.spec.startswith("held-"):
            print("compiling", flush=True)
            threading.Event().wait()
        return real(self, spec)
    GrammarCompiler._compile = compile_
    from router.cli import main
    main(sys.argv[1:])
""")


def _post(port: int, regex: str) -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 4, "guided_regex": regex}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=300).read()
    except (urllib.error.URLError, OSError):
        pass        # the router went away mid-request: what this test does


def test_a_colocated_router_exits_while_a_grammar_compiles_forever(tmp_path):
    tiny_chat_model_folder(tmp_path)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("PDSERVE_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-c", ROUTER_WITH_A_HELD_COMPILE, "--model", str(tmp_path),
                             "--port", str(port), "--num-blocks", "64", "--block-size", "16",
                             "--grammar-max-compiles", "1",
                             # the held requests fail at this limit (a 400) and the HTTP shutdown ends;
                             # the held compile's thread stays where it is, as with the default 5 s
                             "--grammar-compile-timeout-s", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
                break
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        for regex in ("held-[0-9]", "held-[a-z]"):      # one compiling, one queued behind it
            threading.Thread(target=_post, args=(port, regex), daemon=True).start()
        guard = threading.Timer(600, proc.kill)     # a hang guard, not a speed: it never ended before
        guard.start()
        while (line := proc.stdout.readline()) not in ("compiling\n", ""):
            pass                            # (the access log)
        assert line == "compiling\n"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=300)
        guard.cancel()
        assert rc == 0, proc.stderr.read()[-2000:]
        assert "compiling" not in proc.stdout.read()    # the queued grammar never began compiling
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
