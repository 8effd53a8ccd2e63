"""The embedding job's KubeRay RayJob (deploy/k8s/rayjob-embed.yaml): rendered from deploy/k8s/render.py, its
cluster valid against the KubeRay CRD's RayClusterSpec (the RayService CRD in shared/k8s holds the same Go type
as rayClusterConfig), its pod templates valid Kubernetes pod templates, its entrypoint a command the job's CLI
accepts."""

from __future__ import annotations

import shlex
import subprocess
import sys

import jsonschema
import yaml

from tests.test_deploy import K8S, _strict, rayservice_schema, validate_pod_template

# RayJob's spec fields used here, as KubeRay v1's ray.io_rayjobs.yaml names them
RAYJOB_FIELDS = {"entrypoint", "shutdownAfterJobFinishes", "ttlSecondsAfterFinished", "backoffLimit", "rayClusterSpec"}


def manifest() -> dict:
    return yaml.safe_load((K8S / "rayjob-embed.yaml").read_text())


def cluster_schema(strict: bool) -> dict:
    schema = _strict(rayservice_schema()) if strict else rayservice_schema()
    return schema["properties"]["spec"]["properties"]["rayClusterConfig"]


def test_the_rayjob_is_rendered_from_render_py():
    done = subprocess.run([sys.executable, str(K8S / "render.py"), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_rayjob_cluster_validates_against_the_kuberay_cluster_schema():
    job = manifest()
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    assert set(job["spec"]) <= RAYJOB_FIELDS
    for strict in (False, True):
        jsonschema.validate(job["spec"]["rayClusterSpec"], cluster_schema(strict), cls=jsonschema.Draft7Validator)
    broken = manifest()["spec"]["rayClusterSpec"]
    broken["workerGroupSpecs"][0]["replica"] = 2  # a typo the API server would drop silently
    try:
        jsonschema.validate(broken, cluster_schema(True), cls=jsonschema.Draft7Validator)
    except jsonschema.ValidationError:
        pass
    else:
        raise AssertionError("the strict schema let an unknown key through")


def test_the_rayjob_pods_are_valid_and_share_the_jobs_volume():
    cluster = manifest()["spec"]["rayClusterSpec"]
    templates = [("head", cluster["headGroupSpec"]["template"])]
    templates += [(g["groupName"], g["template"]) for g in cluster["workerGroupSpecs"]]
    for name, template in templates:
        validate_pod_template(name, template)
        claims = [v["persistentVolumeClaim"]["claimName"] for v in template["spec"]["volumes"]]
        assert claims == ["mha-encoder-jobs"]  # every actor writes its own shards: every pod mounts the output
        for c in template["spec"]["containers"]:
            assert c["securityContext"]["runAsNonRoot"] and not c["securityContext"]["allowPrivilegeEscalation"]
            assert [m["mountPath"] for m in c["volumeMounts"]] == ["/data"]


def test_the_entrypoint_is_a_command_the_cli_accepts():
    from jobs.__main__ import parser

    words = shlex.split(manifest()["spec"]["entrypoint"])
    assert words[:3] == ["python", "-m", "jobs"]
    args = parser().parse_args(words[3:])
    assert args.command == "embed" and str(args.output).startswith("/data/")
