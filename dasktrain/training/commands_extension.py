"""ChainerUI's ``CommandsExtension`` across the ranks of a job:
:func:`across_ranks`.

A Trainer script of several processes (a ChainerMN script under
``dasktrain launch``, or ``DistributedUpdater`` ranks) cannot take
ChainerUI's extension as it is: on rank 0 alone, a ``stop`` ends rank 0
and leaves the others waiting in their next all-reduce, and an
``adjust_hyperparams`` changes rank 0's learning rate only, so that the
replicas diverge; on every rank, each rank reads the file and acts when it
happens to see the command, at different iterations. Wrapped, it runs on
every rank: rank 0 reads ``OUT/commands`` and answers, as ChainerUI's
extension does, and broadcasts which commands act now; every rank carries
them out in the same iteration (``take_snapshot`` on rank 0 only, which
writes the Trainer's snapshot as ChainerUI does).

``adjust_hyperparams`` reaches the optimizer inside ChainerMN's
multi-node wrapper (whose class name ChainerUI's own receiver compares
with the request's, and so never adjusts), and a request it cannot do is
answered FAILURE with the reason (:class:`~dasktrain.training.steering.
Hyperparameters`), not SUCCESS having done nothing.

Each check of the file is a collective of the ranks, at the wrapped
extension's trigger (ChainerUI's default: every iteration); under
ChainerMN's double buffering it first finishes the mean in flight, as
every ChainerMN collective does, so that ``CommandsExtension(trigger=(20,
'iteration'))`` keeps more of the overlap.

Owns the wrapper; the protocol of dasktrain's own loop is
:mod:`~dasktrain.training.steering`'s. Needs ChainerUI 0.11 importable in
the script's environment (its ``chainerui.extensions`` needs only
Chainer).
"""
from chainer.training import extension
from chainer.training.triggers import IntervalTrigger

from dasktrain.training.commandfile import FAILURE, Refused
from dasktrain.training.hyperparams import Hyperparameters


def across_ranks(commands, comm):
    """ChainerUI's ``commands`` extension (a ``CommandsExtension``) made to
    act on every rank of ``comm`` at the same iteration; extend every
    rank's Trainer with it.

    Parameters
    ----------
    commands : chainerui.extensions.CommandsExtension
        As made for one process (its trigger, receivers, file name).
    comm : communicator
        The job's: a ChainerMN communicator (``bcast_obj``) or a dasktrain
        one (``bcast``).

    Examples
    --------
    >>> from chainerui.extensions import CommandsExtension  # doctest: +SKIP
    >>> comm = dasktrain.chainermn.create_communicator()  # doctest: +SKIP
    >>> trainer.extend(across_ranks(CommandsExtension(),
    ...                             comm))  # doctest: +SKIP
    """
    return CommandsAcrossRanks(commands, comm)


class CommandsAcrossRanks(extension.Extension):
    """See :func:`across_ranks`: the wrapped extension's trigger, receivers
    and file, on every rank; rank 0 reads and answers."""

    trigger = 1, 'iteration'
    priority = extension.PRIORITY_READER

    def __init__(self, commands, comm):
        self.commands, self.comm = commands, comm
        self.lead = comm.rank == 0
        self._bcast = getattr(comm, 'bcast_obj', None) or comm.bcast

    def initialize(self, trainer):
        exchange = getattr(getattr(trainer.updater, 'model', None),
                           'exchange', None)
        if getattr(exchange, 'double_buffering', False) and \
                self.comm.size > 1 and not hasattr(self.comm, 'bcast_obj'):
            raise ValueError(
                'across_ranks cannot agree on commands between the steps '
                'of a double-buffered DistributedUpdater (a sum is in '
                'flight there); train without double_buffering, or steer '
                'it with dasktrain train')
        if self.lead:  # the files, and the stop trigger wrapped
            self.commands.initialize(trainer)
            return
        from chainerui.extensions import commands_extension as ui
        wrap = ui._CommandIntervalTrigger \
            if isinstance(trainer.stop_trigger, IntervalTrigger) \
            else ui._CommandTrigger
        trainer.stop_trigger = wrap(trainer.stop_trigger)

    def __call__(self, trainer):
        if not self.commands._trigger(trainer):  # the same on every rank
            return
        from chainerui.utils.command_item import CommandItem
        name = self.commands._file_name
        due = None
        if self.lead:
            found = CommandItem.load_commands(trainer.out, name)
            due = [(i, c.name, c.request) for i, c in enumerate(found)
                   if c.should_execute(trainer)]
        due = self._bcast(due)
        if not due:
            return
        done = [(i, *self._execute(trainer, command, request))
                for i, command, request in due]
        if self.lead:  # read again: what ChainerUI added meanwhile stays
            found = CommandItem.load_commands(trainer.out, name)
            for (i, body, status), (_, command, request) in zip(done, due):
                if i < len(found) and found[i].name == command and \
                        found[i].request == request:
                    found[i].set_response(trainer, status, body)
            CommandItem.dump_commands(found, trainer.out, name)

    def _execute(self, trainer, command, request):
        """(body, status) of carrying out ``command`` on this rank."""
        from chainerui.extensions import commands_extension as ui
        from chainerui.utils.command_item import CommandItem
        receiver = self.commands._receivers.get(command)
        body = request.get('body') if isinstance(request, dict) else None
        if receiver is None:
            return ({'message': f'{command} command is not available or '
                                'supported'}, CommandItem.RESPONSE_FAILURE)
        if receiver is ui.take_snapshot and not self.lead:
            return None, CommandItem.RESPONSE_SUCCESS  # rank 0 writes it
        if receiver is ui.adjust_hyperparams:
            receiver = adjust_hyperparameters
        try:
            return receiver(trainer, body), CommandItem.RESPONSE_SUCCESS
        except Refused as e:
            return {'message': str(e)}, FAILURE
        except Exception as e:  # a receiver of the user's
            return ({'message': f'{type(e).__name__}: {e}'}, FAILURE)

    def finalize(self):
        if self.lead:
            self.commands.finalize()


def adjust_hyperparameters(trainer, body):
    """ChainerUI's ``adjust_hyperparams`` receiver for any optimizer: the
    Trainer's ``main`` optimizer (inside a multi-node wrapper too) takes
    the request's hyperparameters (``lr``: the learning rate, Adam's
    alpha); Refused, with the reason, for one it cannot take."""
    optimizer = trainer.updater.get_optimizer('main')
    actual = getattr(optimizer, 'actual_optimizer', optimizer)
    hyper = Hyperparameters([actual])
    hyper.apply(hyper.check(body))
    return hyper.answer()
