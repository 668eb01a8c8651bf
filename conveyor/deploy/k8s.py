"""The Kubernetes manifests for a :class:`~conveyor.deploy.Plan`: the namespace, the
settings (ConfigMaps), an example Secret (the namespace first, so it applies alone), Redis
(or the Secret's external URL), the gateway Deployment and Service, and per worker a
Deployment (GPU requests, startup and liveness probes), a PodDisruptionBudget and a KEDA
ScaledObject watching every stream of every stage it serves (:mod:`conveyor.keda`).

The parts every deployment shares are templates beside this module (``templates/``); the
workers are written here, from the plan.
"""

# ruff: noqa: E501  (lines of the YAML written are as wide as the files they make)

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

from conveyor.deploy import REDIS_FILES, Plan, Worker, redis_file
from conveyor.deploy.names import WORKER
from conveyor.keda import TriggerOptions, triggers

K8S_NAMESPACE = "conveyor"
"""The Kubernetes namespace everything goes into."""

BUNDLED_REDIS = f"redis.{K8S_NAMESPACE}.svc.cluster.local:6379"
"""The bundled Redis's address inside the cluster."""


def _template(name: str) -> str:
    return (Path(__file__).with_name("templates") / name).read_text()


def _indent(text: str, spaces: int) -> str:
    pad = " " * spaces
    return "".join(pad + line if line.strip() else line for line in text.splitlines(True))


def redis_address(plan: Plan) -> str:
    """Redis's ``host:port`` as the pods and KEDA reach it."""
    if plan.redis_url is None:
        return BUNDLED_REDIS
    url = urlsplit(plan.redis_url.replace("+cluster://", "://"))
    return f"{url.hostname}:{url.port or 6379}"


def _redis_yaml() -> str:
    data = "".join(f"  {f}: |\n{_indent(redis_file(f), 4)}" for f in REDIS_FILES)
    return _template("redis.yaml").replace("@REDIS_FILES@\n", data)


def _config(plan: Plan) -> str:
    app = ""
    if plan.app:
        app = "  # Your pipelines: the image's /app is the folder they are imported from.\n"
        app += f"  CONVEYOR_APP: {plan.app}\n"
    return (
        _template("config.yaml")
        .replace("@NAMESPACE@", plan.namespace)
        .replace("@PIPELINES@", plan.pipelines)
        .replace("@APP@", app)
    )


def _secret(plan: Plan) -> str:
    text = _template("secret.example.yaml").replace("@REDIS@", redis_address(plan))
    if plan.redis_url and plan.redis_url.startswith("rediss"):
        text = text.replace("redis://", "rediss://")
    return text


def _labels(worker: Worker, indent: str, *, pod: bool = False) -> list[str]:
    lines = [
        f"{indent}app.kubernetes.io/name: conveyor",
        f"{indent}app.kubernetes.io/instance: {worker.name}",
    ]
    lines = lines if pod else []
    lines += [
        f"{indent}app.kubernetes.io/part-of: conveyor",
        f"{indent}app.kubernetes.io/component: worker",
        f"{indent}conveyor/stage: {worker.base}",
    ]
    if worker.variant and not pod:
        lines.append(f"{indent}conveyor/variant: {worker.variant}")
    return lines


def _meta(kind: str, api: str, worker: Worker) -> list[str]:
    return [
        f"apiVersion: {api}",
        f"kind: {kind}",
        "metadata:",
        f"  name: {worker.name}",
        f"  namespace: {K8S_NAMESPACE}",
        "  labels:",
        *_labels(worker, "    "),
    ]


def _selector(worker: Worker, indent: str) -> list[str]:
    return [
        f"{indent}matchLabels:",
        f"{indent}  app.kubernetes.io/name: conveyor",
        f"{indent}  app.kubernetes.io/instance: {worker.name}",
    ]


