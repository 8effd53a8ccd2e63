"""deploy/ validated offline: Kubernetes schemas (kubernetes-validate, strict), the RayService
against the real KubeRay CRD schema (plus a strict unknown-key pass), its pod templates as
Kubernetes pod templates, policies a reviewer asks for, the Serve config it embeds, and the
Dockerfiles. Every check is also shown to fail on a deliberately broken manifest."""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import os
import re
import socket
import subprocess
import sys
from functools import cache
from pathlib import Path

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from service.config import ServiceSettings

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
CRD_NAME = "ray.io_rayservices.yaml"
CRD_SHARED = ROOT.parent / "shared" / "k8s" / CRD_NAME  # beside the repository, as this workspace and CI have it
CRD_ENV = "KUBERAY_CRD"  # or a path given by the environment
# or KubeRay's release, pinned: the same bytes as ../shared/k8s/ (v1.7.0's blob 7ee63d6d)
CRD_TAG = "v1.7.0"
CRD_SHA256 = "0a8fc325e6e22b9231c1f282b309555e2ecf94227ca20a03df3d1d9a403907ab"
CRD_URL = f"https://raw.githubusercontent.com/ray-project/kuberay/{CRD_TAG}/ray-operator/config/crd/bases/{CRD_NAME}"
CRD_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kuberay" / CRD_TAG / CRD_NAME
K8S_VERSION = kubernetes_validate.utils.latest_version()  # the newest Kubernetes it has schemas for
RAY_PORTS = {6379, 8265, 10001}
RAYSERVICES = ["rayservice-cpu.yaml", "rayservice-gpu.yaml"]
STANDARD = ["service.yaml"]  # PodMonitor and PrometheusRule are CRDs of the Prometheus Operator


