"""What the connections of a communicator's mesh are: Dask's comms (TCP
or TLS, between machines) or Unix domain sockets (ranks of one machine).

:func:`~dasktrain.parallel.comm.mesh.connect` listens, dials and accepts
through a transport, and :class:`~dasktrain.parallel.comm.dask.DaskComm`
writes and reads its messages through the connections it gives; both
are the same to them:

* :class:`DaskTransport`: ``distributed.comm`` at ``tcp://HOST`` or
  ``tls://HOST`` with a ``Security``, what ranks on several machines (or
  on a cluster's workers) use;
* :class:`UnixTransport`: stream sockets in a folder only this user can
  enter (``dasktrain launch``'s ranks on one machine, meeting without a
  scheduler). Importing ``distributed`` and its TLS costs a rank a few
  tenths of a second of start-up, which is most of what a script's
  start took beyond ``mpiexec``'s; this transport imports nothing beyond
  the standard library, and the kernel carries its bytes to no one else.

A :class:`UnixTransport` message is a pickle (protocol 5) with its large
buffers (NumPy arrays) out of band: a frame of the count of parts and
each part's length, then the parts. A connection is accepted only from a
process of this user (``SO_PEERCRED``), whose socket path is in the
folder.

Owns how the mesh's connections are made and what goes down them; who
connects to whom is :mod:`~dasktrain.parallel.comm.mesh`'s.
"""
import asyncio
import os
import pickle
import secrets
import socket
import struct

#: ``sockaddr_un``'s path: at most 107 bytes and the NUL.
UNIX_PATH_MAX = 107
#: A listener's socket name in the folder: ``m`` and 12 hex digits.
_NAME_LENGTH = 13
_COUNT = struct.Struct('<I')
#: A message of more parts than this is not one a rank wrote.
MAX_PARTS = 1 << 16
#: StreamReader's buffer: large arrays arrive in fewer, larger reads.
_READ_LIMIT = 1 << 20
#: A pickle shorter than this goes in the frame's write (copied once).
_JOINED = 1 << 16
_UCRED = struct.Struct('3i')  # struct ucred: pid, uid, gid


