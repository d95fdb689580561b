"""Transport security and authentication: TLS / mutual TLS on every server, TLS from the coordinator to
the tiers, and the bearer token on the public API. Certificates are made at test time (tmp dirs)."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from coordinator.config import CoordinatorConfig
from coordinator.pipeline import Pipeline
from coordinator.service import build as build_coordinator
from specdec.client import cli
from specdec.client import Client
from specdec.proto import common_pb2, draft_pb2_grpc, generate_pb2, generate_pb2_grpc, target_pb2_grpc
from specdec.serving.auth import BearerTokenInterceptor
from specdec.serving.server import ServerConfig
from tests.helpers import Cluster

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

TOKEN = "s3cret-Token_0123456789"
TIER_NAME = "tier.specdec.internal"  # a service name in the tiers' cert, for tier_server_name
PROMPT = "The quick brown fox jumps over"
GEN = dict(prompt=PROMPT, max_new_tokens=12, temperature=0.0, num_speculative_tokens=3, proposer="draft")
FAST = 5  # seconds: deadline of the rpcs expected to fail fast


# --- certificates ---------------------------------------------------------------------------------


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key, cert) -> tuple[str, str]:
    path.with_suffix(".key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path.with_suffix(".pem")), str(path.with_suffix(".key"))


def _ca(cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca_key, ca_cert, cn: str, *, server: bool):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                              critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.DNSName(TIER_NAME), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


@dataclass(frozen=True)
class PKI:
    ca: str  # the CA that signed everything below
    server_cert: str  # localhost, tier.specdec.internal, IP 127.0.0.1
    server_key: str
    client_cert: str  # client auth, signed by ca
    client_key: str
    other_ca: str  # an unrelated CA
    other_client_cert: str  # client auth, signed by other_ca
    other_client_key: str


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    d = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = _ca("specdec test CA")
    other_key, other_cert = _ca("unrelated CA")
    ca, _ = _write(d / "ca", ca_key, ca_cert)
    other_ca, _ = _write(d / "other-ca", other_key, other_cert)
    server_cert, server_key = _write(d / "server", *_leaf(ca_key, ca_cert, "specdec-server", server=True))
    client_cert, client_key = _write(d / "client", *_leaf(ca_key, ca_cert, "coordinator", server=False))
    other_client_cert, other_client_key = _write(d / "other-client", *_leaf(other_key, other_cert, "intruder", server=False))
    return PKI(ca, server_cert, server_key, client_cert, client_key, other_ca, other_client_cert, other_client_key)


@pytest.fixture(scope="module")
def tls_cluster(pki, tiny_target, tiny_random_draft):
    """Tiers with mutual TLS, the coordinator reaching them with its client cert (verifying the tiers'
    certs as TIER_NAME), and the public API on TLS with a bearer token."""
    tier_server = ServerConfig(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca)
    cluster = Cluster(tiny_target, tiny_random_draft, tier_server=tier_server, coordinator_overrides=dict(
        server=ServerConfig(tls_cert=pki.server_cert, tls_key=pki.server_key),
        tier_ca=pki.ca, tier_client_cert=pki.client_cert, tier_client_key=pki.client_key, tier_server_name=TIER_NAME,
        auth_token=TOKEN,
    ))
    yield cluster
    cluster.close()


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def _secure_channel(address: str, ca: str, cert: str | None = None, key: str | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key) if key else None,
                                         certificate_chain=_read(cert) if cert else None)
    return grpc.secure_channel(address, creds)


def _model_info(channel: grpc.Channel, tier: str) -> common_pb2.ModelInfo:
    stub = target_pb2_grpc.TargetServiceStub(channel) if tier == "target" else draft_pb2_grpc.DraftServiceStub(channel)
    return stub.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=FAST)


# --- (a) end to end -------------------------------------------------------------------------------


def test_generation_over_mtls_tls_and_token_matches_plaintext(tls_cluster, random_draft_cluster, pki):
    with Client(tls_cluster.address, tls_ca=pki.ca, token=TOKEN, timeout_s=60) as c:
        secure = c.generate(**GEN)
        info = c.info()
    with Client(random_draft_cluster.address, timeout_s=60) as c:
        plain = c.generate(**GEN)
    assert secure.token_ids == plain.token_ids and len(secure.token_ids) == 12
    assert secure.text == plain.text and secure.finish_reason == plain.finish_reason
    assert secure.stats["draft_ms"] > 0  # the draft tier really proposed over mutual TLS (no fallback)
    assert tls_cluster.pipeline.draft_info is not None
    assert info["target"]["address"] == f"127.0.0.1:{tls_cluster.target_port}"


def test_openai_api_over_tls_with_token_matches_plaintext(tls_cluster, random_draft_cluster, pki):
    """The HTTP API takes the gRPC port's TLS settings and token: HTTPS, and the same output."""
    assert tls_cluster.http_url.startswith("https://")
    with Client(random_draft_cluster.address, timeout_s=60) as c:
        plain = c.generate(**GEN)
    https = httpx.Client(verify=ssl.create_default_context(cafile=pki.ca))
    model = tls_cluster.coordinator.frontend.model_name
    with openai.OpenAI(base_url=tls_cluster.http_url + "/v1", api_key=TOKEN, max_retries=0, http_client=https) as oai:
        r = oai.completions.create(model=model, prompt=GEN["prompt"], max_tokens=12, temperature=0.0,
                                   extra_body={"num_speculative_tokens": 3, "proposer": "draft"})
        assert r.choices[0].text == plain.text
    with openai.OpenAI(base_url=tls_cluster.http_url + "/v1", api_key="wrong", max_retries=0,
                       http_client=httpx.Client(verify=ssl.create_default_context(cafile=pki.ca))) as oai:
        with pytest.raises(openai.AuthenticationError):
            oai.models.list()
    with pytest.raises(httpx.HTTPError):  # an unverifiable certificate
        httpx.get(tls_cluster.http_url + "/health", verify=ssl.create_default_context(cafile=pki.other_ca), timeout=FAST)


