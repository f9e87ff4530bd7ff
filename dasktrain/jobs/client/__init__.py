"""The submitter's side of the queue, in the submitter's process: which
queue to talk to (:mod:`~dasktrain.jobs.client.route`), submitting
(:mod:`~dasktrain.jobs.client.submit`), and a shared cluster's socket
client (:mod:`~dasktrain.jobs.client.socket_client`)."""
