"""Rendering and checking deploy/: each overlay through kustomize, each object against the Kubernetes
schemas of ``K8S_VERSIONS``, the rendered temper.toml and pod arguments through the services' own
config classes. Every problem is reported as ``<overlay> <Kind>/<name>: <field path>: <message>``.

Used by tests/deploy (``make deploy-check`` runs them); no cluster is needed.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import yaml
from kubernetes_validate import utils as kv_utils
from referencing import Registry, Resource

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "mtls", "scale")
# the Kubernetes versions every manifest is validated against (strict: unknown fields are errors)
K8S_VERSIONS = ("1.30.0", "1.32.0")
# custom resources without a bundled schema: checked structurally by check_strimzi instead
NO_SCHEMA_GROUPS = {"kafka.strimzi.io": "Strimzi publishes its CRD schemas only with the operator's release "
                                        "files, not in any registry reachable here"}
SERVICES = ("inference", "sandbox", "reward", "replay", "learner", "scheduler", "monitor")
GRPC_PORTS = {"inference": 50051, "sandbox": 50052, "reward": 50053, "replay": 50054, "learner": 50055,
              "scheduler": 50056, "monitor": 50057}
CONFIG_CLASSES = {"inference": "InferenceConfig", "sandbox": "SandboxConfig", "reward": "RewardConfig",
                  "replay": "ReplayConfig", "learner": "LearnerConfig", "scheduler": "SchedulerConfig",
                  "monitor": "MonitorConfig"}
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")
# the label the StatefulSet controller puts on each pod (Kubernetes >= 1.28), and the downward-API path to it
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
POD_INDEX_FIELD = f"metadata.labels['{POD_INDEX_LABEL}']"
HEALTH_PROBE = ["python", "-m", "temper.client.health"]  # the probe that can present a client certificate
# the keys of a kubernetes.io/tls Secret as cert-manager writes it (Kubernetes' contract, not Temper's)
TLS_SECRET_KEYS = {"ca.crt", "tls.crt", "tls.key"}


def kubectl() -> str:
    path = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if not path:
        raise RuntimeError("kubectl (with its built-in kustomize) is needed to render deploy/k8s: `make deploy-tools` "
                           "installs it (Debian package kubernetes-client)")
    return path


def render(directory: Path) -> list[dict]:
    """``kubectl kustomize directory`` as a list of objects (a fresh copy each call: tests edit them)."""
    return copy.deepcopy(_render(directory))


@functools.cache
def _render(directory: Path) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        where = directory.relative_to(REPO) if directory.is_relative_to(REPO) else directory
        raise AssertionError(f"kustomize {where} failed:\n{out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def ref(obj: dict) -> str:
    return f"{obj.get('kind', '?')}/{obj.get('metadata', {}).get('name', '?')}"


@dataclass
class Report:
    where: str
    errors: list[str] = field(default_factory=list)

    def add(self, obj: dict | str, path: str, message: str) -> None:
        self.errors.append(f"{self.where} {obj if isinstance(obj, str) else ref(obj)}: {path}: {message}")

    def check(self) -> None:
        assert not self.errors, f"{len(self.errors)} problem(s):\n" + "\n".join(self.errors)


# -- schemas ----------------------------------------------------------------------------------
@functools.cache
def _validator(version: str, kind: str, api_version: str) -> jsonschema.Validator | None:
    """A strict validator for ``kind`` from kubernetes-validate's bundled schemas (the files its own
    ``validate`` reads; built once here, and used with iter_errors so that every error is reported)."""
    schema_dir = f"kubernetes-json-schema/v{version}-local-strict"
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = kv_utils.schema_contents(f"{schema_dir}/{kind.lower()}-{api}.json", version)
    except FileNotFoundError:
        return None
    definitions = kv_utils.schema_contents(f"{schema_dir}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def validate_schemas(objs: list[dict], report: Report, versions=K8S_VERSIONS) -> list[str]:
    """Validate every object against the Kubernetes schemas of ``versions`` (strict: unknown fields are
    errors); returns the objects skipped, with the reason."""
    skipped = []
    for obj in objs:
        api_version = obj.get("apiVersion", "")
        group = api_version.split("/")[0] if "/" in api_version else ""
        if group in NO_SCHEMA_GROUPS:
            skipped.append(f"{ref(obj)} ({NO_SCHEMA_GROUPS[group]})")
            continue
        for version in versions:
            validator = _validator(version, obj.get("kind", ""), api_version)
            if validator is None:
                report.add(obj, "apiVersion", f"{api_version} {obj.get('kind')} has no schema in Kubernetes {version}")
                continue
            for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
                path = ".".join(str(p) for p in e.absolute_path) or "(object)"
                report.add(obj, path, f"{e.message} (Kubernetes {version} schema)")
    return skipped


def check_strimzi(objs: list[dict], report: Report) -> None:
    """What a Strimzi operator would refuse or silently mis-run: topics of another cluster, more topic
    replicas than brokers, a node pool of no cluster."""
    clusters = {o["metadata"]["name"] for o in objs if o["kind"] == "Kafka"}
    brokers = {}
    for o in objs:
        if o["kind"] not in ("KafkaNodePool", "KafkaTopic", "KafkaUser"):
            continue
        cluster = o["metadata"].get("labels", {}).get("strimzi.io/cluster")
        if cluster not in clusters:
            report.add(o, "metadata.labels.strimzi.io/cluster", f"{cluster!r} is not a Kafka here {sorted(clusters)}")
        if o["kind"] == "KafkaNodePool" and "broker" in o["spec"].get("roles", []):
            brokers[cluster] = brokers.get(cluster, 0) + int(o["spec"]["replicas"])
    for o in objs:
        if o["kind"] == "KafkaTopic":
            spec = o.get("spec", {})
            for key in ("partitions", "replicas"):
                if not isinstance(spec.get(key), int) or spec[key] < 1:
                    report.add(o, f"spec.{key}", f"must be an integer >= 1, got {spec.get(key)!r}")
            cluster = o["metadata"].get("labels", {}).get("strimzi.io/cluster")
            if isinstance(spec.get("replicas"), int) and spec["replicas"] > brokers.get(cluster, 0):
                report.add(o, "spec.replicas", f"{spec['replicas']} replicas but cluster {cluster!r} has "
                                               f"{brokers.get(cluster, 0)} broker(s)")


# -- pods -------------------------------------------------------------------------------------
def workloads(objs: list[dict]):
    for o in objs:
        if o["kind"] in WORKLOAD_KINDS:
            yield o, o["spec"]["template"]["spec"]


def service_of(container: dict) -> str | None:
    """The Temper service a container runs (by its image name temper-<service>), or None."""
    m = re.search(r"temper-([a-z]+)(?::|@|$)", container.get("image", ""))
    return m.group(1) if m else None


def container_env(container: dict, objs: list[dict]) -> dict[str, str]:
    """The environment a container gets from its ConfigMaps (envFrom) and env values (Secrets are not
    rendered: their keys are unknown here and left out)."""
    maps = {o["metadata"]["name"]: o.get("data", {}) for o in objs if o["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(maps.get(source["configMapRef"]["name"], {}))
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in e.get("valueFrom", {}):
            r = e["valueFrom"]["configMapKeyRef"]
            env[e["name"]] = maps.get(r["name"], {}).get(r["key"], "")
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == POD_INDEX_FIELD:
            env[e["name"]] = "0"  # a StatefulSet's pod index: checked as pod 0 sees it
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of command and args (unknown variables stay as they are)."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args and args.index(name) + 1 < len(args) else None


@contextmanager
def environment(env: dict[str, str]):
    """``env`` as the process environment (TEMPER_* variables of a pod reach the config classes)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update({k: v for k, v in saved.items() if not k.startswith("TEMPER_")})
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def config_class(service: str):
    """The service's own config class: temper.<service>.config if it has one, else its entry point."""
    for module in (f"temper.{service}.config", f"temper.{service}.__main__"):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        if hasattr(mod, CONFIG_CLASSES[service]):
            return getattr(mod, CONFIG_CLASSES[service])
    raise AssertionError(f"no {CONFIG_CLASSES[service]} in temper.{service}")


