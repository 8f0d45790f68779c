# Sourced by the scripts that validate every quiet set again with the working tree's code (sim27/knee.sh,
# sim31/all_sets.sh): run SET TRACES refits the set's profile as pdplan/profile.py fits now, calibrates it on the
# set's ShareGPT-like file with the front end and the shared bus from TRACES, and validates all three files by kind
# of step; outputs in $O (refit_, calibrate_, validate_SET.txt), profiles in ${T}_SET_fit.json and _cal.json.
run() {  # SET TRACES
  local s=$1 f
  f=$(ls bench/validation/$1/simulate_measured_sharegpt_*.json)
  $PY bench/validation/sim27/refit.py bench/profiles/cpu_1core_llama58m_$s.json ${T}_${s}_fit.json > $O/refit_$s.txt 2>&1
  $PY -m bench.simulate calibrate $f --profile ${T}_${s}_fit.json --out ${T}_${s}_cal.json \
      --front-from $2/trace_* --beside-from $2/trace_rag_* --node-speed kind > $O/calibrate_$s.txt 2>&1
  $PY -m bench.simulate validate $(ls bench/validation/$s/simulate_measured_*.json) \
      --profile ${T}_${s}_cal.json --node-speed kind > $O/validate_$s.txt 2>&1
}
