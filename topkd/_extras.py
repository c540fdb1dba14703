"""Which packages of an optional extra are missing, found without importing them (a package
that is absent, or broken, is named instead of a failure deep inside another one)."""

from __future__ import annotations

import importlib.util

# the import names of each extra's packages (pyproject.toml's optional dependencies)
EXTRAS = {
    "store": ("safetensors", "numpy", "xxhash"),
    "hf": ("transformers", "accelerate", "tqdm", "safetensors", "numpy", "xxhash", "pyarrow"),
    "megatron": ("modelopt", "megatron.core", "requests", "huggingface_hub"),
}


def missing(extra: str) -> list[str]:
    """The packages of ``extra`` that cannot be imported here."""
    absent = []
    for name in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package missing, or a module set to None
            found = False
        if not found:
            absent.append(name)
    return absent


def require(extra: str, what: str) -> None:
    """ImportError naming what ``what`` needs, when a package of ``extra`` is missing."""
    absent = missing(extra)
    if absent:
        raise ImportError(f"{what} needs {', '.join(absent)}, which "
                          f"{'is' if len(absent) == 1 else 'are'} not installed: "
                          f"pip install 'topkd[{extra}]'")