def _deployment(plan: Plan, worker: Worker) -> list[str]:
    cuda = worker.gpus > 0
    image = plan.cuda_image.name if cuda else plan.cpu_image.name
    memory = f"{worker.memory_mb}Mi"
    limit = "8Gi" if cuda else f"{2 * worker.memory_mb}Mi"
    request_cpu = "250m" if worker.light else f"{max(1, worker.threads // 2)}"
    lines = [
        *_meta("Deployment", "apps/v1", worker),
        "spec:",
        "  # No replicas: the ScaledObject's HPA owns the count.",
        "  revisionHistoryLimit: 3",
        "  selector:",
        *_selector(worker, "    "),
        "  strategy:",
        "    type: RollingUpdate",
        "    rollingUpdate:",
        "      maxSurge: 1",
        "      maxUnavailable: 0",
        "  template:",
        "    metadata:",
        "      labels:",
        *_labels(worker, "        ", pod=True),
        "    spec:",
        "      # On SIGTERM the worker reads nothing new and finishes the batches it holds (no",
        "      # preStop needed); this bounds that drain. Entries of a batch cut short by SIGKILL",
        "      # stay pending in the group for another worker.",
        f"      terminationGracePeriodSeconds: {worker.drain_s}",
        "      automountServiceAccountToken: false",
        "      securityContext:",
        "        runAsNonRoot: true",
        "        runAsUser: 10001",
        "        runAsGroup: 10001",
        "        fsGroup: 10001",
        "        seccompProfile:",
        "          type: RuntimeDefault",
    ]
    if cuda:
        lines += [
            "      # GPU nodes are usually tainted; add a nodeSelector for a GPU model if you mix them.",
            "      tolerations:",
            "        - key: nvidia.com/gpu",
            "          operator: Exists",
            "          effect: NoSchedule",
        ]
    lines += [
        "      containers:",
        "        - name: worker",
        f"          image: {image}",
        f'          command: ["conveyor", "worker", {json.dumps(worker.spec)}]',
        "          envFrom:",
        "            - configMapRef:",
        "                name: conveyor-common",
        "            - configMapRef:",
        "                name: conveyor-worker",
        "          env:",
        "            - name: CONVEYOR_REDIS_URL",
        "              valueFrom:",
        "                secretKeyRef:",
        "                  name: conveyor-redis",
        "                  key: worker-redis-url",
        "            # torch threads = the CPU limit, so a pod never oversubscribes its cores.",
        "            - name: CONVEYOR_THREADS",
        f'              value: "{worker.threads}"',
    ]
    if cuda:
        lines += [
            "            # Overrides conveyor-worker's cpu.",
            "            - name: CONVEYOR_DEVICE",
            "              value: cuda",
        ]
    if worker.variant:  # the stage asks no GPU itself: this copy does
        shares = {s: {"gpus": worker.gpus} for s in worker.stages}
        lines += [
            "            # The stage's GPU share: nvidia.com/gpu below requests it in whole GPUs.",
            "            - name: CONVEYOR_RESOURCES",
            f"              value: '{json.dumps(shares)}'",
        ]
    lines += [
        "          # Restarted when its loop stops coming round (a model call that never returns, a",
        "          # blocked event loop): the worker touches CONVEYOR_ALIVE_FILE (conveyor-worker",
        "          # ConfigMap) on every read; the image's conveyor-healthcheck fails once it is",
        "          # older than 360 s, above the longest a batch may run (CONVEYOR_MAX_TIMEOUT_S).",
        "          # The file appears once the model is loaded: the startup probe allows 10 minutes.",
        "          startupProbe:",
        "            exec:",
        '              command: ["conveyor-healthcheck"]',
        "            periodSeconds: 10",
        "            timeoutSeconds: 10",
        "            failureThreshold: 60",
        "          livenessProbe:",
        "            exec:",
        '              command: ["conveyor-healthcheck"]',
        "            periodSeconds: 30",
        "            timeoutSeconds: 10",
        "            failureThreshold: 3",
        "          resources:",
        "            requests:",
        f'              cpu: "{request_cpu}"',
        f"              memory: {memory}",
        "            limits:",
        f'              cpu: "{worker.threads}"',
        f"              memory: {limit}",
    ]
    if cuda:
        lines.append(f"              nvidia.com/gpu: {worker.gpus}")
    lines += [
        "          securityContext:",
        "            allowPrivilegeEscalation: false",
        "            readOnlyRootFilesystem: true",
        "            capabilities:",
        '              drop: ["ALL"]',
        "          volumeMounts:",
        "            - name: model-cache",
        "              mountPath: /var/cache/conveyor",
        "            - name: tmp",
        "              mountPath: /tmp",
        "      volumes:",
        "        # Tiny offline models are generated here at start (seconds). For hub models use a",
        "        # PersistentVolumeClaim (ReadWriteMany) or bake them into the image.",
        "        - name: model-cache",
        "          emptyDir:",
        f"            sizeLimit: {'64Mi' if worker.light else '4Gi'}",
        "        - name: tmp",
        "          emptyDir:",
        "            sizeLimit: 256Mi",
    ]
    return lines


def _budget(worker: Worker) -> list[str]:
    return [
        *_meta("PodDisruptionBudget", "policy/v1", worker),
        "spec:",
        "  # One at a time (a drain waits for the evicted pod's batches); maxUnavailable rather",
        "  # than minAvailable so a stage scaled to one (or zero) never blocks a node drain.",
        "  maxUnavailable: 1",
        "  selector:",
        *_selector(worker, "    "),
    ]


