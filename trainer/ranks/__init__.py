"""Rank plumbing: one rank (worker), the ranks in-process (local_ranks) or as Ray actors (ray_launch, ray_config), and the decisions every rank takes together (collectives)."""
