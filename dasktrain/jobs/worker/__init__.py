"""A job on its Dask worker: the one task body for every job
(:mod:`~dasktrain.jobs.worker.task`: a program under its keeper), a
training job's own program (:mod:`~dasktrain.jobs.worker.train_job`), whom a
job runs as (:mod:`~dasktrain.jobs.worker.runas`), its environment
(:mod:`~dasktrain.jobs.worker.environment`), who uses the worker's GPUs
(:mod:`~dasktrain.jobs.worker.gpu_use`) and the preload that reports it
(:mod:`~dasktrain.jobs.worker.preload`)."""
