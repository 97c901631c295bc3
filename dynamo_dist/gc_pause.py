"""Python's full garbage collections paused while ``dist`` compiles (issue 17).

A full (oldest-generation) collection walks every tracked object of the process: the model,
torch's modules, and the graphs and fake values a compile builds. Python runs one whenever the
heap has grown by a quarter since the last, so a compile that builds a large heap pays for
several: in a process compiling the 32-layer demo-width Llama (fake dp=2 x tp=2), 17 of them
took 4.7-5.0 s, against 0.8 s for all 5,200 young ones; with the pause, 3 remain (1.25 s).
The pause sets the oldest generation's threshold out of reach and leaves the young ones as
they were; the compile's cyclic garbage that reached the oldest generation is collected by the
first full collection after it (0.5 s there), which Python runs at its next young one.
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Iterator

_OUT_OF_REACH = 1 << 30  # gen-1 collections before a full one: never reached by one compile


def enabled() -> bool:
    """``DYNAMO_DIST_FULL_GC`` is 0 (default: pause full collections while compiling) or 1
    (Python's own schedule). Raises ValueError for another value."""
    flag = os.environ.get("DYNAMO_DIST_FULL_GC", "0")
    if flag not in ("0", "1"):
        raise ValueError(f"DYNAMO_DIST_FULL_GC={flag!r}: fix: use 0 (pause full collections "
                         f"while compiling, the default) or 1 (Python's own schedule)")
    return flag == "0"


@contextlib.contextmanager
def full_collections_paused() -> Iterator[None]:
    """No full collection inside (young ones as usual), unless ``DYNAMO_DIST_FULL_GC=1`` or the
    collector is off; the thresholds are restored after, unless the code inside set others.
    Nests: an inner pause leaves the outer's restore to it. Raises ValueError for a bad
    ``DYNAMO_DIST_FULL_GC``."""
    young, middle, old = gc.get_threshold()
    if not enabled() or not gc.isenabled() or old == _OUT_OF_REACH:
        yield
        return
    gc.set_threshold(young, middle, _OUT_OF_REACH)
    try:
        yield
    finally:
        if gc.get_threshold() == (young, middle, _OUT_OF_REACH):
            gc.set_threshold(young, middle, old)
