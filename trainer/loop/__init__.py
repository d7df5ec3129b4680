"""The store-driven training loop (driver side): `TrainLoop` and what it drives.

loop: the named steps (pull, train, push, checkpoint, export); ranks: the typed `Ranks` over
in-process or Ray rank workers; ledger: the `trained_ids.jsonl` format; metrics: reduction over
ranks and the typed Prometheus handles.
"""
