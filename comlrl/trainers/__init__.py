"""Trainers, importable as in comlrl: `from comlrl.trainers.reinforce import MAGRPOTrainer`."""
