"""The engine worker process: one ``Engine`` behind ZeroMQ (``python -m engine.worker``).

    server.py        the ``Worker``: the ROUTER request loop around an ``Engine``
    requests.py      ``RequestManager``: each client request's life (admit, compile, emit, end)
    replies.py       ``ReplySender``: replies to clients, batched per step, never blocking
    cli.py           the command line (flags, signals, the start line); torch-free until ``run``
    config.py        ``WorkerConfig``, the worker's own settings
    clients.py       ``ClientWatch``: which clients are still there
    grammar_jobs.py  grammar compiles on their own threads
    publisher.py     what the worker sends: reply streams, KV events, load reports
    events.py        the KV event wire types and their PUB/SUB transport (imported by the gateway)
    curve.py         CURVE key files, socket keys and the ZAP handler (imported by the gateway)

NOTE: nothing is imported here, so that the gateway can import ``engine.worker.events`` and
``engine.worker.curve`` without torch; import the submodules directly.
"""