def peer_uid(sock):
    """The user id of the process at the other end of Unix socket
    ``sock`` (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                          _UCRED.size)
    return _UCRED.unpack(raw)[1]


def unix_fits(folder):
    """Whether sockets in ``folder`` fit ``sockaddr_un`` (a long
    ``TMPDIR`` may not leave room for them).

    Examples
    --------
    >>> unix_fits('/tmp/dasktrain-meet-abcd1234')
    True
    >>> unix_fits('/tmp/' + 'x' * 100)
    False
    """
    return len(os.fsencode(os.path.join(folder, 'x' * _NAME_LENGTH))) \
        <= UNIX_PATH_MAX


def frame(parts):
    """The header of a message of ``parts`` (bytes-like): their count,
    then each one's length in bytes.

    Examples
    --------
    >>> frame([b'ab', b'']).hex()
    '0200000002000000000000000000000000000000'
    """
    sizes = [memoryview(p).nbytes for p in parts]
    return _COUNT.pack(len(sizes)) + struct.pack(f'<{len(sizes)}Q', *sizes)


def pack(msg):
    """``msg``'s parts: its pickle (protocol 5), then the raw bytes of
    each buffer pickle left out of band (contiguous arrays), uncopied.

    Examples
    --------
    >>> import numpy as np
    >>> parts = pack({'a': np.arange(3.0)})
    >>> len(parts), bytes(parts[1]) == np.arange(3.0).tobytes()
    (2, True)
    >>> unpack(parts)['a']
    array([0., 1., 2.])
    """
    buffers = []
    head = pickle.dumps(msg, protocol=5, buffer_callback=buffers.append)
    return [head] + [b.raw() for b in buffers]


def unpack(parts):
    """The message of ``parts`` (:func:`pack`'s): arrays come back
    writable where their parts are (bytearrays)."""
    return pickle.loads(parts[0], buffers=parts[1:])


class UnixComm:
    """One connection of the mesh over a Unix stream socket: ``write`` a
    message, ``read`` the next; a peer that closed raises
    ``ConnectionResetError`` (an ``OSError``, as a closed Dask comm's is
    turned into :class:`~dasktrain.parallel.comm.base.PeerLost`)."""

    def __init__(self, reader, writer):
        self._reader, self._writer = reader, writer

    async def write(self, msg):
        parts = pack(msg)
        head = frame(parts)
        if len(parts[0]) < _JOINED:  # one send, one wake-up for the peer
            head, parts = head + parts[0], parts[1:]
        self._writer.write(head)
        for part in parts:
            self._writer.write(part)
        await self._writer.drain()

    async def read(self):
        try:
            (count,) = _COUNT.unpack(
                await self._reader.readexactly(_COUNT.size))
            if not 1 <= count <= MAX_PARTS:
                raise ConnectionResetError(
                    f'a message of {count} parts: not from a rank')
            sizes = struct.unpack(f'<{count}Q',
                                  await self._reader.readexactly(8 * count))
            parts = [await self._reader.readexactly(n) for n in sizes]
        except asyncio.IncompleteReadError:
            raise ConnectionResetError('the peer closed its connection') \
                from None
        # out-of-band buffers as bytearrays: the arrays on them writable
        return unpack(parts[:1] + [bytearray(p) for p in parts[1:]])

    def abort(self):
        self._writer.transport.abort()


class UnixListener:
    """A listening Unix socket in the transport's folder (made by
    :meth:`UnixTransport.listen`); :meth:`stop` closes it and removes its
    path."""

    def __init__(self, server, path):
        self._server, self._path = server, path
        self.contact_address = f'unix://{path}'

    def stop(self):
        self._server.close()
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass


class UnixTransport:
    """The mesh over Unix stream sockets in ``folder`` (which only this
    user may enter: ``dasktrain launch`` makes it 0700): every rank of
    one machine. Its listeners have names of their own there, so a split
    communicator's connections never meet its parent's."""

    #: Links to other machines (never made: one machine) would be sealed
    #: with keys sent over it; nobody else reads a Unix socket's bytes.
    private = True

    def __init__(self, folder):
        self.folder = os.path.abspath(folder)

    def __repr__(self):
        return f'UnixTransport({self.folder!r})'

    def host(self, address):
        """The machine of a listener: this one, for every rank."""
        return '127.0.0.1'

    @staticmethod
    def wrap(obj):
        return obj

    #: What a connection that a peer closed raises.
    lost = (OSError,)

    async def listen(self, handler):
        """Listen in the folder; ``handler(comm)`` (a coroutine) for each
        connection of this user's processes. Returns the listener."""
        path = os.path.join(self.folder, f'm{secrets.token_hex(6)}')

        async def accepted(reader, writer):
            comm = UnixComm(reader, writer)
            try:
                sock = writer.get_extra_info('socket')
                if peer_uid(sock) != os.getuid():
                    comm.abort()
                    return
                await handler(comm)
            except Exception:  # a hello that is not a rank's
                # hung up on, not a traceback in the rank's output: a
                # rank that meant to come and could not times the mesh out
                comm.abort()
        server = await asyncio.start_unix_server(accepted, path,
                                                 limit=_READ_LIMIT)
        return UnixListener(server, path)

    async def dial(self, address):
        """The connection to the listener at ``address``
        (``unix://PATH``, a path in this transport's folder)."""
        path = address.removeprefix('unix://')
        if not address.startswith('unix://') or \
                os.path.dirname(path) != self.folder:
            raise ConnectionRefusedError(
                f'{address!r} is not a listener of this launch')
        reader, writer = await asyncio.open_unix_connection(
            path, limit=_READ_LIMIT)
        return UnixComm(reader, writer)


class DaskTransport:
    """The mesh over ``distributed.comm``: listening at ``listen_host``
    (``tls://HOST`` or ``tcp://HOST``; a port the kernel chooses) with the
    ``security`` (a ``distributed.Security``) of the cluster's workers."""

    def __init__(self, listen_host, security):
        from distributed.comm.addressing import parse_address
        self.listen_host, self.security = listen_host, security
        self.private = parse_address(listen_host)[0] == 'tls'

    def __repr__(self):
        return f'DaskTransport({self.listen_host!r})'

    def host(self, address):
        from distributed.comm.addressing import get_address_host
        return get_address_host(address)

    @staticmethod
    def wrap(obj):
        from distributed.protocol import to_serialize
        return to_serialize(obj)

    @property
    def lost(self):
        from distributed.comm.core import CommClosedError
        return (CommClosedError, OSError)

    async def listen(self, handler):
        from distributed.comm import listen
        listener = listen(f'{self.listen_host}:0', handler,
                          **self.security.get_listen_args('worker'))
        await listener.start()
        return listener

    async def dial(self, address):
        from distributed.comm import connect
        return await connect(address,
                             **self.security.get_connection_args('worker'))


def transport_for(listen, tls=None):
    """The transport of a rank told to listen at ``listen``
    (``unix://FOLDER``, ``tls://HOST`` or ``tcp://HOST``), with ``tls`` a
    ``(ca, cert, key)`` of file paths or None.

    Examples
    --------
    >>> transport_for('unix:///tmp/dasktrain-meet-x')
    UnixTransport('/tmp/dasktrain-meet-x')
    """
    if listen.startswith('unix://'):
        return UnixTransport(listen.removeprefix('unix://'))
    from distributed.security import Security
    if tls:
        ca, cert, key = tls
        # The same certificate dials the scheduler and listens for peers.
        security = Security(tls_ca_file=ca, tls_client_cert=cert,
                            tls_client_key=key, tls_worker_cert=cert,
                            tls_worker_key=key, require_encryption=True)
    else:
        security = Security()
    return DaskTransport(listen, security)