def _scaled_object(plan: Plan, worker: Worker) -> list[str]:
    from pipelines.keys import Keys

    keys = Keys(plan.namespace, plan.partitions)
    lines = [
        *_meta("ScaledObject", "keda.sh/v1alpha1", worker),
        "spec:",
        "  scaleTargetRef:",
        "    apiVersion: apps/v1",
        "    kind: Deployment",
        f"    name: {worker.name}",
        "  pollingInterval: 5",
        "  # Scale to zero: set minReplicaCount to 0. The stage then stops after cooldownPeriod",
        "  # seconds with nothing waiting or in flight, and the first request afterwards waits for a",
        "  # pod to start and load its model (keep the gateway's deadline above that).",
        f"  minReplicaCount: {worker.replicas}",
        f"  maxReplicaCount: {max(worker.replicas, 4 if worker.gpus else 10)}",
        "  cooldownPeriod: 300",
        "  # While KEDA cannot read the stream (Redis down, group not created yet), keep one worker:",
        "  # it creates the group when it starts.",
        "  fallback:",
        "    failureThreshold: 3",
        f"    replicas: {worker.replicas}",
        "  advanced:",
        "    horizontalPodAutoscalerConfig:",
        "      behavior:",
        "        scaleUp:",
        "          stabilizationWindowSeconds: 0",
        "          policies:",
        "            - type: Pods",
        "              value: 4",
        "              periodSeconds: 15",
        "        scaleDown:",
        "          # Slowly: each removed pod drains its batches first.",
        "          stabilizationWindowSeconds: 120",
        "          policies:",
        "            - type: Pods",
        "              value: 1",
        "              periodSeconds: 60",
        "  # The HPA takes the largest: replicas = ceil(lag / target) or ceil(pending / target) of",
        "  # each lane's stream, target = what one worker holds at full speed (max_batch_size x",
        "  # max_concurrent_batches). Any waiting entry (activationLagCount 0) wakes it from zero.",
        "  triggers:",
    ]
    labels = worker.labels or ("",) * len(worker.stages)
    for stage, target, label in zip(worker.stages, worker.targets, labels, strict=True):
        options = TriggerOptions(redis_address(plan), target, cluster=plan.cluster)
        lines += _indent(triggers(keys, stage, options, label), 2).splitlines()
    return lines


def worker_file(plan: Plan, worker: Worker) -> str:
    """One worker's manifests: Deployment, PodDisruptionBudget, ScaledObject."""
    if worker.variant == "gpu":
        head = [
            f"# `{worker.spec}` on GPUs: use this file INSTEAD of {_cpu_path(worker)} (swap them in",
            "# kustomization.yaml; two ScaledObjects on one stream would each scale for the same work).",
            "# Needs the CUDA image and GPU nodes with the NVIDIA device plugin.",
        ]
    else:
        head = [
            f"# Worker `{worker.spec}`: its pods, their disruption budget and their autoscaler.",
            "# Written by `conveyor deploy k8s` from the stages (resources, GPUs, replicas, threads).",
        ]
    docs = [_deployment(plan, worker), _budget(worker), _scaled_object(plan, worker)]
    return "\n".join(head + docs[0] + ["---"] + docs[1] + ["---"] + docs[2]) + "\n"


def worker_path(worker: Worker) -> str:
    """Where a worker's file goes: stages/ (applied) or optional/ (a variant)."""
    folder = "optional" if worker.variant else "stages"
    return f"{folder}/{worker.name.removeprefix(WORKER)}.yaml"


def _cpu_path(worker: Worker) -> str:
    """Where the CPU worker a variant copies has its file."""
    return f"stages/{worker.base}.yaml"


def _kustomization(plan: Plan, redis: bool) -> str:
    lines = [
        f"# kubectl apply -f {'deploy/k8s' if plan.shipped else 'DIR/k8s'}/secret.example.yaml"
        "   (the namespace and the Secret: real passwords first)",
        f"# kubectl apply -k {'deploy/k8s' if plan.shipped else 'DIR/k8s'}",
        "# Needs KEDA >= 2.12 installed in the cluster (namespace keda) for the ScaledObjects.",
        "apiVersion: kustomize.config.k8s.io/v1beta1",
        "kind: Kustomization",
        f"namespace: {K8S_NAMESPACE}",
        "resources:",
        "  - namespace.yaml",
        "  - config.yaml",
    ]
    lines += ["  - redis.yaml"] if redis else []
    lines += [
        "  - gateway.yaml",
        "  - keda.yaml",
        "  # One file per worker (`conveyor deploy k8s`).",
    ]
    lines += [f"  - {worker_path(w)}" for w in plan.workers if not w.variant]
    for w in plan.workers:
        if w.variant:
            lines += [
                f"  # {w.variant.upper()} instead of CPU for {w.spec}: replace {_cpu_path(w)} with",
                f"  # - {worker_path(w)}",
            ]
    return "\n".join(lines) + "\n"


def files(plan: Plan) -> dict[str, str]:
    """The files ``conveyor deploy k8s`` writes, by path relative to its folder (namespace
    first in the kustomization; the example Secret carries the namespace too)."""
    redis = plan.redis_url is None
    out = {
        "kustomization.yaml": _kustomization(plan, redis),
        "namespace.yaml": _template("namespace.yaml"),
        "config.yaml": _config(plan),
        "secret.example.yaml": _secret(plan),
    }
    if redis:
        out["redis.yaml"] = _redis_yaml()
    out["gateway.yaml"] = _template("gateway.yaml").replace("@IMAGE@", plan.cpu_image.name)
    out["keda.yaml"] = _template("keda.yaml")
    out |= {worker_path(w): worker_file(plan, w) for w in plan.workers}
    return out
