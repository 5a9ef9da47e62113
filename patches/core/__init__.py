"""Leaf services every layer of the splice may use: request state, process state, counters,
shortages, model support, tensor parallelism and the hook contract."""
