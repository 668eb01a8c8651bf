"""``python -m conveyor``: the same as the ``conveyor`` command."""

from conveyor.cli import main

main()
