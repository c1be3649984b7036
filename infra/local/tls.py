"""A throwaway certificate authority and the local broker's TLS identity (``cryptography``).

Primitives:
- ``BrokerTLS``: where the files of one broker's TLS material are (CA certificate, keystore) and
  the keystore's password.
- ``issue_broker_tls(folder, hosts)``: a fresh CA and a broker certificate it signs for the given
  loopback names, written as ``ca.pem`` (what clients trust) and ``broker.p12`` (the broker's key
  and chain, a PKCS#12 keystore the JVM reads). The CA's private key never touches the disk: no
  further certificate can be issued under it, so trusting it trusts this one broker only.
- ``write_secret(path, text)``: a file only its owner can read (mode 0600), created that way.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Long enough for any local deployment; the material is replaced with every `broker start`.
VALIDITY = dt.timedelta(days=365)


@dataclass(frozen=True)
class BrokerTLS:
    ca_file: Path
    keystore_file: Path
    keystore_password: str


def write_secret(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` with mode 0600 from the first byte (no window where others could
    read it); an existing file is replaced."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def issue_broker_tls(folder: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> BrokerTLS:
    """A new CA and a broker certificate for ``hosts`` (IP addresses or DNS names) in ``folder``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.serialization import pkcs12

    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key, ca_cert = _issue_ca(now)
    broker_key, broker_cert = _issue_broker_certificate(ca_key, ca_cert, hosts, now)
    ca_file = folder / "ca.pem"
    ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    password = secrets.token_urlsafe(24)
    keystore = pkcs12.serialize_key_and_certificates(
        b"broker",
        broker_key,
        broker_cert,
        [ca_cert],
        serialization.BestAvailableEncryption(password.encode()),
    )
    keystore_file = folder / "broker.p12"
    keystore_file.unlink(missing_ok=True)
    fd = os.open(keystore_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(keystore)
    return BrokerTLS(ca_file=ca_file, keystore_file=keystore_file, keystore_password=password)


def _issue_ca(now: dt.datetime) -> tuple[Any, Any]:
    """A fresh CA: its private key (kept in memory only) and its self-signed certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, f"RelayGR local broker CA {secrets.token_hex(4)}")]
    )
    ca_cert = (
        _certificate(ca_name, ca_name, ca_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, ca_cert


def _issue_broker_certificate(
    ca_key: Any, ca_cert: Any, hosts: tuple[str, ...], now: dt.datetime
) -> tuple[Any, Any]:
    """The broker's private key and its certificate for ``hosts``, signed by the CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    broker_key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    broker_cert = (
        _certificate(subject, ca_cert.subject, broker_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True, key_agreement=True), critical=True)
        # The broker is also a TLS client: of its own controller listener.
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(broker_key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return broker_key, broker_cert


def _certificate(subject: Any, issuer: Any, public_key: Any, now: dt.datetime) -> Any:
    """A certificate builder with its names, key, a random serial and the validity window."""
    from cryptography import x509

    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # tolerate small clock differences
        .not_valid_after(now + VALIDITY)
    )


def _key_usage(**allowed: bool) -> Any:
    """``KeyUsage`` with the uses named in ``allowed`` and no other."""
    from cryptography import x509

    uses = (
        "digital_signature",
        "content_commitment",
        "key_encipherment",
        "data_encipherment",
        "key_agreement",
        "key_cert_sign",
        "crl_sign",
        "encipher_only",
        "decipher_only",
    )
    unknown = set(allowed) - set(uses)
    if unknown:
        raise ValueError(f"unknown key uses {sorted(unknown)}")
    return x509.KeyUsage(**{use: allowed.get(use, False) for use in uses})
