#!/bin/bash
# mixed workload, colocated pdserve, the long-prefill cap off / 256, alternating, 2 rounds
cd /work/main && source .venv/bin/activate && export PYTHONPATH=.
for round in 1 2; do
  for cap in 0 256; do
    echo "=== $(date -u +%T) round $round cap $cap"
    python -m bench.serving compare --workload mixed --rates 0.25,0.5 --systems pdserve-colocated --num-requests 24 \
      --output-cap 256 --deadline-s 240 --no-publish --pdserve-flags "--long-prefill-token-threshold $cap" 2>&1 | grep -v "it/s\|s/it"
  done
done
echo "=== $(date -u +%T) done"
