"""r3flow services: the trajectory store, the rollout worker and their shared parts."""
