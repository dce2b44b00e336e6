"""Time-ordered task ids (UUIDv7 layout): sortable, unguessable, and naming their endpoint."""

from __future__ import annotations

import os
import time


def uuid7_hex() -> str:
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | (rand >> 68 & 0xFFF) << 64
    value |= 0b10 << 62 | rand & ((1 << 62) - 1)
    return f"{value:032x}"


def new_task_id(endpoint_id: str) -> str:
    return f"{uuid7_hex()}.{endpoint_id}"
