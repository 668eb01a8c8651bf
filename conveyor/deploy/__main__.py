"""``python -m conveyor.deploy [ROOT]``: regenerate the shipped deploy/ of the repository at
ROOT (default: the current folder) from the built-in pipelines."""

from __future__ import annotations

import sys
from pathlib import Path

from conveyor.deploy import write_shipped

if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    for path in write_shipped(root):
        print(path)
