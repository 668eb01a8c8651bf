"""The ``conveyor deploy compose|k8s`` subcommand: its flags and what it does with them.

For an app, both targets also write its image's build (:mod:`conveyor.deploy.image`,
conveyor's wheel in ``wheels/``) into the deploy folder; a deploy folder whose ``.env``
still holds ``.env.example``'s placeholder passwords is refused before anything is written.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from conveyor.appflag import add_app_argument
from conveyor.deploy import compose, image, k8s, plan, write
from conveyor.deploy.wheel import build_wheel


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
        ConfigError: the app, a pipeline or a setting is invalid, or ``OUT/.env`` holds a
            placeholder password.
    """
    app = args.app or os.environ.get("CONVEYOR_APP")
    out: Path = args.out
    image.check_env_file(out / ".env")
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
        written = write(k8s.files(the_plan), out / "k8s") + write(image.files(the_plan), out)
    if the_plan.app is not None:
        written.append(build_wheel(out / "wheels"))
    for path in written:
        print(path)
