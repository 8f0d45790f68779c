"""`python -m engine.parallel '<WorkerSpec JSON>'`: one tensor-parallel worker (see worker.py)."""
import sys

from engine.parallel.worker import from_argv, main

main(from_argv(sys.argv))
