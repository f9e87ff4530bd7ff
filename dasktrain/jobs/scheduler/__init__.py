"""The queue in the scheduler process: its policy
(:mod:`~dasktrain.jobs.scheduler.policy`, pure), the dispatcher that
applies it to every job (:mod:`~dasktrain.jobs.scheduler.dispatch`), GPUs
busy outside the queue (:mod:`~dasktrain.jobs.scheduler.outside_use`),
a shared cluster's socket server
(:mod:`~dasktrain.jobs.scheduler.socket_server`), jobs a scheduler lost
(:mod:`~dasktrain.jobs.scheduler.recovery`), its answers to other
processes (:mod:`~dasktrain.jobs.scheduler.query`), the job board,
metrics and page, and the preload that installs them
(:mod:`~dasktrain.jobs.scheduler.preload`)."""
