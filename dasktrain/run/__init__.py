"""Runs: a training run where placement puts it
(:mod:`~dasktrain.run.train`, ``train(config)``), ``dasktrain launch``
(:mod:`~dasktrain.run.launch`, a program as N ranks), and the one rank
driver both use (:mod:`~dasktrain.run.driver`). Nothing is exported
here: ``dasktrain.train`` is :func:`dasktrain.run.train.train`."""
