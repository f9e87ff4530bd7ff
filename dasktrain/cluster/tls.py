"""The cluster's own certificate authority: TLS with no lab PKI needed.

:func:`ensure_certificates` makes, on first use, a private CA (an ECDSA
P-256 key and a self-signed certificate valid for ten years) and one
certificate for this node signed by it, whose subject alternative names are
127.0.0.1, ::1, localhost and the host the scheduler binds. The node
certificate serves both ends (server and client authentication): Dask's
TLS makes every connection present a certificate signed by the CA and
checks the other end's (it checks no host names: the CA belongs to this
cluster alone), so only whoever can read these files can connect.

Every file is the owner's alone (0600, in a 0700 folder). The CA's key stays
here, to sign a new node certificate when ``--host`` names a host the
current one does not cover; a machine that joins gets ``ca.pem``,
``node.pem`` and ``node-key.pem`` only.

A job of ranks meets through a scheduler of its own with a CA made for
it alone (:func:`throwaway`), and each rank reads its copies of those
files (:func:`private_copies`: a rank running as another user too).
"""
import contextlib
import datetime
import ipaddress
import os
import shutil
import socket
import tempfile
from pathlib import Path

from dasktrain.errors import UserError
from dasktrain.files import atomic_write

CA, CA_KEY, CERT, KEY = 'ca.pem', 'ca-key.pem', 'node.pem', 'node-key.pem'
CA_DAYS, CERT_DAYS, RENEW_DAYS = 3650, 825, 30


def files(folder):
    """The TLS files in ``folder`` as ``cluster`` records them (CA,
    certificate, key), or None unless all three exist."""
    folder = Path(folder)
    paths = {'tls_ca_file': folder / CA, 'tls_cert': folder / CERT,
             'tls_key': folder / KEY}
    if not all(p.is_file() for p in paths.values()):
        return None
    return {k: str(p) for k, p in paths.items()}


def ensure_certificates(folder, host='127.0.0.1'):
    """The CA and this node's certificate in ``folder``, made if missing,
    re-issued if they do not cover ``host`` or expire within 30 days.

    Parameters
    ----------
    folder : str or Path
        Created 0700 if missing; every file in it is made 0600.
    host : str, default '127.0.0.1'
        The host the scheduler binds; added to the node certificate.

    Returns
    -------
    dict
        ``tls_ca_file``, ``tls_cert`` and ``tls_key`` paths.
    """
    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)  # also when it existed, or umask got in the way
    ca, ca_key = _load_pair(folder / CA, folder / CA_KEY)
    if ca is None or _expiring(ca):
        ca, ca_key = _make_ca()
        _write(folder / CA_KEY, _key_pem(ca_key))
        _write(folder / CA, _cert_pem(ca))
        (folder / CERT).unlink(missing_ok=True)  # signed by the old CA
    cert, _ = _load_pair(folder / CERT, folder / KEY)
    names = _names(host)
    ours = cert is not None and _signed_by(cert, ca)
    if not ours or _expiring(cert) or not names <= _san(cert):
        if ours:
            names |= _san(cert)  # keep covering the hosts it covered
        key = _new_key()
        _write(folder / KEY, _key_pem(key))
        _write(folder / CERT, _cert_pem(_make_cert(key, ca, ca_key, names)))
    for name in (CA, CA_KEY, CERT, KEY):
        os.chmod(folder / name, 0o600)
    return files(folder)


@contextlib.contextmanager
def throwaway(host='127.0.0.1'):
    """``(ca, cert, key)`` paths of a CA and certificate made for one job
    of ranks alone (``host``), in a private folder removed on exit."""
    folder = tempfile.mkdtemp(prefix='dasktrain-tls-')  # 0700
    try:
        made = ensure_certificates(folder, host)
        yield made['tls_ca_file'], made['tls_cert'], made['tls_key']
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def private_copies(pems, where=None, user=None):
    """The CA, certificate and key ``pems`` (PEM texts) as files only
    ``user`` (anything with ``uid`` and ``gid``; None: this process's
    user) may read, 0600 in a 0700 folder made in ``where`` (default the
    system's temporary folder), removed on exit: ``(ca, cert, key)``
    paths."""
    folder = tempfile.mkdtemp(prefix='.dasktrain-tls-', dir=where)
    try:
        paths = []
        for name, text in zip((CA, CERT, KEY), pems):
            path = os.path.join(folder, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, 'w') as f:
                f.write(text)
            if user is not None:
                os.chown(path, user.uid, user.gid)
            paths.append(path)
        if user is not None:
            os.chown(folder, user.uid, user.gid)
        yield tuple(paths)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------- internals