def check_configs(objs: list[dict], report: Report, tmp: Path) -> dict[str, object]:
    """Parse each Temper container's rendered config (temper.toml + env + args) with its service's config
    class, and the [job] table with the scheduler's JobSpec; returns the parsed configs by service."""
    from pydantic import ValidationError

    from temper.runtime.config import load_config
    from temper.runtime.errors import TemperError
    from temper.scheduler.core import JobSpec

    maps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    parsed: dict[str, object] = {}
    for obj, pod in workloads(objs):
        mounts = {v["name"]: v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v}
        for c in pod.get("containers", []):
            service = service_of(c)
            if service not in SERVICES:
                continue
            args = expand(c.get("args", []), container_env(c, objs))
            config_path = flag(args, "--config")
            mount = next((m for m in c.get("volumeMounts", [])
                          if config_path and config_path.startswith(m["mountPath"] + "/")), None)
            if mount is None or mount["name"] not in mounts:
                report.add(obj, f"containers[{c['name']}].args", f"--config {config_path} is not on a mounted ConfigMap")
                continue
            data = maps[mounts[mount["name"]]].get("data", {})
            key = config_path[len(mount["mountPath"]) + 1:]
            if key not in data:
                report.add(obj, f"volumes[{mount['name']}]", f"ConfigMap {mounts[mount['name']]} has no key {key}")
                continue
            toml_file = tmp / f"{obj['metadata']['name']}-{c['name']}.toml"
            toml_file.write_text(data[key])
            argv = ["--config", str(toml_file)] + [a for i, a in enumerate(args)
                                                  if a != "--config" and (i == 0 or args[i - 1] != "--config")]
            env = {k: v for k, v in container_env(c, objs).items() if k.startswith("TEMPER_")}
            try:
                with environment(env):
                    parsed[service] = load_config(config_class(service), argv)
            except ValidationError as e:
                for err in e.errors():
                    report.add(obj, f"temper.toml [{service}] " + ".".join(map(str, err["loc"])), err["msg"])
            except SystemExit as e:  # the CLI source rejects a flag
                report.add(obj, f"containers[{c['name']}].args", f"rejected by temper-{service}: {e}")
            try:
                job = tomllib.loads(data[key]).get("job")
            except tomllib.TOMLDecodeError as e:
                report.add(obj, f"ConfigMap {mounts[mount['name']]} {key}", f"not TOML: {e}")
                continue
            if job is not None and "job" not in parsed:
                try:
                    spec = JobSpec(**job)
                    spec.validate()
                    parsed["job"] = spec
                except TypeError as e:
                    report.add(obj, "temper.toml [job]", str(e))
                except TemperError as e:
                    report.add(obj, f"temper.toml [job] {e.field}", e.message)
    return parsed


