"""The tiered store: the host tier (`host/`) in front of an optional storage tier
(`kv_offload.backends`). `tiered.TieredStore` drives loads (`loads`), stores (`stores`) and
the start-up read probe (`probe`) over jobs (`jobs`); the host tier's slots and eviction are
`manager` and `policies`; what each tier holds is the `key_view`; `generations` keeps a
reset in force across restarts; `tp/` shares records across tensor-parallel sizes."""
