"""Byte sizes as people write them: '20GiB' in, '1.50 GiB' out."""

from __future__ import annotations

import re

from flatshard.cli.config import ConfigError

MiB = 1 << 20
GiB = 1 << 30


def size(nbytes: float) -> str:
    if abs(nbytes) >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    return f"{nbytes / MiB:.1f} MiB"


def parse_size(text: str, option: str, device_bytes: int) -> int:
    """'20GiB', '512MiB', '80GB', '600KiB' or 'device' (``device_bytes``) -> bytes."""
    if text == "device":
        return device_bytes
    match = re.fullmatch(r"\s*([0-9]+\.?[0-9]*)\s*(" + "|".join(_UNITS) + r")\s*", text)
    if match is None:
        raise ConfigError(
            f"{option}: expected a number and a unit ({', '.join(_UNITS)}), e.g. 20GiB or "
            f"512MiB, or 'device'; got {text!r}"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2)])


_UNITS = {
    "TiB": 1 << 40,
    "TB": 10**12,
    "GiB": 1 << 30,
    "GB": 10**9,
    "MiB": 1 << 20,
    "MB": 10**6,
    "KiB": 1 << 10,
    "KB": 10**3,
}
