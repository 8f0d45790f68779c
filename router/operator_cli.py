"""The operator's commands against a running router's /admin API (router/http/operator.py):

    pdserve nodes  [--url URL] [--admin-key-file F]                    a table of the nodes
    pdserve drain  NODE [--deadline-s S] [--url URL] [--admin-key-file F]
    pdserve remove NODE [--url URL] [--admin-key-file F]
    pdserve pools  [--url URL] [--admin-key-file F]                    each pool's target and nodes
    pdserve scale  [--prefill N] [--decode M] [--drain-deadline-s S] [--url URL] [--admin-key-file F]

The admin key comes from --admin-key-file (its first line), else $PDSERVE_ADMIN_KEY; never from
argv, which other users of the host can read. `main(argv)` takes the command first and returns
the exit status: 0 done, 1 the router refused (its message on stderr), 2 bad usage.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

import httpx

from router.cluster.membership import DEFAULT_DRAIN_DEADLINE_S
from router.config import KEY_VARIABLES, MAX_KV_MOVE_TIMEOUT_S

ENV_VAR = KEY_VARIABLES["admin_api_key"]     # the router's own variable for it: one key, both ends
DEFAULT_URL = "http://127.0.0.1:8000"
COMMANDS = ("nodes", "drain", "remove", "pools", "scale")
_TIMEOUT_S = 10.0
_REMOVE_TIMEOUT_S = 2 * MAX_KV_MOVE_TIMEOUT_S  # a remove answers once the node is out: after its KV moves (2 x --kv-move-timeout-s)
_COLUMNS = (("NODE", "id"), ("ROLE", "role"), ("STATE", "state"), ("RUN", "num_running"),
            ("WAIT", "num_waiting"), ("KV%", "kv_usage"), ("FREE", "num_free_blocks"),
            ("EPOCH", "epoch"), ("BEAT_AGE_S", "last_heartbeat_age_s"), ("ADDRESS", "address"))
_POOL_COLUMNS = (("POOL", "role"), ("TARGET", "target"), ("ACTIVE", "active"), ("DRAINING", "draining"),
                 ("STARTING", "starting"))


def main(argv: Sequence[str]) -> int:
    """argv: the command and its flags, e.g. ["drain", "decode-1", "--deadline-s", "30"]."""
    args = _parser().parse_args(list(argv))
    key = _admin_key(args.admin_key_file)
    if key is None:
        print(f"pdserve {args.command}: no admin key (--admin-key-file or ${ENV_VAR})", file=sys.stderr)
        return 2
    requests = _requests(args)
    if not requests:
        print(f"pdserve {args.command}: give --prefill and/or --decode", file=sys.stderr)
        return 2
    for method, path, body in requests:
        try:
            reply = httpx.request(method, args.url.rstrip("/") + path, json=body,
                                  timeout=_REMOVE_TIMEOUT_S if args.command == "remove" else _TIMEOUT_S,
                                  headers={"Authorization": f"Bearer {key}"})
        except httpx.HTTPError as err:
            print(f"pdserve {args.command}: {args.url}: {err}", file=sys.stderr)
            return 1
        if reply.status_code != 200:
            print(f"pdserve {args.command}: {reply.status_code} {_message(reply)}", file=sys.stderr)
            return 1
        print(_shown(args.command, reply.json()))
    return 0


def table(nodes: list[dict], columns: tuple[tuple[str, str], ...] = _COLUMNS) -> str:
    """The nodes (or pools) as aligned columns, a header first."""
    rows = [[title for title, _ in columns]] + [[_cell(n, field) for _, field in columns] for n in nodes]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def _cell(node: dict, field: str) -> str:
    value = node[field]
    if field == "kv_usage":
        return f"{100 * value:.0f}"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value) if value != "" else "-"


def _shown(command: str, reply: dict) -> str:
    if command == "nodes":
        return table(reply["data"])
    if command == "pools":
        return table(reply["data"], _POOL_COLUMNS)
    if command == "scale":
        return (f"{reply['role']}: target {reply['target']} ({reply['active']} active, {reply['draining']} "
                f"draining, {reply['starting']} starting)")
    return _summary(reply)


def _summary(node: dict) -> str:
    if node["state"] == "draining":
        return f"{node['id']}: draining; its requests move in {node['drain_deadline_s']:.0f} s if not done"
    return f"{node['id']}: {node['state']}"


def _requests(args: argparse.Namespace) -> list[tuple[str, str, dict | None]]:
    if args.command in ("nodes", "pools"):
        return [("GET", f"/admin/{args.command}", None)]
    if args.command == "drain":
        return [("POST", f"/admin/nodes/{args.node}/drain", {"deadline_s": args.deadline_s})]
    if args.command == "scale":
        return [("POST", f"/admin/pools/{role}", {"count": count, "drain_deadline_s": args.drain_deadline_s})
                for role, count in (("prefill", args.prefill), ("decode", args.decode)) if count is not None]
    return [("POST", f"/admin/nodes/{args.node}/remove", None)]


def _admin_key(path: str | None) -> str | None:
    if path is not None:
        with open(path, encoding="utf-8") as f:
            return f.readline().strip() or None
    return os.environ.get(ENV_VAR) or None


def _message(reply: httpx.Response) -> str:
    try:
        return reply.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return reply.text[:200]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="operate a running router's nodes")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {"nodes": "list the nodes: role, state, load, epoch, address, heartbeat age",
                "drain": "no new work for NODE; its requests finish, or move after the deadline; then it leaves",
                "remove": "NODE leaves now; its requests move to other nodes",
                "pools": "list the pools: target, active, draining and starting nodes",
                "scale": "grow or shrink the pools (under pdserve up or pdserve ray up): new nodes start, "
                         "the surplus drains"}
    for name, text in commands.items():
        command = sub.add_parser(name, help=text, description=text)
        if name in ("drain", "remove"):
            command.add_argument("node", metavar="NODE")
        if name == "scale":
            command.add_argument("--prefill", type=int, metavar="N", help="the prefill pool's new size")
            command.add_argument("--decode", type=int, metavar="M", help="the decode pool's new size")
            command.add_argument("--drain-deadline-s", type=float, default=DEFAULT_DRAIN_DEADLINE_S,
                                 help="a drained node's requests move after this long "
                                      f"(default {DEFAULT_DRAIN_DEADLINE_S:g})")
        if name == "drain":
            command.add_argument("--deadline-s", type=float, default=DEFAULT_DRAIN_DEADLINE_S,
                                 help=f"seconds before its requests are moved (default {DEFAULT_DRAIN_DEADLINE_S:g})")
        command.add_argument("--url", default=DEFAULT_URL, help=f"the router (default {DEFAULT_URL})")
        command.add_argument("--admin-key-file", help=f"a file holding the admin key (else ${ENV_VAR})")
    return parser
