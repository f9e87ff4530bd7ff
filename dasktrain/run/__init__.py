"""Runs: a training run where placement puts it
(:mod:`~dasktrain.run.train`, ``train(config)``), ``dasktrain launch``
(:mod:`~dasktrain.run.launch`, a program as N ranks), and the one rank
driver of every job of ranks, theirs and a gang's
(:mod:`~dasktrain.run.driver`). Nothing is exported
here: ``dasktrain.train`` is :func:`dasktrain.run.train.train`."""
