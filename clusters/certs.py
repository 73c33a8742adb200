"""Certificates for a test or small private cluster under Dask's TLS: ``llumdask certs --out DIR``.

Writes a self-signed CA (``ca.pem``, and ``ca.key`` to sign more) and one node certificate and
key (``node.pem``, ``node.key``) signed by it, good for the scheduler, the workers and the
clients alike, with the given hosts as subject alternative names. Dask checks a peer's
certificate against the CA (mutual authentication) and not its host name, so one node
certificate serves every machine of the cluster; a production cluster takes its certificates
from its own CA. `security(DIR)` is the `distributed.Security` over them.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from distributed import Security

FILES = ("ca.pem", "ca.key", "node.pem", "node.key")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llumdask"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # readable by its owner only
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_certificates(out: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost"), days: int = 30) -> list[Path]:
    """Write the CA and the node certificate under `out` (refusing to overwrite); the paths written."""
    if not hosts:
        raise ValueError("give at least one host name or address for the node certificate")
    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    out.mkdir(parents=True, exist_ok=True)
    existing = [name for name in FILES if (out / name).exists()]
    if existing:
        raise FileExistsError(f"{out} already holds {', '.join(existing)}; remove them or choose another --out")
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("llumdask CA")).issuer_name(_name("llumdask CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    node_key = ec.generate_private_key(ec.SECP256R1())
    node = (x509.CertificateBuilder().subject_name(_name("llumdask node")).issuer_name(ca.subject)
            .public_key(node_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    (out / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (out / "node.pem").write_bytes(node.public_bytes(serialization.Encoding.PEM))
    _write_key(out / "ca.key", ca_key)
    _write_key(out / "node.key", node_key)
    return [out / name for name in FILES]


def security(directory: Path) -> Security:
    """Dask security over the files `make_certificates` wrote: TLS required, every role the node's."""
    cert, key = str(directory / "node.pem"), str(directory / "node.key")
    return Security(tls_ca_file=str(directory / "ca.pem"), tls_scheduler_cert=cert, tls_scheduler_key=key,
                    tls_worker_cert=cert, tls_worker_key=key, tls_client_cert=cert, tls_client_key=key,
                    require_encryption=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llumdask certs", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for ca.pem, ca.key, node.pem, node.key")
    parser.add_argument("--hosts", default="127.0.0.1,localhost",
                        help="host names and addresses of the node certificate, comma-separated (default %(default)s)")
    parser.add_argument("--days", type=int, default=30, help="validity in days (default %(default)s)")
    args = parser.parse_args(argv)
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    try:
        written = make_certificates(args.out, hosts, args.days)
    except (ValueError, FileExistsError) as exc:
        parser.error(str(exc))
    for path in written:
        print(f"wrote {path}")
    return 0
