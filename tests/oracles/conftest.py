"""Shared set-up of the oracle suite: corelib's samplers against outside implementations."""

import sys
from pathlib import Path

# --import-mode=importlib puts no test folder on sys.path; the suite's helpers live next to
# this file under a name no other tests/ folder uses.
sys.path.insert(0, str(Path(__file__).parent))
