"""flash-attn, when installed and usable (an optional GPU extra), and the check behind --use-flash-attn.

Kept apart from the model code so flags can be validated without importing DeepSpeed.
"""

from __future__ import annotations

from hybrid.errors import ConfigError

try:  # optional GPU extra
    from flash_attn import flash_attn_func
    FLASH_ATTN_ERROR = None
except Exception as _error:  # ImportError, or a broken CUDA build
    flash_attn_func = None
    FLASH_ATTN_ERROR = f"{type(_error).__name__}: {_error}"


def check_flash_attn_installed() -> None:
    """--use-flash-attn must get flash-attn, never a silent fallback (as Megatron-LM): raise a
    ConfigError naming the cause, the default backend (SDPA) and how to install it. (Its device and
    precision needs are rules of hybrid.capabilities.)"""
    if flash_attn_func is None:
        raise ConfigError(f"--use-flash-attn: flash-attn is not usable here ({FLASH_ATTN_ERROR}); drop "
                          f"--use-flash-attn to use torch's scaled_dot_product_attention (SDPA, the default), or "
                          f"install it on a CUDA machine: pip install -e '.[gpu]' (flash-attn).")
