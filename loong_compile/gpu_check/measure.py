"""What every gpu-check check measures with: the CUDA device (or a ``Skip`` saying why there
is none) and the error of a result against its reference."""

from __future__ import annotations

import torch

from loong_compile.gpu_check.report import Skip


def require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise Skip(f"no CUDA device (torch {torch.__version__}, "
                   f"built with CUDA {torch.version.cuda or 'none'})")
    return torch.device("cuda", 0)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-12))
