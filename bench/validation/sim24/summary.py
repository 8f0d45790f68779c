"""sim24: from validate tables (--node-speed): points within 20% node-priced, the mean absolute error
over their 54 figures, and the worst. usage: summary.py VALIDATE_TXT..."""
import re
import sys

for path in sys.argv[1:]:
    rows = [line.split("|") for line in open(path) if re.match(r"\| (mixed|rag|sharegpt) ", line)]
    errors = [abs(float(e.strip().rstrip("%"))) for r in rows for e in r[10].split("/")]
    ok = sum(r[11].strip() == "yes" for r in rows)
    print(f"{path}: {ok} of {len(rows)} within 20%, mean abs error {sum(errors) / len(errors):.1f}%, worst {max(errors):.0f}%")
