"""The operator's commands against a running router's /admin API (router/http/operator.py):

    pdserve nodes  --url URL [--admin-key-file F]                    a table of the nodes
    pdserve drain  NODE [--deadline-s S] --url URL [--admin-key-file F]
    pdserve remove NODE --url URL [--admin-key-file F]
    pdserve pools  --url URL [--admin-key-file F]                    each pool's target and nodes
    pdserve scale  [--prefill N] [--decode M] [--drain-deadline-s S] --url URL [--admin-key-file F]

The admin key comes from --admin-key-file (its first line; a file only this user can read, as ssh
wants a private key), else $PDSERVE_ADMIN_KEY; never from argv, which other users of the host can
read. It goes only where the operator points: the router's URL is --url, else $PDSERVE_ROUTER_URL,
never a default (any local user can listen on 127.0.0.1:8000 while the router is down or on
another port, and a bearer key cannot check who receives it); no proxy from the environment, no
redirect. Of the environment only $SSL_CERT_FILE / $SSL_CERT_DIR are read (the CAs an https:// router's
certificate is checked against, as OpenSSL and httpx read them), else certifi's bundle. `main(argv)` takes the command first and returns the exit status: 0 done, 1 the router
refused (its message on stderr), 2 bad usage.
"""
from __future__ import annotations

import argparse
import os
import ssl
import sys
from typing import Sequence

import httpx

from router.cluster.membership import DEFAULT_DRAIN_DEADLINE_S
from router.config import KEY_VARIABLES, MAX_KV_MOVE_TIMEOUT_S
from router.key_file import KeyFileError, read_key_file

ENV_VAR = KEY_VARIABLES["admin_api_key"]     # the router's own variable for it: one key, both ends
URL_VAR = "PDSERVE_ROUTER_URL"
COMMANDS = ("nodes", "drain", "remove", "pools", "scale")
_TIMEOUT_S = 10.0
_REMOVE_TIMEOUT_S = 2 * MAX_KV_MOVE_TIMEOUT_S  # a remove answers once the node is out: after its KV moves (2 x --kv-move-timeout-s)
_COLUMNS = (("NODE", "id"), ("ROLE", "role"), ("STATE", "state"), ("RUN", "num_running"),
            ("WAIT", "num_waiting"), ("KV%", "kv_usage"), ("FREE", "num_free_blocks"),
            ("EPOCH", "epoch"), ("BEAT_AGE_S", "last_heartbeat_age_s"), ("ADDRESS", "address"))
_POOL_COLUMNS = (("POOL", "role"), ("TARGET", "target"), ("ACTIVE", "active"), ("DRAINING", "draining"),
                 ("STARTING", "starting"))


class UsageError(ValueError):
    """Bad usage (status 2); the message says what to give."""


def main(argv: Sequence[str]) -> int:
    """argv: the command and its flags, e.g. ["drain", "decode-1", "--deadline-s", "30"]."""
    args = _parser().parse_args(list(argv))
    try:
        url, key, requests = _router_url(args.url), _admin_key(args.admin_key_file), _requests(args)
    except (UsageError, KeyFileError) as err:
        print(f"pdserve {args.command}: {err}", file=sys.stderr)
        return 2
    for method, path, body in requests:
        try:
            reply = httpx.request(method, url.rstrip("/") + path, json=body, trust_env=False, follow_redirects=False,
                                  verify=_verify(),
                                  timeout=_REMOVE_TIMEOUT_S if args.command == "remove" else _TIMEOUT_S,
                                  headers={"Authorization": f"Bearer {key}"})
        except httpx.HTTPError as err:
            print(f"pdserve {args.command}: {url}: {err}", file=sys.stderr)
            return 1
        if reply.status_code != 200:
            print(f"pdserve {args.command}: {reply.status_code} {_message(reply)}", file=sys.stderr)
            return 1
        print(_shown(args.command, reply.json()))
    return 0


def _verify() -> ssl.SSLContext | bool:
    """The CAs to check an https:// router against: $SSL_CERT_FILE / $SSL_CERT_DIR when set (trust_env
    off, httpx would ignore them), else httpx's default (certifi)."""
    cafile, capath = os.environ.get("SSL_CERT_FILE") or None, os.environ.get("SSL_CERT_DIR") or None
    if cafile is None and capath is None:
        return True
    return ssl.create_default_context(cafile=cafile, capath=capath)


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


def _router_url(flag: str | None) -> str:
    url = flag or os.environ.get(URL_VAR)
    if not url:
        raise UsageError(f"which router? give --url (e.g. http://127.0.0.1:8000) or ${URL_VAR}; the admin key "
                         "goes nowhere by default")
    return url


def _requests(args: argparse.Namespace) -> list[tuple[str, str, dict | None]]:
    if args.command in ("nodes", "pools"):
        return [("GET", f"/admin/{args.command}", None)]
    if args.command == "drain":
        return [("POST", f"/admin/nodes/{args.node}/drain", {"deadline_s": args.deadline_s})]
    if args.command == "scale":
        scales = [("POST", f"/admin/pools/{role}", {"count": count, "drain_deadline_s": args.drain_deadline_s})
                  for role, count in (("prefill", args.prefill), ("decode", args.decode)) if count is not None]
        if not scales:
            raise UsageError("give --prefill and/or --decode")
        return scales
    return [("POST", f"/admin/nodes/{args.node}/remove", None)]


def _admin_key(path: str | None) -> str:
    key = read_key_file(path) if path is not None else os.environ.get(ENV_VAR)
    if not key:
        raise UsageError(f"no admin key (--admin-key-file or ${ENV_VAR})")
    return key


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
        command.add_argument("--url", help=f"the router, e.g. http://127.0.0.1:8000 (else ${URL_VAR}; no default: "
                                           "the admin key goes only where you point it)")
        command.add_argument("--admin-key-file", help=f"a file holding the admin key, mode 600 (else ${ENV_VAR})")
    return parser
