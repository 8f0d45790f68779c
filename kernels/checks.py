"""Small launcher-side argument checks shared by every kernel; each raises ValueError."""

import torch


def require(cond: bool, message: str) -> None:
    """Raise ValueError(message) unless cond holds."""
    if not cond:
        raise ValueError(message)


def require_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    """t.shape must equal shape; None entries match any size."""
    ok = t.dim() == len(shape) and all(s is None or s == n for s, n in zip(shape, t.shape))
    require(ok, f"{name}: expected shape {tuple('*' if s is None else s for s in shape)}, "
            f"got {tuple(t.shape)}")


def require_dtype(name: str, t: torch.Tensor, *dtypes: torch.dtype) -> None:
    """t.dtype must be one of dtypes."""
    require(t.dtype in dtypes, f"{name}: expected dtype in {dtypes}, got {t.dtype}")


def require_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors live on one device; returns it."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    require(all(d == first for d in devices.values()), f"tensors on different devices: {devices}")
    return first


def require_ids_in_range(name: str, ids: torch.Tensor, limit: int) -> None:
    """0 <= ids < limit; only checked for CPU tensors (on CUDA it would cost a device sync)."""
    if ids.device.type == "cpu" and ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        require(0 <= lo and hi < limit, f"{name}: ids must lie in [0, {limit}), got [{lo}, {hi}]")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class CheckMemo:
    """Remembers the arguments a launcher's checks last passed, so the model's layers, which
    call a kernel with the same batch tensors one after another, pay for the checks once per
    step. Index tensors are compared by identity and in-place version (a write to one makes
    it unseen again, as does a new tensor); `meta` holds whatever else the checks read
    (shapes, dtypes, devices); `value` keeps what the caller derived from them (e.g. a plan
    of the batch). Holds strong references to the last tensors only."""

    def __init__(self) -> None:
        self._last: tuple | None = None
        self.value = None    # whatever the caller derived from the remembered tensors

    def seen(self, tensors: tuple[torch.Tensor, ...], meta: tuple) -> bool:
        last = self._last
        return (last is not None and len(last[0]) == len(tensors)
                and all(a is b for a, b in zip(last[0], tensors))
                and last[1] == tuple(t._version for t in tensors) and last[2] == meta)

    def remember(self, tensors: tuple[torch.Tensor, ...], meta: tuple, value=None) -> None:
        self._last = (tensors, tuple(t._version for t in tensors), meta)
        self.value = value
