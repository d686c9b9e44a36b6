"""The gateway over TLS (certificates made here) and as the `kvdir gateway` daemon."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvdir.gateway.config import from_dict
from kvdir.gateway.server import BackgroundGateway
from kvdir.local import free_ports, wait_for
from tests.gateway.helpers import MODEL, Backends, backend_cfg, call

pytestmark = pytest.mark.integration


def _certs(d: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for localhost / 127.0.0.1 signed by it."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvdir test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_path, cert_path, key_path = d / "ca.pem", d / "server.pem", d / "server.key"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return ca_path, cert_path, key_path


@pytest.mark.timeout(60)
def test_serves_https_with_the_configured_certificate(backends: Backends, tmp_path: Path) -> None:
    ca, cert, key = _certs(tmp_path)
    raw = {
        "listen": "127.0.0.1:0",
        "tls_cert": str(cert),
        "tls_key": str(key),
        "policy": "round-robin",
        "backends": [backend_cfg(backends, n) for n in backends.names],
    }
    gw = BackgroundGateway(from_dict(raw))
    port = gw.start()
    try:
        trusted = ssl.create_default_context(cafile=str(ca))
        r = call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": [1, 2]}, tls=trusted)
        assert r.status == 200 and r.json()["backend"] in backends.names
        with pytest.raises(ssl.SSLCertVerificationError):  # an untrusting client refuses it
            call(port, "GET", "/health", tls=ssl.create_default_context())
    finally:
        gw.stop()


def _kvdir(*args: str, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvdir.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


@pytest.mark.timeout(60)
def test_cli_refuses_bad_configs_with_one_line(tmp_path: Path) -> None:
    cases = {
        "missing.toml": None,
        "syntax.toml": "listen = ",
        "policy.toml": 'policy = "fastest"\n[[backends]]\n'
        'url = "http://127.0.0.1:1"\nnode_id = "a"\n',
        "tokenizer.toml": '[[models]]\nname = "m"\ntokenizer = "/nonexistent.json"\n'
        '[[backends]]\nurl = "http://127.0.0.1:1"\nnode_id = "a"\n',
    }
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        r = _kvdir("gateway", "--config", str(path))
        assert r.returncode == 1, (name, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvdir: error:"), (name, r.stderr)


@pytest.mark.timeout(90)
def test_cli_daemon_serves_and_stops_on_sigterm(backends: Backends, tmp_path: Path) -> None:
    (port,) = free_ports(1)
    cfg = tmp_path / "gateway.toml"
    lines = [f'listen = "127.0.0.1:{port}"', 'policy = "least-loaded"', 'log_format = "text"']
    for n in backends.names:
        lines += ["[[backends]]", f'url = "{backends.url(n)}"', f'node_id = "{n}"']
    cfg.write_text("\n".join(lines) + "\n")
    log = open(tmp_path / "gateway.log", "wb")  # noqa: SIM115 - the daemon's output
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvdir.cli", "gateway", "--config", str(cfg)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    try:

        def up() -> bool:
            try:
                return call(port, "GET", "/health", timeout_s=1).status == 200
            except OSError:
                return False

        wait_for(up, 30, "the gateway daemon answering /health")
        r = call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": [3]})
        assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
