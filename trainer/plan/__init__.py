"""`r3flow plan`: per-rank GPU memory of a training job, and whether it fits (memory.py owns the
model, models.py the architectures it knows by name, manifest.py reads job specs, cli.py the CLI)."""
