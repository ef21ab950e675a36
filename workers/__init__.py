"""The Ray roles: rollout workers (engines), learners, the checkpointer, and their launch."""
