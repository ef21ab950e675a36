"""The README's example and what it shares with the tests and benchmarks.

Each piece lives here once and is imported by the others: the seed example's reward
(`rewards`), the environment that keeps every run on this machine (`local_env`), and the
W&B history reader with the training-curve picture (`training_curve`).
"""
