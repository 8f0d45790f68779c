#!/bin/bash
# sim26: the quiet sets (quiet12-14 on the Xeon, quiet15-16 on the AVX2-only EPYC) calibrated and validated
# (--node-speed kind, as bench/validation/quiet_set.sh) with the front end's and the admission's cost per prompt
# token from each machine's traces: the ShareGPT-like ones only (TAG sharegpt: quiet12-14 as made; quiet15 as
# made took the Xeon's) or all of them, the RAG trace's long prompts too (TAG all). quiet15 and quiet16 take this
# EPYC's own traces (bench/validation/trace26, session 26) in both, and the Xeon's ShareGPT-like ones as quiet15
# was made (TAG xeon). From the repository root:
#   bash bench/validation/sim26/front_traces.sh && python bench/validation/sim24/summary.py bench/validation/sim26/validate_*
export PYTHONPATH=.
PY=${PY:-.venv/bin/python}
O=bench/validation/sim26
X=bench/validation/quiet8 E=bench/validation/trace26
run() {  # SET TRACES FRONT TAG: calibrate on the set's ShareGPT-like file, validate all three
  s=$1 f=$(ls bench/validation/$1/simulate_measured_sharegpt_*.json)
  $PY -m bench.simulate calibrate $f --profile bench/profiles/cpu_1core_llama58m_$s.json --out /tmp/sim26_${s}_$4.json \
      --front-from $2/$3 --beside-from $2/trace_rag_* --node-speed kind > $O/calibrate_${s}_$4.txt 2>&1
  $PY -m bench.simulate validate $(ls bench/validation/$s/simulate_measured_*.json) \
      --profile /tmp/sim26_${s}_$4.json --node-speed kind > $O/validate_${s}_$4.txt 2>&1
}
for front in 'trace_sharegpt_*:sharegpt' 'trace_*:all'; do
  run quiet12 $X "${front%%:*}" "${front##*:}" & run quiet13 $X "${front%%:*}" "${front##*:}" & wait
  run quiet14 $X "${front%%:*}" "${front##*:}" & run quiet15 $E "${front%%:*}" "${front##*:}" & wait
  run quiet16 $E "${front%%:*}" "${front##*:}"
done
run quiet15 $X 'trace_sharegpt_*' xeon & run quiet16 $X 'trace_sharegpt_*' xeon & wait
# each set's misses with TAG all, jittered (validate --jitter: sends up to 0.5 ms late, prices up to 1% off; 'maybe'
# where every node-priced figure's range reaches the 20% band)
for s in quiet12 quiet13 quiet14 quiet15 quiet16; do
  $PY -m bench.simulate validate $(ls bench/validation/$s/simulate_measured_*.json) --profile /tmp/sim26_${s}_all.json \
      --node-speed kind --jitter 10 > $O/jitter_${s}_all.txt 2>&1 &
  [ $s = quiet13 ] && wait
done
wait
