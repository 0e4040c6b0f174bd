"""A local certificate authority for a cluster's gRPC links (``kvcache up --tls``, tests).

One CA key signs one server certificate that every service of the cluster presents (its names:
the cluster's hosts and IPs); clients verify servers against the CA certificate. Keys are written
0600. Real deployments bring their own PKI: every service takes ``--tls-cert`` / ``--tls-key`` and
every client a CA file.
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


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: str  # PEM, what clients verify against
    cert: str  # PEM, the services' certificate (signed by the CA)
    key: str  # PEM, its private key (0600)


def _write(path: str, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_local_ca(directory: str, hosts: list[str], days: int = 30) -> TlsFiles:
    """Write ca.pem, server.pem and server.key under ``directory`` for ``hosts`` (names or IPs;
    localhost and 127.0.0.1 are always included)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("kvcache local CA"))
        .issuer_name(_name("kvcache local CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(["localhost", "127.0.0.1", *hosts]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("kvcache"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    files = TlsFiles(
        os.path.join(directory, "ca.pem"),
        os.path.join(directory, "server.pem"),
        os.path.join(directory, "server.key"),
    )
    pem = serialization.Encoding.PEM
    _write(files.ca_cert, ca_cert.public_bytes(pem), 0o644)
    _write(files.cert, cert.public_bytes(pem), 0o644)
    _write(
        files.key,
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        0o600,
    )
    return files