def check_pods(objs: list[dict], report: Report) -> None:
    """Probes, requests, restricted security for all but the sandbox, entry points that exist."""
    for obj, pod in workloads(objs):
        for c in pod.get("initContainers", []) + pod.get("containers", []):
            where = f"containers[{c['name']}]"
            if not c.get("resources", {}).get("requests"):
                report.add(obj, f"{where}.resources.requests", "missing (the scheduler cannot place it)")
            command = c.get("command", [])
            if command[:2] == ["python", "-m"] and importlib.util.find_spec(command[2]) is None:
                report.add(obj, f"{where}.command", f"no module {command[2]}")
            service = service_of(c)
            sc, psc = c.get("securityContext", {}), pod.get("securityContext", {})
            if service == "sandbox":
                continue  # privileged on purpose: deploy/k8s/base/sandbox.yaml says why
            if sc.get("privileged"):
                report.add(obj, f"{where}.securityContext.privileged", "only the sandbox may be privileged")
            if service is not None or obj["metadata"]["name"] == "otel-collector":
                rules = (
                    (f"{where}.securityContext.allowPrivilegeEscalation", sc.get("allowPrivilegeEscalation") is False),
                    (f"{where}.securityContext.capabilities.drop", "ALL" in sc.get("capabilities", {}).get("drop", [])),
                    ("securityContext.runAsNonRoot", psc.get("runAsNonRoot") is True or sc.get("runAsNonRoot") is True),
                    ("securityContext.seccompProfile", psc.get("seccompProfile", {}).get("type") == "RuntimeDefault"),
                    ("automountServiceAccountToken", pod.get("automountServiceAccountToken") is False))
                for path, ok in rules:
                    if not ok:
                        report.add(obj, path, "does not meet Pod Security `restricted`")
        for c in pod.get("containers", []):
            service = service_of(c)
            if service not in GRPC_PORTS:
                continue
            port = GRPC_PORTS[service]
            args = c.get("args", [])
            if flag(args, "--port") != str(port):
                report.add(obj, f"containers[{c['name']}].args", f"--port must be {port} (the Service's)")
            if flag(args, "--host") != "0.0.0.0":
                report.add(obj, f"containers[{c['name']}].args", "--host 0.0.0.0 is needed: probes and peers use the pod IP")
            tls = tls_dir(c) is not None
            health = [*HEALTH_PROBE, f"127.0.0.1:{port}"]
            for probe in ("readinessProbe", "livenessProbe"):
                if tls and c.get(probe, {}).get("exec", {}).get("command", [])[:4] != health:
                    report.add(obj, f"containers[{c['name']}].{probe}", f"must be an exec probe of `{' '.join(health)}` "
                                                                       "(mTLS: a gRPC probe has no client certificate)")
                elif not tls and c.get(probe, {}).get("grpc", {}).get("port") != port:
                    report.add(obj, f"containers[{c['name']}].{probe}", f"must be a gRPC health probe on {port}")


