"""``python -m topkd``: the ``topkd`` command line (see :mod:`topkd.cli`)."""

import sys

from .cli import main

sys.exit(main())
