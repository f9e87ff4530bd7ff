"""The examples in the job queue's docstrings hold: the rules each module
states in its own words, run as doctests."""
import doctest
import importlib

import pytest

MODULES = [
    'dasktrain.jobs.job', 'dasktrain.jobs.request', 'dasktrain.jobs.fits',
    'dasktrain.jobs.wire',
    'dasktrain.jobs.status', 'dasktrain.jobs.end_notice',
    'dasktrain.jobs.client.route', 'dasktrain.jobs.scheduler.policy',
    'dasktrain.jobs.ending', 'dasktrain.jobs.record', 'dasktrain.jobs.fields',
    'dasktrain.jobs.worker.program',
    'dasktrain.jobs.worker.environment', 'dasktrain.jobs.worker.gpu_use',
    'dasktrain.run.driver', 'dasktrain.run.launch', 'dasktrain.keeper']


@pytest.mark.parametrize('name', MODULES)
def test_the_examples_hold(name):
    result = doctest.testmod(importlib.import_module(name),
                             optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, name
