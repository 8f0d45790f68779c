"""A node profile: what one engine step costs on one machine, and what shipping a KV block costs,
as a JSON file the simulator and the planner read. Written by `pdserve profile` (profiler.py) from
measurements, or by hand from published figures (then `source` says where from and
`extrapolated` is true).

One step's cost is linear in six features of the batch it runs, each sequence i computing
n_i new tokens over c_i tokens already in its context:

    t(step) = fixed + per_token * sum(n_i) + per_seq * #seqs
              + per_decode_ctx * sum(c_i + 1 over decoding seqs, n_i == 1)      attention reads (bandwidth)
              + per_prefill_pair * sum(n_i * (c_i + (n_i + 1) / 2) over n_i > 1) attention pairs (compute)
              + per_prefill_ctx * sum(c_i over n_i > 1)                         a chunk's cached context read

The last term is what a short chunk over a long cached context (a RAG question after its
document) costs beyond its pairs: measured, a 16-token question over 1-3k cached tokens cost
12-35% more than the five-feature price and a 64-token one 9-11% less (bench/README.md, plan5
and plan6). A profile written before it has no per_prefill_ctx: it loads as 0.

A step's linears read every weight whatever its batch: below some number of tokens they cost
that read, not their arithmetic, so the tokens term has a floor, `knee_tokens`; and the LM head,
run on one row a sequence, reads its weights likewise (the 58M bench model's: 39% of what a decode
step reads), so the sequences term has one too, `knee_seqs`:

    per_token * max(sum(n_i), knee_tokens) + per_seq * max(#seqs, knee_seqs)

(1 is no floor: a step has a token and a sequence at least). Measured, a 58M model's decode step
on one CPU core costs about the same at batch 1 and 4; the linear price (knee 1) had batch 1
5-17% low and batches 4-6 up to 20% high in serving (bench/README.md, sim26 and sim27). The fit
takes one knee for both terms, from KNEES (4 there; 512 for a 7B model on an H200, whose steps
the host's launches bound). A profile written with the tokens' floor alone loads with knee_seqs 1
and prices as it did.

The same function prices a prefill node's chunks, a decode node's batches and a colocated
engine's mixed steps; the coefficients are a non-negative least-squares fit over every measured
step (the raw steps stay in the file), at each knee of KNEES, the one with the least error kept.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from pdplan.kind_cost import KindCost, KindSpeed

FEATURES = ("fixed", "per_token", "per_seq", "per_decode_ctx", "per_prefill_pair", "per_prefill_ctx")
KNEES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)   # fit() tries each


@dataclass(frozen=True, slots=True)
class StepShape:
    """One scheduled sequence of a step: new tokens and the context before them."""
    new_tokens: int
    context: int


def step_features(shapes: list[StepShape] | list[tuple[int, int]], knee: float = 1.0,
                  knee_seqs: float = 1.0) -> list[float]:
    """The six features of FEATURES for a step's scheduled sequences [(new, context), ...], the
    tokens counted as `knee` at least and the sequences as `knee_seqs` (the floors of the weights'
    read: the module docstring)."""
    tokens = decode_ctx = pairs = prefill_ctx = 0.0
    for n, c in shapes:
        tokens += n
        if n == 1:
            decode_ctx += c + 1
        else:
            pairs += n * (c + (n + 1) / 2)
            prefill_ctx += c
    seqs = max(len(shapes), knee_seqs) if shapes else 0.0
    return [1.0, max(tokens, knee) if tokens else 0.0, seqs, decode_ctx, pairs, prefill_ctx]


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds per unit of each feature (see the module docstring)."""
    fixed: float
    per_token: float
    per_seq: float
    per_decode_ctx: float
    per_prefill_pair: float
    per_prefill_ctx: float = 0.0    # 0 in profiles written before it (fitted from then on)
    knee_tokens: float = 1.0        # the tokens term's floor; 1 (none) in profiles written before it
    knee_seqs: float = 1.0          # the sequences term's floor; 1 in profiles written before it

    def of(self, shapes: list[tuple[int, int]]) -> float:
        """Seconds for one step that schedules `shapes`: [(new tokens, context before them), ...]."""
        features = step_features(shapes, self.knee_tokens, self.knee_seqs)
        return sum(getattr(self, name) * x for name, x in zip(FEATURES, features))

    def scaled(self, k: float) -> "StepCost":
        """Every step k times as dear (an engine running slower or faster than when profiled)."""
        return replace(self, **{name: getattr(self, name) * k for name in FEATURES})

    @classmethod
    def fit(cls, samples: list["StepSample"], knees: tuple[float, ...] = KNEES) -> "StepCost":
        """Non-negative least squares over the median of each group of like steps (same kind,
        batch and tokens; context within 10%: a busy machine's outliers weigh little, and a
        decode grid of hundreds of steps no more than a prefill of a few), relative error
        weighted (a 5 ms step matters as much as a 1 s one); features with a negative
        coefficient are dropped and the rest refitted. At each of `knees` (one floor for both the
        tokens and the sequences): the least error's."""
        groups: dict[tuple, list[StepSample]] = {}
        for s in samples:
            f = step_features(s.shapes)
            key = (s.kind, f[1], f[2], round(math.log1p(f[3]) * 10), round(math.log1p(f[4]) * 10))
            groups.setdefault(key, []).append(s)
        medians = [_median(g) for g in groups.values()]
        y = np.array([s.seconds for s in medians])
        w = 1.0 / np.maximum(y, 1e-6)
        fits = [_nnls(np.array([step_features(s.shapes, knee, knee) for s in medians]), y, w) + (knee,)
                for knee in knees]
        _, coef, knee = min(fits, key=lambda f: f[0])
        return cls(*coef, knee_tokens=float(knee), knee_seqs=float(knee))