def check_topology(objs: list[dict], parsed: dict, report: Report) -> None:
    """The cross-object wiring that no schema sees."""
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    pods = [(o, o["spec"]["template"]) for o in objs if o["kind"] in WORKLOAD_KINDS]

    def labels_match(selector: dict, labels: dict) -> bool:
        return all(labels.get(k) == v for k, v in selector.items())

    def pod_labels(o: dict, tpl: dict) -> list[dict]:
        """The labels of the workload's pods: a StatefulSet's each get their index (POD_INDEX_LABEL)."""
        labels = tpl["metadata"].get("labels", {})
        if o["kind"] != "StatefulSet":
            return [labels]
        return [{**labels, POD_INDEX_LABEL: str(i)} for i in range(int(o["spec"].get("replicas", 1)))]

    for s in services.values():
        if not any(labels_match(s["spec"].get("selector", {}), labels) for o, t in pods for labels in pod_labels(o, t)):
            report.add(s, "spec.selector", "selects no pod template")

    def address(owner: str, path: str, addr: str) -> None:
        from temper.client.shards import shard_addresses

        if len(shard_addresses(addr)) > 1:  # several (replay shards): each checked
            for one in shard_addresses(addr):
                address(owner, path, one)
            return
        target = addr.removeprefix("dns:///")
        host, _, port = target.rpartition(":")
        parts = host.split(".")
        name = parts[1] if len(parts) > 1 and (("StatefulSet", parts[0].rsplit("-", 1)[0]) in by) else parts[0]
        svc = services.get(name)
        if svc is None:
            report.add(owner, path, f"{addr}: no Service {name!r}")
        elif int(port) not in [p["port"] for p in svc["spec"]["ports"]]:
            report.add(owner, path, f"{addr}: Service {name} has no port {port}")
        if len(parts) > 1 and parts[0] != name:  # pod-N.headless: the StatefulSet must use that Service
            set_name, _, index = parts[0].rpartition("-")
            sts = by.get(("StatefulSet", set_name))
            if sts is None or sts["spec"]["serviceName"] != name:
                report.add(owner, path, f"{addr}: {parts[0]} is not a pod of a StatefulSet served by {name}")
            elif not index.isdigit() or int(index) >= int(sts["spec"].get("replicas", 1)):
                report.add(owner, path, f"{addr}: StatefulSet {set_name} has {sts['spec'].get('replicas', 1)} "
                                        f"replicas: no pod {parts[0]}")
            elif svc is not None and svc["spec"].get("clusterIP") != "None":
                report.add(owner, path, f"{addr}: Service {name} is not headless: its pods have no names")

    if "reward" in parsed:
        address("temper.toml [reward]", "sandbox_address", parsed["reward"].sandbox_address)
    if "scheduler" in parsed:
        address("temper.toml [scheduler]", "inference_address", parsed["scheduler"].inference_address)
    if "learner" in parsed:
        learner = parsed["learner"]
        address("temper.toml [learner]", "replay_address", learner.replay_address)
        for i, a in enumerate(learner.inference_addresses):
            address("temper.toml [learner]", f"inference_addresses[{i}]", a)
        hpa = by.get(("HorizontalPodAutoscaler", "inference"))
        fixed = not any(a.startswith("dns:") for a in learner.inference_addresses)  # dns:///: every pod there is
        if hpa and fixed and hpa["spec"]["maxReplicas"] > len(learner.inference_addresses):
            report.add(hpa, "spec.maxReplicas", f"{hpa['spec']['maxReplicas']} replicas but the learner pushes weights "
                                                f"to {len(learner.inference_addresses)} (inference_addresses)")
        if not learner.checkpoint_url:
            report.add("temper.toml [learner]", "checkpoint_url", "empty: checkpoints would live in the pod only")
    if "replay" in parsed and not parsed["replay"].snapshot_url:
        report.add("temper.toml [replay]", "snapshot_url", "empty: snapshots would live in the pod only")

    for name in ("sandbox", "reward", "inference"):
        hpa = by.get(("HorizontalPodAutoscaler", name))
        if hpa is None:
            report.add(f"HorizontalPodAutoscaler/{name}", "(object)", "missing")
            continue
        t = hpa["spec"]["scaleTargetRef"]
        if (t["kind"], t["name"]) not in by:
            report.add(hpa, "spec.scaleTargetRef", f"no {t['kind']} {t['name']}")
    for o, tpl in pods:
        if o["kind"] == "Job" or not any(service_of(c) in SERVICES for c in tpl["spec"]["containers"]):
            continue
        labels = tpl["metadata"].get("labels", {})
        if not any(p["kind"] == "PodDisruptionBudget" and labels_match(p["spec"]["selector"]["matchLabels"], labels)
                   for p in objs):
            report.add(o, "(object)", "no PodDisruptionBudget selects its pods")
    for name in ("replay", "learner"):
        sts = by.get(("StatefulSet", name))
        if sts is None:
            report.add(f"StatefulSet/{name}", "(object)", "missing (its data needs a volume claim)")
            continue
        claims = {c["metadata"]["name"] for c in sts["spec"].get("volumeClaimTemplates", [])}
        c = sts["spec"]["template"]["spec"]["containers"][0]
        data_dir = flag(c.get("args", []), "--data-dir")
        mount = next((m for m in c.get("volumeMounts", []) if m["mountPath"] == data_dir), None)
        if mount is None or mount["name"] not in claims:
            report.add(sts, "spec.volumeClaimTemplates", f"--data-dir {data_dir} is not on a volume claim")
    check_scale(objs, parsed, report)
    classes = {o["metadata"]["name"] for o in objs if o["kind"] == "RuntimeClass"}
    used = {tpl["spec"].get("runtimeClassName") for _, tpl in pods} - {None}
    if classes - used:
        report.add(f"RuntimeClass/{sorted(classes - used)[0]}", "(object)", "no pod uses it")
    for name in used - classes:
        report.add(f"RuntimeClass/{name}", "(object)", "used by a pod but not defined")
    sandbox_policy = by.get(("NetworkPolicy", "temper-sandbox"))
    if sandbox_policy is None or sandbox_policy["spec"].get("egress") != [] \
            or "Egress" not in sandbox_policy["spec"].get("policyTypes", []):
        report.add("NetworkPolicy/temper-sandbox", "spec.egress", "the sandbox must have no egress")
    deny = by.get(("NetworkPolicy", "default-deny"))
    apps = {tpl["metadata"]["labels"].get("app") for _, tpl in pods} - {None}
    denied = set()
    if deny is not None:
        for expr in deny["spec"]["podSelector"].get("matchExpressions", []):
            denied |= set(expr.get("values", []))
    for app in sorted(a for a in apps if a.startswith("temper-") and a not in denied):
        report.add("NetworkPolicy/default-deny", "spec.podSelector", f"does not cover app={app}")


