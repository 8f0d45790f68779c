"""The colocated engine: requests in, one scheduler step at a time, cumulative outputs out.

Request lifecycle:
  1. add_request validates and tokenizes the prompt, makes a sequence group, queues it
  2. the scheduler admits it when blocks allow (prefix-cache hits reused), prefills in chunks
  3. the step that computes the prompt's last token samples the first token; a group with
     n > 1 forks there, its sequences sharing the prompt's blocks
  4. each later step decodes one token per sequence; stop checks run after each token (a
     structured output's matcher, engine/grammar.py, masks each draw and accepts each token)
  5. on finish or abort every sequence frees its blocks exactly once
"""
from __future__ import annotations

import logging
import time
import torch

import kernels
from engine.beam_group import advance_beams, beam_outputs, new_beam_state
from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import DecodeState, Detokenizer, find_stop
from engine.grammar import GrammarCompiler, GrammarMatcher
from engine.grammar_jobs import CompileJob
from engine.kv_pool import block_bytes, num_blocks_for
from pdwire.outputs import CompletionOutput, EngineMetrics, RequestOutput
from engine.parallel import make_runner
from engine.prompt_logprobs import record_prompt_logprobs
from engine.runner_base import RunnerBroken
from engine.sampler import Sampler, SampledToken, SamplingRow
from pdwire.sampling_params import SamplingParams, choice_seed
from engine.scheduler import ReservedPrompt, ScheduledSeq, Scheduler
from engine.sequence import FinishReason, Sequence, SequenceGroup
from engine.step_memory import retain_step_memory
from engine.step_observer import StepObserver
from engine.swap import PreemptionMode, SwapPool


