"""Python runs this at the start of every process whose path holds this folder: the test's Ray head puts it
on PYTHONPATH, so its job driver and every Ray worker install the CPU patches of ../cpu.py (lazily)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cpu  # noqa: E402

cpu.install()
