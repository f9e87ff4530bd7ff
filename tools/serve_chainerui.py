"""Serve ChainerUI 0.11 on current gevent, to its owner alone: `make
chainerui` runs this with the Python of .venv-chainerui (built from
tools/chainerui-requirements.txt), as `serve_chainerui.py server --host H
--port P`.

ChainerUI has no login: its page and its API (which reads every
registered run's logs and settings, writes a run's `OUT/commands` as the
user who serves it, and registers any path that user can read) answer
whoever reaches its port, and on a shared machine every user reaches
127.0.0.1. So this script puts a gate in front of ChainerUI's own app
(:class:`Gate`, WSGI): it answers only a browser that carries the
server's token, a secret drawn at each start and shown only to whoever
started it (printed on their terminal: the address to open, with
`?token=`). The page sets it as a cookie of that address
(`HttpOnly`, `SameSite=Strict`) and drops it from the address; a script
may send it as `Authorization: token T`. The gate also answers no
request whose `Host` is not the address it serves (a web page that
renames itself 127.0.0.1 by DNS cannot reach it). A browser sends a
127.0.0.1 cookie to every port of 127.0.0.1: open no other user's server
there in the browser that holds it (docs/training.md).

And `chainerui server` calls ``gevent.signal``, which gevent 1.5 (2020)
renamed ``gevent.signal_handler``; every gevent that installs on Python
>= 3.8 lacks the old name. This script gives it back.
"""
import argparse
import hmac
import secrets
import sys
from http.cookies import SimpleCookie
from urllib.parse import parse_qs, urlencode

import gevent

gevent.signal = gevent.signal_handler

import chainerui.app  # noqa: E402  (after the name is back)


class Gate:
    """ChainerUI's WSGI ``app`` behind ``token``, served on ``host``:
    ``port`` (see the module); its other attributes are the app's (the
    server sets its ``config``)."""

    def __init__(self, app, token, host, port):
        self.app, self.token = app, token
        self.cookie = f'dasktrain_chainerui_{port}'
        names = {host, 'localhost'} if host in ('127.0.0.1', '::1') \
            else {host}
        self.hosts = {f'{n}:{port}' for n in names} | \
            {f'[{n}]:{port}' for n in names if ':' in n}

    def __getattr__(self, name):
        return getattr(self.app, name)

    def __call__(self, environ, start_response):
        if environ.get('HTTP_HOST', '') not in self.hosts:
            return _refuse(start_response, 'this server answers requests '
                           'for its own address only')
        query = parse_qs(environ.get('QUERY_STRING', ''))
        given = query.pop('token', [None])[0]
        if given is not None and self._right(given):
            # The token becomes the page's cookie, gone from the address.
            path = environ.get('PATH_INFO', '/') or '/'
            rest = urlencode(query, doseq=True)
            start_response('303 See Other', [
                ('Location', path + (f'?{rest}' if rest else '')),
                ('Set-Cookie', f'{self.cookie}={self.token}; Path=/; '
                               'HttpOnly; SameSite=Strict'),
                ('Cache-Control', 'no-store')])
            return [b'']
        if self._right(self._carried(environ)):
            return self.app(environ, start_response)
        return _refuse(start_response, 'ChainerUI here is its owner\'s: open '
                       'the address with ?token= that `make chainerui` '
                       'printed')

    def _carried(self, environ):
        """The token the request carries: its cookie, or its
        ``Authorization: token T`` header."""
        header = environ.get('HTTP_AUTHORIZATION', '')
        if header.startswith('token '):
            return header[len('token '):].strip()
        cookies = SimpleCookie()
        try:
            cookies.load(environ.get('HTTP_COOKIE', ''))
        except Exception:  # a malformed header: no token
            return ''
        found = cookies.get(self.cookie)
        return found.value if found is not None else ''

    def _right(self, given):
        return hmac.compare_digest(given.encode(), self.token.encode())


def _refuse(start_response, why):
    start_response('403 Forbidden', [('Content-Type', 'text/plain')])
    return [why.encode() + b'\n']


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument('--host', default='127.0.0.1')
    parser.add_argument('--port', type=int, default=5000)
    known, _ = parser.parse_known_args(argv)
    token = secrets.token_urlsafe(32)
    create = chainerui.app.create_app  # what its server handler calls

    def gated():
        return Gate(create(), token, known.host, known.port)
    chainerui.app.create_app = gated
    host = f'[{known.host}]' if ':' in known.host else known.host
    print(f' * ChainerUI for you alone: open http://{host}:{known.port}/'
          f'?token={token}', flush=True)
    sys.argv = ['chainerui', *argv]
    return chainerui.app.main()


if __name__ == '__main__':
    sys.exit(main())
