"""What :mod:`dasktrain.chainermn` does not do, said as one line naming
the call: :class:`Unsupported`, and the ChainerMN names that raise it."""
from dasktrain.errors import UserError


class Unsupported(UserError, NotImplementedError):
    """A ChainerMN call that ``dasktrain.chainermn`` does not offer.

    Examples
    --------
    >>> str(Unsupported('chainermn.functions.send()'))
    'dasktrain.chainermn does not support chainermn.functions.send()'
    """

    def __init__(self, call, why=None):
        super().__init__(f'dasktrain.chainermn does not support {call}'
                         + (f': {why}' if why else ''))


#: ChainerMN's public names that have no counterpart here.
MISSING = ('functions', 'iterators', 'global_except_hook',
           'MultiNodeChainList', 'create_multi_node_iterator',
           'create_synchronized_iterator', 'create_multi_node_n_step_rnn',
           'create_mnbn_model')
