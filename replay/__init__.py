"""``agentgate replay``: trace replays through every routing policy on in-process sim workers.

    workloads   TraceRequest, load_mooncake, agent_workload (the inputs)
    harness     replay(requests, policy, ReplayConfig) -> ReplayResult (virtual time)
    sim_worker  one in-process sim Engine, its events fed to the router's KVIndex
    tokens      deterministic token ids and page hashes of trace blocks
    metrics     per-request records and the per-policy summary
    report      table, JSON document, PNG plots
    cli         the command line; live: the same slice through real processes

Nothing is imported here: ``replay.workloads`` stays torch-free, the harness loads the engine.
"""
