"""The ``conveyor deploy compose|k8s`` subcommand: its flags and what it does with them."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from conveyor.appflag import add_app_argument
from conveyor.deploy import compose, k8s, plan, write


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``deploy`` to the ``conveyor`` command's subcommands."""
    deploy = sub.add_parser(
        "deploy", help="write a compose file or Kubernetes manifests for your pipelines"
    )
    deploy.add_argument("target", choices=["compose", "k8s"])
    add_app_argument(deploy)
    deploy.add_argument("--pipelines", help="comma-separated pipelines (default: all of --app)")
    deploy.add_argument("--out", required=True, type=Path, help="folder to write the files to")
    deploy.add_argument(
        "--registry",
        help="prefix of every image name conveyor builds, e.g. ghcr.io/me/ (CONVEYOR_REGISTRY)",
    )
    deploy.add_argument(
        "--redis-url",
        help="k8s: an external Redis (its host:port for the pods and KEDA) instead of the "
        "bundled StatefulSet",
    )
    deploy.add_argument(
        "--gpu-variant",
        action="append",
        default=[],
        metavar="STAGE",
        help="also write an optional GPU worker for STAGE (compose profile gpu, k8s optional/)",
    )


def run(args: argparse.Namespace) -> None:
    """Write the files ``args`` ask for and print their paths.

    Raises:
        ConfigError: the app, a pipeline or a setting is invalid.
    """
    app = args.app or os.environ.get("CONVEYOR_APP")
    out: Path = args.out
    the_plan = plan(
        app,
        args.pipelines or os.environ.get("CONVEYOR_PIPELINES"),
        out,
        registry=args.registry,
        redis_url=args.redis_url,
        gpu_variants=tuple(args.gpu_variant),
    )
    if args.target == "compose":
        written = write(compose.files(the_plan), out)
    else:
        written = write(k8s.files(the_plan), out / "k8s")
    for path in written:
        print(path)
