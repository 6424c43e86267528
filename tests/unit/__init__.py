"""Unit tests, in folders that mirror the package (tests/unit/store/ tests kv_offload/store/).

Every folder is a package, so test files of the same name in two folders do not collide under
pytest's default import mode; a test imports another's helpers as `unit.store.test_tiering`.
"""