# -- scaled out: replay shards, the learner over hosts ---------------------------------------
def check_scale(objs: list[dict], parsed: dict, report: Report) -> None:
    """Replay shards and learner ranks as the code needs them: a replay StatefulSet of N pods runs
    ``--shard $(POD_INDEX)/N``, N divides the partitions of `scored`, the learner samples every shard; a
    learner StatefulSet of several pods runs torchrun with a node per pod (static rendezvous on pod 0, by a
    headless Service that publishes pods before they are ready), one rank per GPU, the `learner` Service
    sends calls to pod 0 only, and every pod mounts one ReadWriteMany checkpoint folder."""
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    replay = by.get(("StatefulSet", "replay"))
    if replay is not None:
        n = int(replay["spec"].get("replicas", 1))
        c = replay["spec"]["template"]["spec"]["containers"][0]
        shard = flag(c.get("args", []), "--shard")
        index = next((e["name"] for e in c.get("env", [])
                      if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == POD_INDEX_FIELD), None)
        if n > 1 and shard != f"$({index})/{n}":
            report.add(replay, "containers[replay].args", f"{n} replicas need --shard $(<pod index variable>)/{n} "
                                                          f"(got {shard!r}): each shard owns its partitions")
        topic = by.get(("KafkaTopic", "scored"))
        if n > 1 and topic is not None and topic["spec"].get("partitions", 0) % n:
            report.add(topic, "spec.partitions", f"{topic['spec']['partitions']} partitions: not divisible by the "
                                                 f"{n} replay shards")
        if n > 1 and "learner" in parsed:
            from temper.client.shards import shard_addresses

            hosts = {a.rpartition(":")[0] for a in shard_addresses(parsed["learner"].replay_address)}
            wanted = {f"replay-{i}.{replay['spec']['serviceName']}" for i in range(n)}
            if hosts != wanted:
                report.add("temper.toml [learner]", "replay_address", f"samples {sorted(hosts)}, but the {n} "
                                                                      f"replay shards are {sorted(wanted)}")
    learner = by.get(("StatefulSet", "learner"))
    if learner is None or int(learner["spec"].get("replicas", 1)) < 2:
        return
    n = int(learner["spec"]["replicas"])
    pod = learner["spec"]["template"]["spec"]
    c = pod["containers"][0]
    command = c.get("command", [])
    where = "containers[learner].command"
    if command[:3] != ["python", "-m", "torch.distributed.run"] or command[-2:] != ["-m", "temper.learner"]:
        report.add(learner, where, f"{n} replicas: one torchrun node each (python -m torch.distributed.run ... "
                                   "-m temper.learner), not independent learners")
        return
    headless = by.get(("Service", learner["spec"]["serviceName"]), {}).get("spec", {})
    if flag(command, "--nnodes") != str(n):
        report.add(learner, where, f"--nnodes {flag(command, '--nnodes')} but {n} replicas")
    if flag(command, "--rdzv-backend") != "static" or not re.fullmatch(r"\$\(\w+\)", flag(command, "--node-rank") or ""):
        report.add(learner, where, "--rdzv-backend static with --node-rank $(<pod index>): rank 0, the service, "
                                   "must be on pod 0, the one the learner Service calls")
    if flag(command, "--master-addr") != f"learner-0.{learner['spec']['serviceName']}":
        report.add(learner, where, f"--master-addr must be learner-0.{learner['spec']['serviceName']}")
    if headless.get("clusterIP") != "None" or headless.get("publishNotReadyAddresses") is not True:
        report.add(learner, "spec.serviceName", "must be a headless Service with publishNotReadyAddresses: true "
                                                "(the ranks meet before any is ready)")
    gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    if gpus is not None and flag(command, "--nproc-per-node") != str(gpus):
        report.add(learner, where, f"--nproc-per-node {flag(command, '--nproc-per-node')} but {gpus} GPUs per pod")
    selector = by.get(("Service", "learner"), {}).get("spec", {}).get("selector", {})
    if selector.get(POD_INDEX_LABEL) != "0":
        report.add("Service/learner", "spec.selector", f"{n} learner pods: calls must go to pod 0 (rank 0) only "
                                                       f"({POD_INDEX_LABEL}: \"0\")")
    folder = parsed["learner"].checkpoint_dir if "learner" in parsed else ""
    mount = next((m for m in c.get("volumeMounts", []) if folder and m["mountPath"] == folder), None)
    claim = next((v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", [])
                  if mount and v["name"] == mount["name"] and "persistentVolumeClaim" in v), None)
    pvc = by.get(("PersistentVolumeClaim", claim), {}).get("spec", {})
    if "ReadWriteMany" not in pvc.get("accessModes", []):
        report.add(learner, "containers[learner].volumeMounts", f"checkpoint_dir {folder!r} must be on one "
                                                                "ReadWriteMany claim every pod mounts (every rank "
                                                                "writes its shards of a checkpoint there)")


