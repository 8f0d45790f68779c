# sim24: calibrate (--node-speed kind) and validate (--node-speed kind) on quiet12 and quiet13; outputs
# in $2 tagged $1; with $3 = N, kind_cost.LONG_CHUNK set to N (long_chunk.py). Lowest priority, from the
# repository root: setsid bash -c 'echo 19 > /proc/self/autogroup; exec nice -n 19 bash THIS TAG DIR [N]'
set -e
export PYTHONPATH=.
PY=/work/main/.venv/bin/python
RUN="-m bench.simulate"
[ -n "$3" ] && RUN="bench/validation/sim24/long_chunk.py $3"
T="--front-from bench/validation/quiet8/trace_sharegpt_* --beside-from bench/validation/quiet8/trace_rag_*"
for s in quiet12 quiet13; do
  f=$(ls bench/validation/$s/simulate_measured_sharegpt_*.json)
  $PY $RUN calibrate $f --profile bench/profiles/cpu_1core_llama58m_$s.json \
      --out $2/cal_${s}_$1.json $T --node-speed kind > $2/calibrate_${s}_$1.txt 2>&1
  $PY $RUN validate bench/validation/$s/simulate_measured_*_20261203-1*.json \
      --profile $2/cal_${s}_$1.json --node-speed kind > $2/validate_${s}_$1.txt 2>&1
done
