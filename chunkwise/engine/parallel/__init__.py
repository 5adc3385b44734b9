"""Tensor parallelism: the executors the engine runs its steps through (executor.py), the worker processes and
their messages (workers.py), a rank's shard and collectives (tensor_parallel.py), and the custom all-reduce over
peer memory (custom_all_reduce.py, peer_memory.py)."""
