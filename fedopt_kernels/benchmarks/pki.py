"""A throwaway public-key infrastructure for secure deployments on loopback (the tests'
and the benchmarks'), made with ``cryptography`` (a dependency of flwr): a CA, a SuperLink
certificate for 127.0.0.1 and localhost signed by it (valid now, or expired), and
SuperNode authentication keys.

Flower's requirements, from its TLS and SuperNode-authentication guides: PEM
certificates and key for the SuperLink; SuperNode keys on a NIST elliptic curve, the
private key in OpenSSH format, the public key as an OpenSSH line (what ``flwr supernode
register`` reads).  Nothing here is for production: the keys are unencrypted files in
the test's temporary directory.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["CA", "make_ca", "make_server_cert", "make_node_keys", "make_security"]

CURVE = ec.SECP384R1  # P-384, the curve Flower's guides use


@dataclass(frozen=True)
class CA:
    cert: Path
    key: ec.EllipticCurvePrivateKey
    subject: x509.Name


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key, path: Path, fmt=serialization.PrivateFormat.TraditionalOpenSSL) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption()))
    path.chmod(0o600)
    return path


def make_ca(folder: Path, name: str = "fedopt test CA") -> CA:
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(CURVE())
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=3)).not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    path = folder / "ca.crt"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return CA(path, key, cert.subject)


def make_server_cert(ca: CA, folder: Path, *, expired: bool = False, stem: str = "superlink"):
    """``(cert, key)`` paths of a SuperLink certificate for 127.0.0.1 and localhost signed
    by ``ca``: valid from a minute ago for a day, or (``expired``) valid for a day that
    ended an hour ago."""
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = ((now - datetime.timedelta(days=2), now - datetime.timedelta(hours=1)) if expired
                  else (now - datetime.timedelta(minutes=1), now + datetime.timedelta(days=1)))
    key = ec.generate_private_key(CURVE())
    cert = (x509.CertificateBuilder().subject_name(_name("localhost")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca.key, hashes.SHA256()))
    cert_path = folder / f"{stem}.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, _write_key(key, folder / f"{stem}.key")


def make_node_keys(folder: Path, count: int, stem: str = "node"):
    """``[(private, public)]`` paths of ``count`` SuperNode authentication key pairs."""
    pairs = []
    for i in range(count):
        key = ec.generate_private_key(CURVE())
        private = _write_key(key, folder / f"{stem}{i}", serialization.PrivateFormat.OpenSSH)
        public = folder / f"{stem}{i}.pub"
        public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                         serialization.PublicFormat.OpenSSH))
        pairs.append((private, public))
    return pairs


def make_security(folder: Path, nodes: int, *, expired: bool = False):
    """``(Security, [(private, public)])``: a fresh CA, a SuperLink certificate (expired
    if asked) and ``nodes`` SuperNode key pairs in ``folder``, as :mod:`.flower_run`'s
    :class:`~.flower_run.Security` (TLS and SuperNode authentication) takes them."""
    from .flower_run import Security

    ca = make_ca(folder)
    cert, key = make_server_cert(ca, folder, expired=expired)
    return Security(ca.cert, cert, key, node_auth=True), make_node_keys(folder, nodes)
