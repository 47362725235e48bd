"""Test certificates made by the tests (cryptography): a CA, one node certificate for
127.0.0.1 / localhost usable as server and client (every service serves and calls), and a
rogue CA with a node certificate of its own, for the clients that must be refused."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class NodeFiles:
    ca: str
    cert: str
    key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def make_node(directory: Path, label: str) -> NodeFiles:
    """A CA and a node certificate it signed, written under `directory` as PEM files."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"{label} test CA")
    ca_cert = (_builder(ca_name, ca_name, ca_key.public_key())
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .sign(ca_key, hashes.SHA256()))
    node_key = ec.generate_private_key(ec.SECP256R1())
    alt_names = x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    usage = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    node_cert = (_builder(_name(f"{label} node"), ca_name, node_key.public_key())
                 .add_extension(alt_names, critical=False).add_extension(usage, critical=False)
                 .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                 .sign(ca_key, hashes.SHA256()))
    files = NodeFiles(str(directory / f"{label}-ca.pem"), str(directory / f"{label}-node.pem"),
                      str(directory / f"{label}-node.key"))
    Path(files.ca).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    Path(files.cert).write_bytes(node_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(node_key, Path(files.key))
    return files
