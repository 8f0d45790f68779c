"""Configuration of a prefill or decode node process; its CLI is generated from the fields.

    python -m prefill_node --router tcp://127.0.0.1:7100 --node-id prefill-0 [--model DIR] ...
    python -m decode_node  --router tcp://127.0.0.1:7100 --node-id decode-0 --kv-bind tcp://127.0.0.1:0

A decode node's KV receiver binds --kv-bind and is announced to the router (and so to prefill
nodes) at that address, or at --kv-advertise-host with the bound port: a node bound to a wildcard
address (0.0.0.0, ::) must name the address other hosts reach it at.

--tensor-parallel-size N splits a node's model and KV heads over N ranks (engine.parallel). Each
node picks its own: blocks travel between nodes with every kv head, so a prefill node of one tp
ships to a decode node of any other.

Every node proves to the router and to its KV peers that it holds the deployment's cluster
secret: from --cluster-secret-file (mode 0600) or $PDSERVE_CLUSTER_SECRET (kvtransport.secret).

--kv-transport torch_dist ships block payloads as tensor sends on a process group per prefill /
decode pair (NCCL between GPUs, gloo on CPU) instead of ZeroMQ frames; the control messages stay
on ZeroMQ. Both nodes of a pair must use the same transport (the handshake checks it).
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from engine.args import EngineArgs
from engine.flags import add_dataclass_args, build_dataclass
from pdwire.messages import BATCH_BYTES, BATCH_BYTES_LIMIT, PAYLOAD_WAIT_S, RECV_QUEUE_BYTES, SPLIT_PAYLOADS


KV_TRANSPORTS = ("zmq", "torch_dist")
WILDCARD_HOSTS = ("0.0.0.0", "::", "*", "")
MAX_LAYER_GROUPS = 64
MAX_LAYER_GROUP_MIN_BLOCKS = 1 << 20
MAX_KV_POLL_MS = 1000       # the loop must still heartbeat the router (--heartbeat-s) between two polls


def _tcp_host(endpoint: str) -> str | None:
    """The host of a tcp:// endpoint (None for ipc://)."""
    m = re.fullmatch(r"tcp://\[?([^\]]*?)\]?:[0-9*]+", endpoint)
    return m.group(1) if m else None


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig(EngineArgs):
    """A node is an engine (EngineArgs: the same knobs, under the same names, as `LLM(...)` and
    `python -m router`) plus how it joins the deployment."""
    router: str                          # the router's control endpoint, e.g. tcp://10.0.0.1:7100
    node_id: str                         # unique among the router's nodes
    kv_bind: str = "tcp://127.0.0.1:0"   # decode nodes: where the KV receiver listens (port 0: any free)
    kv_advertise_host: str | None = None  # decode nodes: the host prefill nodes reach it at; default: kv_bind's
    heartbeat_s: float = 0.5             # seconds between heartbeats to the router
    router_timeout_s: float = 10.0       # no reply from the router this long: register again (new epoch)
    kv_connect_timeout_s: float = 10.0   # prefill nodes: pairing with a decode node's KV receiver (a step per
                                         # tick; torch_dist's group join blocks up to ~2 * its MAX_JOIN_S);
                                         # requests for it wait this long at most, then fail
    lease_s: float = 30.0                # a reservation's lease, renewed by the sender's progress
    kv_transport: str = "zmq"            # zmq: payloads as ZeroMQ frames; torch_dist: tensor sends
                                         # (NCCL between CUDA pools, gloo between CPU pools)
    p2p_host: str = "127.0.0.1"          # torch_dist: the address this node's process groups bind and
                                         # announce to its peers (a concrete address, not a wildcard)
    kv_payload_wait_s: float = PAYLOAD_WAIT_S  # decode nodes (torch_dist, CPU pools): how long the loop waits for a
                                         # block's payload after its header; past it the transfer fails, the
                                         # pair is broken (the prefill node pairs again) and the loop serves on
    cluster_secret_file: str | None = None  # the node network's secret (mode 0600); else $PDSERVE_CLUSTER_SECRET
    kv_batch_mib: int = BATCH_BYTES >> 20  # payload MiB of one KV batch (BlockBatch: one header and MAC): a decode
                                         # node takes up to it (2 MiB at most where a batch's payloads come in its
                                         # message, not as messages of their own), a sender packs blocks ready
                                         # together up to it and the receiver's (one block at least; per frame
                                         # the limit stays one block)
    kv_recv_queue_mib: int = RECV_QUEUE_BYTES >> 20  # decode nodes (zmq): payload MiB one prefill connection
                                         # may have queued here, as messages of one block where payloads come
                                         # as messages of their own, else of --kv-batch-mib (one at least)
    kv_split_payloads: bool = SPLIT_PAYLOADS  # decode nodes (zmq, a pool of every kv head): let senders send each
                                         # payload of a batch as a message of its own (--no-kv-split-payloads:
                                         # one message a batch, as before the split, which an older sender needs;
                                         # README: upgrading)
    kv_poll_ms: int = 20                 # the most time one poll of the KV transport takes messages for (decode
                                         # nodes: blocks; prefill nodes: replies) before the node's loop serves
                                         # the rest (its engine's step, the router, leases): a flood of messages
                                         # cannot hold the loop longer
    kv_layer_groups: int = 8             # prefill nodes (CPU pool, tp = 1): > 1 ships the blocks a prompt's last
                                         # chunk completes in this many layer groups during its forward (to
                                         # decode nodes that take slices), leaving one group's bytes for after
                                         # it; 1: whole blocks after each chunk
    kv_layer_group_min_blocks: int = 32  # prefill nodes: layer groups are used only when the last chunk completes
                                         # at least this many blocks: each group's send costs the forward ~0.3 ms
                                         # of the node's CPU (before the first token), which the few blocks of a
                                         # short prompt do not repay (bench/README.md, issue #18: what a node adds
                                         # to a prefill step)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9._:-]{1,64}", self.node_id):
            raise ValueError(f"node_id must be 1-64 characters of [A-Za-z0-9._:-], got {self.node_id!r}")
        if not self.router.startswith(("tcp://", "ipc://")):
            raise ValueError(f"router must be a tcp:// or ipc:// endpoint, got {self.router!r}")
        if min(self.heartbeat_s, self.lease_s, self.router_timeout_s, self.kv_connect_timeout_s,
               self.kv_payload_wait_s) <= 0:
            raise ValueError("heartbeat_s, lease_s, router_timeout_s, kv_connect_timeout_s and kv_payload_wait_s "
                             "must be > 0")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 1 <= self.kv_batch_mib <= BATCH_BYTES_LIMIT >> 20:
            raise ValueError(f"kv_batch_mib must be in [1, {BATCH_BYTES_LIMIT >> 20}], got {self.kv_batch_mib}")
        if self.kv_recv_queue_mib < 1:
            raise ValueError(f"kv_recv_queue_mib must be >= 1, got {self.kv_recv_queue_mib}")
        if not 1 <= self.kv_poll_ms <= MAX_KV_POLL_MS:
            raise ValueError(f"kv_poll_ms must be in [1, {MAX_KV_POLL_MS}], got {self.kv_poll_ms}")
        if not 1 <= self.kv_layer_groups <= MAX_LAYER_GROUPS:
            raise ValueError(f"kv_layer_groups must be in [1, {MAX_LAYER_GROUPS}], got {self.kv_layer_groups}")
        if not 1 <= self.kv_layer_group_min_blocks <= MAX_LAYER_GROUP_MIN_BLOCKS:
            raise ValueError(f"kv_layer_group_min_blocks must be in [1, {MAX_LAYER_GROUP_MIN_BLOCKS}], "
                             f"got {self.kv_layer_group_min_blocks}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {KV_TRANSPORTS}, got {self.kv_transport!r}")
        if self.kv_transport == "torch_dist" and self.p2p_host in WILDCARD_HOSTS:
            raise ValueError(f"--p2p-host {self.p2p_host!r}: torch_dist announces this address to its peers; "
                             "give one they reach this node at")
        host = self.kv_advertise_host or _tcp_host(self.kv_bind)
        if host in WILDCARD_HOSTS:
            raise ValueError(f"a decode node bound to {self.kv_bind} must say where prefill nodes reach it: "
                             f"--kv-advertise-host HOST (not a wildcard address)")

    @property
    def kv_batch_bytes(self) -> int:
        return self.kv_batch_mib << 20

    @property
    def kv_recv_queue_bytes(self) -> int:
        return self.kv_recv_queue_mib << 20

    @property
    def kv_poll_s(self) -> float:
        return self.kv_poll_ms / 1000

    def kv_advertised(self, bound: str) -> str:
        """The endpoint prefill nodes connect to, for a receiver bound at `bound` (its real port)."""
        if self.kv_advertise_host is None or not bound.startswith("tcp://"):
            return bound
        port = bound.rsplit(":", 1)[1]
        host = self.kv_advertise_host
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    @classmethod
    def from_argv(cls, prog: str, argv: list[str] | None = None) -> "NodeConfig":
        parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        add_dataclass_args(parser, cls)
        return build_dataclass(cls, vars(parser.parse_args(argv)))
