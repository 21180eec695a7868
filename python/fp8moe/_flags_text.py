"""MoE flags (configs/base.yml) as the "key=value" strings the library parses."""
from __future__ import annotations

from typing import Any

from . import _core


def flag_list(flags: dict[str, Any]) -> list[str]:
    """{"num_experts": 4, "sparse_matmul": True} -> ["num_experts=4", "sparse_matmul=true"]."""
    def text(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        return str(v)
    return [f"{k}={text(v)}" for k, v in flags.items()]


def validated(flags: dict[str, Any]) -> str:
    """The flags as one "key=value" line each, after the library validated them
    (ValueError with the command's message otherwise)."""
    lines = flag_list(flags)
    _core.moe_config(lines)
    return "\n".join(lines)
