"""Solve: pick one decomposition per layer (ILP in ``ilp``; brute force in ``brute`` for tests)."""
