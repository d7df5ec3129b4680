"""From pulled groups to what a step trains: routing rows aligned to the model's MoE layers (alignment), samples and micro-batches (batch), a rank's intake of its groups (intake)."""
