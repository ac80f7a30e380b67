"""A package face whose names load on first use (PEP 562).

A package lists its public names and the module each lives in; importing the
package, or one of its modules as `python -m` does, imports none of them until
a name is read. So `python -m cflib.lab.nbclean` (a commit hook) and
`python -m cflib.bench perf-table` start without torch.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_names(package: str, module_of: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package` (its `__name__`), whose names are `module_of`'s keys."""
    namespace = sys.modules[package].__dict__

    def load(name: str) -> Any:
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_of[name]), name)
        namespace[name] = value  # the next lookup finds it without this function
        return value

    def listing() -> list[str]:
        return sorted({*namespace, *module_of})

    return load, listing
