"""Helpers shared by the tests and the benchmarks, imported as modules (`tests.support.X`): the
repository root is on sys.path under pytest (pyproject: pythonpath) and in every bench script
(`python tests/bench/x.py` puts it there first), so nothing is loaded by file path."""
