"""Rotary position embeddings, as Hugging Face computes them (default, llama3, linear, yarn, ...)."""
from __future__ import annotations

import torch

from kernels import cpu_layer_ops


def inv_freq_and_scale(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the cos/sin scaling of the config's RoPE."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK RoPE depends on the batch's length; pdserve does not run it")
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        return inv_freq.float(), float(scale)
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    return inv_freq, 1.0


class RotaryEmbedding:
    """cos/sin tables for every position, built once on the CPU in float32, then cast."""

    def __init__(self, hf_config, head_dim: int, max_positions: int, dtype: torch.dtype, device):
        inv_freq, scale = inv_freq_and_scale(hf_config, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]                    # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                           # [P, D]
        self.cos = (emb.cos() * scale).to(device=device, dtype=dtype)     # [P, D]
        self.sin = (emb.sin() * scale).to(device=device, dtype=dtype)     # [P, D]
        self._rows: tuple | None = None     # (positions, its version, cos rows, sin rows): every layer reuses them

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        """Rotate x [T, heads, D] in place by each row's position (q and k heads can go in
        together). On CPU one C call (kernels/csrc/layer_ops.c) when x's heads are contiguous."""
        if cpu_layer_ops.usable(x, self.cos) and cpu_layer_ops.rows_contiguous(x):
            cpu_layer_ops.rotary_(x, positions, self.cos, self.sin)
            return
        cos, sin = self._rows_for(positions)                               # [T, 1, D] each
        x.copy_(x * cos + _rotate_half(x) * sin)

    def _rows_for(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._rows
        if rows is None or rows[0] is not positions or rows[1] != positions._version:
            rows = self._rows = (positions, positions._version, self.cos[positions].unsqueeze(1),
                                 self.sin[positions].unsqueeze(1))
        return rows[2], rows[3]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
