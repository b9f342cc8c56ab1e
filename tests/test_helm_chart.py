"""The Helm chart (deploy/helm/specmesh), linted and rendered by Helm itself.

helm-python-sdk binds Helm's Go SDK (v4) through a bundled shared library, so
`helm lint` and `helm template` run here offline, without a helm binary or a
cluster. Each test renders the chart for the default (development) values or
for deploy/helm/values-production.yaml, parses the manifests and checks how
the three tiers are wired.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

if os.environ.get("CI"):
    import helm_python as helm  # CI installs the dev extra: a missing SDK is a failure there
else:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "specmesh"
PRODUCTION = ROOT / "deploy" / "helm" / "values-production.yaml"
RELEASE, NAMESPACE = "sm", "specmesh"
FULLNAME = f"{RELEASE}-specmesh"
TIERS = {
    "orchestrator": ("specmesh.v1.Orchestrator", 50051),
    "draft": ("specmesh.v1.Draft", 50061),
    "verifier": ("specmesh.v1.Verifier", 50062),
}
GPU = "nvidia.com/gpu"
# The gRPC tiers above plus the OpenAI-compatible HTTP gateway (on by default).
SCALED = {*TIERS, "gateway"}


def production_values() -> dict:
    # Parsed by Helm's own YAML reader, exactly as `-f values-production.yaml`.
    return helm.values_from_yaml(PRODUCTION.read_text())


def render(values: dict | None = None, release: str = RELEASE) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values or {}, name=release, namespace=NAMESPACE, is_install=True)
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc["__template__"] = path
                docs.append(doc)
    return docs


def notes(values: dict | None = None) -> str:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return manifests["specmesh/templates/NOTES.txt"]


def of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def tier_of(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def container(deployment: dict, name: str | None = None) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    if name is None:
        name = tier_of(deployment)
    return next(c for c in containers if c["name"] == name)


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def pods(docs: list[dict]) -> list[tuple[str, dict]]:
    """(name, pod spec) of every workload and test pod in the render."""
    out = [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in docs if d["kind"] == "Deployment"]
    out += [(d["metadata"]["name"], d["spec"]) for d in docs if d["kind"] == "Pod"]
    return out


@pytest.fixture(scope="module")
def dev() -> list[dict]:
    return render()


@pytest.fixture(scope="module")
def prod() -> list[dict]:
    return render(production_values())


@pytest.fixture(params=["dev", "prod"])
def docs(request) -> list[dict]:
    return request.getfixturevalue(request.param)


# --------------------------------------------------------------------- lint


@pytest.mark.parametrize("which", ["default", "production"])
def test_chart_lints_clean_in_strict_mode(which):
    values = production_values() if which == "production" else None
    report = helm.lint(CHART, values, strict=True, kube_version="v1.30.0")
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    # Severity 2 = warning, 3 = error; only info (e.g. "icon is recommended") is allowed.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_chart_metadata():
    with helm.Chart.load(CHART) as chart:
        meta = chart.metadata
        assert meta["apiVersion"] == "v2"
        assert meta["name"] == "specmesh"
        assert chart.schema is not None  # values.schema.json ships with the chart


def test_schema_rejects_bad_values():
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmError, match="verifier/gpu"):
            chart.render({"verifier": {"gpu": "one"}}, name=RELEASE)
        with pytest.raises(helm.HelmError, match="logFormat"):
            chart.render({"logFormat": "xml"}, name=RELEASE)


# ------------------------------------------------------------------ tiers


def test_one_deployment_and_service_per_tier(docs):
    deployments, services = of_kind(docs, "Deployment"), of_kind(docs, "Service")
    for tier, (_, port) in TIERS.items():
        name = f"{FULLNAME}-{tier}"
        assert tier_of(deployments[name]) == tier
        svc = services[name]
        assert svc["spec"]["selector"] == deployments[name]["spec"]["selector"]["matchLabels"]
        assert svc["spec"]["selector"]["app.kubernetes.io/component"] == tier
        ports = {p["name"]: p for p in svc["spec"]["ports"]}
        assert ports["grpc"]["port"] == port and ports["grpc"]["targetPort"] == "grpc"
        assert ports["metrics"]["port"] == 9464
        c = container(deployments[name])
        assert c["command"] == ["specmesh", "serve", tier]
        cports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert cports == {"grpc": port, "metrics": 9464}
        env = env_of(c)
        assert env["SPECMESH_PORT"]["value"] == str(port)
        assert env["SPECMESH_METRICS_PORT"]["value"] == "9464"
        assert env["SPECMESH_CACHE_DIR"]["value"] == "/var/cache/specmesh"


def test_every_tier_has_grpc_probes_on_its_own_port_and_service(docs):
    deployments = of_kind(docs, "Deployment")
    for tier, (service, port) in TIERS.items():
        c = container(deployments[f"{FULLNAME}-{tier}"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            kind = set(c[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"}
            if kind == {"exec"}:   # with TLS (production): the same health check, over TLS, by specmesh_cli.probe
                command = c[probe]["exec"]["command"]
                assert command[:3] == ["python", "-m", "specmesh_cli.probe"], (tier, probe)
                c[probe]["grpc"] = {"port": int(command[command.index("--port") + 1]),
                                    "service": command[command.index("--service") + 1]}
            else:
                assert kind == {"grpc"}, (tier, probe)
            assert c[probe]["grpc"]["port"] == port
        # Readiness and startup wait for the model (the tier's service turns SERVING once loaded).
        assert c["readinessProbe"]["grpc"]["service"] == service
        assert c["startupProbe"]["grpc"]["service"] == service
        # Model loading can take minutes: the startup probe allows for it.
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_orchestrator_startup_waits_as_long_as_the_verifier_loads(docs):
    # The orchestrator turns SERVING only after every verifier address answers.
    deployments = of_kind(docs, "Deployment")

    def allowance(tier):
        p = container(deployments[f"{FULLNAME}-{tier}"])["startupProbe"]
        return p["periodSeconds"] * p["failureThreshold"]

    assert allowance("orchestrator") >= allowance("verifier")


def test_termination_grace_covers_the_drain(docs):
    for d in of_kind(docs, "Deployment").values():
        if tier_of(d) not in TIERS:
            continue
        spec = d["spec"]["template"]["spec"]
        sleep = int(container(d)["lifecycle"]["preStop"]["exec"]["command"][1])
        # Services drain in-flight calls for 30 s after SIGTERM.
        assert spec["terminationGracePeriodSeconds"] >= sleep + 30


# -------------------------------------------------------------------- GPU


def gpu_mentions(obj) -> bool:
    return GPU in yaml.safe_dump(obj)


def test_gpu_only_on_the_verifier(docs):
    for d in docs:
        if d["kind"] == "Deployment" and tier_of(d) == "verifier":
            continue
        assert not gpu_mentions(d), f"{d['kind']} {d['metadata']['name']} mentions {GPU}"


def test_dev_install_runs_the_verifier_on_cpu(dev):
    v = of_kind(dev, "Deployment")[f"{FULLNAME}-verifier"]
    assert not gpu_mentions(v)
    assert env_of(container(v))["SPECMESH_DEVICE"]["value"] == "cpu"


def test_production_verifier_gets_a_gpu_on_gpu_nodes(prod):
    v = of_kind(prod, "Deployment")[f"{FULLNAME}-verifier"]
    c = container(v)
    assert c["resources"]["limits"][GPU] == 1
    assert env_of(c)["SPECMESH_DEVICE"]["value"] == "cuda"
    assert "specmesh-cuda" in c["image"]
    spec = v["spec"]["template"]["spec"]
    assert spec["nodeSelector"]
    assert any(t.get("key") == GPU for t in spec["tolerations"])
    # The other tiers stay on the CPU image and off the GPU nodes.
    for tier in ("orchestrator", "draft"):
        d = of_kind(prod, "Deployment")[f"{FULLNAME}-{tier}"]
        assert "specmesh-cuda" not in container(d)["image"]
        assert "tolerations" not in d["spec"]["template"]["spec"]


def test_a_gpu_request_outside_the_verifier_is_refused():
    for tier in ("orchestrator", "draft"):
        with pytest.raises(helm.HelmError, match="only the verifier tier may use GPUs"):
            render({tier: {"resources": {"limits": {GPU: 1}}}})


def test_verifier_gpu_count_is_configurable():
    docs = render({"verifier": {"gpu": 2}})
    c = container(of_kind(docs, "Deployment")[f"{FULLNAME}-verifier"])
    assert c["resources"]["limits"][GPU] == 2 and c["resources"]["requests"][GPU] == 2
    assert env_of(c)["SPECMESH_DEVICE"]["value"] == "cuda"
    # Memory limits given in values survive the GPU merge.
    assert c["resources"]["limits"]["memory"] == "4Gi"


# ----------------------------------------------------------- orchestrator


def service_port(docs: list[dict], name: str) -> int:
    svc = of_kind(docs, "Service")[name]
    return next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")


def test_orchestrator_dials_the_rendered_draft_and_verifier_services(docs):
    deployments, services = of_kind(docs, "Deployment"), of_kind(docs, "Service")
    env = env_of(container(deployments[f"{FULLNAME}-orchestrator"]))
    for var, tier in (("SPECMESH_DRAFT_ADDRS", "draft"), ("SPECMESH_VERIFIER_ADDRS", "verifier")):
        addrs = env[var]["value"].split(",")
        assert addrs, var
        for addr in addrs:
            host, port = addr.rsplit(":", 1)
            assert host in services, f"{var} names {host}, which is not a rendered Service"
            assert tier_of(services[host]) == tier
            assert int(port) == service_port(docs, host) == TIERS[tier][1]
    # Orchestrator and verifier agree on the target model (tokenizer vs weights).
    verifier_env = env_of(container(deployments[f"{FULLNAME}-verifier"]))
    assert env["SPECMESH_MODEL"]["value"] == verifier_env["SPECMESH_MODEL"]["value"]


def test_dev_orchestrator_uses_the_bundled_redis(dev):
    deployments, services = of_kind(dev, "Deployment"), of_kind(dev, "Service")
    env = env_of(container(deployments[f"{FULLNAME}-orchestrator"]))
    url = env["REDIS_URL"]["value"]
    assert url.startswith("redis://")
    host, port = url.removeprefix("redis://").split("/")[0].split(":")
    redis_svc = services[host]
    assert tier_of(redis_svc) == "redis"
    assert int(port) == redis_svc["spec"]["ports"][0]["port"] == 6379
    redis = deployments[f"{FULLNAME}-redis"]
    assert redis["spec"]["replicas"] == 1
    assert container(redis, "redis")["image"].startswith("redis:")
    assert redis_svc["spec"]["selector"] == redis["spec"]["selector"]["matchLabels"]
    # A password by default (generated, in a Secret): Redis holds every prompt and output.
    ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] in of_kind(dev, "Secret") and "--requirepass" in container(redis, "redis")["args"]
    assert "--protected-mode" not in container(redis, "redis")["args"]
    off = env_of(container(of_kind(render({"redis": {"auth": {"enabled": False}}}), "Deployment")[
        f"{FULLNAME}-orchestrator"]))
    assert "REDIS_PASSWORD" not in off   # only when switched off


def test_bundled_redis_password_reaches_both_sides():
    docs = render({"redis": {"auth": {"password": "s3cret"}}})
    secrets = of_kind(docs, "Secret")
    secret = secrets[f"{FULLNAME}-redis"]
    deployments = of_kind(docs, "Deployment")
    orch_env = env_of(container(deployments[f"{FULLNAME}-orchestrator"]))
    ref = orch_env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == f"{FULLNAME}-redis" and ref["key"] in secret["data"]
    redis = container(deployments[f"{FULLNAME}-redis"], "redis")
    assert "--requirepass" in redis["args"]
    assert env_of(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == ref
    assert "s3cret" not in yaml.safe_dump(deployments[f"{FULLNAME}-orchestrator"])


def test_production_uses_external_redis_with_a_secret_password(prod):
    deployments = of_kind(prod, "Deployment")
    assert f"{FULLNAME}-redis" not in deployments
    assert all(tier_of(s) != "redis" for s in of_kind(prod, "Service").values())
    env = env_of(container(deployments[f"{FULLNAME}-orchestrator"]))
    values = production_values()
    assert env["REDIS_URL"]["value"] == values["externalRedis"]["url"]
    ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": values["externalRedis"]["existingSecret"],
                   "key": values["externalRedis"]["existingSecretPasswordKey"]}
    assert "Secret" not in {d["kind"] for d in prod}  # the existing Secret is not re-created


def test_external_redis_password_given_inline_becomes_a_chart_secret():
    docs = render({"redis": {"enabled": False},
                   "externalRedis": {"url": "rediss://cache.example:6380/2", "password": "pw"}})
    secret = of_kind(docs, "Secret")[f"{FULLNAME}-external-redis"]
    env = env_of(container(of_kind(docs, "Deployment")[f"{FULLNAME}-orchestrator"]))
    assert env["REDIS_URL"]["value"] == "rediss://cache.example:6380/2"
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]


def test_redis_configuration_mistakes_fail_the_render():
    with pytest.raises(helm.HelmError, match="externalRedis.url"):
        render({"redis": {"enabled": False}})
    with pytest.raises(helm.HelmError, match="redis.enabled=false"):
        render({"externalRedis": {"url": "redis://elsewhere:6379/0"}})


# ------------------------------------------------------------- autoscaling


def test_no_hpa_pdb_or_servicemonitor_by_default(dev):
    kinds = {d["kind"] for d in dev}
    assert "HorizontalPodAutoscaler" not in kinds
    assert "PodDisruptionBudget" not in kinds
    assert "ServiceMonitor" not in kinds
    for d in of_kind(dev, "Deployment").values():
        assert d["spec"]["replicas"] == 1


def test_production_hpas_target_the_right_deployments(prod):
    deployments = of_kind(prod, "Deployment")
    hpas = of_kind(prod, "HorizontalPodAutoscaler")
    assert {tier_of(h) for h in hpas.values()} == SCALED
    for hpa in hpas.values():
        assert hpa["apiVersion"] == "autoscaling/v2"
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["apiVersion"] == "apps/v1"
        target = deployments[ref["name"]]
        assert tier_of(target) == tier_of(hpa)
        # The HPA owns the replica count.
        assert "replicas" not in target["spec"]
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        assert hpa["spec"]["metrics"]
    by_tier = {tier_of(h): h for h in hpas.values()}
    orch_metrics = {m["type"] for m in by_tier["orchestrator"]["spec"]["metrics"]}
    assert orch_metrics == {"Resource", "Pods"}
    verifier_metrics = by_tier["verifier"]["spec"]["metrics"]
    assert [m["pods"]["metric"]["name"] for m in verifier_metrics if m["type"] == "Pods"] == [
        "specmesh_verifier_queue_depth"]


def test_hpa_cpu_only_without_custom_metrics():
    values = production_values()
    values["autoscaling"]["customMetrics"]["enabled"] = False
    values["verifier"]["autoscaling"]["targetCPUUtilizationPercentage"] = 80
    hpas = of_kind(render(values), "HorizontalPodAutoscaler")
    for hpa in hpas.values():
        assert [m["type"] for m in hpa["spec"]["metrics"]] == ["Resource"]
        assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"


def test_an_hpa_without_any_metric_is_refused():
    values = production_values()
    values["autoscaling"]["customMetrics"]["enabled"] = False  # verifier has CPU disabled in production
    with pytest.raises(helm.HelmError, match="verifier.autoscaling: no metric"):
        render(values)


def test_production_pdbs_select_their_tier(prod):
    deployments = {tier_of(d): d for d in of_kind(prod, "Deployment").values()}
    pdbs = of_kind(prod, "PodDisruptionBudget")
    assert {tier_of(p) for p in pdbs.values()} == SCALED
    for pdb in pdbs.values():
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert selector == deployments[tier_of(pdb)]["spec"]["selector"]["matchLabels"]
        assert ("minAvailable" in pdb["spec"]) != ("maxUnavailable" in pdb["spec"])


# -------------------------------------------------------------- monitoring


def test_servicemonitor_only_when_enabled(dev, prod):
    assert of_kind(dev, "ServiceMonitor") == {}
    (sm,) = of_kind(prod, "ServiceMonitor").values()
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    # It selects exactly the tier Services (and the gateway's), each of which has a metrics port.
    selected = [s for s in of_kind(prod, "Service").values()
                if all(s["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
                and tier_of(s) in sm["spec"]["selector"]["matchExpressions"][0]["values"]]
    assert {tier_of(s) for s in selected} == SCALED
    assert all(any(p["name"] == "metrics" for p in s["spec"]["ports"]) for s in selected)


# ---------------------------------------------------------------- security


def test_every_pod_runs_restricted(docs):
    assert pods(docs)
    for name, spec in pods(docs):
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True, name
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec.get("automountServiceAccountToken") is False, name
        assert "hostPath" not in yaml.safe_dump(spec.get("volumes", [])), name
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            assert "add" not in sc["capabilities"], (name, c["name"])
            assert sc.get("privileged", False) is False, (name, c["name"])
            assert sc.get("runAsNonRoot", psc["runAsNonRoot"]) is True, (name, c["name"])


def test_specmesh_pods_run_as_uid_10001_with_writable_tmp_and_cache(docs):
    for d in of_kind(docs, "Deployment").values():
        if tier_of(d) not in TIERS:
            continue
        spec = d["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsUser"] == 10001
        mounts = {m["mountPath"]: m["name"] for m in container(d)["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]]
        assert mounts["/var/cache/specmesh"] in volumes


def test_serviceaccount_is_shared_and_mounts_no_token(docs):
    (sa,) = of_kind(docs, "ServiceAccount").values()
    assert sa["automountServiceAccountToken"] is False
    for d in of_kind(docs, "Deployment").values():
        if tier_of(d) in TIERS:
            assert d["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


# ------------------------------------------------------------------ models


def test_production_mounts_the_model_claim_read_only_in_every_tier(prod):
    values = production_values()
    for d in of_kind(prod, "Deployment").values():
        if tier_of(d) not in TIERS:   # the gateway holds no model
            continue
        spec = d["spec"]["template"]["spec"]
        claim = next(v for v in spec["volumes"] if v["name"] == "models")
        assert claim["persistentVolumeClaim"] == {"claimName": values["models"]["existingClaim"], "readOnly": True}
        mount = next(m for m in container(d)["volumeMounts"] if m["name"] == "models")
        assert mount["mountPath"] == "/models" and mount["readOnly"] is True
    env = env_of(container(of_kind(prod, "Deployment")[f"{FULLNAME}-draft"]))
    assert env["SPECMESH_DRAFT_MODEL"]["value"].startswith("/models/")


def test_dev_has_no_model_claim_and_seeds_the_cache_from_the_image(dev):
    for d in of_kind(dev, "Deployment").values():
        if tier_of(d) not in TIERS:
            continue
        spec = d["spec"]["template"]["spec"]
        assert all("persistentVolumeClaim" not in v for v in spec["volumes"])
        (init,) = spec["initContainers"]
        assert init["image"] == container(d)["image"]
        assert "/opt/specmesh/cache" in init["command"][-1]
    assert "SPECMESH_DRAFT_MODEL" not in env_of(container(of_kind(dev, "Deployment")[f"{FULLNAME}-draft"]))


# -------------------------------------------------------------------- misc


def test_network_policies_let_only_the_orchestrator_reach_the_backends(prod):
    policies = of_kind(prod, "NetworkPolicy")
    orchestrator_labels = of_kind(prod, "Deployment")[f"{FULLNAME}-orchestrator"]["spec"]["selector"]["matchLabels"]
    for tier in ("draft", "verifier"):
        grpc_rule = policies[f"{FULLNAME}-{tier}"]["spec"]["ingress"][0]
        assert grpc_rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
        assert grpc_rule["from"] == [{"podSelector": {"matchLabels": orchestrator_labels}}]


def test_notes_explain_how_to_call_the_orchestrator():
    text = notes()
    assert f"port-forward svc/{FULLNAME}-orchestrator 50051:50051" in text
    assert "grpcurl -plaintext" in text and "specmesh.v1.Orchestrator/Generate" in text
    assert "specmesh generate --addr localhost:50051" in text


def test_long_release_names_keep_resource_names_valid():
    docs = render(release="a-very-long-release-name-for-a-specmesh-deployment-x")
    for d in docs:
        name = d["metadata"]["name"]
        assert len(name) <= 63, name


def test_tier_settings_render_as_their_environment_variables():
    docs = render({"draft": {"settings": {"max_k": 6, "ngram_min": 3}},
                   "orchestrator": {"settings": {"session_ttl_s": 900}}})
    deployments = of_kind(docs, "Deployment")
    draft_env = env_of(container(deployments[f"{FULLNAME}-draft"]))
    assert draft_env["SPECMESH_MAX_K"]["value"] == "6" and draft_env["SPECMESH_NGRAM_MIN"]["value"] == "3"
    assert env_of(container(deployments[f"{FULLNAME}-orchestrator"]))["SPECMESH_SESSION_TTL_S"]["value"] == "900"


def test_draft_trees_are_cut_by_what_the_verifier_measures_unless_the_draft_settings_say(dev, prod):
    """The orchestrator chooses each session's cut from the verifier's measured cost (orchestrator/tree_cut.py),
    on a CPU or a GPU alike: the chart sets none, and a tree_min_confidence in the draft's settings, which
    then wins over the orchestrator's, is rendered once."""
    def draft_env(docs):
        deployment = of_kind(docs, "Deployment")[f"{FULLNAME}-draft"]
        names = [e["name"] for e in container(deployment).get("env", [])]
        assert names.count("SPECMESH_TREE_MIN_CONFIDENCE") <= 1
        return env_of(container(deployment))

    assert "SPECMESH_TREE_MIN_CONFIDENCE" not in draft_env(dev)
    assert "SPECMESH_TREE_MIN_CONFIDENCE" not in draft_env(prod)
    chosen = render({"draft": {"settings": {"tree_min_confidence": 0.05}}})
    assert draft_env(chosen)["SPECMESH_TREE_MIN_CONFIDENCE"]["value"] == "0.05"


