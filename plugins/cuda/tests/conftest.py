"""Puts this folder on sys.path (``--import-mode=importlib`` does not) so the cuda plugin's
test modules share ``cuda_support``, a name no other plugin's tests use."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
