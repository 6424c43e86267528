"""The connector's scheduler side: hits, load and store plans, KV events. Keys and block ids
only: nothing here imports torch, the kernels, the store or the tiers."""
