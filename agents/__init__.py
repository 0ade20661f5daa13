"""RL agents built on detrl (the deterministic DQN arrives with its own issue)."""
