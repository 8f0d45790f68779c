#!/bin/bash
# sim31 (session 31, the Zen 4, 03:32 UTC, nothing else running): the mixed colocated 0.25 point traced (every
# process's timestamps, bench/simulate/trace_points.py); its 46-token chat came out at 46 ms, not on the cliff
# (bench/README.md, "sim31")
python -m bench.simulate trace --workload mixed --rates 0.25 --systems colocated --num-requests 24 \
    --profile bench/profiles/cpu_1core_llama58m_quiet21.json
