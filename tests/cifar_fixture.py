"""Small archives in the real CIFAR-10 format, and a real HTTP server for them.

The batch files are written opcode by opcode as Python 2's cPickle wrote
them (protocol 2, ``str`` as BINSTRING, arrays through
``numpy.core.multiarray._reconstruct``), so the loader meets what the real
archive holds rather than what Python 3 would write.
"""
import hashlib
import http.server
import io
import struct
import tarfile
import threading
from pathlib import Path

import numpy as np

LABEL_NAMES = ['airplane', 'automobile', 'bird', 'cat', 'deer', 'dog',
               'frog', 'horse', 'ship', 'truck']


def _str(b):
    if len(b) < 256:
        return b'U' + bytes([len(b)]) + b                # SHORT_BINSTRING
    return b'T' + struct.pack('<i', len(b)) + b          # BINSTRING


def _int(i):
    if 0 <= i < 256:
        return b'K' + bytes([i])                         # BININT1
    return b'J' + struct.pack('<i', i)                   # BININT


def _ndarray(a):
    shape = b''.join(_int(n) for n in a.shape)
    shape += {1: b'\x85', 2: b'\x86', 3: b'\x87'}[a.ndim]
    dtype = (b'cnumpy\ndtype\n' + _str(a.dtype.str[1:].encode()) +
             b'\x89\x88\x87R' +                          # (name, False, True)
             b'(' + _int(3) + _str(a.dtype.str[:1].encode()) +
             b'NNN' + b'J\xff\xff\xff\xff' * 2 + _int(0) + b'tb')
    return (b'cnumpy.core.multiarray\n_reconstruct\n' +
            b'cnumpy\nndarray\n' + _int(0) + b'\x85' + _str(b'b') +
            b'\x87R' + b'(' + _int(1) + shape + dtype + b'\x89' +
            _str(np.ascontiguousarray(a).tobytes()) + b'tb')


def _obj(o):
    if isinstance(o, bytes):
        return _str(o)
    if isinstance(o, (int, np.integer)):
        return _int(int(o))
    if isinstance(o, np.ndarray):
        return _ndarray(o)
    if isinstance(o, list):
        return b'](' + b''.join(_obj(x) for x in o) + b'e'
    if isinstance(o, dict):
        return b'}(' + b''.join(_obj(k) + _obj(v) for k, v in o.items()) + b'u'
    raise TypeError(type(o))


def py2_pickle(obj):
    """Bytes of ``obj`` as Python 2's cPickle.dump(obj, f, 2) wrote them."""
    return b'\x80\x02' + _obj(obj) + b'.'


def make_batches(n_train=(20, 20, 20, 20, 20), n_test=20, seed=0):
    """{name: (images uint8 (N,3,32,32), labels)} for a CIFAR-like split.

    Images are a per-image colour ramp plus noise: distinct per image and
    learnable from their label (each class has its own mean colour).
    """
    rng = np.random.RandomState(seed)
    out = {}
    names = [f'data_batch_{i + 1}' for i in range(len(n_train))]
    for name, n in zip(names + ['test_batch'], list(n_train) + [n_test]):
        labels = rng.randint(0, 10, size=n)
        base = (labels[:, None] * 23 + np.arange(3)[None, :] * 60) % 200
        images = base[:, :, None, None] + rng.randint(0, 56, (n, 3, 32, 32))
        out[name] = (images.astype(np.uint8), labels)
    return out


def batch_file(images, labels, name=b'training batch'):
    n = len(images)
    return py2_pickle({
        b'batch_label': name,
        b'labels': [int(t) for t in labels],
        b'data': images.reshape(n, -1),
        b'filenames': [b'img_%05d.png' % i for i in range(n)],
    })


def meta_file():
    return py2_pickle({b'num_cases_per_batch': 10000,
                       b'label_names': [s.encode() for s in LABEL_NAMES],
                       b'num_vis': 3072})


def write_archive(path, batches, extra=(), compresslevel=1):
    """Write ``cifar-10-python.tar.gz`` holding ``batches``; return its MD5.

    ``extra`` is a sequence of (TarInfo, bytes or None) members to append, for
    archives that try something nasty.
    """
    files = {f'cifar-10-batches-py/{name}': batch_file(*arrays)
             for name, arrays in batches.items()}
    files['cifar-10-batches-py/batches.meta'] = meta_file()
    with tarfile.open(path, 'w:gz', compresslevel=compresslevel) as tar:
        folder = tarfile.TarInfo('cifar-10-batches-py')
        folder.type, folder.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(folder)
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
        for info, content in extra:
            tar.addfile(info, io.BytesIO(content) if content else None)
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


class ArchiveServer:
    """A real HTTP server on 127.0.0.1 serving files, with fault injection.

    ``faults`` is a list consumed one request at a time; each entry is
    ``None`` (serve normally), an int status to answer with, ``('cut', n)``
    to send only n bytes of the body and close, or ``'no-range'`` to ignore
    a Range header. ``requests`` records (path, Range header) of each request.
    """

    def __init__(self, root):
        self.root = Path(root)
        self.faults = []
        self.requests = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = 'HTTP/1.1'

            def log_message(self, *args):
                pass

            def do_GET(self):
                server.requests.append((self.path, self.headers.get('Range')))
                fault = server.faults.pop(0) if server.faults else None
                if isinstance(fault, int):
                    self.send_response(fault)
                    self.send_header('Content-Length', '0')
                    self.end_headers()
                    return
                path = server.root / self.path.lstrip('/')
                if not path.is_file():
                    self.send_response(404)
                    self.send_header('Content-Length', '0')
                    self.end_headers()
                    return
                data = path.read_bytes()
                start = 0
                spec = self.headers.get('Range')
                if spec and fault != 'no-range':
                    start = int(spec.split('=')[1].split('-')[0])
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header('Content-Length', '0')
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header('Content-Range',
                                     f'bytes {start}-{len(data) - 1}/'
                                     f'{len(data)}')
                else:
                    self.send_response(200)
                body = data[start:]
                self.send_header('Content-Length', str(len(body)))
                self.send_header('Accept-Ranges', 'bytes')
                self.end_headers()
                if isinstance(fault, tuple) and fault[0] == 'cut':
                    self.wfile.write(body[:fault[1]])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       daemon=True)

    def url(self, name='cifar-10-python.tar.gz'):
        return f'http://127.0.0.1:{self.port}/{name}'

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()
