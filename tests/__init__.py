"""The test suite. The repo root (and ``python -m pytest``'s current directory) goes behind
site-packages on ``sys.path``: our top-level ``kernels/`` folder shares its name with Hugging
Face's ``kernels`` package, which transformers imports (pyproject's ``--import-mode=append``
covers the ``pytest`` command; this covers ``python -m pytest``)."""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_front = [p for p in sys.path if os.path.abspath(p or os.curdir) == _ROOT]
sys.path[:] = [p for p in sys.path if p not in _front] + _front