def test_a_setting_the_tier_does_not_have_is_refused():
    with pytest.raises(helm.HelmError, match="settings"):
        render({"draft": {"settings": {"max_batch": 4}}})   # a verifier setting
    with pytest.raises(helm.HelmError, match="settings"):
        render({"orchestrator": {"settings": {"redis_url": "redis://elsewhere"}}})   # wired by the chart


# ------------------------------------------------------------------ gateway


def test_gateway_deployment_service_and_probes(dev):
    deployments, services = of_kind(dev, "Deployment"), of_kind(dev, "Service")
    d = deployments[f"{FULLNAME}-gateway"]
    c = container(d)
    assert c["command"] == ["specmesh", "serve", "gateway"]
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("http", 8000)]
    env = env_of(c)
    # It dials the orchestrator Service on its gRPC port.
    host, port = env["SPECMESH_ORCHESTRATOR_ADDR"]["value"].split(":")
    assert host == f"{FULLNAME}-orchestrator" and int(port) == service_port(dev, host) == TIERS["orchestrator"][1]
    assert env["SPECMESH_HTTP_PORT"]["value"] == "8000"
    # Readiness follows the orchestrator (/health); liveness and startup only this process (/ping).
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/ping", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/ping", "port": "http"}
    # No model, no GPU, no cache volume.
    assert all(v["name"] != "models" and v["name"] != "cache" for v in d["spec"]["template"]["spec"]["volumes"])
    assert GPU not in str(c.get("resources", {}))
    svc = services[f"{FULLNAME}-gateway"]
    assert svc["spec"]["selector"] == d["spec"]["selector"]["matchLabels"]
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["http"]["port"] == 8000 and ports["http"]["targetPort"] == "http"
    assert ports["metrics"]["targetPort"] == "http"   # /metrics shares the HTTP port
    assert d["spec"]["replicas"] == 1
    assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 30 + 5


