"""On PYTHONPATH only in a traced validation run (bench/simulate/trace.py): every Python process
started there records its part of each request's path (bench/simulate/trace_points.py)."""
import os

if os.environ.get("PDSERVE_TRACE_DIR"):
    from bench.simulate.trace_points import install
    install(only=os.environ.get("PDSERVE_TRACE_ONLY", ""))