def load(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


# --- checks -------------------------------------------------------------------------------------


def k8s_validate(manifest: dict) -> None:
    """Strict Kubernetes schema validation; raises on any error."""
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def find_crd(env: dict | None = None, shared: Path = CRD_SHARED, cache_file: Path = CRD_CACHE,
             url: str = CRD_URL, sha256: str = CRD_SHA256) -> Path:
    """KubeRay's RayService CRD: $KUBERAY_CRD when set, else ../shared/k8s/ beside the repository,
    else KubeRay's file at the pinned tag, downloaded once into the user's cache and checked against
    its sha256. Raises FileNotFoundError with one line saying where it looked when none works."""
    env = os.environ if env is None else env
    if env.get(CRD_ENV):
        given = Path(env[CRD_ENV])
        if not given.is_file():
            raise FileNotFoundError(f"${CRD_ENV} names {given}, which is not a file")
        return given
    if shared.is_file():
        return shared
    if cache_file.is_file() and hashlib.sha256(cache_file.read_bytes()).hexdigest() == sha256:
        return cache_file
    try:
        body = httpx.get(url, timeout=30, follow_redirects=True).raise_for_status().content
    except httpx.HTTPError as e:
        raise FileNotFoundError(
            f"KubeRay's CRD is not in {shared} nor ${CRD_ENV}, and its download from {url} failed "
            f"({type(e).__name__}: {e}); put {CRD_NAME} (KubeRay {CRD_TAG}) in one of them") from None
    digest = hashlib.sha256(body).hexdigest()
    if digest != sha256:
        raise FileNotFoundError(f"{url} has sha256 {digest}, not KubeRay {CRD_TAG}'s {sha256}")
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    partial = cache_file.with_suffix(f".{os.getpid()}.part")
    partial.write_bytes(body)
    partial.replace(cache_file)  # whole or absent, when two workers download at once
    return cache_file


@cache
def rayservice_schema() -> dict:
    try:
        crd_file = find_crd()
    except FileNotFoundError as e:
        pytest.fail(str(e), pytrace=False)
    crd = yaml.safe_load(crd_file.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def _strict(schema: dict) -> dict:
    """The schema with unknown keys forbidden wherever it lists properties and does not say
    x-kubernetes-preserve-unknown-fields (what the API server's pruning would drop silently)."""
    schema = copy.deepcopy(schema)

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def crd_validate(manifest: dict, strict: bool) -> None:
    schema = _strict(rayservice_schema()) if strict else rayservice_schema()
    # metadata is the API server's ObjectMeta, typed only as `object` in the CRD
    jsonschema.validate(manifest, schema, cls=jsonschema.Draft7Validator)


def pod_templates(rayservice: dict) -> list[tuple[str, dict]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    found = [("head", cluster["headGroupSpec"]["template"])]
    found += [(g["groupName"], g["template"]) for g in cluster.get("workerGroupSpecs", [])]
    return found


def validate_pod_template(name: str, template: dict) -> None:
    k8s_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template})


def containers(rayservice: dict) -> list[dict]:
    return [c for _, t in pod_templates(rayservice) for c in t["spec"]["containers"]]


# --- the real manifests pass ------------------------------------------------------------------


@pytest.mark.parametrize("name", STANDARD)
def test_standard_manifests_validate_strictly(name):
    k8s_validate(load(name))


@pytest.mark.parametrize("name", RAYSERVICES)
def test_rayservice_validates_against_the_kuberay_crd(name):
    manifest = load(name)
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    crd_validate(manifest, strict=False)
    crd_validate(manifest, strict=True)


@pytest.mark.parametrize("name", RAYSERVICES)
def test_rayservice_pod_templates_are_valid_pod_templates(name):
    templates = pod_templates(load(name))
    assert len(templates) >= 2  # head and at least one worker group
    for group, template in templates:
        validate_pod_template(group, template)


def _serve_once(body: bytes):
    """A loopback HTTP server answering every GET with `body`; returns (url, server)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/{CRD_NAME}", server


def test_the_crd_is_found_beside_the_repository_in_an_env_path_or_downloaded_at_its_pinned_sha256(tmp_path):
    """A clone anywhere finds KubeRay's CRD: $KUBERAY_CRD first, then ../shared/k8s/, then the pinned
    release downloaded once into a cache (its sha256 checked, a wrong body refused), and one line naming
    all three when none works. The download is served on loopback here (CI reaches no GitHub)."""
    shared, cache_file = tmp_path / "shared" / CRD_NAME, tmp_path / "cache" / CRD_NAME
    given = tmp_path / "given.yaml"
    given.write_text("kind: CustomResourceDefinition\n")
    assert find_crd({CRD_ENV: str(given)}, shared, cache_file, url="http://127.0.0.1:1/x") == given
    with pytest.raises(FileNotFoundError, match=r"\$KUBERAY_CRD names .*missing.yaml, which is not a file"):
        find_crd({CRD_ENV: str(tmp_path / "missing.yaml")}, shared, cache_file)
    shared.parent.mkdir()
    shared.write_text("kind: CustomResourceDefinition\n")
    assert find_crd({}, shared, cache_file, url="http://127.0.0.1:1/x") == shared
    shared.unlink()

    body = b"kind: CustomResourceDefinition  # the release's bytes\n"
    url, server = _serve_once(body)
    try:
        with pytest.raises(FileNotFoundError, match="has sha256 .*, not KubeRay v1.7.0's 0+$"):
            find_crd({}, shared, cache_file, url=url, sha256="0" * 64)
        assert not cache_file.exists()  # a wrong body is never cached
        digest = hashlib.sha256(body).hexdigest()
        assert find_crd({}, shared, cache_file, url=url, sha256=digest) == cache_file
        assert cache_file.read_bytes() == body
    finally:
        server.shutdown()
        server.server_close()
    # cached: no server needed any more
    assert find_crd({}, shared, cache_file, url="http://127.0.0.1:1/x", sha256=digest) == cache_file
    cache_file.unlink()
    with pytest.raises(FileNotFoundError) as failed:
        find_crd({}, shared, cache_file, url="http://127.0.0.1:1/x", sha256=digest)
    line = str(failed.value)
    assert "\n" not in line and str(shared) in line and "$KUBERAY_CRD" in line and "127.0.0.1:1" in line, line


def test_the_pinned_crd_is_the_one_beside_the_repository():
    """The pinned sha256 is what ../shared/k8s/ holds (KubeRay v1.7.0's file), so the download and the
    workspace's copy validate the manifests against the same schema."""
    found = find_crd()
    assert hashlib.sha256(found.read_bytes()).hexdigest() == CRD_SHA256, found


def test_kubernetes_validate_cannot_check_a_rayservice_by_itself():
    """Why the CRD check exists: kubernetes-validate has no schema for a custom resource, so
    even a nonsense RayService is not reported as invalid by it."""
    broken = load("rayservice-cpu.yaml")
    broken["spec"]["rayClusterConfig"]["headGroupSpec"] = "not an object"
    with pytest.raises(kubernetes_validate.utils.SchemaNotFoundError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    with pytest.raises(jsonschema.ValidationError):
        crd_validate(broken, strict=False)


# --- and broken ones fail each check ----------------------------------------------------------


def _break_service(kind: str) -> dict:
    m = load("service.yaml")
    if kind == "wrong type":
        m["spec"]["ports"][0]["port"] = "eighty"
    elif kind == "unknown key":
        m["spec"]["loadBalancerPorts"] = [80]
    else:  # missing required field
        del m["spec"]["ports"][0]["port"]
    return m


def _break_rayservice(kind: str) -> dict:
    m = load("rayservice-cpu.yaml")
    if kind == "wrong type":
        m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    elif kind == "unknown key":
        m["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParamz"] = {}
    else:
        del m["spec"]["rayClusterConfig"]
    return m


def _break_pod(kind: str) -> dict:
    template = copy.deepcopy(pod_templates(load("rayservice-cpu.yaml"))[1][1])
    c = template["spec"]["containers"][0]
    if kind == "wrong type":
        c["ports"][0]["containerPort"] = "8000"
    elif kind == "unknown key":
        c["readinessProbe"]["httpGett"] = c["readinessProbe"].pop("httpGet")
    else:
        del c["name"]
    return template


BREAKS = ["wrong type", "unknown key", "missing required field"]


@pytest.mark.parametrize("kind", BREAKS)
def test_broken_service_fails_kubernetes_validation(kind):
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(_break_service(kind))


@pytest.mark.parametrize("kind", BREAKS)
def test_broken_rayservice_fails_the_crd_check(kind):
    broken = _break_rayservice(kind)
    with pytest.raises(jsonschema.ValidationError):
        crd_validate(broken, strict=True)
    if kind != "unknown key":  # the lenient pass catches type and required errors by itself
        with pytest.raises(jsonschema.ValidationError):
            crd_validate(broken, strict=False)


@pytest.mark.parametrize("kind", BREAKS)
def test_broken_pod_template_fails_validation(kind):
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_pod_template("worker", _break_pod(kind))


# --- policies -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RAYSERVICES)
def test_gpu_requests_equal_limits_and_only_the_gpu_variant_asks_for_gpus(name):
    gpus = []
    for c in containers(load(name)):
        requests, limits = c["resources"].get("requests", {}), c["resources"].get("limits", {})
        assert "cpu" in requests and "memory" in requests and "memory" in limits, c["name"]
        if "nvidia.com/gpu" in requests or "nvidia.com/gpu" in limits:
            assert requests.get("nvidia.com/gpu") == limits.get("nvidia.com/gpu"), c["name"]
            gpus.append(limits["nvidia.com/gpu"])
    assert bool(gpus) == ("gpu" in name)
    if gpus:
        assert gpus == ["1"]


@pytest.mark.parametrize("name", RAYSERVICES)
def test_containers_run_as_non_root_without_privilege_escalation(name):
    for group, template in pod_templates(load(name)):
        pod_security = template["spec"].get("securityContext", {})
        for c in template["spec"]["containers"]:
            security = {**pod_security, **c.get("securityContext", {})}
            assert security.get("runAsNonRoot") is True, (group, c["name"])
            assert security.get("runAsUser", 0) != 0, (group, c["name"])
            assert c["securityContext"].get("allowPrivilegeEscalation") is False, (group, c["name"])


def test_no_service_exposes_ray_internal_ports():
    for path in K8S.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Service":
                for port in doc["spec"]["ports"]:
                    assert port["port"] not in RAY_PORTS and port.get("targetPort") not in RAY_PORTS, path


def serve_config() -> dict:
    return yaml.safe_load((ROOT / "deploy/serve_config.yaml").read_text())


def settings_of(config: dict) -> ServiceSettings:
    return ServiceSettings.from_serve_app(config["applications"][0])


@pytest.mark.parametrize("name", RAYSERVICES)
def test_serve_limits_are_sane(name):
    config = yaml.safe_load(load(name)["spec"]["serveConfigV2"])
    s = settings_of(config)
    # a batch can only fill with as many requests in flight as a replica holds
    assert s.max_ongoing_requests >= s.batching.max_sub_batch_size
    assert s.max_ongoing_requests >= s.batching.max_concurrent_batches
    # Serve's queue in front of full replicas is bounded
    assert 0 < s.max_queued_requests < 100_000
    for _, template in pod_templates(load(name)):
        assert s.graceful_shutdown_timeout_s < template["spec"]["terminationGracePeriodSeconds"]


# --- one Serve config -------------------------------------------------------------------------


def test_rayservice_manifests_are_rendered_from_the_current_serve_config():
    result = subprocess.run([sys.executable, str(K8S / "render.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


GPU_ARGS = {"provider": "cuda", "num_gpus": 0.25}  # all that a GPU cluster's Serve config changes
CPU_CLUSTER_ARGS = {"max_replicas_per_node": 1}  # and a CPU cluster's
# and both: the Batch API's files and batches, and the model repository, on the jobs volume
BATCH_ARGS = {"jobs_dir": "/data/openai-batches", "models_dir": "/data/models"}


@pytest.mark.parametrize("name", RAYSERVICES)
def test_every_rayservice_pod_mounts_the_jobs_claim_at_the_serve_configs_jobs_dir(name):
    """OpenAI's Batch API keeps its files and batches in jobs_dir, and a batch's embedding job (a Ray actor
    on any pod) writes its shards there: every pod mounts the jobs PersistentVolumeClaim where the embedded
    Serve config's jobs_dir is, and where its model repository (models_dir) is."""
    manifest = load(name)
    args = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]
    jobs_dir, models_dir = Path(args["jobs_dir"]), Path(args["models_dir"])
    templates = pod_templates(manifest)
    assert len(templates) >= 2
    for group, template in templates:
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in template["spec"].get("volumes", [])
                  if "persistentVolumeClaim" in v}
        for c in template["spec"]["containers"]:
            mounted = [m for m in c.get("volumeMounts", []) if claims.get(m["name"]) == "mha-encoder-jobs"]
            assert any(jobs_dir.is_relative_to(m["mountPath"]) for m in mounted), (group, c["name"], mounted)
            assert any(models_dir.is_relative_to(m["mountPath"]) for m in mounted), (group, c["name"], mounted)


@pytest.mark.parametrize("name", RAYSERVICES)
def test_serve_config_v2_is_the_serve_config_file(name):
    """The file, with two replicas at least in a cluster (so a lost pod leaves one serving) and, on
    GPUs, replicas on CUDA asking Ray for a GPU share, on CPUs one replica a worker pod; nothing else
    differs."""
    embedded = yaml.safe_load(load(name)["spec"]["serveConfigV2"])
    expected = serve_config()
    for app in expected["applications"]:
        for deployment in app["deployments"]:
            deployment["autoscaling_config"]["min_replicas"] = 2
    if "gpu" in name:  # the file for `serve deploy` on GPUs, plus the jobs volume's jobs_dir
        gpu_file = yaml.safe_load((ROOT / "deploy/serve_config.gpu.yaml").read_text())
        for app in gpu_file["applications"]:
            app["args"].update(BATCH_ARGS)
        assert embedded == gpu_file
    for app in expected["applications"]:
        app["args"].update({**(GPU_ARGS if "gpu" in name else CPU_CLUSTER_ARGS), **BATCH_ARGS})
    assert embedded == expected
    assert serve_config()["applications"][0]["deployments"][0]["autoscaling_config"]["min_replicas"] == 1  # make run


def test_cpu_cluster_spreads_its_minimum_replicas_over_two_worker_pods():
    """One replica a worker pod, for good: Serve never moves a running replica, so without the cap a
    replica lost with its pod comes back beside the other one, and the next pod lost takes both."""
    manifest = load("rayservice-cpu.yaml")
    group = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    settings = settings_of(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    assert group["replicas"] == group["minReplicas"] == settings.autoscaling.min_replicas == 2
    assert settings.max_replicas_per_node == 1
    # room to scale out: a pod for every replica the autoscaler may ask for
    assert group["maxReplicas"] >= settings.autoscaling.max_replicas


# --- the containers `make containers` runs: KubeRay's pods, rendered from the manifests ------------------


def kuberay_pods(name: str):
    from deploy.k8s import kuberay

    manifest = load(name)
    return manifest, kuberay.pods(manifest)


def flag_values(script: str) -> dict[str, str]:
    """`ray start`'s flags in KubeRay's script: {'num-cpus': '4', 'block': ''}."""
    assert script.startswith("ulimit -n 65536; ray start "), script
    out = {}
    for word in script.split("ray start ", 1)[1].split():
        key, _, value = word.removeprefix("--").partition("=")
        out[key] = value
    return out


@pytest.mark.parametrize("name", RAYSERVICES)
def test_container_command_lines_match_the_rayservice(name):
    """Each container `make containers` starts has its pod's image, user, resource limits, environment,
    liveness probe and grace period, and the `ray start` line KubeRay derives from the group's
    rayStartParams and limits, all read from the rendered manifest."""
    from deploy.k8s.kuberay import quantity

    manifest, pods = kuberay_pods(name)
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    assert len(pods) == 1 + sum(g["replicas"] for g in cluster["workerGroupSpecs"])
    head_svc = f"{manifest['metadata']['name']}-head-svc"
    for pod in pods:
        group = groups[0] if pod.head else next(g for g in groups[1:] if g["groupName"] == pod.group)
        spec = group["template"]["spec"]
        container = spec["containers"][0]
        limits = container["resources"]["limits"]
        argv = pod.run_argv(network="net", aliases=(head_svc,) if pod.head else ())
        options = " ".join(argv)
        assert argv[-2] == container["image"] and argv[-1] == pod.ray_start
        assert f"--cpus={quantity(limits['cpu']):g}" in argv and f"--memory={int(quantity(limits['memory']))}" in argv
        assert argv[argv.index("--user") + 1] == str(spec["securityContext"]["runAsUser"]) == "1000"
        assert argv[argv.index("--workdir") + 1] == container["workingDir"]
        assert f"--stop-timeout={spec['terminationGracePeriodSeconds']}" in argv
        assert "--cap-drop=ALL" in argv and "--security-opt=no-new-privileges" in argv
        assert argv[argv.index("--health-cmd") + 1] == json.dumps(container["livenessProbe"]["exec"]["command"])
        for env in container["env"]:
            assert f"{env['name']}={env['value']}" in argv, env
        assert ("--device" in argv) == ("nvidia.com/gpu" in limits)
        flags = flag_values(pod.ray_start)
        for key, value in group["rayStartParams"].items():
            assert flags[key] == str(value), (pod.name, key)
        assert flags["block"] == "" and flags["dashboard-agent-listen-port"] == "52365"  # the liveness probe's port
        assert flags["metrics-export-port"] == "8080"
        assert flags["memory"] == str(int(quantity(limits["memory"])))
        assert flags["num-cpus"] == group["rayStartParams"].get("num-cpus", str(int(quantity(limits["cpu"]))))
        if pod.head:
            assert flags["num-cpus"] == "0" and "address" not in flags and "--network-alias=" + head_svc in options
        else:
            assert flags["address"] == f"{head_svc}:6379"
            assert dict(e.split("=", 1) for e in argv[argv.index("-e") + 1::2] if "=" in e)["RAY_ADDRESS"] == flags["address"]


def test_container_command_lines_follow_a_changed_manifest():
    """Rendered from the manifest, not copied: change the worker's limits and the command line follows."""
    from deploy.k8s import kuberay

    manifest = copy.deepcopy(load("rayservice-cpu.yaml"))
    worker = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    worker["template"]["spec"]["containers"][0]["resources"]["limits"] = {"cpu": "3", "memory": "5Gi"}
    worker["rayStartParams"]["num-gpus"] = "0"
    pod = kuberay.pods(manifest, image="localhost/x:1")[1]
    argv = pod.run_argv()
    assert "--cpus=3" in argv and f"--memory={5 * 2**30}" in argv and argv[-2] == "localhost/x:1"
    assert {"num-cpus": "3", "memory": str(5 * 2**30), "num-gpus": "0"}.items() <= flag_values(pod.ray_start).items()


def test_gpu_replicas_ask_ray_for_the_gpu_their_pod_has_and_ray_assigns_devices():
    """The GPU RayService: each replica asks for a GPU share, as many replicas as a worker pod has
    CPUs for fill exactly its GPUs, and nothing stops Ray from setting CUDA_VISIBLE_DEVICES."""
    manifest = load("rayservice-gpu.yaml")
    s = settings_of(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    assert s.provider == "cuda" and s.precision == "auto" and s.num_gpus == 0.25
    group = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    pod_gpus, pod_cpus = int(limits["nvidia.com/gpu"]), int(limits["cpu"])
    assert int(group["rayStartParams"]["num-gpus"]) == pod_gpus
    replicas_per_pod = int(pod_cpus // s.num_cpus)
    assert replicas_per_pod * s.num_gpus == pod_gpus  # fills the GPU, never over-asks it
    assert s.autoscaling.max_replicas * s.num_gpus <= pod_gpus * group["maxReplicas"]
    for c in containers(manifest):
        names = {e["name"] for e in c.get("env", [])}
        assert "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES" not in names, c["name"]
    cpu = settings_of(serve_config())
    assert cpu.provider == "auto" and cpu.num_gpus is None  # CPU clusters: no GPU asked for


def test_serve_config_import_path_and_args_are_real():
    for app in serve_config()["applications"]:
        module, attr = app["import_path"].split(":")
        builder = getattr(importlib.import_module(module), attr)
        from service.app import build_app

        assert builder is build_app
        settings = settings_of({"applications": [app]})
        assert settings.autoscaling is not None and settings.autoscaling.max_replicas >= 1


def test_serve_config_args_with_a_typo_are_refused():
    config = serve_config()
    config["applications"][0]["args"]["max_batch_token"] = 1
    with pytest.raises(ValueError, match="max_batch_token"):
        settings_of(config)


@pytest.mark.parametrize("name", RAYSERVICES)
def test_probe_paths_answer_200_on_a_ready_service(name, service_url):
    """Every HTTP probe of the Serve port, asked of the real running service."""
    paths = set()
    for c in containers(load(name)):
        for probe in (c.get("readinessProbe"), c.get("livenessProbe")):
            if probe and "httpGet" in probe and probe["httpGet"]["port"] == 8000:
                paths.add(probe["httpGet"]["path"])
    assert paths, "no HTTP probe on the Serve port"
    for path in sorted(paths):
        assert httpx.get(f"{service_url}{path}", timeout=10).status_code == 200, path


@pytest.mark.parametrize("name", RAYSERVICES)
def test_liveness_never_depends_on_the_model(name):
    for c in containers(load(name)):
        live = c["livenessProbe"]
        assert "httpGet" not in live or live["httpGet"]["path"] not in ("/health", "/v2/health/ready")
        assert "local_raylet_healthz" in " ".join(live.get("exec", {}).get("command", []))


# --- Dockerfiles ------------------------------------------------------------------------------

DOCKERFILES = [ROOT / "deploy/Dockerfile", ROOT / "deploy/Dockerfile.cuda"]


def stages(dockerfile: Path) -> list[tuple[str, list[str]]]:
    """(FROM line, with the defaults of the build args before the first FROM filled in, and
    instructions) for each build stage."""
    out: list[tuple[str, list[str]]] = []
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    args: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not out and (m := re.match(r"ARG\s+(\w+)=(\S+)", line)):
            args[m.group(1)] = m.group(2).strip("\"'")
        if line.upper().startswith("FROM "):
            line = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), line)
            out.append((line, []))
        elif out:
            out[-1][1].append(line)
    return out


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile):
    hadolint = Path(sys.executable).with_name("hadolint")
    result = subprocess.run(
        [str(hadolint), "--config", str(ROOT / ".hadolint.yaml"), str(dockerfile)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_rules(dockerfile):
    all_stages = stages(dockerfile)
    assert len(all_stages) >= 2, "an export stage and a serving stage"
    for from_line, _ in all_stages:
        image = from_line.split()[1]
        tag = image.rsplit(":", 1)[-1] if ":" in image else ""
        assert tag and tag != "latest" and re.search(r"\d", tag), f"unpinned base image: {from_line}"
    serve_from, serve_body = all_stages[-1]
    # Ray's image of the version we pin, or a slim Python 3.11 base that gets ray[serve] from
    # pyproject.toml's pin (docs/images.md); the base is a build argument either way
    serve_image = serve_from.split()[1]
    assert serve_image.startswith(("rayproject/ray:2.60.0-py311", "python:3.11")), serve_from
    body = "\n".join(serve_body)
    users = [line.split()[1] for line in serve_body if line.upper().startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), "the serving stage must end as a non-root user"
    assert "torch" not in re.sub(r"find_spec\('torch'\)", "", body), "no torch in the serving stage"
    assert "[export]" not in body and "export," not in body
    # the CUDA image takes the CUDA libraries from the project's own `cuda` extra, nothing else
    assert (".[serve,cuda]" in body) if dockerfile.name.endswith(".cuda") else (".[serve]" in body and "cuda" not in body)
    assert any(line.upper().startswith("HEALTHCHECK") for line in serve_body)
    assert "COPY --from=export" in body, "the bundle comes from the export stage"
    export_body = "\n".join(all_stages[0][1])
    assert "python -m export" in export_body and ".[export]" in export_body


def test_what_serve_changes_live_is_in_the_deployments_entry_not_in_args():
    """Ray hashes `args` into the code version, so a knob there restarts every replica when it
    changes: the replica count, autoscaling and the batching knobs live in the `deployments` entry
    (num_replicas / autoscaling_config / user_config), which Serve applies to running replicas."""
    from service.config import BatchingSettings

    for name in ("serve_config.yaml", "serve_config.gpu.yaml"):
        app = yaml.safe_load((ROOT / "deploy" / name).read_text())["applications"][0]
        assert not {"replicas", "autoscaling", "batching", "max_ongoing_requests", "max_queued_requests"} \
            & set(app["args"]), name
        (encoder,) = app["deployments"]
        assert encoder["name"] == "Encoder"
        assert set(encoder) <= {"name", "num_replicas", "autoscaling_config", "user_config", "max_ongoing_requests",
                                "max_queued_requests"}, encoder
        BatchingSettings.model_validate(encoder["user_config"])  # every knob known, none misspelt
        settings = ServiceSettings.from_serve_app(app)
        assert settings.batching == BatchingSettings.model_validate(encoder["user_config"])
        assert settings.autoscaling.model_dump() == encoder["autoscaling_config"]
        # Serve's limit per replica is the replica's: Serve routes only to replicas with room
        assert settings.max_ongoing_requests == encoder["max_ongoing_requests"]
        assert settings.max_queued_requests == encoder["max_queued_requests"]


def test_image_healthcheck_says_live_and_what_the_replica_runs_on(service_url):
    """The images' HEALTHCHECK (python -m service.healthcheck): exit 0 and one line naming the provider and,
    on a machine without a GPU, why CUDA is not used; exit 1 with a reason where nothing answers."""
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        text = (ROOT / "deploy" / dockerfile).read_text()
        assert 'CMD ["python", "-m", "service.healthcheck"]' in text, dockerfile
    live = subprocess.run([sys.executable, "-m", "service.healthcheck", "--url", service_url],
                          capture_output=True, text=True, timeout=30)
    info = httpx.get(f"{service_url}/info", timeout=30).json()
    assert live.returncode == 0, live.stdout + live.stderr
    assert live.stdout.strip() == f"live; serving on {info['provider']} (CUDA not used: {info['provider_note']})"
    assert "no GPU visible" in live.stdout or "CUDA libraries missing" in live.stdout  # this machine has no GPU
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = subprocess.run([sys.executable, "-m", "service.healthcheck", "--url", f"http://127.0.0.1:{port}", "--timeout", "2"],
                          capture_output=True, text=True, timeout=30)
    assert dead.returncode == 1 and dead.stdout.startswith("not live:"), dead.stdout
