"""Tensor parallelism: a pass over the built K2 target, gpt-fast style.

    sharding.py  which slice of each tensor rank r of tp reads; bytes_per_rank for the plan
    comm.py      the process group and the rank-ordered (deterministic, batch-invariant) all-reduce
    launch.py    launch_tp(cfg, checkpoint, ops): ranks 1..N-1 as child processes, rank 0 here -> TPModel
    worker.py    a rank 1..N-1: load its slices, run rank 0's commands
    model.py     TPModel / TPCache: the Target protocol on rank 0, every target op mirrored on all ranks
Engine.from_config uses launch_tp when tp.size > 1; Engine.close() stops the workers.
"""
