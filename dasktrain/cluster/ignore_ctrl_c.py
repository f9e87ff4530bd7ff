"""The local workers' Dask preload
(``preload=['dasktrain.cluster.ignore_ctrl_c']``): a worker ignores
Ctrl-C, and keeps quiet about the tasks its command cancels on the way
out.

A terminal sends SIGINT to every process of its foreground group, local
worker processes included; each would print a screen of tracebacks while
the command that started them is already shutting them down, and then a
warning for each rank task the command cancelled ("Async instruction ...
ended with CancelledError"). Owns those two settings.
"""
import logging
import signal
import threading


def dask_setup(worker):
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Its warnings are the cancels the command itself asked for.
    logging.getLogger('distributed.worker.state_machine').setLevel(
        logging.ERROR)
