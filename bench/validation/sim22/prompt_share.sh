#!/bin/bash
# quiet12 calibrated and validated with --node-speed kind at another node_steps.PROMPT_SHARE (bench/README.md, sim22)
# usage: bench/validation/sim22/prompt_share.sh SHARE   (from the repository root; writes /tmp/sim22/)
mkdir -p /tmp/sim22
export PYTHONPATH=$PWD
PY=${PY:-python}
S=$1
Q=bench/validation/quiet12
run() { $PY -c "import sys; import bench.simulate.node_steps as n; n.PROMPT_SHARE=$S; from bench.simulate.__main__ import main; main(sys.argv[1:])" "$@"; }
run calibrate $Q/simulate_measured_sharegpt_20261203-135707.json --profile bench/profiles/cpu_1core_llama58m_quiet12.json --out /tmp/sim22/q12_cal_share$S.json \
   --front-from bench/validation/quiet8/trace_sharegpt_* --beside-from bench/validation/quiet8/trace_rag_* --node-speed kind > /tmp/sim22/cal_share$S.txt 2>&1
run validate $Q/simulate_measured_*_20261203-1*.json --profile /tmp/sim22/q12_cal_share$S.json --node-speed kind > /tmp/sim22/val_share$S.txt 2>&1
echo done $S
