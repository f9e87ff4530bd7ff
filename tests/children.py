"""Child processes a test starts and reads, never outliving it.

A test that waits on a child must fail, never hang the suite: the child
runs in a session of its own (so its whole process group can be killed),
its output is read by a daemon thread (which cannot keep pytest from
exiting), and leaving the ``with`` block kills what is still running.
"""
import contextlib
import os
import signal
import subprocess
import sys
import threading


class Child:
    """A running child: ``lines`` grows with its stdout as it prints."""

    def __init__(self, argv, env=None, cwd=None):
        self.lines, self.err = [], []
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env, cwd=cwd, start_new_session=True)
        self.readers = [
            threading.Thread(target=lambda s=stream, i=into: i.extend(s),
                             daemon=True)
            for stream, into in ((self.proc.stdout, self.lines),
                                 (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    def signal(self, signum):
        self.proc.send_signal(signum)

    def wait(self, timeout):
        """The exit code within ``timeout`` seconds, else AssertionError
        (the child is killed on the way out of :func:`child`)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f'{self.proc.args} still running after '
                                 f'{timeout} s') from None

    def stderr(self, timeout=5):
        """What the child wrote to stderr, once the readers have drained
        the pipes (after it exited; a grandchild holding them open is
        waited for ``timeout`` seconds at most)."""
        for reader in self.readers:
            reader.join(timeout)
        return ''.join(self.err)

    def stdout(self, timeout=5):
        """What the child printed, once the readers have drained the
        pipes (as :meth:`stderr`): after ``wait``, ``lines`` may still be
        filling."""
        for reader in self.readers:
            reader.join(timeout)
        return ''.join(self.lines)

    def kill(self):
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


@contextlib.contextmanager
def child(*args, env=None, cwd=None):
    """``python -m dasktrain.cli ARGS`` (or any argv when ``args[0]`` is a
    list), killed with its process group when the block is left."""
    argv = args[0] if args and isinstance(args[0], list) else \
        [sys.executable, '-m', 'dasktrain.cli', *args]
    running = Child(argv, env=env, cwd=cwd)
    try:
        yield running
    finally:
        running.kill()
