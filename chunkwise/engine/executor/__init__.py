"""The executors the engine runs its steps through (executor.py: one device, or rank 0 of N) and the worker
processes and their messages (workers.py), above the model runner."""
