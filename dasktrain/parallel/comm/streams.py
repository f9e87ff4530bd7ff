"""One direction of one connection between two ranks' links
(:mod:`~dasktrain.parallel.comm.links`): what it sends, in records of
:data:`RECORD` bytes, sealed with AES-GCM (:class:`Sealer`) or plain, and
the thread that drives it (:class:`Stream`: jobs run in order, blocking
calls that release the GIL, so several streams work on several cores).

A sealed record is its plaintext encrypted and authenticated under the
connection's own key, its number on the connection as the nonce: a record
changed, replayed, reordered, dropped or sealed under another key fails
its check (:class:`LinkLost`). Received records are opened straight into
the caller's buffer; plain ones are received straight into it.
"""
import queue
import socket
import threading

from dasktrain.parallel.comm.base import PEER_GONE, CollectiveError

#: Bytes of one record: the unit a stream sends, seals and sums.
RECORD = DEFAULT_RECORD = 1 << 20
TAG = 16  # bytes of an AES-GCM tag
KEY = 32  # AES-256


class LinkLost(CollectiveError):
    """A link's peer closed it, or a record failed its check."""


class Sealer:
    """AES-GCM of one direction of one connection: record n is sealed with
    nonce n (the key is this connection's alone)."""

    def __init__(self, key):
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        self._aead = AESGCM(key)
        self._count = 0
        self._into = hasattr(self._aead, 'encrypt_into')

    def _nonce(self):
        self._count += 1
        return self._count.to_bytes(12, 'little')

    def seal(self, plain, out):
        """``plain`` sealed into ``out`` (``len(plain) + TAG`` bytes)."""
        if self._into:
            self._aead.encrypt_into(self._nonce(), plain, None, out)
        else:
            out[:] = self._aead.encrypt(self._nonce(), plain, None)

    def open(self, sealed, out):
        """``sealed`` checked and decrypted into ``out``."""
        from cryptography.exceptions import InvalidTag
        try:
            if self._into:
                self._aead.decrypt_into(self._nonce(), sealed, None, out)
            else:
                out[:] = self._aead.decrypt(self._nonce(), bytes(sealed),
                                            None)
        except InvalidTag:
            raise LinkLost('a record failed its authentication check: '
                           'the link was tampered with or fell out of '
                           'step') from None


class Stream:
    """One direction of one connection, and the thread that drives it:
    jobs (callables) run in the order they were queued."""

    def __init__(self, sock, key, name, failed):
        self.sock, self.failed = sock, failed
        self._sealer = Sealer(key) if key is not None else None
        self._scratch = bytearray(RECORD + TAG) if key is not None else None
        self.bytes = 0  # payload bytes carried, for tests and benches
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=name)
        self._thread.start()

    def _run(self):
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except BaseException as e:  # the caller raises it
                self.failed(e)

    def queue(self, job):
        self._jobs.put(job)

    def send(self, view):
        """Send the bytes of ``view`` (sealed record by record)."""
        view = memoryview(view).cast('B')
        self.bytes += len(view)
        if self._sealer is None:
            self.sock.sendall(view)
            return
        out = memoryview(self._scratch)
        for at in range(0, len(view), RECORD):
            plain = view[at:at + RECORD]
            self._sealer.seal(plain, out[:len(plain) + TAG])
            self.sock.sendall(out[:len(plain) + TAG])

    def recv_into(self, view):
        """Fill ``view`` with what the peer sent (checked and opened
        record by record)."""
        view = memoryview(view).cast('B')
        self.bytes += len(view)
        if self._sealer is None:
            self._fill(view)
            return
        box = memoryview(self._scratch)
        for at in range(0, len(view), RECORD):
            plain = view[at:at + RECORD]
            sealed = box[:len(plain) + TAG]
            self._fill(sealed)
            self._sealer.open(sealed, plain)

    def _fill(self, view):
        while view:
            got = self.sock.recv_into(view)
            if not got:
                raise LinkLost(f'a peer closed its link: {PEER_GONE}')
            view = view[got:]

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._jobs.put(None)