@pytest.mark.parametrize("direct_tls", [True, False], ids=["mtls", "plaintext"])
def test_direct_rounds_over_mutual_tls(pki, tiny_target, tiny_random_draft, random_draft_cluster, direct_tls):
    """With TLS to the tiers, a draft replica whose own channel to the target is mutual TLS (its CA, client certificate
    and the name the target's certificate carries) runs the sessions' rounds, with the tokens of plaintext; one whose
    channel would be plaintext says so (ModelInfo.direct_tls) and is left out: the coordinator runs every round."""
    tier_server = ServerConfig(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca)
    direct = dict(direct_target_ca=pki.ca, direct_target_client_cert=pki.client_cert,
                  direct_target_client_key=pki.client_key, direct_target_server_name=TIER_NAME) if direct_tls else True
    cluster = Cluster(tiny_target, tiny_random_draft, tier_server=tier_server, direct=direct, coordinator_overrides=dict(
        tier_ca=pki.ca, tier_client_cert=pki.client_cert, tier_client_key=pki.client_key))
    try:
        with Client(cluster.address, timeout_s=60) as c:
            got = c.generate(**GEN)
        with Client(random_draft_cluster.address, timeout_s=60) as c:
            plain = c.generate(**GEN)
        assert got.token_ids == plain.token_ids and len(got.token_ids) == 12
        info = cluster.pipeline.draft_info
        assert info.direct_rounds and info.direct_tls == direct_tls
        assert cluster.pipeline.direct_rounds == direct_tls
        if direct_tls:
            assert got.stats["direct_rounds"] == got.stats["rounds"] > 0  # none handed back to the coordinator
        else:
            assert got.stats["direct_rounds"] == 0 and got.stats["draft_ms"] > 0
    finally:
        cluster.close()


def test_client_certificate_on_the_public_api(pki, tiny_target):
    """The coordinator's public port can require client certificates too (ServerConfig.tls_client_ca)."""
    cluster = Cluster(tiny_target, None, tier_server=ServerConfig(tls_cert=pki.server_cert, tls_key=pki.server_key),
                      coordinator_overrides=dict(
                          server=ServerConfig(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca),
                          tier_ca=pki.ca))
    try:
        with Client(cluster.address, tls_ca=pki.ca, client_cert=pki.client_cert, client_key=pki.client_key, timeout_s=60) as c:
            out = c.generate(prompt=PROMPT, max_new_tokens=4, temperature=0.0)
        assert len(out.token_ids) == 4
        with Client(cluster.address, tls_ca=pki.ca, timeout_s=FAST) as c, pytest.raises(grpc.RpcError) as e:
            c.info()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        cluster.close()


# --- (b) plaintext vs TLS ---------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["coordinator", "target", "draft"])
def test_plaintext_client_cannot_reach_tls_server(tls_cluster, which):
    port = {"coordinator": tls_cluster.port, "target": tls_cluster.target_port, "draft": tls_cluster.draft_port}[which]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, pytest.raises(grpc.RpcError) as e:
        if which == "coordinator":
            generate_pb2_grpc.GenerationStub(ch).GetInfo(
                generate_pb2.GetInfoRequest(), timeout=FAST, metadata=(("authorization", f"Bearer {TOKEN}"),))
        else:
            _model_info(ch, which)
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_client_with_the_wrong_ca_cannot_reach_the_coordinator(tls_cluster, pki):
    with Client(tls_cluster.address, tls_ca=pki.other_ca, token=TOKEN, timeout_s=FAST) as c, pytest.raises(grpc.RpcError) as e:
        c.info()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


