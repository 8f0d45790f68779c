"""The cluster secret: what every process of one deployment's node network proves it holds.

Where it comes from, first found wins (never the command line, which `ps` shows to everyone):
  1. a file named by --cluster-secret-file, owned by this user and readable by it only (mode 0600
     or 0400);
  2. the environment variable PDSERVE_CLUSTER_SECRET.
Either holds 64 hex digits (`pdserve secret` prints a fresh one) or any text of 16+ bytes.
`pdserve up` makes a fresh secret per deployment and hands it to its nodes in their environment.
"""
from __future__ import annotations

import os
import secrets
import stat

from kvtransport.session import MIN_SECRET_LEN

ENV_VAR = "PDSERVE_CLUSTER_SECRET"


class SecretError(ValueError):
    """No usable cluster secret; the message says how to provide one."""


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def encode_secret(secret: bytes) -> str:
    """The secret as text for a file or the environment (hex)."""
    return secret.hex()


def load_secret(path: str | None = None) -> bytes:
    """The cluster secret from `path` or the environment; raises SecretError if there is none,
    or if the file is readable by others than its owner."""
    if path:
        return _parse(_read_private(path), path)
    text = os.environ.get(ENV_VAR)
    if text:
        return _parse(text, f"${ENV_VAR}")
    raise SecretError(f"no cluster secret: the node network only talks to processes that prove they "
                      f"hold one. Set {ENV_VAR} or pass --cluster-secret-file FILE (mode 0600) to the "
                      f"router and to every node; `pdserve secret` prints a fresh one.")


def write_secret(path: str, secret: bytes) -> None:
    """Write the secret to a new file readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(encode_secret(secret) + "\n")


def _read_private(path: str) -> str:
    """The file's text; it must be ours and private (checked on the file opened, not its name)."""
    try:
        with open(path) as f:
            st = os.fstat(f.fileno())
            if st.st_uid != os.geteuid():
                raise SecretError(f"{path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()}): "
                                  "its owner can read or change the secret")
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise SecretError(f"{path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it")
            return f.read()
    except OSError as e:
        raise SecretError(f"cannot read the cluster secret file {path}: {e.strerror}") from None


def _parse(text: str, where: str) -> bytes:
    text = text.strip()
    try:
        secret = bytes.fromhex(text) if len(text) >= 2 * MIN_SECRET_LEN else text.encode()
    except ValueError:
        secret = text.encode()
    if len(secret) < MIN_SECRET_LEN:
        raise SecretError(f"the cluster secret in {where} is shorter than {MIN_SECRET_LEN} bytes")
    return secret
