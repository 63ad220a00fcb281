"""loong_compile: a torch.compile backend for long-sequence LLM training."""

from loong_compile.errors import (
    LoongConfigError, LoongError, LoongMeshError, LoongRankMismatchError, LoongShapeError,
    LoongUnsupportedError,
)

__all__ = [
    "LoongConfigError", "LoongError", "LoongMeshError", "LoongRankMismatchError",
    "LoongShapeError", "LoongUnsupportedError",
]
