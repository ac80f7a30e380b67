"""Training steps without the garbage collector's long pauses.

A full collection walks every object the process tracks: with torch and transformers imported that is about
330,000, which took 140-190 ms on a two-core host, taken inside whichever step happens to allocate past the
threshold, while the GPU waits for the host. What exists when training starts (modules, libraries, the data)
lives as long as the run:
`gc.freeze` moves it into the collector's permanent generation, so the collections during training walk only
what the steps themselves make. Cycles among those are still collected; nothing is disabled.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_depth = 0  # nested holders: only the outermost freezes and unfreezes


@contextlib.contextmanager
def steady_collector() -> Iterator[None]:
    """Within: the objects alive on entry are out of the collector's walks (gc.freeze); on exit every frozen
    object, those frozen before it included, is collectable again (gc.unfreeze), so a notebook that trained frees
    the run's objects as usual."""
    global _depth
    if _depth == 0:
        gc.collect()  # what is garbage now is not frozen with the rest
        gc.freeze()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            gc.unfreeze()
