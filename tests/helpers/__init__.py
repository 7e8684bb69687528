"""Helpers shared by the tests (fixtures stay in conftest.py)."""
