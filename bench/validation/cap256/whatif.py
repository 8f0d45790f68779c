"""The simulator's prediction of --long-prefill-token-threshold 256 from a run without it: quiet15's
mixed colocated points (their requests and arrivals), simulated with the cap, priced by kind of step.
usage: whatif.py CALIBRATED_PROFILE  (quiet15's kind-priced calibration: bench/validation/quiet15/commands.sh)"""
import json
import sys

from bench.simulate.validate import markdown, predict
from pdplan.profile import Profile

measured = json.load(open("bench/validation/quiet15/simulate_measured_mixed_20261204-120022.json"))
measured["systems"] = {"colocated": measured["systems"]["colocated"]}
measured["systems"]["colocated"]["server"]["argv"] += ["--long-prefill-token-threshold", "256"]
print(markdown(predict(measured, Profile.load(sys.argv[1]), node_speed="kind")))
