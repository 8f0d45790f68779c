"""A model's context length from its config fields, torch-free: the engine (engine/config.py,
through transformers' config) and the router (router/model_facts.py, through config.json as
plain JSON) must agree on it to the token."""
from __future__ import annotations

from typing import Any, Callable


def context_length(field: Callable[[str, Any], Any]) -> int:
    """field(name, default): the config's value, default if it has no such field."""
    length = field("max_position_embeddings", None)
    window = field("sliding_window", None)
    if window and field("use_sliding_window", True):
        length = min(length, window)    # pdserve runs full attention: stay inside the window
    return length
