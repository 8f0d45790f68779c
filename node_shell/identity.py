"""A node's KV identity (what a peer must match to exchange blocks) and its heartbeat figures."""
from __future__ import annotations

import json
import os

import torch

from engine.config import ModelConfig
from engine.llm_engine import LLMEngine
from engine.model import CausalLM
from pdwire.control import NodeStatus
from pdwire.figures import NodeFigures, PrefixCounters, TransferCounters
from pdwire.handshake import KVLayout, PeerIdentity, model_fingerprint
from kvtransport.metrics import ReceiverMetrics, SenderMetrics


def kv_identity(engine: LLMEngine, node_id: str, epoch: str, transport: str = "zmq") -> PeerIdentity:
    """This node's KV identity: its model's fingerprint (config and whole weight shapes) and the
    layout of a block with every kv head, as it travels; neither depends on the node's tp."""
    with open(os.path.join(engine.model_config.path, "config.json")) as f:
        config = {k: v for k, v in json.load(f).items() if not k.startswith("_") and k != "transformers_version"}
    model_id = model_fingerprint(config, _weight_shapes(engine.model_config))
    layout = KVLayout.for_pool(engine.runner.kv_cache, model_id, engine.config.tensor_parallel_size)
    return PeerIdentity(node_id, epoch, transport, layout)


def _weight_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every weight's name and whole shape, from a model built on the meta device (no memory):
    a tensor-parallel rank's own model holds slices."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def node_status(engine: LLMEngine, node_id: str, epoch: str,
                transfer: SenderMetrics | ReceiverMetrics | None = None) -> NodeStatus:
    """The heartbeat: the engine's figures and, if given, the node's KV transfer counters."""
    m = engine.metrics()
    figures = NodeFigures(m.num_running, m.num_waiting, min(1.0, max(0.0, m.kv_usage)), min(1.0, m.prefix_hit_rate),
                          m.num_preemptions, m.num_free_blocks,
                          transfer.counters() if transfer is not None else TransferCounters(),
                          PrefixCounters(m.prefix_queried_tokens, m.prefix_hit_tokens))
    return NodeStatus.of(node_id, epoch, figures)
