"""Tensor parallelism's collectives, below the model: a rank's shard and collectives (tensor_parallel.py), and the
custom all-reduce over peer memory (custom_all_reduce.py, peer_memory.py). Nothing here knows about steps."""
