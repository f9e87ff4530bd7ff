"""Serve ChainerUI 0.11 on current gevent: `make chainerui` runs this with
the Python of .venv-chainerui (built from tools/chainerui-requirements.txt).

`chainerui server` calls ``gevent.signal``, which gevent 1.5 (2020) renamed
``gevent.signal_handler``; every gevent that installs on Python >= 3.8 lacks
the old name. This script gives it back and runs ChainerUI's own command
with the same arguments: ``serve_chainerui.py server --host H --port P``.
"""
import sys

import gevent

gevent.signal = gevent.signal_handler

from chainerui.app import main  # noqa: E402  (after the name is back)

if __name__ == '__main__':
    sys.argv[0] = 'chainerui'
    sys.exit(main())
