"""Training steps without the garbage collector's long pauses.

A full collection walks every object the process tracks: with torch and transformers imported that is about
330,000, which took 140-190 ms on a two-core host, taken inside whichever step happens to allocate past the
threshold, while the GPU waits for the host. What exists when training starts (modules, libraries, the data)
lives as long as the run:
`gc.freeze` moves it into the collector's permanent generation, so the collections during training walk only
what the steps themselves make. Cycles among those are still collected; nothing is disabled.

A process that froze objects itself (`gc.freeze`, as many do before forking workers) keeps its arrangement: the
collector is left as it is, since `gc.unfreeze` would release the caller's frozen objects with ours.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_depth = 0  # nested holders: only the outermost freezes and unfreezes


@contextlib.contextmanager
def steady_collector() -> Iterator[None]:
    """Within: the objects alive on entry are out of the collector's walks (gc.freeze); on exit every frozen
    object is collectable again (gc.unfreeze), so a notebook that trained frees the run's objects as usual. Where
    objects were frozen before the outermost entry, by the process itself, nothing is collected, frozen or
    unfrozen."""
    global _depth
    froze = _depth == 0 and gc.get_freeze_count() == 0
    if froze:
        gc.collect()  # what is garbage now is not frozen with the rest
        gc.freeze()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if froze:
            gc.unfreeze()
