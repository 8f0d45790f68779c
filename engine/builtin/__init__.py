"""pdserve's built-in model: a ~6M-parameter Llama trained on Shakespeare's plays.

It ships inside the package (engine/builtin/shakespeare-6m/) so that `make run` works on a
fresh machine with no download. Rebuild it with `python -m scripts.builtin_model.train`;
see docs/builtin_model.md.
"""

from pathlib import Path

#: Absolute path of the Hugging Face folder (config.json, model.safetensors, tokenizer).
BUILTIN_MODEL_PATH: str = str(Path(__file__).resolve().parent / "shakespeare-6m")

__all__ = ["BUILTIN_MODEL_PATH"]
