"""On/off switches read from the environment (``DYNAMO_DIST_*``), one way for every pass."""

from __future__ import annotations

import os


def switch(name: str, on: str, off: str) -> bool:
    """Environment variable ``name``: "1" (the default: ``on``) or "0" (``off``); ValueError
    naming both for another value."""
    text = os.environ.get(name, "1")
    if text not in ("0", "1"):
        raise ValueError(f"{name}={text!r}: fix: use 1 ({on}, the default) or 0 ({off})")
    return text == "1"
