"""Each node's steps of a measured point against a profile's price, by kind (decode-only, prompt rows < 256 or >= 256 tokens):
median thread CPU / price and wall / price, and the sums (bench/README.md, sim22).

    PYTHONPATH=. python bench/validation/sim22/step_ratios_by_kind.py PROFILE MEASURED.json..."""
import json
import statistics
import sys

from pdplan.profile import Profile
from bench.simulate.node_steps import NodeStep
prof = Profile.load(sys.argv[1])
for path in sys.argv[2:]:
    d = json.load(open(path))
    for system, out in d['systems'].items():
        for p in out['points']:
            for node, lines in sorted(p.get('steps', {}).items()):
                st = [NodeStep.parse(x) for x in lines]
                groups = {}
                for s in st:
                    pre = sum(n for n, c in s.shapes if n > 1)
                    kind = 'dec' if pre == 0 else ('pre<256' if pre < 256 else 'pre>=256')
                    price = prof.step.of(list(s.shapes))
                    groups.setdefault(kind, []).append((s.cpu_s / price, s.wall_s / price, s.cpu_s, price))
                desc = []
                for k in ('dec', 'pre<256', 'pre>=256'):
                    g = groups.get(k)
                    if not g: continue
                    desc.append(f"{k} n={len(g)} cpu/p={statistics.median(x[0] for x in g):.2f} wall/p={statistics.median(x[1] for x in g):.2f} sumcpu={sum(x[2] for x in g):.1f} sumprice={sum(x[3] for x in g):.1f}")
                print(d['sweep']['workload'], system, p['rate'], node, p['cpu'].get(node), '|', ' ; '.join(desc))
