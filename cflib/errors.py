"""User-facing errors shared across the layers: each message names the thing at fault."""
from __future__ import annotations

import reprlib

# What an error shows of a value it names: enough to recognise it, never a whole document (a YAML file of nested
# aliases, a long list) repeated into the message.
_SHOWN = reprlib.Repr()
for _name, _limit in (("maxlevel", 3), ("maxtuple", 6), ("maxlist", 6), ("maxarray", 6), ("maxdict", 6),
                      ("maxset", 6), ("maxfrozenset", 6), ("maxdeque", 6), ("maxstring", 80), ("maxlong", 40),
                      ("maxother", 80)):
    setattr(_SHOWN, _name, _limit)
SHOWN_CHARS = 200


class ParamError(ValueError):
    """A parameter set that cannot run; the message names the parameter."""


class KernelUnavailable(ParamError):
    """A required fast path cannot run here; the message says which check failed."""


def shown(value: object) -> str:
    """`repr(value)` for an error message, bounded: a few items of each container, a few levels deep, at most
    SHOWN_CHARS characters; its cost does not grow with the value's size."""
    text = _SHOWN.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."
