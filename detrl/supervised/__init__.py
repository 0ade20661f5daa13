"""Supervised recipes: models, data and the train loop that records and replays through a Session."""
