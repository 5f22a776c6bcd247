"""The real control plane in the test suite: the node agent (node_agent.py) and the pytest fixtures (fixtures.py)
on top of scripts/testbed.sh. Importable as `testbed` (tests/ is on sys.path under pytest)."""
