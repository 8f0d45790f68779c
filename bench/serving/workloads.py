"""Benchmark workloads, generated offline from a seed: a list of BenchRequest (prompt token ids
and an exact output length). Same name + seed + size -> the same list, byte for byte.

| workload | prompt | output | what it stresses |
|---|---|---|---|
| sharegpt | lognormal, mean 161, long tail | lognormal, mean 338 | decode-heavy chat (vLLM paper, Fig. 11) |
| alpaca   | lognormal, mean 19            | lognormal, mean 58  | short instructions (vLLM paper, Fig. 11) |
| rag      | one of a few long shared documents + a short question | short | prefill, prefix reuse, transfer size |
| prefix   | one of a few shared system prompts + an alpaca-like question | alpaca-like | prefix caching |
| mixed    | sharegpt chats, a fraction replaced by long unique prompts | | long prefills among decodes |

Lengths are clipped so that prompt + output fits the model's context (`max_model_len`). RAG
document lengths are 2k-8k tokens as in long-context RAG, scaled by max_model_len / 8192.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_FIRST_WORD = 3          # token ids 0, 1, 2 are <unk>, <s>, </s>; prompts use ids >= 3


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_ids: tuple[int, ...]     # one word token per id; the text is the words joined by spaces
    output_len: int                 # exact: sent as max_tokens with EOS ignored
    kind: str                       # "chat" | "rag" | "long" | ... for per-kind breakdowns

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True, slots=True)
class LogNormal:
    """Lengths ~ lognormal with the given arithmetic mean; sigma sets the tail."""
    mean: float
    sigma: float

    def sample(self, rng: np.random.Generator, n: int, low: int, high: int) -> np.ndarray:
        mu = math.log(self.mean) - self.sigma ** 2 / 2      # E[exp(N(mu, s^2))] = exp(mu + s^2/2)
        return np.clip(np.rint(rng.lognormal(mu, self.sigma, n)), low, high).astype(int)


# (prompt, output) length models fitted to the means the vLLM paper reports (Fig. 11).
SHAREGPT = (LogNormal(161.0, 1.0), LogNormal(338.0, 0.9))
ALPACA = (LogNormal(19.0, 0.6), LogNormal(58.0, 0.8))


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str                       # sharegpt | alpaca | rag | prefix | mixed
    num_requests: int
    seed: int = 0
    max_model_len: int = 4096
    vocab_size: int = 32000
    output_cap: int | None = None   # optional extra cap on output lengths (time budgets)


def random_ids(rng: np.random.Generator, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(_FIRST_WORD, vocab_size, n))


def generate(spec: WorkloadSpec) -> list[BenchRequest]:
    """The workload's requests in arrival order."""
    try:
        make = _GENERATORS[spec.name]
    except KeyError:
        raise ValueError(f"unknown workload {spec.name!r}; one of {sorted(_GENERATORS)}") from None
    return make(spec, np.random.default_rng(spec.seed))


def _out_cap(spec: WorkloadSpec) -> int:
    return spec.output_cap or spec.max_model_len // 2


