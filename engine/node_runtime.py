"""What prefill and decode nodes share: their KV identity, their heartbeat figures, their loop.

The loop never blocks on the network while the engine has work: control messages and transport
frames are polled with a zero timeout between steps, and with a short one when idle.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from engine.config import ModelConfig
from engine.llm_engine import LLMEngine
from engine.model import CausalLM
from pdwire.control import NodeStatus
from pdwire.figures import NodeFigures, TransferCounters
from pdwire.handshake import KVLayout, PeerIdentity, model_fingerprint
from kvtransport.metrics import ReceiverMetrics, SenderMetrics

if TYPE_CHECKING:
    from engine.node_config import NodeConfig

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.005


class NodeService(Protocol):
    engine: LLMEngine

    def poll(self, timeout: float) -> None:
        """Take control messages and transport events for up to `timeout` seconds."""

    def on_outputs(self, outputs: list[Any]) -> None:
        """Forward the outputs of one engine step."""

    def busy(self) -> bool:
        """Whether work is pending besides the engine's own (e.g. transfers in flight)."""

    def should_stop(self) -> bool: ...

    def fail(self, rid: str, reason: str) -> None:
        """Tell the router request `rid` failed here (the engine has already dropped it)."""

    def close(self) -> None: ...


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
                          transfer.counters() if transfer is not None else TransferCounters())
    return NodeStatus.of(node_id, epoch, figures)


def main(role: str, make_service: Callable[[NodeConfig], NodeService]) -> None:
    """`python -m {role}_node`: the node from its flags, served until told to stop."""
    from engine.node_config import NodeConfig
    from kvtransport.secret import SecretError

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")
    config = NodeConfig.from_argv(f"python -m {role}_node")
    try:
        service = make_service(config)
    except SecretError as err:
        sys.exit(f"{role} node {config.node_id}: {err}")
    run(service)


def run(service: NodeService) -> None:
    """Serve until the router says leave or the process gets SIGTERM/SIGINT."""
    stopping = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stopping.append(True))
    try:
        while not stopping and not service.should_stop():
            working = service.engine.has_unfinished_requests()
            service.poll(0.0 if working or service.busy() else IDLE_POLL_S)
            if service.engine.has_unfinished_requests():
                outputs, failed = service.engine.safe_step()      # a broken engine raises: the node ends
                for rid, reason in failed.items():
                    service.fail(rid, reason)
                service.on_outputs(outputs)
    finally:
        service.close()
