#!/bin/bash
# sim31: the eleven quiet sets (quiet12-14 on the Xeon, quiet15-18 on the AVX2-only EPYC, quiet19-22 on the Zen 4), each
# profile's step cost fitted again as pdplan/profile.py fits now, calibrated on its ShareGPT-like file and validated on
# all three, node-priced by kind of step (as bench/validation/quiet_set.sh and sim27/knee.sh do), with the code of the
# working tree. From the repository root:
#   O=bench/validation/sim31/base bash bench/validation/sim31/all_sets.sh
#   python bench/validation/sim24/summary.py bench/validation/sim31/base/validate_*
export PYTHONPATH=.
PY=${PY:-.venv/bin/python}
O=${O:?O: the output folder}
T=/tmp/${O//\//_}
mkdir -p $O
X=bench/validation/quiet8 E=bench/validation/trace26
run() {  # SET TRACES
  s=$1 f=$(ls bench/validation/$1/simulate_measured_sharegpt_*.json)
  $PY bench/validation/sim27/refit.py bench/profiles/cpu_1core_llama58m_$s.json ${T}_${s}_fit.json > $O/refit_$s.txt 2>&1
  $PY -m bench.simulate calibrate $f --profile ${T}_${s}_fit.json --out ${T}_${s}_cal.json \
      --front-from $2/trace_* --beside-from $2/trace_rag_* --node-speed kind > $O/calibrate_$s.txt 2>&1
  $PY -m bench.simulate validate $(ls bench/validation/$s/simulate_measured_*.json) \
      --profile ${T}_${s}_cal.json --node-speed kind > $O/validate_$s.txt 2>&1
}
run quiet12 $X & run quiet13 $X & wait
run quiet14 $X & run quiet15 $E & wait
run quiet16 $E & run quiet17 $E & wait
run quiet18 $E & run quiet19 $E & wait
run quiet20 $E & run quiet21 $E & wait
run quiet22 $E