def _chats(spec: WorkloadSpec, rng: np.random.Generator, lengths: tuple[LogNormal, LogNormal],
           n: int, kind: str = "chat") -> list[BenchRequest]:
    prompt_dist, output_dist = lengths
    outs = output_dist.sample(rng, n, 1, _out_cap(spec))
    prompts = prompt_dist.sample(rng, n, 1, spec.max_model_len // 2)
    prompts = np.minimum(prompts, spec.max_model_len - outs)
    return [BenchRequest(random_ids(rng, p, spec.vocab_size), int(o), kind) for p, o in zip(prompts, outs)]


def sharegpt(spec: WorkloadSpec, rng: np.random.Generator) -> list[BenchRequest]:
    return _chats(spec, rng, SHAREGPT, spec.num_requests)


def alpaca(spec: WorkloadSpec, rng: np.random.Generator) -> list[BenchRequest]:
    return _chats(spec, rng, ALPACA, spec.num_requests)


def rag_document_lengths(max_model_len: int, rng: np.random.Generator, n: int) -> np.ndarray:
    """2k-8k tokens at an 8k context, scaled to `max_model_len` (leaves room for Q and A)."""
    scale = max_model_len / 8192
    return rng.integers(int(2048 * scale), int(8192 * scale) - 256, n, endpoint=True)


def rag(spec: WorkloadSpec, rng: np.random.Generator, num_docs: int = 4) -> list[BenchRequest]:
    """Each request: one of `num_docs` shared documents (Zipf-ish popularity) + a short question."""
    docs = [random_ids(rng, int(n), spec.vocab_size) for n in rag_document_lengths(spec.max_model_len, rng, num_docs)]
    popularity = 1.0 / np.arange(1, num_docs + 1)
    picks = rng.choice(num_docs, spec.num_requests, p=popularity / popularity.sum())
    questions = LogNormal(24.0, 0.4).sample(rng, spec.num_requests, 4, 64)
    answers = LogNormal(64.0, 0.5).sample(rng, spec.num_requests, 8, min(192, _out_cap(spec)))
    first = {int(d): i for i, d in reversed(list(enumerate(picks)))}   # each document's first request
    # kind "rag-first": the first request of its document (nothing can have it cached); "rag": later ones
    return [BenchRequest(docs[d] + random_ids(rng, int(q), spec.vocab_size), int(a),
                         "rag-first" if first[int(d)] == i else "rag")
            for i, (d, q, a) in enumerate(zip(picks, questions, answers))]


def prefix(spec: WorkloadSpec, rng: np.random.Generator, num_prefixes: int = 4,
           prefix_len: int = 512) -> list[BenchRequest]:
    """Each request: one of a few shared system prompts + an alpaca-like question and answer."""
    systems = [random_ids(rng, prefix_len, spec.vocab_size) for _ in range(num_prefixes)]
    picks = rng.integers(0, num_prefixes, spec.num_requests)
    chats = _chats(spec, rng, ALPACA, spec.num_requests, "prefix")
    return [BenchRequest(systems[k] + c.prompt_ids, c.output_len, "prefix") for k, c in zip(picks, chats)]


def mixed(spec: WorkloadSpec, rng: np.random.Generator, long_fraction: float = 0.1) -> list[BenchRequest]:
    """ShareGPT-like chats with ~`long_fraction` of them replaced by long unique prompts."""
    chats = _chats(spec, rng, SHAREGPT, spec.num_requests)
    is_long = rng.random(spec.num_requests) < long_fraction
    lengths = rag_document_lengths(spec.max_model_len, rng, spec.num_requests)
    answers = LogNormal(64.0, 0.5).sample(rng, spec.num_requests, 8, 192)
    return [BenchRequest(random_ids(rng, int(n), spec.vocab_size), int(a), "long") if long else c
            for c, long, n, a in zip(chats, is_long, lengths, answers)]


_GENERATORS = {"sharegpt": sharegpt, "alpaca": alpaca, "rag": rag, "prefix": prefix, "mixed": mixed}
WORKLOADS = tuple(_GENERATORS)


def summary(requests: list[BenchRequest]) -> dict:
    """Means and tails of the lengths, recorded in every result JSON."""
    p = np.array([r.prompt_len for r in requests])
    o = np.array([r.output_len for r in requests])
    kinds = sorted({r.kind for r in requests})
    return {"num_requests": len(requests), "prompt_mean": float(p.mean()), "prompt_p50": float(np.median(p)),
            "prompt_p99": float(np.percentile(p, 99)), "prompt_max": int(p.max()),
            "output_mean": float(o.mean()), "output_p50": float(np.median(o)),
            "output_p99": float(np.percentile(o, 99)), "output_max": int(o.max()),
            "kinds": {k: sum(r.kind == k for r in requests) for k in kinds}}
