"""``python -m bench``: run the seed benchmark and print its table."""

from __future__ import annotations

import argparse
import platform

import torch

from bench import seed


def main() -> None:
    """Parse arguments, run, print the markdown table."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=seed.__doc__)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    table = seed.main(args.requests, args.concurrency, args.batch)
    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"python {platform.python_version()}, torch {torch.__version__}"
    )
    print(table)


if __name__ == "__main__":
    main()
