"""Process plumbing every layer may use: contained faults logged once per episode
(`faults`), our threads kept off the engine's cores (`affinity`), the shared secret read
from `secret_file` (`secret_file`), and the old import paths of moved modules (`moved`).
Imports nothing of kv_offload but `kv_offload.errors`."""
