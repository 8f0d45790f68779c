"""No request holds the router's event loop (issues #14, #22): a large prompt is tokenized and a
large echo+logprobs response is built off the loop. Latency bars with generous margins."""
from __future__ import annotations

import os
import threading
import time

import pytest

from tests.router_process import RouterProcess, http_request, read_until


@pytest.fixture(scope="module")
def router():
    with RouterProcess("--hf-tokenizer", "--steps", "4000", "--interval-s", "0.02",
                       "--max-prompt-chars", str(4 << 20)) as process:
        yield process


def _in_background(work) -> threading.Thread:
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def test_a_large_prompt_does_not_stall_a_running_stream(router):
    """While a 4 MiB-character prompt (the largest allowed here) is tokenized, a running stream's
    longest gap stays under 1 s, and router RSS comes back within 100 MB of where it was. A gap
    leaves out the time the router's loop thread, or this reading thread, waited for a CPU (as
    _health_beside's latencies do)."""
    sock = router.connect()
    sock.sendall(http_request("/v1/completions", {"prompt": "hi", "max_tokens": 4000, "stream": True}))
    read_until(sock, b"data: ")
    before = router.rss_mb()
    prompt = "ROMEO: what light through yonder window breaks. " * 87_000      # 4,176,000 characters
    big = _in_background(lambda: router.request("/v1/completions", {"prompt": prompt, "max_tokens": 1}))
    threads = [(router.process.pid, router.process.pid), (os.getpid(), threading.get_native_id())]
    gaps, last, waited = [], time.monotonic(), [_runnable_s(*t) for t in threads]
    while big.is_alive() and len(gaps) < 2000:
        sock.recv(1 << 16)
        now, ran = time.monotonic(), [_runnable_s(*t) for t in threads]
        gaps.append(now - last - max(r - w for r, w in zip(ran, waited)))
        last, waited = now, ran
    big.join(30)
    sock.close()
    print(f"longest gap {max(gaps):.3f} s over {len(gaps)} reads; RSS {before:.0f} -> {router.rss_mb():.0f} MB")
    assert len(gaps) > 5 and max(gaps) < 1.0
    assert router.rss_mb() - before < 100


def _runnable_s(pid: int, tid: int) -> float:
    """Seconds thread tid of process pid has waited, runnable, for a CPU (Linux schedstat)."""
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def _health_beside(router, body: dict) -> tuple[list[float], tuple[int, bytes]]:
    """(/health latencies, sorted; (status, data) of body's request) while body's request runs.

    A latency leaves out the time the router's loop thread, or this probing thread, waited for a
    CPU (the longer of the two): what a starved machine adds, not a held loop (a loop held by work
    or a lock, the GIL among them, still counts)."""
    result = {}
    big = _in_background(lambda: result.update(answer=router.request("/v1/completions", body, timeout_s=120)))
    latencies: list[float] = []
    threads = [(router.process.pid, router.process.pid), (os.getpid(), threading.get_native_id())]
    while big.is_alive() and len(latencies) < 1000:
        start, waited = time.monotonic(), [_runnable_s(*t) for t in threads]
        assert router.request("/health")[0] == 200
        starved = max(_runnable_s(*t) - w for t, w in zip(threads, waited))
        latencies.append(time.monotonic() - start - starved)
        time.sleep(0.02)
    big.join(120)
    return sorted(latencies), result["answer"]


def test_health_answers_within_100_ms_beside_the_largest_echo_logprobs_request(router):
    """Bar: /health answers within 100 ms while a request at max_logprob_cells is built and sent
    (on the loop that took seconds). 9 probes in 10 must meet it; the slowest gets 0.5 s, as the
    OS may hold any one probe back on a busy 2-core machine, whatever the router does."""
    body = {"prompt": [[5] * 1000], "max_tokens": 1, "n": 47, "logprobs": 20, "echo": True}  # 988,467 cells
    latencies, (status, data) = _health_beside(router, body)
    assert status == 200 and len(data) > 10_000_000 and len(latencies) > 5
    p90 = latencies[int(0.9 * (len(latencies) - 1))]
    print(f"/health p90 {1000 * p90:.1f} ms, worst {1000 * latencies[-1]:.1f} ms over {len(latencies)} probes; "
          f"response {len(data)} bytes")
    assert p90 < 0.1 and latencies[-1] < 0.5


def test_health_answers_beside_a_body_of_millions_of_token_ids(router):
    """A 7.5 MB body of 2.5M token ids (10x --max-prompt-token-ids) is refused before it is parsed:
    /health keeps answering within 1 s, half what the finding's loop was held (parsing and validating
    it took 2-4 s). Not 0.5 s: what the VM's host takes from a core (steal) is not in schedstat's
    wait, and one probe of a full run on two workers took 0.70 s while the host took seconds a minute."""
    latencies, (status, data) = _health_beside(router, {"prompt": [1] * 2_500_000, "max_tokens": 1})
    assert status == 400 and b"--max-prompt-token-ids" in data
    print(f"/health worst {1000 * latencies[-1]:.1f} ms over {len(latencies)} probes")
    assert latencies[-1] < 1.0
