"""cluster/kuberay, checked without Kubernetes: the RayService passes the RayService CRD's own
OpenAPI schema (KubeRay's Helm chart, vendored under data/), read strictly as kubectl's field
validation does, and uses no deprecated field; it serves configs/serve.yaml's application with
proxies where KubeRay's probes look for them and holds the pinned pools; its GPU groups are
pinned to labelled, tainted nodes; every pod shares a Hugging Face cache volume and takes its
secrets from Kubernetes; a serving pod is ready only while epd's /health answers; the image
comes from a registry that scripts/push_image builds, pushes and renders into the manifest.
Nothing here starts a cluster: a real KubeRay deployment is not exercised."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft4Validator

from cluster.app import app_builder
from cluster.config import REPO_ROOT, SERVE_CONFIG, load_config
from cluster.placement import NodeShape, unplaceable

KUBERAY = REPO_ROOT / "cluster" / "kuberay"
MANIFEST = KUBERAY / "rayservice.yaml"
CRD_SCHEMA = Path(__file__).parent / "data" / "kuberay-v1.7.0-rayservice-v1-schema.json"
IMAGE_PLACEHOLDER = "${REGISTRY}/epd:${TAG}"
HF_CACHE = "/home/ray/.cache/huggingface"
# RayServiceSpec fields KubeRay marks "Deprecated: This field is not used anymore" (kuberay#1685,
# ray-operator/apis/ray/v1/rayservice_types.go at v1.7.0); the schema still accepts them.
DEPRECATED_SPEC_FIELDS = {"serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"}


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _manifest() -> dict:
    return _yaml(MANIFEST)


def _serve_config_v2(manifest: dict) -> dict:
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


def _cluster(manifest: dict) -> dict:
    return manifest["spec"]["rayClusterConfig"]


def _groups(manifest: dict) -> dict[str, dict]:
    """Every pod template by group: `head` and each worker group's name."""
    cluster = _cluster(manifest)
    groups = {"head": cluster["headGroupSpec"]}
    groups.update({g["groupName"]: g for g in cluster["workerGroupSpecs"]})
    return groups


def _container(group: dict) -> dict:
    (container,) = group["template"]["spec"]["containers"]  # KubeRay's Ray container: the first
    return container


# --- the CRD's schema, as the API server and kubectl read it ---------------------------------


