"""Wire-schema primitives shared by every message: the protocol version, limits, field checks.

Every check raises `ProtocolError` (a `ValueError`), so a decoder that validates through these
helpers can only ever fail with `ProtocolError`, whatever bytes a peer sends.
"""
from __future__ import annotations

import re
from typing import Any, NewType

PROTOCOL_VERSION = 1

XferId = NewType("XferId", str)        # receiver-generated, unique across its restarts
BlockHash = NewType("BlockHash", bytes)  # 16-byte blake2b chain over (previous hash, token ids)

HASH_LEN = 16
MAX_RID_LEN = 128
MAX_ID_LEN = 64             # xfer ids, node ids, epochs, group names
MAX_TEXT_LEN = 512          # free-text reasons
MAX_BLOCKS = 1 << 16        # blocks per transfer (1M tokens at block size 16)
MAX_INT = (1 << 63) - 1
MAX_TOKEN_ID = (1 << 31) - 1

_ID_RE = re.compile(r"[A-Za-z0-9._:/-]+")
_INT_ONLY = frozenset((int,))


class ProtocolError(ValueError):
    """A message that does not follow the schema: unknown kind, wrong version, bad field."""


def check_int(value: Any, name: str, lo: int = 0, hi: int = MAX_INT) -> int:
    """An `int` (never a `bool`) in [lo, hi]."""
    if type(value) is not int:
        raise ProtocolError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ProtocolError(f"{name}={value} is outside [{lo}, {hi}]")
    return value


def check_bool(value: Any, name: str) -> bool:
    if type(value) is not bool:
        raise ProtocolError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_str(value: Any, name: str, max_len: int = MAX_TEXT_LEN, min_len: int = 0) -> str:
    if type(value) is not str:
        raise ProtocolError(f"{name} must be a str, got {type(value).__name__}")
    if not min_len <= len(value) <= max_len:
        raise ProtocolError(f"{name} length {len(value)} is outside [{min_len}, {max_len}]")
    return value


def check_id(value: Any, name: str, max_len: int = MAX_ID_LEN) -> str:
    """A non-empty identifier of printable ASCII ([A-Za-z0-9._:/-])."""
    check_str(value, name, max_len=max_len, min_len=1)
    if not _ID_RE.fullmatch(value):
        raise ProtocolError(f"{name} has characters outside [A-Za-z0-9._:/-]")
    return value


def is_id(value: Any, max_len: int = MAX_ID_LEN) -> bool:
    """Whether check_id(value, name, max_len) passes, in one step (no message made)."""
    return type(value) is str and len(value) <= max_len and _ID_RE.fullmatch(value) is not None


def only_ints(items: tuple | list) -> bool:
    """Every item is an int (never a bool), in C-level calls (no Python step an item)."""
    return set(map(type, items)) <= _INT_ONLY


def check_seq(value: Any, name: str, max_len: int) -> tuple:
    """A list or tuple of at most max_len items, returned as a tuple."""
    if type(value) not in (list, tuple):
        raise ProtocolError(f"{name} must be a list, got {type(value).__name__}")
    if len(value) > max_len:
        raise ProtocolError(f"{name} has {len(value)} items, more than {max_len}")
    return tuple(value)


def check_ints(value: Any, name: str, max_len: int, lo: int = 0, hi: int = MAX_INT) -> tuple[int, ...]:
    items = check_seq(value, name, max_len)
    if not items or (only_ints(items) and lo <= min(items) and max(items) <= hi):
        return items            # the usual case, in C-level calls (no Python step an item), at no name's cost
    for i, item in enumerate(items):
        check_int(item, f"{name}[{i}]", lo, hi)     # raises, naming the first bad item
    return items


def check_ids(value: Any, name: str, max_len: int) -> tuple[str, ...]:
    items = check_seq(value, name, max_len)
    for i, item in enumerate(items):
        check_id(item, f"{name}[{i}]")
    return items


def check_hashes(value: Any, name: str, max_len: int = MAX_BLOCKS) -> tuple[bytes, ...]:
    items = check_seq(value, name, max_len)
    for i, item in enumerate(items):
        if type(item) is not bytes or len(item) != HASH_LEN:
            raise ProtocolError(f"{name}[{i}] must be {HASH_LEN} bytes")
    return items
