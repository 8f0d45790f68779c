"""Beam search over a sequence group whose beams share blocks, scored as Hugging Face does.

Each step (all running beams of the group were just computed):
  1. every candidate (beam b, token t) scores running_score[b] + logprob[b, t] (float32);
     the best K = max(2, 1 + #eos) * width candidates are kept, best first
  2. a candidate that ends its beam (EOS, max_tokens, the context) and ranks among the first
     `width` enters the finished set with score / generated_len ** length_penalty; the
     finished set keeps its best `width`
  3. the best `width` candidates that do not end become the next running beams: the first
     candidate of a parent beam continues that beam in place, later ones fork it (the block
     table is shared, copy-on-write on the next write), parents chosen by none are dropped
  4. the search stops when no running beam can still beat the worst finished one
     (early_stopping False / "never" heuristics), when `width` beams finished and
     early_stopping is True, or when every candidate ended
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

_NEG = -1.0e9


class Choice(NamedTuple):
    parent: int     # index among the running beams the step computed
    token: int


@dataclass(slots=True)
class Hypothesis:
    score: float                 # length-penalized
    token_ids: list[int]         # generated tokens, the last one included


@dataclass(slots=True)
class BeamState:
    width: int
    length_penalty: float
    early_stopping: bool | str
    max_tokens: int              # generated tokens at most (from max_tokens and the context)
    eos_ids: tuple[int, ...]     # empty with ignore_eos
    scores: torch.Tensor = field(default_factory=lambda: torch.zeros(1))   # [running beams] float32
    finished: list[Hypothesis] = field(default_factory=list)               # best first, <= width
    generated: int = 0           # tokens each running beam has generated
    improvable: bool = True
    done: bool = False

    def step(self, logprobs: torch.Tensor, outputs: list[list[int]]) -> list[Choice]:
        """logprobs: [running beams, vocab] float32 (log-softmax); outputs: each running beam's
        generated tokens. Updates the finished set; returns the next running beams, best first."""
        vocab = logprobs.shape[1]
        keep = max(2, 1 + len(self.eos_ids)) * self.width
        acc = (logprobs + self.scores.to(logprobs.device)[:, None]).reshape(-1)
        top, idx = acc.topk(min(keep, acc.numel()))
        cands = [Choice(int(i) // vocab, int(i) % vocab) for i in idx.tolist()]
        new_len = self.generated + 1
        ends = [c.token in self.eos_ids or new_len >= self.max_tokens for c in cands]
        self._finish([(top[j], cands[j]) for j in range(min(self.width, len(cands))) if ends[j]],
                     outputs, new_len)
        running = [j for j in range(len(cands)) if not ends[j]][: self.width]
        self.scores = top[running].clone() if running else torch.zeros(0)
        self.generated = new_len
        self._check_improvable()
        all_full = len(self.finished) == self.width
        self.done = not running or not self.improvable or (self.early_stopping is True and all_full)
        return [cands[j] for j in running]

    def stop(self, outputs: list[list[int]]) -> None:
        """Ends the search early (the pool cannot hold the beams): each running beam with a token
        joins the finished set at its score so far. outputs: the running beams' generated tokens."""
        self._add(Hypothesis(score / len(tokens) ** self.length_penalty, list(tokens))
                  for score, tokens in zip(self.scores.tolist(), outputs) if tokens)
        self.done = True

    def _finish(self, ended, outputs: list[list[int]], new_len: int) -> None:
        if (self.early_stopping is True and len(self.finished) == self.width) or not self.improvable:
            return
        penalty = new_len ** self.length_penalty
        self._add(Hypothesis(float(score) / penalty, outputs[choice.parent] + [choice.token]) for score, choice in ended)

    def _add(self, hypotheses) -> None:
        """Into the finished set, which keeps its best `width`, best first."""
        self.finished.extend(hypotheses)
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.width:]

    def _check_improvable(self) -> None:
        if len(self.finished) < self.width or self.scores.numel() == 0:
            return
        length = self.max_tokens if (self.early_stopping == "never" and self.length_penalty > 0) \
            else self.generated
        best_possible = float(self.scores[0]) / (length ** self.length_penalty)
        self.improvable = self.improvable and best_possible > self.finished[-1].score
