#!/bin/bash
# trace26 (session 26, the AVX2-only AMD EPYC, 13:46-13:53 UTC): the front end's and the admission's cost per prompt
# token on this CPU (bench/simulate/trace.py front_end, admission), as quiet8's traces gave them on the Xeon
PR=bench/profiles/cpu_1core_llama58m_quiet15.json
python -m bench.simulate trace --workload sharegpt --rates 0.25,0.5 --systems 1p1d --num-requests 24 --profile $PR
python -m bench.simulate trace --workload rag --rates 0.3 --systems 1p1d --num-requests 20 --profile $PR