# -- mTLS -------------------------------------------------------------------------------------
def tls_dir(container: dict) -> str | None:
    """The folder a container's ``TEMPER_TLS_DIR`` names (the variable's name as the client code reads it)."""
    from temper.client.transport import TLS_DIR_ENV

    return next((e.get("value") for e in container.get("env", []) if e["name"] == TLS_DIR_ENV), None)


def identity(container: dict) -> str | None:
    """The TLS identity a Temper container needs: its service, ``submit`` for the CLI image (the submit Job)."""
    service = service_of(container)
    return "submit" if service == "cli" else service


def temper_containers(objs: list[dict], apps: set | None = None):
    """(workload, its pod spec, the pod's volumes by name, container, TLS identity, "containers[NAME]") of every
    Temper container, in workloads whose ``app`` label is in ``apps`` (None: every workload)."""
    for obj, pod in workloads(objs):
        if apps is not None and obj["spec"]["template"]["metadata"].get("labels", {}).get("app") not in apps:
            continue
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod.get("containers", []):
            name = identity(c)
            if name is not None:
                yield obj, pod, volumes, c, name, f"containers[{c['name']}]"


def check_mtls(objs: list[dict], report: Report) -> dict[str, str]:
    """Every Temper container serves and calls over mTLS: ``TEMPER_TLS_DIR`` names a read-only mount of its own
    Secret ``temper-<service>-tls`` holding, under the names the code reads (``TLS_FILES``), the CA, the
    certificate and the key, readable by the pod's user; gRPC ports probed by exec probes of the health
    module, with time for its answer. Returns {service: Secret name}."""
    from temper.client.health import main as _health_main  # noqa: F401 (the probe's module exists)
    from temper.client.transport import TLS_FILES

    secrets: dict[str, str] = {}
    for obj, pod, volumes, c, name, where in temper_containers(objs):
        folder = tls_dir(c)
        if folder is None:
            report.add(obj, f"{where}.env", "no TEMPER_TLS_DIR: this service would serve and call in plaintext")
            continue
        mount, secret = _mounted(obj, c, volumes, folder, "TEMPER_TLS_DIR", "secret", report)
        if secret is None:
            continue
        if secret["secretName"] != f"temper-{name}-tls":
            report.add(obj, f"volumes[{mount['name']}].secret.secretName",
                       f"{secret['secretName']}: each service mounts its own Secret temper-{name}-tls")
        if secret["secretName"] in secrets.values() and secrets.get(name) != secret["secretName"]:
            report.add(obj, f"volumes[{mount['name']}].secret.secretName", f"{secret['secretName']} is shared")
        secrets[name] = secret["secretName"]
        items = {i["path"]: i["key"] for i in secret.get("items", [])} or {k: k for k in TLS_SECRET_KEYS}
        if set(items) != set(TLS_FILES):
            report.add(obj, f"volumes[{mount['name']}].secret.items", f"mounts {sorted(items)} but the service reads "
                                                                      f"{sorted(TLS_FILES)} from TEMPER_TLS_DIR")
        if not set(items.values()) <= TLS_SECRET_KEYS:
            report.add(obj, f"volumes[{mount['name']}].secret.items",
                       f"keys {sorted(set(items.values()) - TLS_SECRET_KEYS)} are not in a kubernetes.io/tls Secret")
        psc = pod.get("securityContext", {})
        user = (c.get("securityContext", {}).get("runAsUser", psc.get("runAsUser", 0)))
        mode = secret.get("defaultMode", 0o644)
        if mode & 0o007:
            report.add(obj, f"volumes[{mount['name']}].secret.defaultMode", f"{mode:#o}: the key is readable by others")
        if user != 0 and (psc.get("fsGroup") is None or not mode & 0o040):
            report.add(obj, "securityContext.fsGroup", f"the Secret's files (mode {mode:#o}, root-owned) are not "
                                                       f"readable by user {user}: set fsGroup and group read")
        port = GRPC_PORTS.get(name)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe") if port else ():
            spec = c.get(probe)
            if spec is None:
                continue
            command, health = spec.get("exec", {}).get("command", []), [*HEALTH_PROBE, f"127.0.0.1:{port}"]
            if "grpc" in spec or command[:4] != health:
                report.add(obj, f"{where}.{probe}", f"must be an exec probe of `{' '.join(health)}`")
                continue
            wait = float(flag(command, "--timeout") or 2.0)  # the health module's default
            if spec.get("timeoutSeconds", 1) <= wait:
                report.add(obj, f"{where}.{probe}.timeoutSeconds", f"{spec.get('timeoutSeconds', 1)}s: the check "
                                                                  f"itself waits up to {wait}s (and starts Python)")
    check_kafka_tls(objs, report)
    return secrets


