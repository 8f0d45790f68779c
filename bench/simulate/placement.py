"""Which decode node each measured request went to, as the real router chose it: its DecodeRequest
leaving the router (router/cluster/admission.py sends it to the node it picked; trace_points.py's
hook on ControlServer.send records it, and in a measure run nothing else), joined to the client's
records by the response's id (the router's request id, which each of its wire rids starts with:
`<id>-<prompt>`, `#<choice>` when n > 1, `~<attempt>` on a retry).

    measure    the server runs with env(dir): one line per control message the router sends
    per point  attach(point["requests"], read(dir)): each request gains "decode_node"
    validate   --replay-placement: the simulator sends each request where the router did
"""
from __future__ import annotations

import os

from bench.simulate.trace import HOOK, load

ROUTER_SENDS = "router.cluster.control_server"      # trace_points.PATCHES: the router's sends alone


def env(out_dir: str, repo: str, only: str = ROUTER_SENDS) -> dict[str, str]:
    """The server's environment for a run that records where its requests went (and with `only`
    naming more of trace_points.PATCHES, more: node_steps.py its nodes' steps)."""
    os.makedirs(out_dir, exist_ok=True)
    return {"PYTHONPATH": f"{repo}:{HOOK}", "PDSERVE_TRACE_DIR": out_dir, "PDSERVE_TRACE_ONLY": only}


def request_id(wire_rid: str) -> str:
    """The router's request id of a wire rid (`cmpl-ab12-0~1` -> `cmpl-ab12`)."""
    return wire_rid.split("~")[0].split("#")[0].rsplit("-", 1)[0]


def read(out_dir: str) -> dict[str, str]:
    """Request id -> the decode node that took its first attempt: the last one that attempt's
    DecodeRequest went to (a node that answers Busy has the router ask the next one it ranks,
    under the same wire rid), of the request's first wire rid; a retry's or a KV move's attempt
    (`~k`) is not it."""
    latest: dict[str, str] = {}         # first attempts' wire rids, in order of their first ask
    for e in load(out_dir):
        if e["e"] == "send" and e.get("m") == "DecodeRequest" and e.get("rid") and "~" not in e["rid"]:
            latest[e["rid"]] = e["node"]
    where: dict[str, str] = {}
    for wire_rid, node in latest.items():
        where.setdefault(request_id(wire_rid), node)
    return where


def attach(requests: list[dict], where: dict[str, str]) -> int:
    """Sets each compact request record's "decode_node" from `where` by its response id; returns how
    many were found ("" for a request the router never sent to a decode node)."""
    for r in requests:
        r["decode_node"] = where.get(r.get("id", ""), "")
    return sum(1 for r in requests if r["decode_node"])
