"""A Dask worker preload (``preload=['dasktrain.cluster.calm']``): the
worker ignores Ctrl-C.

A terminal sends SIGINT to every process of its foreground group, local
worker processes included; each would print a screen of tracebacks while
the command that started them is already shutting them down. Owns that
one setting.
"""
import signal
import threading


def dask_setup(worker):
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
