"""`r3flow local`: the whole system as local processes (embedded Redis, store, rollout, trainer)."""