# --- (c) mutual TLS on the tiers ------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["target", "draft"])
def test_tier_requires_a_client_cert_from_its_ca(tls_cluster, pki, tier):
    address = f"127.0.0.1:{tls_cluster.target_port if tier == 'target' else tls_cluster.draft_port}"
    with _secure_channel(address, pki.ca, pki.client_cert, pki.client_key) as ch:  # control: the coordinator's cert
        assert _model_info(ch, tier).vocab_size > 0
    for cert, key in ((None, None), (pki.other_client_cert, pki.other_client_key)):
        with _secure_channel(address, pki.ca, cert, key) as ch, pytest.raises(grpc.RpcError) as e:
            _model_info(ch, tier)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (cert, e.value)


# --- (d) the coordinator refuses tiers it cannot verify ----------------------------------------------------


@pytest.mark.parametrize("case", ["wrong_ca", "wrong_server_name", "no_client_cert", "plaintext"])
def test_coordinator_start_fails_when_tier_tls_fails(tls_cluster, pki, tiny_target, case):
    tls = dict(tier_ca=pki.ca, tier_client_cert=pki.client_cert, tier_client_key=pki.client_key)
    tls.update({"wrong_ca": dict(tier_ca=pki.other_ca),
                "wrong_server_name": dict(tier_server_name="not-the-tier.example"),
                "no_client_cert": dict(tier_client_cert=None, tier_client_key=None),
                "plaintext": dict(tier_ca=None, tier_client_cert=None, tier_client_key=None)}[case])
    config = CoordinatorConfig(target_address=f"127.0.0.1:{tls_cluster.target_port}",
                               draft_address=f"127.0.0.1:{tls_cluster.draft_port}", tokenizer=tiny_target,
                               connect_timeout_s=1.0, **tls)
    with pytest.raises(ConnectionError, match="did not answer") as e:
        tls_cluster._call(build_coordinator(config), timeout=60)
    # The reason reaches the operator (grpcio's wording):
    reason = {"wrong_ca": "CERTIFICATE_VERIFY_FAILED", "wrong_server_name": "Hostname Verification"}.get(case, "")
    assert reason in str(e.value)


def test_tls_settings_are_checked(pki, tmp_path):
    with pytest.raises(ValueError, match="together"):
        ServerConfig(tls_cert=pki.server_cert)
    with pytest.raises(ValueError, match="tls_client_ca"):
        ServerConfig(tls_client_ca=pki.ca)
    base = dict(target_address="127.0.0.1:1", draft_address=None, tokenizer="unused")
    with pytest.raises(ValueError, match="needs tier_ca"):
        Pipeline.tier_credentials(CoordinatorConfig(**base, tier_server_name=TIER_NAME))
    with pytest.raises(ValueError, match="together"):
        Pipeline.tier_credentials(CoordinatorConfig(**base, tier_ca=pki.ca, tier_client_cert=pki.client_cert))
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match="not a PEM"):
        Pipeline.tier_credentials(CoordinatorConfig(**base, tier_ca=str(not_pem)))
    with pytest.raises(OSError, match="cannot read"):
        Pipeline.tier_credentials(CoordinatorConfig(**base, tier_ca=str(tmp_path / "missing.pem")))
    assert "s3cret" not in repr(CoordinatorConfig(**base, auth_token="s3cret"))


# --- (e) bearer token ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def public_channel(tls_cluster, pki):
    with _secure_channel(tls_cluster.address, pki.ca) as ch:
        yield ch


@pytest.mark.parametrize("metadata, message", [
    ((), "missing credentials"),
    ((("authorization", "Bearer wrong-token"),), "invalid bearer token"),
    ((("authorization", f"Bearer {TOKEN}x"),), "invalid bearer token"),
    ((("authorization", f"Basic {TOKEN}"),), "malformed"),
    ((("authorization", "Bearer"),), "malformed"),
])
def test_bearer_token_rejected(public_channel, metadata, message):
    stub = generate_pb2_grpc.GenerationStub(public_channel)
    with pytest.raises(grpc.RpcError) as e:
        stub.GetInfo(generate_pb2.GetInfoRequest(), timeout=FAST, metadata=metadata)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and message in e.value.details()
    request = generate_pb2.GenerateRequest(text=PROMPT, max_new_tokens=2)
    with pytest.raises(grpc.RpcError) as e:  # the streaming rpc, too
        list(stub.Generate(request, timeout=FAST, metadata=metadata))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and message in e.value.details()


