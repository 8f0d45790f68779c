"""pdserve's serving benchmark: the same workload, sent over HTTP to pdserve (1P+1D and
colocated), vLLM's CPU build and `transformers serve`, measured as `vllm bench serve` measures.

    python -m bench.serving compare --quick      # see __main__.py for every command

Along the path of one measurement:

    model.py       the peers' random Llama + a word-level tokenizer (n words = n tokens everywhere)
    workloads.py   seeded request lists: sharegpt, alpaca, rag, prefix, mixed
    arrivals.py    gamma / Poisson send times at an offered rate
    servers.py     start / health-check / stop each system (process groups, no orphans)
    client.py      one streamed /v1/completions request, timed
    loadgen.py     a bounded run: schedule -> tasks -> records (+ prometheus.py scraping /metrics)
    metrics.py     TTFT, TPOT, ITL, E2EL, throughputs, goodput, SLO attainment, normalized latency
    compare.py     the side-by-side rate sweep; tune.py: prefill knobs against TTFT
    record.py      the result JSON (machine, versions, model, workload, flags, every request)
    plots.py, report.py   PNGs and the README's markdown tables
    install.py     vLLM CPU and transformers serve's extras, once
"""
