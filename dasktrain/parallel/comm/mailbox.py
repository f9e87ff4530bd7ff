"""Point-to-point messages matched as MPI matches them: by source and tag.

A communicator's :meth:`~dasktrain.parallel.comm.base.Communicator.send`
and ``recv`` carry the messages of two ranks in the order they were sent,
untagged. :class:`Mailbox` adds MPI's matching on top: every message
travels with its tag, and ``recv(source, tag)`` returns the first message
from ``source`` with that tag; one with another tag that arrives first is
kept until its own ``recv`` asks for it (``tag=ANY``: the first message
from ``source``, kept or new). Messages of one source and tag are never
overtaken by each other, as in MPI.

An ``arrival`` hook sees each message as it is read, in the order it was
sent, before it is kept or returned: where part of a message follows on
another channel (GPU arrays over NCCL, which match sends to receives in
the order they were made), the hook takes it at once, so a message kept
for later never blocks the ones behind it.

Owns matching; the channel is the communicator's.
"""
import collections

#: ``recv``'s tag that takes any message (MPI's ``ANY_TAG``).
ANY = None


def take(kept, tag):
    """Remove and return the first ``(tag, message)`` of ``kept`` (a
    deque) whose tag is ``tag`` (any with :data:`ANY`): its message, and
    True; else (None, False).

    Examples
    --------
    >>> kept = collections.deque([(1, 'a'), (2, 'b'), (1, 'c')])
    >>> take(kept, 1), take(kept, 1), take(kept, 3), list(kept)
    (('a', True), ('c', True), (None, False), [(2, 'b')])
    """
    for i, (t, message) in enumerate(kept):
        if tag is ANY or t == tag:
            del kept[i]
            return message, True
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
        self._arrival = arrival
        self._kept = collections.defaultdict(collections.deque)

    def send(self, message, dest, tag=0):
        """Send ``message`` to rank ``dest`` with ``tag``; it returns once
        the message is on its way (the channel's send)."""
        self.comm.send((tag, message), dest)

    def recv(self, source, tag=ANY):
        """The first message from ``source`` with ``tag``, kept or next to
        arrive; messages with other tags read meanwhile are kept."""
        kept = self._kept[source]
        message, found = take(kept, tag)
        if found:
            return message
        while True:
            got, message = self.comm.recv(source)
            if self._arrival is not None:
                message = self._arrival(source, message)
            if tag is ANY or got == tag:
                return message
            kept.append((got, message))

    def waiting(self):
        """How many messages are kept, unasked for, by source."""
        return {source: len(kept) for source, kept in self._kept.items()
                if kept}