def _nnls(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, list[float]]:
    """(weighted squared error, coefficients): least squares with each negative coefficient's
    feature dropped and the rest refitted."""
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all() or not keep:
            break
        keep.pop(int(np.argmin(coef)))
    full = [0.0] * x.shape[1]
    for k, c in zip(keep, coef):
        full[k] = float(c)
    return float(((((x @ np.array(full)) - y) * w) ** 2).sum()), full


def _median(group: list["StepSample"]) -> "StepSample":
    """The group's median step: the middle one's shapes, at the median of the times (with an even
    count, the mean of the two middle ones: a like step measured twice, as the profiler measures
    each short prompt, is priced between its two times, not at the slower)."""
    ranked = sorted(group, key=lambda s: s.seconds)
    mid = ranked[(len(ranked) - 1) // 2]
    return StepSample(mid.shapes, statistics.median(s.seconds for s in ranked), mid.kind)


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured step: the scheduled (new tokens, context) pairs and its wall time."""
    shapes: list[tuple[int, int]]
    seconds: float
    kind: str = ""                  # prefill | prefill_cached | decode | mixed: what the experiment was


@dataclass(frozen=True, slots=True)
class Transfer:
    """Shipping one KV block from a prefill node to a decode node."""
    per_block_s: float
    per_transfer_s: float           # once per request: reservation round trip, commit
    block_bytes: int


@dataclass(frozen=True, slots=True)
class Overheads:
    """What the engine step does not include: the serving path around it. `pdserve profile`
    measures engines only (these stay 0); bench/simulate/calibrate.py fits them to real runs."""
    request_s: float = 0.0          # HTTP, tokenizing, routing: arrival to the first engine admission
    prompt_token_s: float = 0.0     # ... and per prompt token on top (the body, the tokenizer): a 3k-token
                                    # RAG prompt reached the router 6-18 ms after it was sent, a short one 2-4
    front_cpu_token_s: float = 0.0  # of which CPU (the tokenizer's, traced): a colocated server's front end runs
                                    # on its engine's core, so pinned on a machine it shares it with the steps
    admit_token_s: float = 0.0      # a disaggregated router's, per prompt token on top, its backend -> the decode
                                    # node's reservation (hashing, DecodeRequest with every token, D's prefix match)
    handoff_s: float = 0.0          # a prompt sent to a prefill node, on top: PrefillRequest, FirstToken messages
    token_s: float = 0.0            # per token a streaming step samples: node -> router -> client (added to the step)
    # CPU seconds per streamed token of the processes pinned nowhere in the validation runs, measured
    # there (bench/simulate/measure.py float_cpu): they take a core from a node only when no core is
    # idle (pdplan/sim_core.py FloatingWork); in a plan (separate hosts) they cost nothing
    router_token_s: float = 0.0     # a disaggregated router (a colocated one is its engine's process)
    client_token_s: float = 0.0     # the load generator
    # ... and CPU seconds per second of the run whatever streams (heartbeats, polls, the event loops):
    # the per-token figure alone, a median over points of 26-128 s, was 21-44% off them (median; sim28)
    router_per_s: float = 0.0
    client_per_s: float = 0.0
    # wall time a colocated server's engine loses beyond a decode node's, per step and per request it
    # starts (and per prompt token of it): its HTTP front end runs in the engine's process (GIL) and on
    # its core; measured from traces of both (bench/simulate/loop_cost.py); added to its simulated steps
    colocated_step_s: float = 0.0
    colocated_admit_s: float = 0.0
    colocated_admit_token_s: float = 0.0
    # not the serving path but the machine's: a step's price multiplier while another core of the same
    # machine runs a prefill step (shared L3 and memory bus; traced 1.05-1.15x for a decode step:
    # bench/simulate/trace.py beside_prefill); only nodes pinned on one machine pay it (pdplan/sim_bus.py)
    beside_prefill: float = 1.0

    def front_s(self, prompt_len: int) -> float:
        """Arrival to the first engine admission, for a prompt of prompt_len tokens."""
        return self.request_s + self.prompt_token_s * prompt_len


@dataclass(frozen=True, slots=True)
class Profile:
    machine: dict                   # where it was measured (cpu, gpu, threads), or the published source's hardware;
                                    # `speed`: the speed probe before and after (speed_probe.py; not in older profiles)
    model: dict                     # name, parameters, layers, kv bytes per token
    block_size: int
    num_blocks: int                 # KV blocks one node holds
    max_num_seqs: int
    max_num_batched_tokens: int
    step: StepCost
    transfer: Transfer
    overheads: Overheads = Overheads()
    source: str = "measured"        # measured | the publication the figures come from
    extrapolated: bool = False      # true when not measured on the machine it describes
    samples: list[StepSample] = field(default_factory=list)
    long_prefill_token_threshold: int = 0   # the nodes' cap on a prompt's tokens a step (0: none; engine flag)

    def step_seconds(self, shapes: list[tuple[int, int]]) -> float:
        return self.step.of(shapes)

    def at_speed(self, k) -> "Profile":
        """This profile with every step k times as dear (1.0: itself); k a KindSpeed (kind_cost.py):
        a step's decoding rows and its prompt rows each at their own factor."""
        if isinstance(k, tuple):
            return replace(self, step=KindCost(self.step, KindSpeed(*k)))
        return self if k == 1.0 else replace(self, step=self.step.scaled(k))

    def blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def fit_error(self) -> float:
        """Median relative error of the fitted step cost over the measured steps (nan if none)."""
        if not self.samples:
            return float("nan")
        errors = [abs(self.step.of(s.shapes) - s.seconds) / s.seconds for s in self.samples]
        return float(np.median(errors))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        samples = [StepSample([tuple(p) for p in s["shapes"]], s["seconds"], s.get("kind", ""))
                   for s in d.get("samples", [])]
        return cls(d["machine"], d["model"], d["block_size"], d["num_blocks"], d["max_num_seqs"],
                   d["max_num_batched_tokens"], StepCost(**d["step"]), Transfer(**d["transfer"]),
                   Overheads(**d.get("overheads", {})), d.get("source", "measured"),
                   d.get("extrapolated", False), samples, d.get("long_prefill_token_threshold", 0))

    @classmethod
    def load(cls, path: str) -> "Profile":
        with open(path) as f:
            return cls.from_dict(json.load(f))