log = logging.getLogger(__name__)
MAX_STEP_FAILURES = 3       # failed steps with no working one between them: the engine is broken


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, observer: StepObserver | None = None):
        self.config = config = config or EngineConfig()
        self.observer = observer
        path = config.model_path
        self.model_config = ModelConfig.from_pretrained(path, config.dtype, config.max_model_len,
                                                        config.torch_device.type)
        cfg = self.model_config
        if (reason := kernels.unsupported_attention(cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                                    config.torch_device)) is not None:
            raise ValueError(f"{cfg.path}: {reason}")
        self.tokenizer = _load_tokenizer(path)
        bs = config.cache.block_size
        num_blocks = num_blocks_for(self.model_config, config.cache)
        self.max_model_len = min(self.model_config.max_model_len, num_blocks * bs)
        if not config.scheduler.enable_chunked_prefill:     # a prompt (or a recompute) is one step
            self.max_model_len = min(self.max_model_len, config.scheduler.max_num_batched_tokens)
        self.block_manager = BlockManager(num_blocks, bs, config.cache.enable_prefix_caching)
        if config.torch_device.type == "cpu":           # a step's activations: kept mapped, not faulted in again
            retain_step_memory(self.model_config, config.scheduler.max_num_batched_tokens)
        self.runner = make_runner(config, self.model_config, num_blocks)   # tp > 1: engine.parallel
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self._swap_pool(config))
        self.sampler = Sampler(config.seed)
        self.detokenizer = Detokenizer(self.tokenizer)
        self._groups: dict[str, SequenceGroup] = {}
        self._step_failures = 0                         # in a row; see safe_step
        self._decode: dict[int, DecodeState] = {}      # seq_id -> incremental detokenizer state
        self._grammar: dict[int, GrammarMatcher] = {}  # seq_id -> its structured output's state

    def _swap_pool(self, config: EngineConfig) -> SwapPool | None:
        if config.cache.swap_space_gib <= 0:
            return None
        bs = config.cache.block_size
        num = int(config.cache.swap_space_gib * 2**30) // block_bytes(self.model_config, bs)
        self.runner.enable_swap(num)
        sched = config.scheduler
        return SwapPool(num, bs, PreemptionMode(sched.preemption_mode), sched.swap_min_blocks)

    @property
    def model_name(self) -> str:
        return self.model_config.path.rstrip("/").split("/")[-1]

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    prior_outputs: int = 0) -> None:
        """Queue a request. Raises ValueError for a bad id, prompt or parameters; nothing is
        queued then, and the requests already queued are untouched.

        prior_outputs > 0 continues a request moved from another node: the prompt's last
        `prior_outputs` tokens are what it generated there. They count as generated tokens for
        the presence and frequency penalties and for seeded draws, so the continuation samples
        as the first node would have. max_tokens and min_tokens are the caller's to reduce."""
        self.scheduler.add(self._new_group(request_id, prompt, params, prior_outputs))

    def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                growth_tokens: int, prior_outputs: int = 0) -> ReservedPrompt | None:
        """Decode side of a disaggregated request: hold blocks for a prompt another node
        prefills. Returns its block table, the leading blocks already cached here and the blocks
        it took from the free ones, or None when there is no room for the prompt plus
        `growth_tokens` (busy). Raises ValueError like add_request."""
        if params.n != 1 or params.use_beam_search:
            raise ValueError("a disaggregated request carries one completion (n = 1, no beam search)")
        group = self._new_group(request_id, prompt_ids, params, prior_outputs)
        reserved = self.scheduler.reserve(group, growth_tokens)
        if reserved is None:
            self._forget(group)
        return reserved

    def prefill_reserved(self, request_id: str) -> None:
        """A reserved prompt is computed by this engine instead of another node: its uncached
        tokens are prefilled in chunks beside the running decodes and its first token is sampled
        here, exactly as for add_request. KeyError if `request_id` is not reserved."""
        self.scheduler.compute_reserved(request_id)

    def adopt(self, request_id: str, first_token: int,
              logprobs: dict[int, float] | None = None) -> RequestOutput:
        """Every block of a reserved prompt has arrived: take the first token the prefill node
        sampled and join the decode batch."""
        group = self.scheduler.adopt(request_id)
        self._append(group.seqs[0], group, SampledToken(first_token, logprobs))
        self.scheduler.remove_finished()
        out = self._output(group)
        if group.is_finished:
            self._forget(group)
        return out

    def _new_group(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                   prior_outputs: int = 0) -> SequenceGroup:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already running")
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        ids = self.encode(prompt)
        self._check_request(params, len(ids), prior_outputs)
        seq = Sequence(ids, len(ids), seed=params.seed, num_prior_outputs=prior_outputs,
                       reuses_cache=params.prompt_logprobs is None)
        group = SequenceGroup(request_id, [seq], params, time.monotonic())
        if params.use_beam_search:
            group.beam = new_beam_state(params, len(ids), self.max_model_len, self.model_config.eos_token_ids)
        if params.structured is not None:     # done at once for a caller that parked on grammar_job
            group.grammar = self._grammars().compiled(params.structured)
            # replays the tokens generated on another node; refuses a grammar that allows no token
            self._grammar[seq.seq_id] = self._grammars().matcher(group.grammar, seq.generated_token_ids)
        self._groups[request_id] = group
        self._decode[seq.seq_id] = self.detokenizer.start(ids)
        return group

    def grammar_job(self, params: SamplingParams) -> CompileJob | None:
        """Start compiling a request's grammar, without waiting (None: it has none). A loop that
        must not wait parks the request until the job is done (engine/grammar_waits.py), then
        calls add_request or reserve. Raises ValueError (no tokenizer) or GrammarBusy."""
        return None if params.structured is None else self._grammars().submit(params.structured)

    def _grammars(self) -> GrammarCompiler:
        """The grammar compiler, made when the first request asks for a structured output."""
        if self.sampler.grammars is None:
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: structured outputs need one")
            self.sampler.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                    self.model_config.eos_token_ids,
                                                    self.config.grammar)
        return self.sampler.grammars

    def _check_request(self, params: SamplingParams, prompt_len: int, prior_outputs: int) -> None:
        """ValueError for what this engine cannot run (SamplingParams checks the values alone)."""
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.model_config.eos_token_ids))
        if params.min_tokens and len(banned) >= vocab:
            raise ValueError("min_tokens bans every token of the vocabulary (stop_token_ids and EOS)")
        if type(prior_outputs) is not int or not 0 <= prior_outputs < prompt_len:
            raise ValueError(f"prior_outputs must be an integer in [0, {prompt_len}), got {prior_outputs!r}")
        width = params.beam_width if params.use_beam_search else params.n
        if width > self.config.scheduler.max_num_seqs:
            raise ValueError(f"n ({width}) must not exceed max_num_seqs ({self.config.scheduler.max_num_seqs})")
        if prior_outputs and (params.n != 1 or params.use_beam_search):
            raise ValueError("only a single completion (n = 1, no beam search) continues prior outputs")

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                        for t in prompt):
            ids = list(prompt)
            if any(t < 0 or t >= self.model_config.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be in [0, {self.model_config.vocab_size})")
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; this engine's context is "
                             f"{self.max_model_len} tokens, including at least one output token")
        return ids

    def abort_request(self, request_id: str) -> None:
        group = self.scheduler.abort(request_id)
        if group is not None:
            self._forget(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def safe_step(self) -> tuple[list[RequestOutput], dict[str, str]]:
        """step(), except that a step that raises fails the requests this engine held (fail_step)
        instead: (outputs, {request_id: reason}) for the caller to tell their clients. The
        MAX_STEP_FAILURES-th failure with no working step in between re-raises: the engine (or
        its device) is broken; a RunnerBroken (engine.runner_base) re-raises at once."""
        try:
            outputs = self.step()
        except RunnerBroken:
            raise                   # no later step can work: the caller ends the engine
        except Exception as err:    # noqa: BLE001 -- which request broke it is unknown
            self._step_failures += 1
            if self._step_failures >= MAX_STEP_FAILURES:
                raise
            log.exception("engine step failed; failing the requests it held")
            return [], dict.fromkeys(self.fail_step(), f"engine step failed: {type(err).__name__}: {err}"[:500])
        self._step_failures = 0
        return outputs, {}

    def fail_step(self) -> list[str]:
        """After `step()` raised: which request broke it is unknown, so every request here
        (not the reserved ones, whose K/V another node is sending) is aborted, and their ids
        returned for the caller to fail. Raises (the engine is beyond repair) if blocks are then
        not all accounted for."""
        sched = self.scheduler
        ids = [rid for rid in self._groups if rid not in sched.reserved]
        for rid in ids:             # also those the failed step had already ended (plan.finished)
            group = self._groups[rid]
            sched.abort(rid)
            self._forget(group)
        self.check_integrity()
        return ids

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        touched: dict[str, SequenceGroup] = {g.request_id: g for g in plan.finished}
        self.runner.swap_blocks(plan.swap_out, plan.swap_in)   # even if nothing runs this step
        if plan.scheduled:
            self.runner.copy_blocks(plan.copies)
            if self.observer is not None:
                self.observer.before_forward(plan.scheduled)
            logits = self.runner.execute(plan.scheduled)
            sampling = [s for s in plan.scheduled if s.samples]
            if logits.shape[0] > len(sampling):
                record_prompt_logprobs(logits[len(sampling):], plan.scheduled)
                logits = logits[:len(sampling)]
            for item in plan.scheduled:
                item.seq.num_computed_tokens += item.num_new_tokens
                self.block_manager.commit_computed(item.seq)
                if self.observer is not None:
                    self.observer.on_computed(item.group, item.seq)
            self._sample(logits, sampling, touched)
        self.scheduler.remove_finished()
        outputs = [self._output(g) for g in touched.values()]
        for group in touched.values():
            if group.is_finished:
                self._forget(group)
        return outputs

    def _sample(self, logits: torch.Tensor, sampling: list[ScheduledSeq],
                touched: dict[str, SequenceGroup]) -> None:
        beam_rows: dict[str, list[int]] = {}
        pairs: list[tuple[Sequence, SequenceGroup]] = []
        rows: list[int] = []
        for row, item in enumerate(sampling):
            if item.group.beam is not None:
                beam_rows.setdefault(item.group.request_id, []).append(row)
                continue
            new = self._fork(item.group) if not item.group.forked else [item.seq]
            pairs += [(seq, item.group) for seq in new]
            rows += [row] * len(new)
        for rid, group_rows in beam_rows.items():
            group = self._groups[rid]
            advance_beams(group, logits[group_rows], self.block_manager, self.scheduler)
            if group.is_finished:
                touched[rid] = group
        if not pairs:
            return
        if len(rows) != logits.shape[0] or rows != list(range(len(rows))):
            logits = logits[rows]
        samples = self.sampler(logits, [self._sampling_row(s, g) for s, g in pairs])
        for (seq, group), sample in zip(pairs, samples):
            self._append(seq, group, sample)
            touched[group.request_id] = group

    def _fork(self, group: SequenceGroup) -> list[Sequence]:
        """After the prompt's prefill: the group's n sequences, sharing the prompt's blocks. The
        children's matchers come from the group's compiled grammar (nothing compiles in a step),
        made before anything changes: the fork is whole or not at all."""
        parent, grammar = group.seqs[0], group.grammar
        matchers = [None if grammar is None else self._grammars().matcher(grammar) for _ in range(1, group.params.n)]
        for i, matcher in enumerate(matchers, 1):
            child = parent.fork(i)
            if group.params.seed is not None:
                child.seed = choice_seed(group.params.seed, i)
            self.block_manager.fork(parent, child)
            self._decode[child.seq_id] = self.detokenizer.start(group.prompt_token_ids)
            if matcher is not None:
                self._grammar[child.seq_id] = matcher
            group.seqs.append(child)
        group.forked = True
        return list(group.seqs)

    def _sampling_row(self, seq: Sequence, group: SequenceGroup) -> SamplingRow:
        p = group.params
        banned = ()
        if seq.num_output_tokens < p.min_tokens:
            banned = tuple(p.stop_token_ids) + (() if p.ignore_eos else self.model_config.eos_token_ids)
        return SamplingRow(p, group.prompt_token_ids if p.repetition_penalty != 1.0 else [],
                           seq.generated_token_ids, seq.seed, banned, self._grammar.get(seq.seq_id))

    def _append(self, seq: Sequence, group: SequenceGroup, sample: SampledToken) -> None:
        p, token = group.params, sample.token_id
        grammar = self._grammar.get(seq.seq_id)
        if grammar is not None and not grammar.accept(token):   # a grammar that allows no token, or
            log.warning("request %s: token %d does not follow its grammar", group.request_id, token)
            return self.scheduler.finish_seq(seq, FinishReason.ABORT)   # a first token another node sent
        seq.token_ids.append(token)
        if sample.logprobs is not None:
            seq.logprobs.append(sample.logprobs)
        new_text = self.detokenizer.step(self._decode[seq.seq_id], token)
        seq.text += new_text
        reason = None
        if grammar is not None and grammar.terminated:
            reason = FinishReason.STOP
        elif (not p.ignore_eos and token in self.model_config.eos_token_ids) or token in p.stop_token_ids:
            reason = FinishReason.STOP
        elif p.stop and new_text and (at := find_stop(seq.text, len(new_text), p.stop))[0] != -1:
            seq.text, reason = seq.text[:at[1] if p.include_stop_str_in_output else at[0]], FinishReason.STOP
        elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) \
                or len(seq) >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.scheduler.finish_seq(seq, reason)

    def _output(self, group: SequenceGroup) -> RequestOutput:
        if group.beam is not None:
            return RequestOutput(group.request_id, group.prompt_token_ids,
                                 beam_outputs(group, self.tokenizer), group.is_finished)
        outs = [CompletionOutput(s.index, s.text, s.output_token_ids,
                                 s.logprobs if group.params.logprobs is not None else None,
                                 s.finish_reason.value if s.finish_reason else None)
                for s in group.seqs]
        prompt = None
        if group.params.prompt_logprobs is not None:
            lead = group.seqs[0]
            prompt = list(lead.prompt_logprobs or [None] * lead.num_prompt_tokens)
        return RequestOutput(group.request_id, group.prompt_token_ids, outs, group.is_finished, prompt,
                             group.num_cached_tokens or 0, group.queue_time)

    def _forget(self, group: SequenceGroup) -> None:
        self._groups.pop(group.request_id, None)
        for seq in group.seqs:
            self._decode.pop(seq.seq_id, None)
            self._grammar.pop(seq.seq_id, None)

    # -- figures ----------------------------------------------------------------------------
    def metrics(self) -> EngineMetrics:
        bm, sched = self.block_manager, self.scheduler
        live = sched.live_seqs()
        return EngineMetrics(
            num_running=sum(len(g.unfinished()) for g in sched.running), num_waiting=len(sched.waiting), kv_usage=bm.usage,
            num_free_blocks=bm.num_free_blocks, num_cached_blocks=bm.num_cached_blocks,
            num_total_blocks=bm.num_blocks, prefix_hit_rate=bm.stats.hit_rate,
            num_preemptions=sched.num_preemptions, wasted_slots=bm.wasted_slots(live), block_size=bm.block_size,
            prefix_queried_tokens=bm.stats.queried_tokens, prefix_hit_tokens=bm.stats.hit_tokens)

    def check_integrity(self) -> None:
        """Block conservation in the device pool and, with swap, in the swap pool."""
        self.block_manager.check_integrity(self.scheduler.live_seqs())
        if self.scheduler.swap is not None:
            self.scheduler.swap.bm.check_integrity(self.scheduler.swapped_seqs())


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        return None
