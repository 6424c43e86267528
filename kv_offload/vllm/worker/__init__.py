"""The connector's worker side: one `OffloadWorker` per rank drives its tiered store (loads
before the forward, stores after it, in-step and layer-wise loads, the pump thread)."""
