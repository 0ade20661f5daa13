"""Gymnasium environments under the detrl switchboard (arrive with the DQN issue)."""
