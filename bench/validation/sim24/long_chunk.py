"""sim24: `python -m bench.simulate ...` with kind_cost.LONG_CHUNK set to another size, to see how
firm the count is against the short/long boundary (256 in the code).
usage: long_chunk.py N calibrate|validate ARGS..."""
import runpy
import sys

from pdplan import kind_cost

kind_cost.LONG_CHUNK = int(sys.argv[1])
sys.argv = ["bench.simulate"] + sys.argv[2:]
runpy.run_module("bench.simulate", run_name="__main__")
