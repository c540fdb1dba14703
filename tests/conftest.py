import os
import sys

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
# The package is importable from the repository root without installing; the test helpers
# (reference.py, helpers.py) live beside this file.
for _p in (_HERE, _ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
