"""One small `locate()` for swappable parts named in YAML by dotted path (verifier, filter, domain)."""

from __future__ import annotations

import importlib
from typing import Any


def locate(path: str) -> Any:
    """Resolve 'pkg.module:attr' or 'pkg.module.attr' to the object.

    >>> locate("math:sqrt")(4.0)
    2.0
    """
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not a dotted path: expected 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} for {path!r}: {e}") from None
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ValueError(f"{module_name!r} has no attribute {attr!r} (from {path!r})") from None
    return obj