def _mounted(obj: dict, c: dict, volumes: dict, folder: str, variable: str, kind: str,
             report: Report) -> tuple[dict | None, dict | None]:
    """(mount, volume source) of the ``kind`` volume (secret | projected) mounted at ``folder``, which must be
    read-only; (None, None), reported, when there is none."""
    where = f"containers[{c['name']}]"
    mount = next((m for m in c.get("volumeMounts", []) if m["mountPath"] == folder), None)
    source = volumes.get(mount["name"], {}).get(kind) if mount else None
    if source is None:
        report.add(obj, f"{where}.volumeMounts", f"{variable}={folder} is not a mounted "
                                                 f"{'Secret' if kind == 'secret' else 'projected volume'}")
        return None, None
    if not mount.get("readOnly"):
        report.add(obj, f"{where}.volumeMounts[{mount['name']}].readOnly", "must be true")
    return mount, source


def check_kafka_tls(objs: list[dict], report: Report) -> None:
    """Kafka over mutual TLS: every listener serves TLS and authenticates clients by certificate; the pods
    dial its port (KAFKA_BOOTSTRAP); every Kafka client (an app the listener admits) has
    ``TEMPER_KAFKA_TLS_DIR`` on a read-only mount holding, under the names ``temper.runtime.kafka`` reads,
    the cluster CA's ``ca.crt`` and its own KafkaUser's ``user.crt`` / ``user.key``, readable by the pod's user
    only, and that KafkaUser exists with TLS authentication."""
    from temper.runtime.kafka import TLS_DIR_ENV as KAFKA_TLS_ENV
    from temper.runtime.kafka import TLS_FILES as KAFKA_FILES

    kafka = next((o for o in objs if o["kind"] == "Kafka"), None)
    if kafka is None:
        return
    cluster = kafka["metadata"]["name"]
    listeners = kafka["spec"]["kafka"]["listeners"]
    for i, listener in enumerate(listeners):
        if not listener.get("tls") or listener.get("authentication", {}).get("type") != "tls":
            report.add(kafka, f"spec.kafka.listeners[{i}]", f"{listener.get('name')!r} (port {listener.get('port')}): "
                                                            "must serve TLS with authentication type tls")
    endpoints = next((o.get("data", {}) for o in objs if o["kind"] == "ConfigMap"
                      and o["metadata"]["name"].startswith("temper-endpoints")), {})
    port = endpoints.get("KAFKA_BOOTSTRAP", "").rpartition(":")[2]
    if port not in {str(listener.get("port")) for listener in listeners}:
        report.add("ConfigMap/temper-endpoints", "data.KAFKA_BOOTSTRAP", f"{endpoints.get('KAFKA_BOOTSTRAP')}: no "
                                                                         "listener on that port")
    apps = {v for listener in listeners for peer in listener.get("networkPolicyPeers", [])
            for e in peer.get("podSelector", {}).get("matchExpressions", []) for v in e.get("values", [])}
    users = {o["metadata"]["name"]: o for o in objs if o["kind"] == "KafkaUser"}
    for obj, _pod, volumes, c, name, where in temper_containers(objs, apps):
        folder = next((e.get("value") for e in c.get("env", []) if e["name"] == KAFKA_TLS_ENV), None)
        if folder is None:
            report.add(obj, f"{where}.env", f"no {KAFKA_TLS_ENV}: this Kafka client would speak plaintext")
            continue
        mount, projected = _mounted(obj, c, volumes, folder, KAFKA_TLS_ENV, "projected", report)
        if projected is None:
            continue
        files = {i["path"]: (src["secret"]["name"], i["key"]) for src in projected.get("sources", [])
                 if "secret" in src for i in src["secret"].get("items", [])}
        user = f"temper-{name}"
        wanted = {KAFKA_FILES["ca"]: (f"{cluster}-cluster-ca-cert", "ca.crt"),
                  KAFKA_FILES["cert"]: (user, "user.crt"), KAFKA_FILES["key"]: (user, "user.key")}
        if files != wanted:
            report.add(obj, f"volumes[{mount['name']}].projected.sources", f"mounts {files}, but the client reads "
                                                                           f"{wanted}")
        if projected.get("defaultMode", 0o644) & 0o007:
            report.add(obj, f"volumes[{mount['name']}].projected.defaultMode", "the key is readable by others")
        if user not in users:
            report.add(obj, f"volumes[{mount['name']}]", f"no KafkaUser {user} (its Secret holds the certificate)")
        elif users[user]["spec"].get("authentication", {}).get("type") != "tls":
            report.add(f"KafkaUser/{user}", "spec.authentication.type", "must be tls")