def test_gateway_hpa_and_pdb_in_production(prod):
    hpa = of_kind(prod, "HorizontalPodAutoscaler")[f"{FULLNAME}-gateway"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{FULLNAME}-gateway"
    assert "replicas" not in of_kind(prod, "Deployment")[f"{FULLNAME}-gateway"]["spec"]
    assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"] == [
        "specmesh_gateway_active_streams"]
    assert f"{FULLNAME}-gateway" in of_kind(prod, "PodDisruptionBudget")
    # With ingressFrom restricting the orchestrator, the gateway pods are still let in.
    values = production_values()
    values["networkPolicy"]["ingressFrom"] = [{"namespaceSelector": {"matchLabels": {"team": "api"}}}]
    policies = of_kind(render(values), "NetworkPolicy")
    peers = policies[f"{FULLNAME}-orchestrator"]["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "specmesh", "app.kubernetes.io/instance": RELEASE,
                                            "app.kubernetes.io/component": "gateway"}}} in peers
    assert f"{FULLNAME}-gateway" in policies


def test_gateway_can_be_disabled_and_is_validated():
    docs = render({"gateway": {"enabled": False}})
    assert all(tier_of(d) != "gateway" for d in docs if d["kind"] in ("Deployment", "Service"))
    docs = render({"gateway": {"orchestratorAddr": "orch.example:50051",
                               "settings": {"served_model_name": "smol", "max_body_bytes": 8388608}}})
    env = env_of(container(of_kind(docs, "Deployment")[f"{FULLNAME}-gateway"]))
    assert env["SPECMESH_ORCHESTRATOR_ADDR"]["value"] == "orch.example:50051"
    assert env["SPECMESH_SERVED_MODEL_NAME"]["value"] == "smol"
    assert env["SPECMESH_MAX_BODY_BYTES"]["value"] == "8388608"   # an integer, not 8.388608e+06
    with pytest.raises(helm.HelmError):
        render({"gateway": {"port": "eighty"}})
    with pytest.raises(helm.HelmError):
        render({"gateway": {"settings": {"max_body_bytes": "ten"}}})