def test_bearer_token_accepted(public_channel):
    stub = generate_pb2_grpc.GenerationStub(public_channel)
    for value in (f"Bearer {TOKEN}", f"bearer {TOKEN}"):  # the scheme is case-insensitive (RFC 6750)
        info = stub.GetInfo(generate_pb2.GetInfoRequest(), timeout=FAST, metadata=(("authorization", value),))
        assert info.max_new_tokens_cap > 0


def test_client_without_token_is_unauthenticated(tls_cluster, pki):
    with Client(tls_cluster.address, tls_ca=pki.ca, timeout_s=FAST) as c, pytest.raises(grpc.RpcError) as e:
        c.generate(prompt=PROMPT, max_new_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_and_reflection_need_no_token(public_channel):
    health = health_pb2_grpc.HealthStub(public_channel)
    status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=FAST).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    # An unknown service gets the health service's own NOT_FOUND, not UNAUTHENTICATED.
    with pytest.raises(grpc.RpcError) as e:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=FAST)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    stub = reflection_pb2_grpc.ServerReflectionStub(public_channel)
    responses = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=FAST))
    names = {s.name for s in responses[0].list_services_response.service}
    assert "specdec.v1.Generation" in names


def test_interceptor_refuses_unusable_tokens():
    for bad in ("", "has space", "tab\t", "nön-ascii"):
        with pytest.raises(ValueError):
            BearerTokenInterceptor(bad)


# --- CLI and entry points -----------------------------------------------------------------------------------


def test_cli_info_with_tls_and_token(tls_cluster, pki, capsys, monkeypatch):
    args = ["info", "--address", tls_cluster.address, "--tls-ca", pki.ca]
    assert cli.main([*args, "--token", TOKEN]) == 0
    assert '"max_new_tokens_cap"' in capsys.readouterr().out
    assert cli.main(args) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("SPECDEC_TOKEN", TOKEN)  # the token from the environment
    assert cli.main(args) == 0


def test_cli_generate_with_tls_and_token(tls_cluster, pki, capsys):
    code = cli.main(["generate", PROMPT, "--no-chat", "--json", "--max-new-tokens", "3", "--temperature", "0",
                     "--address", tls_cluster.address, "--tls-ca", pki.ca, "--token", TOKEN])
    assert code == 0 and '"finish_reason"' in capsys.readouterr().out


def test_coordinator_flags(tmp_path, monkeypatch, capsys):
    from coordinator.__main__ import auth_token_from, main

    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    assert auth_token_from(None, str(token_file)) == TOKEN
    assert auth_token_from(TOKEN, None) == TOKEN
    assert auth_token_from("", None) is None
    for bad in ((TOKEN, str(token_file)), ("with space", None), (None, str(tmp_path / "missing"))):
        with pytest.raises(SystemExit) as e:
            auth_token_from(*bad)
        assert e.value.code == 2
    # Misconfigured TLS exits 2 before connecting to anything.
    for argv, message in ((["--tier-client-cert", "c.pem", "--tier-client-key", "k.pem"], "need --tier-ca"),
                          (["--tls-cert", "c.pem"], "--tls-cert and --tls-key"),
                          (["--tier-ca", str(tmp_path / "missing.pem")], "cannot read tier CA")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    # --help never shows a token taken from the environment.
    monkeypatch.setenv("SPECDEC_COORDINATOR_AUTH_TOKEN", TOKEN)
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "SPECDEC_COORDINATOR_AUTH_TOKEN" in out and TOKEN not in out


@pytest.mark.parametrize("module", ["draft_service", "target_service"])
def test_tier_entry_point_rejects_missing_tls_files(module, tmp_path, capsys):
    import importlib

    main = importlib.import_module(f"{module}.__main__").main
    with pytest.raises(SystemExit) as e:  # exits before loading any model
        main(["--model", "unused", "--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem")])
    assert e.value.code == 2 and "cannot read TLS certificate" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--direct-target", "127.0.0.1:1", "--direct-target-ca", "MISSING"], "cannot read tier CA"),
    (["--direct-target-ca", "MISSING"], "--direct-target-ca needs --direct-target"),
    (["--direct-target", "127.0.0.1:1", "--direct-target-server-name", TIER_NAME],
     "--direct-target-server-name needs --direct-target-ca"),
])
def test_draft_entry_point_checks_its_direct_rounds_tls(flags, message, tmp_path, capsys):
    from draft_service.__main__ import main

    with pytest.raises(SystemExit) as e:  # exits before loading any model
        main(["--model", "unused", *(str(tmp_path / f) if f == "MISSING" else f for f in flags)])
    assert e.value.code == 2 and message in capsys.readouterr().err
