"""The chart's locked door: TLS from a Secret or cert-manager, mutual TLS
between the tiers, token Secrets, probes that speak TLS, and production values
that close every port to all but named peers."""
from __future__ import annotations

import pytest

from tests.test_helm_chart import (FULLNAME, NAMESPACE, TIERS, container, env_of, helm, of_kind, pods,
                                   production_values, render, CHART)

CERT_MANAGER = {"tls": {"enabled": True, "certManager": {"enabled": True, "issuerRef": {"name": "internal-ca"}}}}


@pytest.fixture(scope="module")
def sealed() -> list[dict]:
    return render({**CERT_MANAGER, "auth": {"tokensSecret": "api-tokens", "internalTokenSecret": "internal"}})


def _volumes(deployment: dict) -> dict[str, dict]:
    return {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}


def _mounts(c: dict) -> dict[str, dict]:
    return {m["name"]: m for m in c.get("volumeMounts", [])}


def test_cert_manager_certificate_names_every_tier_service(sealed):
    cert = of_kind(sealed, "Certificate")[f"{FULLNAME}-tls"]
    names = cert["spec"]["dnsNames"]
    for tier in TIERS:
        assert f"{FULLNAME}-{tier}" in names and f"{FULLNAME}-{tier}.{NAMESPACE}.svc" in names
    assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])
    assert cert["spec"]["issuerRef"]["name"] == "internal-ca" and cert["spec"]["secretName"] == f"{FULLNAME}-tls"


def test_every_grpc_tier_serves_tls_and_the_backends_want_client_certificates(sealed):
    deployments = of_kind(sealed, "Deployment")
    for tier, (service, port) in TIERS.items():
        d = deployments[f"{FULLNAME}-{tier}"]
        c = container(d)
        env = env_of(c)
        assert env["SPECMESH_TLS_CERT_FILE"]["value"] == "/etc/specmesh/tls/tls.crt"
        assert env["SPECMESH_TLS_KEY_FILE"]["value"] == "/etc/specmesh/tls/tls.key"
        mutual = "SPECMESH_TLS_CLIENT_CA_FILE" in env
        assert mutual == (tier in ("draft", "verifier")), tier
        assert ("SPECMESH_TLS_CA_FILE" in env) == (tier == "orchestrator"), tier   # it checks the replicas
        # The whole folder (a subPath mount never sees a renewal), read-only.
        assert _mounts(c)["tls"] == {"name": "tls", "mountPath": "/etc/specmesh/tls", "readOnly": True}
        assert _volumes(d)["tls"]["secret"]["secretName"] == f"{FULLNAME}-tls"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = c[probe]["exec"]["command"]
            assert command[:3] == ["python", "-m", "specmesh_cli.probe"] and str(port) in command
            assert command[command.index("--server-name") + 1] == f"{FULLNAME}-{tier}"
            assert "grpc" not in c[probe]
        assert service in c["readinessProbe"]["exec"]["command"]


def test_the_gateway_gets_the_ca_and_no_private_key(sealed):
    d = of_kind(sealed, "Deployment")[f"{FULLNAME}-gateway"]
    env = env_of(container(d))
    assert env["SPECMESH_TLS_CA_FILE"]["value"] == "/etc/specmesh/tls/ca.crt"
    assert "SPECMESH_TLS_KEY_FILE" not in env and "SPECMESH_INTERNAL_TOKEN_FILE" not in env
    assert _volumes(d)["tls"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]


def test_token_secrets_go_where_they_are_checked(sealed):
    deployments = of_kind(sealed, "Deployment")
    for tier in TIERS:
        d = deployments[f"{FULLNAME}-{tier}"]
        env, volumes = env_of(container(d)), _volumes(d)
        assert env["SPECMESH_INTERNAL_TOKEN_FILE"]["value"] == "/etc/specmesh/internal/internal-token"
        assert volumes["internal-token"]["secret"]["secretName"] == "internal"
        assert ("SPECMESH_AUTH_TOKENS_FILE" in env) == (tier == "orchestrator")
        assert ("auth-tokens" in volumes) == (tier == "orchestrator")


def test_helm_test_pod_checks_the_orchestrator_over_tls(sealed):
    pod = dict(pods(sealed))[f"{FULLNAME}-test-health"]
    c = pod["containers"][0]
    assert env_of(c)["SPECMESH_TLS_CA_FILE"]["value"] == "/etc/specmesh/tls/ca.crt"
    assert c["command"][:3] == ["python", "-m", "specmesh_cli.probe"]


def test_without_tls_the_probes_stay_kubelets_own(dev):
    for tier, (service, port) in TIERS.items():
        c = container(of_kind(dev, "Deployment")[f"{FULLNAME}-{tier}"])
        assert c["readinessProbe"]["grpc"] == {"port": port, "service": service}
        assert not any(k.startswith("SPECMESH_TLS_") for k in env_of(c))


@pytest.fixture(scope="module")
def dev() -> list[dict]:
    return render()


def test_tls_without_a_certificate_source_fails_the_render():
    with pytest.raises(helm.HelmError, match="tls.existingSecret"):
        render({"tls": {"enabled": True}})
    with pytest.raises(helm.HelmError, match="issuerRef.name"):
        render({"tls": {"enabled": True, "certManager": {"enabled": True}}})


def test_an_existing_secret_needs_no_cert_manager():
    docs = render({"tls": {"enabled": True, "existingSecret": "my-tls"}})
    assert not of_kind(docs, "Certificate")
    d = of_kind(docs, "Deployment")[f"{FULLNAME}-verifier"]
    assert _volumes(d)["tls"]["secret"]["secretName"] == "my-tls"


def test_production_closes_every_port_to_all_but_named_peers():
    docs = render(production_values())
    policies = of_kind(docs, "NetworkPolicy")
    for name, policy in policies.items():
        for rule in policy["spec"]["ingress"]:
            assert rule.get("from"), f"{name}: port {rule['ports']} is open to every pod"
    orchestrator = policies[f"{FULLNAME}-orchestrator"]["spec"]["ingress"]
    grpc_rule = next(r for r in orchestrator if r["ports"][0]["port"] == "grpc")
    assert any("podSelector" in peer for peer in grpc_rule["from"])   # the gateway is always let in
    assert of_kind(docs, "Certificate"), "production runs TLS from cert-manager"


def test_production_with_tls_lints_clean():
    report = helm.lint(CHART, production_values(), strict=True, kube_version="v1.30.0")
    assert report["total_charts_linted"] == 1
