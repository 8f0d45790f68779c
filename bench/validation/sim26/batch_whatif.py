"""What-if (not landed): decode-only steps priced with a per-batch correction taken from the profile's own decode
samples (median sample / linear price at batches 1, 4, 8; linear between; 1.0 from 16 up), then calibrate and
validate as quiet_set.sh. From the repository root, e.g. (quiet12-14 with bench/validation/quiet8's traces):
  T=bench/validation/trace26; S=quiet17
  python bench/validation/sim26/batch_whatif.py $S calibrate bench/validation/$S/simulate_measured_sharegpt_*.json \
      --profile bench/profiles/cpu_1core_llama58m_$S.json --out /tmp/bw_$S.json --front-from $T/trace_* \
      --beside-from $T/trace_rag_* --node-speed kind
  python bench/validation/sim26/batch_whatif.py $S validate bench/validation/$S/simulate_measured_*.json \
      --profile /tmp/bw_$S.json --node-speed kind > bench/validation/sim26/whatif_validate_$S.txt"""
import runpy
import statistics
import sys

from pdplan import profile as P

S = sys.argv[1]
orig_of = P.StepCost.of
prof = P.Profile.load(f"bench/profiles/cpu_1core_llama58m_{S}.json")
by = {}
for s in prof.samples:
    if all(q == 1 for q, _ in s.shapes):
        by.setdefault(len(s.shapes), []).append(s.seconds / orig_of(prof.step, list(s.shapes)))
pts = sorted((b, statistics.median(v)) for b, v in by.items() if b <= 16)
pts = [(b, c) for b, c in pts if b < 16] + [(16, 1.0)]
def corr(b):
    if b >= 16: return 1.0
    for (b0, c0), (b1, c1) in zip(pts, pts[1:]):
        if b0 <= b <= b1: return c0 + (c1 - c0) * (b - b0) / (b1 - b0)
    return pts[0][1]
print("correction", [(b, round(corr(b), 3)) for b in range(1, 17)], file=sys.stderr)
def of(self, shapes):
    base = orig_of(self, shapes)
    return base * corr(len(shapes)) if shapes and all(q == 1 for q, _ in shapes) else base
P.StepCost.of = of
sys.argv = ["bench.simulate"] + sys.argv[2:]
runpy.run_module("bench.simulate", run_name="__main__")
