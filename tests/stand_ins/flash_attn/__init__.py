"""A CPU stand-in for flash-attn 2.8 (tests only): same Python interface and op namespace.

``flash_attn_func`` applies ``flash_attn_interface.FlashAttnFunc``, whose forward
and backward call ``torch.ops.flash_attn._flash_attn_forward`` /
``_flash_attn_backward`` with flash-attn 2.8's argument order and return
tuples; the ops compute exact math attention on CPU and read the LSE, the
output and its gradient as contiguous memory, as the CUDA kernels do.
"""

__version__ = "2.8.3"

from flash_attn.flash_attn_interface import flash_attn_func  # noqa: E402

__all__ = ["flash_attn_func"]