def _json_schema(node, *, is_schema: bool = True):
    """A Kubernetes structural schema (OpenAPI v3) as JSON Schema, read as `kubectl apply`'s
    strict field validation does: an object with `properties` rejects other fields (unless
    x-kubernetes-preserve-unknown-fields), `nullable` admits null, x-kubernetes-int-or-string
    admits both. Not evaluated: CEL rules (x-kubernetes-validations; see the test below) and
    the uniqueness of list-type map/set keys."""
    if isinstance(node, list):
        return [_json_schema(n) for n in node]
    if not isinstance(node, dict) or not is_schema:
        return node
    out = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key == "properties":
            out[key] = {name: _json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf"):
            out[key] = _json_schema(value) if not isinstance(value, bool) else value
        else:  # required, enum, default, format, pattern, ...: values, not schemas
            out[key] = value
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in node:
        out["type"] = [node["type"], "null"]
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _crd_schema() -> dict:
    return json.loads(CRD_SCHEMA.read_text())["openAPIV3Schema"]


def _validator() -> Draft4Validator:
    return Draft4Validator(_json_schema(_crd_schema()))


def _schema_errors(manifest: dict) -> list[str]:
    return sorted(
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in _validator().iter_errors(manifest)
    )


def test_the_vendored_crd_schema_says_where_it_comes_from():
    vendored = json.loads(CRD_SCHEMA.read_text())
    assert "ray-project/kuberay tag v1.7.0" in vendored["_source"]
    assert "helm-chart/kuberay-operator/crds/ray.io_rayservices.yaml" in vendored["_source"]
    spec = vendored["openAPIV3Schema"]["properties"]["spec"]
    assert {"serveConfigV2", "rayClusterConfig", "upgradeStrategy"} <= set(spec["properties"])


def test_rayservice_passes_the_crd_schema():
    assert _schema_errors(_manifest()) == []


def test_the_schema_check_rejects_what_the_api_server_or_kubectl_would():
    """The check is not vacuous: a misspelt field, a wrong type and a malformed quantity fail."""

    def broken(edit) -> list[str]:
        manifest = _manifest()
        edit(manifest)
        return _schema_errors(manifest)

    def typo(m):
        _container(_cluster(m)["workerGroupSpecs"][0])["imagePullPolcy"] = "Always"

    def replicas_as_text(m):
        _cluster(m)["workerGroupSpecs"][0]["replicas"] = "4"

    def bad_memory(m):
        _container(_cluster(m)["headGroupSpec"])["resources"]["limits"]["memory"] = "32 GB"

    def no_cluster(m):
        del m["spec"]["rayClusterConfig"]

    assert any("imagePullPolcy" in e for e in broken(typo))
    assert any("replicas" in e for e in broken(replicas_as_text))
    assert any("memory" in e for e in broken(bad_memory))
    assert any("rayClusterConfig" in e for e in broken(no_cluster))


def test_rayservice_uses_no_deprecated_field():
    spec = _crd_schema()["properties"]["spec"]["properties"]
    assert DEPRECATED_SPEC_FIELDS <= set(spec)  # the schema still takes them: hence this check
    assert DEPRECATED_SPEC_FIELDS & set(_manifest()["spec"]) == set()
    deprecated = _manifest()
    deprecated["spec"]["serviceUnhealthySecondThreshold"] = 900
    assert _schema_errors(deprecated) == []  # what the schema alone would let through


def _cel_guarded(node: dict, path: tuple = ()) -> list[tuple]:
    found = [path] if node.get("x-kubernetes-validations") else []
    for name, sub in node.get("properties", {}).items():
        found += _cel_guarded(sub, (*path, name))
    if isinstance(node.get("items"), dict):
        found += _cel_guarded(node["items"], (*path, "[]"))
    return found


def _present(doc, path: tuple) -> bool:
    if not path:
        return True
    key, rest = path[0], path[1:]
    if key == "[]":
        return isinstance(doc, list) and any(_present(d, rest) for d in doc)
    return isinstance(doc, dict) and key in doc and _present(doc[key], rest)


def test_rayservice_sets_no_field_guarded_by_a_rule_this_check_cannot_run():
    """CEL rules (x-kubernetes-validations) are the API server's; the manifest avoids them."""
    guarded = _cel_guarded(_crd_schema())
    assert ("spec", "managedBy") in guarded
    assert [p for p in guarded if _present(_manifest(), p)] == []


# --- the Serve application and the pools -----------------------------------------------------


def test_rayservice_serves_the_serve_yaml_application():
    from ray.serve.schema import ServeDeploySchema

    manifest = _manifest()
    v2 = _serve_config_v2(manifest)
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    ServeDeploySchema.model_validate(v2)
    expected = _yaml(SERVE_CONFIG)
    expected["applications"][0]["args"]["config"] = (
        "configs/multi_node.yaml"  # the one difference: the GPU config
    )
    assert v2 == expected
    (app,) = ServeDeploySchema.model_validate(v2).applications
    module, attr = app.import_path.split(":")
    assert getattr(__import__(module, fromlist=[attr]), attr) is app_builder


def test_proxies_run_where_kuberay_probes_for_them():
    """KubeRay's RayService readiness looks for a Serve proxy on the pod (kuberay#4994):
    HeadOnly leaves none on the workers."""
    assert _serve_config_v2(_manifest())["proxy_location"] == "EveryNode"
    assert _yaml(SERVE_CONFIG)["proxy_location"] == "EveryNode"


def test_rayservice_worker_groups_hold_the_pinned_pools():
    manifest = _manifest()
    cluster = _cluster(manifest)
    assert cluster["rayVersion"] == __import__("ray").__version__
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
    shapes = []
    for group in cluster["workerGroupSpecs"]:
        limits = _container(group)["resources"]["limits"]
        custom = json.loads(
            json.loads(group["rayStartParams"]["resources"])
        )  # KubeRay's quoted JSON string
        shapes.append(
            NodeShape(
                group["groupName"],
                {
                    "CPU": float(limits["cpu"]),
                    "GPU": float(limits.get("nvidia.com/gpu", 0)),
                    **custom,
                },
                group["minReplicas"],
            )
        )
    config = REPO_ROOT / _serve_config_v2(manifest)["applications"][0]["args"]["config"]
    assert unplaceable(load_config(config), shapes) == []


_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9, "": 1}


