"""Reading a key from a file the way ssh reads a private key: only from a file this user owns that
no one else may read or write; anything else is refused with the fix in the message."""
from __future__ import annotations

import os
import stat


class KeyFileError(ValueError):
    """The key file cannot be used; the message says why and what to do."""


def read_key_file(path: str) -> str | None:
    """The file's first line, stripped (None if empty). Refuses a file owned by another user or
    with any group or other permission bit (checked on the file opened, not its name)."""
    try:
        with open(path, encoding="utf-8") as f:
            st = os.fstat(f.fileno())
            if st.st_uid != os.geteuid():
                raise KeyFileError(f"{path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()}): "
                                   "its owner can read or replace the key")
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise KeyFileError(f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}); "
                                   "a key file must be private: chmod 600 it")
            return f.readline().strip() or None
    except OSError as err:
        raise KeyFileError(f"cannot read the key file {path}: {err.strerror}") from None
