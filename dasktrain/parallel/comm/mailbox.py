"""Point-to-point messages matched as MPI matches them: by source and tag.

A communicator's :meth:`~dasktrain.parallel.comm.base.Communicator.send`
and ``recv`` carry the messages of two ranks in the order they were sent,
untagged. :class:`Mailbox` adds MPI's matching on top: every message
travels with its tag, and ``recv(source, tag)`` returns the first message
from ``source`` with that tag; one with another tag that arrives first is
kept until its own ``recv`` asks for it (``tag=ANY``: the first message
from ``source``, kept or new). Messages of one source and tag are never
overtaken by each other, as in MPI.

A *synchronous* send (``send(..., sync=True)``, MPI's ``ssend``) returns
only once the receiver's ``recv`` has taken the message: the receiver
answers with an acknowledgement on the same channel (a reserved tag that
``ANY`` never matches), which the sender waits for, keeping whatever else
that peer sends meanwhile. So a message sent synchronously is never still
unread when its sender goes on: what the sender does next (a collective,
a GPU kernel writing the sent buffer, leaving) comes after the receive.

An ``arrival`` hook sees each message as it is read, in the order it was
sent, before it is kept or returned: where part of a message follows on
another channel (GPU arrays over NCCL, which match sends to receives in
the order they were made), the hook takes it at once, so a message kept
for later never blocks the ones behind it.

Owns matching; the channel is the communicator's.
"""
import collections
import itertools

#: ``recv``'s tag that takes any message (MPI's ``ANY_TAG``).
ANY = None
#: The tag of acknowledgements of synchronous sends: not a user's tag
#: (an int), so :data:`ANY` never matches it.
ACK = ('ack',)


def take(kept, tag):
    """Remove and return the first ``(tag, message, ack)`` of ``kept`` (a
    deque) whose tag is ``tag`` (any with :data:`ANY`), and True; else
    (None, False).

    Examples
    --------
    >>> kept = collections.deque([(1, 'a', None), (2, 'b', None),
    ...                           (1, 'c', None)])
    >>> take(kept, 1)[0][1], take(kept, 1)[0][1], take(kept, 3), list(kept)
    ('a', 'c', (None, False), [(2, 'b', None)])
    """
    for i, entry in enumerate(kept):
        if tag is ANY or entry[0] == tag:
            del kept[i]
            return entry, True
    return None, False


class Mailbox:
    """Tagged point-to-point messages over ``comm``'s ordered ones.

    Parameters
    ----------
    comm : Communicator
        Its ``send(obj, dest)`` and ``recv(source)`` carry the messages;
        nothing else may read from its peers meanwhile (a communicator of
        their own, e.g. from ``split``, keeps collectives apart).
    arrival : callable, optional
        ``arrival(source, message) -> message``, called on every message
        as it is read (see the module).

    Examples
    --------
    >>> box = Mailbox(comm)  # doctest: +SKIP
    >>> box.send('first', dest=1, tag=1)  # rank 0  # doctest: +SKIP
    >>> box.send('second', dest=1, tag=2)  # doctest: +SKIP
    >>> box.recv(0, tag=2), box.recv(0, tag=1)  # rank 1  # doctest: +SKIP
    ('second', 'first')
    """

    def __init__(self, comm, arrival=None):
        self.comm = comm
        self.arrival = arrival
        self._kept = collections.defaultdict(collections.deque)
        self._acked = collections.defaultdict(set)  # source -> ack ids
        self._ids = itertools.count(1)

    def send(self, message, dest, tag=0, sync=False):
        """Send ``message`` to rank ``dest`` with ``tag``. It returns once
        the message is on its way, or with ``sync`` once ``dest`` has
        received it (see the module)."""
        if not sync:
            self.comm.send((tag, message, None), dest)
            return
        ack = next(self._ids)
        self.comm.send((tag, message, ack), dest)
        while ack not in self._acked[dest]:
            self._read(dest)
        self._acked[dest].discard(ack)

    def recv(self, source, tag=ANY):
        """The first message from ``source`` with ``tag``, kept or next to
        arrive; messages with other tags read meanwhile are kept."""
        return self.recv_tagged(source, tag)[1]

    def recv_tagged(self, source, tag=ANY):
        """:meth:`recv`, and the tag the message came with:
        ``(tag, message)``."""
        kept = self._kept[source]
        entry, found = take(kept, tag)
        while not found:
            self._read(source)
            entry, found = take(kept, tag)
        got, message, ack = entry
        if ack is not None:  # a synchronous send waits for this
            self.comm.send((ACK, ack, None), source)
        return got, message

    def _read(self, source):
        """Read the next message from ``source``: keep it (after the
        arrival hook), or note it as an acknowledgement."""
        got, message, ack = self.comm.recv(source)
        if got == ACK:
            self._acked[source].add(message)
            return
        if self.arrival is not None:
            message = self.arrival(source, message)
        self._kept[source].append((got, message, ack))

    def waiting(self):
        """How many messages are kept, unasked for, by source."""
        return {source: len(kept) for source, kept in self._kept.items()
                if kept}
