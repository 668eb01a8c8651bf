"""``conveyor deploy``'s names: one worker per stage whatever its characters, every name a
valid DNS-1123 label of at most 63 characters, the same name for the same stage on every
run, and a refusal naming both stages where two would still share one
(:mod:`conveyor.deploy.names`).

Each app is generated with the real command and checked with the tools test_generated
uses: docker-compose, kubernetes-validate and KEDA's CRD schema. YAML is read with a loader
that refuses a repeated key, since compose's own reader keeps the last one silently."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.kedacrd import assert_match_keda_crd
from tests.deploy.test_deploy import _compose_cli, worker_stages
from tests.deploy.test_generated import deploy, run_deploy

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")

HEAD = """from typing import Any

from pydantic import BaseModel

from pipelines.graph import Pipeline, function, model
from pipelines.stages import Stage


class Text(BaseModel):
    text: str


def tidy(payload: dict[str, Any]) -> dict[str, Any]:
    return payload


def stage(name: str) -> Stage:
    return Stage(name, Text, runner="tests.helpers:Doubler")
"""

PUNCT = ("a_b", "a-b", "a.b", "other")
"""Three stages whose names differ only by '_', '-' and '.', and one more."""

LONG = ("a_very.long-stage_name." * 5)[:101]
"""The longest stage name there is (``pipelines.stages``: 101 characters)."""
LONG_TWIN = LONG[:-1] + "z"  # the same first 100 characters
LONG_PIPELINE = ("p_" * 49)[:97]  # its function stages' names reach 101: <pipeline>.f_g


def _app(folder: Path, module: str, body: str) -> Path:
    (folder / f"{module}.py").write_text(HEAD + body)
    return folder


def punct_app(folder: Path, order: tuple[str, ...] = PUNCT) -> Path:
    """One pipeline per stage of ``order`` (its pipelines in that order)."""
    body = "pipelines = [\n"
    body += "".join(
        f'    Pipeline("p{PUNCT.index(s)}", Text, (model("m", stage({s!r})),)),\n' for s in order
    )
    return _app(folder, "punct", body + "]\n")


class _Unique(yaml.SafeLoader):
    """A YAML loader refusing a key repeated in one mapping."""


def _mapping(loader: _Unique, node: yaml.MappingNode) -> dict[Any, Any]:
    keys = [k.value for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"]
    repeated = sorted({str(k) for k in keys if keys.count(k) > 1})
    assert not repeated, f"keys repeated in one mapping: {repeated}"
    return loader.construct_mapping(node)


_Unique.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_all(path: Path) -> list[dict[str, Any]]:
    """The documents of ``path``, refusing a repeated key."""
    return [d for d in yaml.load_all(path.read_text(), Loader=_Unique) if d]


def generate(folder: Path, app: str, *args: str) -> Path:
    """``conveyor deploy compose`` and ``k8s`` for ``app`` into ``folder/out``."""
    deploy(folder, "compose", *args, app=app)
    return deploy(folder, "k8s", *args, app=app)


def k8s_documents(out: Path) -> list[tuple[str, dict[str, Any]]]:
    return [
        (str(p.relative_to(out)), d)
        for p in sorted((out / "k8s").rglob("*.yaml"))
        if p.name != "kustomization.yaml"
        for d in load_all(p)
    ]


def validate(out: Path) -> None:
    """What test_generated checks a generated folder with: docker-compose, the Kubernetes
    schemas (strict) and KEDA's CRD schema."""
    docs = k8s_documents(out)
    kv = pytest.importorskip("kubernetes_validate.utils")
    for where, doc in docs:
        if not doc["apiVersion"].startswith("keda.sh/"):
            try:
                kv.validate(doc, kv.latest_version(), strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{where}: {exc}")
    assert_match_keda_crd([(w, d) for w, d in docs if d["apiVersion"].startswith("keda.sh/")])
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no docker-compose to validate with (apt: docker-compose)")
    (out / ".env").write_text("REDIS_GATEWAY_PASSWORD=gw\nREDIS_WORKER_PASSWORD=wk\n")
    checked = subprocess.run(
        [*cli, "-f", str(out / "compose.yaml"), "config", "-q"],
        cwd=out,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stderr


def compose_workers(out: Path) -> dict[str, dict[str, Any]]:
    (conf,) = load_all(out / "compose.yaml")
    return {k: v for k, v in conf["services"].items() if k.startswith("worker-")}


def kustomized(out: Path) -> list[str]:
    (kustomization,) = load_all(out / "k8s" / "kustomization.yaml")
    return [r for r in kustomization["resources"] if r.startswith("stages/")]


def names_in(node: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """Every (where, value) of ``node`` that Kubernetes takes as a name or a label value."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("labels", "matchLabels"):
                yield from ((f"{key}.{k}.{label}", str(value)) for label, value in v.items())
            elif k == "name" and isinstance(v, str):
                yield f"{key}.name", v
            else:
                yield from names_in(v, f"{key}.{k}")
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from names_in(item, f"{key}[{i}]")


def test_stages_differing_only_by_punctuation_each_get_their_own_worker(tmp_path: Path) -> None:
    out = generate(punct_app(tmp_path), "punct:pipelines")
    workers = compose_workers(out)
    assert len(workers) == 4, sorted(workers)
    served = {name: worker_stages(w["command"]) for name, w in workers.items()}
    assert sorted(s for stages in served.values() for s in stages) == sorted(PUNCT), served

    files = kustomized(out)
    assert len(files) == 4, files
    assert len(set(files)) == 4, f"a file listed twice: {files}"
    written = sorted(p.relative_to(out / "k8s").as_posix() for p in (out / "k8s").rglob("*.yaml"))
    shared = ["config.yaml", "gateway.yaml", "keda.yaml", "kustomization.yaml", "namespace.yaml"]
    assert written == sorted([*shared, "redis.yaml", "secret.example.yaml", *files])
    deployed: dict[str, str] = {}
    for rel in files:
        docs = load_all(out / "k8s" / rel)
        (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
        name = deployment["metadata"]["name"]
        (stage,) = worker_stages(deployment["spec"]["template"]["spec"]["containers"][0]["command"])
        deployed[stage] = name
        assert name in workers, f"{rel}: {name} is not a compose service"
        assert served[name] == [stage], f"{rel}: compose's {name} serves {served[name]}"
        # The PDB and ScaledObject of the file are that Deployment's, on that stage's streams.
        for doc in docs:
            assert doc["metadata"]["name"] == name, rel
        (scaled,) = [d for d in docs if d["kind"] == "ScaledObject"]
        assert scaled["spec"]["scaleTargetRef"]["name"] == name
        streams = {t["metadata"]["stream"] for t in scaled["spec"]["triggers"]}
        assert streams == {f"{{conveyor}}:stage:{stage}", f"{{conveyor}}:stage:{stage}:bulk"}
    assert sorted(deployed) == sorted(PUNCT)
    assert len(set(deployed.values())) == 4, deployed
    validate(out)


def test_the_longest_stage_names_give_valid_kubernetes_names(tmp_path: Path) -> None:
    body = f"""
pipelines = [
    Pipeline("long", Text, (model("m", stage({LONG!r})),)),
    Pipeline("twin", Text, (model("m", stage({LONG_TWIN!r})),)),
    Pipeline(
        {LONG_PIPELINE!r},
        Text,
        (
            function("f_g", tidy, then="f-g"),
            function("f-g", tidy, then="f.g"),
            function("f.g", tidy),
        ),
    ),
]
"""
    out = generate(_app(tmp_path, "longapp", body), "longapp:pipelines", "--gpu-variant", LONG)
    workers = compose_workers(out)
    assert len(workers) == 4, sorted(workers)  # two stages, one pipeline's functions, a GPU copy
    bad = [
        f"compose service {name!r}"
        for name in workers
        if len(name) > 63 or not DNS_LABEL.fullmatch(name)
    ]
    for path in sorted((out / "k8s").glob("*/*.yaml")):  # stages/, optional/: one per worker
        if len(path.stem) > 63 or not DNS_LABEL.fullmatch(path.stem):
            bad.append(f"file {path.relative_to(out)}")
    docs = k8s_documents(out)
    for where, doc in docs:
        for at, value in names_in(doc):
            if at.startswith(".spec.triggers") or ".env[" in at:
                continue  # KEDA's trigger names (checked below) and variables' names
            if len(value) > 63 or not DNS_LABEL.fullmatch(value):
                bad.append(f"{where} {doc['kind']}{at}: {value!r} ({len(value)})")
    assert bad == [], "\n".join(bad)
    for where, doc in docs:
        if doc["kind"] == "ScaledObject":
            triggers = [t["name"] for t in doc["spec"]["triggers"]]
            assert len(set(triggers)) == len(triggers), f"{where}: {triggers}"
    served = sorted(s for w in workers.values() for s in worker_stages(w["command"]))
    functions = [f"{LONG_PIPELINE}.{f}" for f in ("f_g", "f-g", "f.g")]
    assert served == sorted([LONG, LONG, LONG_TWIN, *functions])
    validate(out)


# What the stages of PUNCT are deployed as, on every run and in every release: a changed name
# leaves the old Deployment running beside the new one on the next `kubectl apply -k`.
PUNCT_NAMES = {
    "a_b": "worker-a-b-648fa9b3",
    "a-b": "worker-a-b",
    "a.b": "worker-a-b-2e7336dc",
    "other": "worker-other",
}


def _tree(out: Path) -> dict[str, bytes]:
    return {
        p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()
    }


def test_names_are_stable_across_runs_and_orders(tmp_path: Path) -> None:
    trees = []
    for i, (order, seed) in enumerate([(PUNCT, "1"), (PUNCT, "2"), (PUNCT[::-1], "3")]):
        folder = tmp_path / str(i)
        folder.mkdir()
        for target in ("compose", "k8s"):
            deploy(
                punct_app(folder, order),
                target,
                app="punct:pipelines",
                extra={"PYTHONHASHSEED": seed},
            )
        trees.append(_tree(folder / "out"))
    assert trees[0] == trees[1], "a second run wrote other files"
    # Another order of the pipelines orders the services; the names stay.
    assert set(trees[0]) == set(trees[2])
    for i in (0, 2):
        workers = compose_workers(tmp_path / str(i) / "out")
        named = {worker_stages(w["command"])[0]: name for name, w in workers.items()}
        assert named == PUNCT_NAMES


def test_a_clash_left_after_hashing_is_refused_naming_both_stages(tmp_path: Path) -> None:
    hashed = PUNCT_NAMES["a_b"].removeprefix("worker-")  # a stage may be called that, too
    body = "pipelines = [\n"
    for i, name in enumerate(("a_b", "a-b", hashed)):
        body += f'    Pipeline("p{i}", Text, (model("m", stage({name!r})),)),\n'
    _app(tmp_path, "clash", body + "]\n")
    for target in ("compose", "k8s"):
        done = run_deploy(tmp_path, target, app="clash:pipelines")
        assert done.returncode == 2, done.stdout
        (line,) = done.stderr.splitlines()
        assert "'a_b'" in line, line
        assert f"'{hashed}'" in line, line
        assert not (tmp_path / "out").exists(), "nothing is written"


def test_workers_of_a_pipeline_and_a_gpu_copy_keep_their_own_names(tmp_path: Path) -> None:
    body = """
pipelines = [
    # A model stage named as a pipeline whose function stages also need a worker.
    Pipeline("p", Text, (model("m", stage("p"), then="f"), function("f", tidy))),
    # A model stage named as another stage's GPU copy.
    Pipeline("g", Text, (model("m", stage("g")),)),
    Pipeline("g-gpu", Text, (model("m", stage("g-gpu")),)),
]
"""
    out = generate(_app(tmp_path, "twins", body), "twins:pipelines", "--gpu-variant", "g")
    workers = compose_workers(out)
    served = sorted(tuple(worker_stages(w["command"])) for w in workers.values())
    assert served == sorted([("p",), ("p.f",), ("g",), ("g",), ("g-gpu",)]), sorted(workers)
    assert workers["worker-p"]["command"][2] == "p"  # the stage called exactly that keeps it
    assert workers["worker-g-gpu"]["command"][2] == "g-gpu"
    gpu = [n for n, w in workers.items() if w.get("profiles") == ["gpu"]]
    assert len(gpu) == 1
    assert worker_stages(workers[gpu[0]]["command"]) == ["g"]
    assert len(kustomized(out)) == 4
    validate(out)
