"""Helpers shared by the tests (not tests themselves): `from helpers.tier_helpers import ...`.

`tests/` is on the path: pyproject's `[tool.pytest.ini_options] pythonpath` for pytest; a
script outside pytest (a benchmark, a child process) puts it there itself. Keep this file
free of imports: some helpers need vllm, which a test imports only after `importorskip`.
"""
