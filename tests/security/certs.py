"""A throwaway PKI made at test time: a cluster CA, a rogue CA, leaf certificates.

Leaves carry CN = identity (what kvdir's servers authenticate), SANs for
localhost and 127.0.0.1 (what clients on loopback verify), and both server
and client EKUs, since a node's certificate serves and dials. EC P-256 keys
keep generation fast on a 2-core machine.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvdir.core.security import ClientSecurity

VALID_DAYS = 2


@dataclass(frozen=True, slots=True)
class Leaf:
    cert: str
    key: str
    ca: str

    def client(self, token: str = "") -> ClientSecurity:
        return ClientSecurity(self.ca, self.cert, self.key, token)

    def daemon_flags(self) -> list[str]:
        return ["--tls-cert", self.cert, "--tls-key", self.key, "--tls-ca", self.ca]


def _write(path: str, data: bytes) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class Authority:
    """A CA under `directory`; `issue(identity)` writes a leaf signed by it."""

    def __init__(self, directory: str, name: str) -> None:
        self.dir = directory
        self.name = name
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} test CA")])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        self.ca_path = _write(
            os.path.join(directory, f"{name}-ca.crt"),
            self.cert.public_bytes(serialization.Encoding.PEM),
        )

    def issue(self, identity: str, trust: str | None = None) -> Leaf:
        """A leaf for `identity`; `trust` is the CA file it will verify peers with."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    ]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        base = os.path.join(self.dir, f"{self.name}-{identity}")
        return Leaf(
            _write(base + ".crt", cert.public_bytes(serialization.Encoding.PEM)),
            _write(base + ".key", _key_pem(key)),
            trust or self.ca_path,
        )