def _bytes(quantity: str) -> float:
    number, unit = re.fullmatch(r"([0-9.]+)([KMG]i?|)", str(quantity)).groups()
    return float(number) * _UNITS[unit]


def test_gpu_pods_hold_the_published_model_and_fit_their_nodes():
    """A worker stages the bfloat16 weights of configs/multi_node.yaml's 3B model (~7.5 GB) in
    host memory before its GPU takes them, beside torch/CUDA and Ray's object store (30% of the
    pod): 24 GiB at least. The header's nodes (8 vCPU, 32 GiB) leave ~29 GiB to pods."""
    assert "3B" in load_config(REPO_ROOT / "configs" / "multi_node.yaml").model.checkpoint
    for name, group in _groups(_manifest()).items():
        resources = _container(group)["resources"]
        assert resources["requests"] == resources["limits"], name  # Guaranteed QoS
        if name == "head":
            continue
        memory, cpu = _bytes(resources["limits"]["memory"]), float(resources["limits"]["cpu"])
        assert 24 * 2**30 <= memory <= 29 * 2**30 and cpu <= 7.5, name


# --- where the pods land, what they mount, what they read -------------------------------------


def test_gpu_groups_are_pinned_to_labelled_tainted_nodes():
    manifest, text = _manifest(), MANIFEST.read_text()
    gpu_taint = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    pools = set()
    for name, group in _groups(manifest).items():
        spec = group["template"]["spec"]
        if name == "head":  # a CPU pod: no GPU, and kept off the GPU nodes by their taint
            assert "nvidia.com/gpu" not in _container(group)["resources"]["limits"]
            assert gpu_taint not in spec.get("tolerations", [])
            continue
        assert _container(group)["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert gpu_taint in spec["tolerations"], name
        ((key, pool),) = spec["nodeSelector"].items()
        assert key == "epd/pool" and f"kubectl label node NODE epd/pool={pool}" in text, name
        pools.add(pool)
    assert pools == {"encoder", "llm"}  # one label value per group


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def test_pods_share_a_hugging_face_cache_and_take_secrets_from_kubernetes():
    for name, group in _groups(_manifest()).items():
        container, spec = _container(group), group["template"]["spec"]
        env = _env(container)
        assert env["HF_HOME"]["value"] == HF_CACHE, name
        mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volume = {v["name"]: v for v in spec["volumes"]}["hf-cache"]
        assert mount["hf-cache"] == HF_CACHE and volume["emptyDir"]["sizeLimit"], name
        token = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert token["optional"] is True, name  # the shipped model is not gated
        key = env["EPD_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert key["optional"] is False, name  # no key secret: the pod waits, not an open API
    assert 'os.environ.get("EPD_API_KEY")' in (REPO_ROOT / "cluster" / "prepare.py").read_text()
    assert f"ENV HF_HOME={HF_CACHE}" in (KUBERAY / "Dockerfile").read_text()


# --- readiness: epd's /health on the serving pods ---------------------------------------------


def _probe_script(group: dict) -> str:
    command = _container(group)["readinessProbe"]["exec"]["command"]
    assert command[:2] == ["python", "-c"]
    return command[2]


class _Stub(BaseHTTPRequestHandler):
    status: dict[str, int] = {}

    def do_GET(self):
        code = self.status.get(self.path, 200)
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"success" if code == 200 else b"unavailable")

    def log_message(self, *args):
        pass


@pytest.fixture
def stub_pod():
    """One local server standing in for a pod's dashboard agent and Serve proxy."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_serving_pods_are_ready_only_while_health_answers(stub_pod):
    """The worker groups replace KubeRay's readiness probe (injected only where none is set):
    the node's Ray health, the pod's Serve proxy and epd's /health on the Serve port must all
    answer. The head keeps KubeRay's: the Serve app is submitted only once the head is Ready."""
    from cluster.api_key import GUARDED

    manifest = _manifest()
    port = _serve_config_v2(manifest)["http_options"]["port"]
    assert not "/health".startswith(GUARDED)  # open without the API key
    groups = _groups(manifest)
    assert "readinessProbe" not in _container(groups.pop("head"))
    scripts = {_probe_script(group) for group in groups.values()}
    (script,) = scripts  # the same probe on every worker group
    for url in (
        "http://localhost:52365/api/healthz",
        f"http://localhost:{port}/-/healthz",
        f"http://localhost:{port}/health",
    ):
        assert url in script
    for group in groups.values():
        assert {"containerPort": port, "name": "serve"} in _container(group)["ports"]
    local = re.sub(r"localhost:\d+", f"127.0.0.1:{stub_pod.server_port}", script)

    def probe(**status: int) -> subprocess.CompletedProcess:
        _Stub.status = {f"/{path.replace('_', '/')}": code for path, code in status.items()}
        return subprocess.run(
            [sys.executable, "-c", local], capture_output=True, text=True, timeout=30
        )

    assert probe().returncode == 0
    unhealthy = probe(health=503)  # a stage without a healthy worker
    assert unhealthy.returncode == 1 and "/health: HTTP Error 503" in unhealthy.stderr
    assert probe(**{"-_healthz": 503}).returncode == 1  # the pod's proxy draining
    assert probe(api_healthz=503).returncode == 1  # the node's raylet gone


# --- the image --------------------------------------------------------------------------------


def test_every_pod_runs_the_registry_image_placeholder():
    images = {_container(g)["image"] for g in _groups(_manifest()).values()}
    assert images == {IMAGE_PLACEHOLDER}


def _push_image(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("REGISTRY", "TAG", "OUT")}
    return subprocess.run(
        [str(REPO_ROOT / "scripts" / "push_image"), *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_push_image_renders_the_manifest_with_the_pushed_image(tmp_path):
    out = tmp_path / "rayservice.yaml"
    done = _push_image(
        "--render-only", REGISTRY="registry.example.com/team", TAG="t1", OUT=str(out)
    )
    assert done.returncode == 0, done.stderr
    rendered = _yaml(out)
    image = "registry.example.com/team/epd:t1"
    assert {_container(g)["image"] for g in _groups(rendered).values()} == {image}
    assert yaml.safe_load(out.read_text().replace(image, IMAGE_PLACEHOLDER)) == _manifest()
    assert _schema_errors(rendered) == []
    refused = _push_image("--render-only")
    assert refused.returncode == 2 and "set REGISTRY" in refused.stderr
    bad = _push_image("--render-only", REGISTRY="Registry.Example.com", TAG="t1")
    assert bad.returncode == 2 and "is not a registry" in bad.stderr


def test_dockerfile_sets_up_epd_for_serving_without_the_model():
    text = (KUBERAY / "Dockerfile").read_text()
    ray_version = _cluster(_manifest())["rayVersion"]
    assert f"FROM rayproject/ray:{ray_version}-py311-gpu" in text
    assert "./scripts/setup --serve" in text  # no test tools in the image
    assert "build-model" not in text  # the pods fetch the model into their cache volume
    build = (REPO_ROOT / "scripts" / "push_image").read_text()
    assert "-f cluster/kuberay/Dockerfile" in build and 'push "$image"' in build