def dialled_names(objs: list[dict], parsed: dict) -> dict[str, set[str]]:
    """{service: the host names its callers put in their TLS handshake} from the parsed configs and the submit
    Job's flags, plus 127.0.0.1 for its exec probes."""
    hosts: dict[str, set[str]] = {s: {"127.0.0.1"} for s in SERVICES}

    def add(service: str, address: str) -> None:
        hosts[service].add(address.removeprefix("dns:///").rpartition(":")[0])

    if "reward" in parsed:
        add("sandbox", parsed["reward"].sandbox_address)
    if "learner" in parsed:
        add("replay", parsed["learner"].replay_address)
        for a in parsed["learner"].inference_addresses:
            add("inference", a)
    if "scheduler" in parsed:
        add("inference", parsed["scheduler"].inference_address)
        add("reward", parsed["scheduler"].reward_address)
    if "monitor" in parsed:
        add("scheduler", parsed["monitor"].scheduler_address)
    for _, pod in workloads(objs):
        for c in pod["containers"]:
            if identity(c) == "submit":
                for service in ("scheduler", "learner"):
                    if flag(c.get("args", []), f"--{service}"):
                        add(service, flag(c["args"], f"--{service}"))
    return hosts


def check_certificates(certs: list[dict], secrets: dict[str, str], hosts: dict[str, set[str]], report: Report) -> None:
    """cert-manager objects (no schema reachable here: checked structurally) that issue every Secret the pods
    mount, from one CA, for server and client auth, naming every host its callers dial."""
    by = {(o["kind"], o["metadata"]["name"]): o for o in certs}
    issued = {o["spec"]["secretName"]: o for o in certs if o["kind"] == "Certificate" and not o["spec"].get("isCA")}
    issuers = {(o["spec"]["issuerRef"].get("kind", "Issuer"), o["spec"]["issuerRef"]["name"]) for o in issued.values()}
    if len(issuers) != 1:
        report.add("Certificate/*", "spec.issuerRef", f"one CA must sign every certificate, got {sorted(issuers)}")
    for kind, name in issuers:
        ca = by.get((kind, name), {}).get("spec", {}).get("ca", {}).get("secretName")
        if not any(o["kind"] == "Certificate" and o["spec"].get("isCA") and o["spec"]["secretName"] == ca for o in certs):
            report.add(f"{kind}/{name}", "spec.ca.secretName", f"{ca!r} is issued by no CA Certificate here")
    for service, secret in secrets.items():
        cert = issued.get(secret)
        if cert is None:
            report.add(f"Secret/{secret}", "(object)", "mounted by a pod, issued by no Certificate")
            continue
        usages = set(cert["spec"].get("usages", []))
        if not {"server auth", "client auth"} <= usages:
            report.add(cert, "spec.usages", f"{sorted(usages)}: needs server auth and client auth")
        names = set(cert["spec"].get("dnsNames", [])) | set(cert["spec"].get("ipAddresses", []))
        if hosts.get(service, set()) - names:
            report.add(cert, "spec.dnsNames",
                       f"{sorted(hosts[service] - names)} dialled by its callers, not in the certificate")
