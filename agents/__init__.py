"""RL agents built on detrl: the deterministic DQN (dqn.py), its networks, replay buffers, the SB3 bridge."""