def _write(path, data):
    atomic_write(path, lambda f: f.write(data), mode=0o600)


def _load_pair(cert_path, key_path):
    """(certificate, key) from PEM files, (None, None) if either is
    missing; UserError if one is unreadable (a certificate other machines
    use must not be replaced silently)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    if not (cert_path.is_file() and key_path.is_file()):
        return None, None
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(),
                                                 password=None)
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f'cannot read the TLS files {cert_path} and '
                        f'{key_path} ({e}); delete {cert_path.parent} to '
                        'make new ones (machines that joined need the new '
                        'files then)') from None
    return cert, key


def _names(host):
    """The SANs a node certificate for ``host`` needs, as x509 names."""
    from cryptography import x509
    names = {x509.DNSName('localhost'),
             x509.IPAddress(ipaddress.ip_address('127.0.0.1')),
             x509.IPAddress(ipaddress.ip_address('::1'))}
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if host:
            names.add(x509.DNSName(host))
        return names
    if ip.is_unspecified:  # every interface: name the machine instead
        names.add(x509.DNSName(socket.gethostname()))
    else:
        names.add(x509.IPAddress(ip))
    return names


def _san(cert):
    from cryptography import x509
    try:
        ext = cert.extensions.get_extension_for_class(
            x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return set()
    return set(ext.value)


def _signed_by(cert, ca):
    from cryptography.exceptions import InvalidSignature
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _now():
    return datetime.datetime.now(datetime.timezone.utc)


def _expiring(cert):
    return cert.not_valid_after_utc - _now() < \
        datetime.timedelta(days=RENEW_DAYS)


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key):
    from cryptography.hazmat.primitives import serialization
    return key.private_bytes(serialization.Encoding.PEM,
                             serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert):
    from cryptography.hazmat.primitives import serialization
    return cert.public_bytes(serialization.Encoding.PEM)


def _builder(subject, issuer, public_key, days):
    from cryptography import x509
    now = _now()
    return (x509.CertificateBuilder().subject_name(subject)
            .issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(
                public_key), critical=False))


def _name(common_name):
    from cryptography import x509
    from cryptography.x509.oid import NameOID
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, 'dasktrain'),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_usage(**allowed):
    """x509 KeyUsage with only the ``allowed`` uses set."""
    from cryptography import x509
    uses = dict.fromkeys((
        'digital_signature', 'content_commitment', 'key_encipherment',
        'data_encipherment', 'key_agreement', 'key_cert_sign', 'crl_sign',
        'encipher_only', 'decipher_only'), False)
    return x509.KeyUsage(**dict(uses, **allowed))


def _make_ca():
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    key = _new_key()
    subject = _name(f'dasktrain cluster CA of {_owner()}')
    cert = (_builder(subject, subject, key.public_key(), CA_DAYS)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0),
                           critical=True)
            .add_extension(_key_usage(key_cert_sign=True, crl_sign=True),
                           critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def _make_cert(key, ca, ca_key, names):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID
    ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    return (_builder(_name('dasktrain node'), ca.subject, key.public_key(),
                     CERT_DAYS)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                           critical=True)
            .add_extension(_key_usage(digital_signature=True,
                                      key_agreement=True), critical=True)
            .add_extension(x509.ExtendedKeyUsage([
                ExtendedKeyUsageOID.SERVER_AUTH,
                ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier
                           .from_issuer_subject_key_identifier(ski.value),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(
                sorted(names, key=str)), critical=False)
            .sign(ca_key, hashes.SHA256()))


def _owner():
    try:
        import getpass
        return f'{getpass.getuser()}@{socket.gethostname()}'
    except (KeyError, OSError):
        return socket.gethostname()
