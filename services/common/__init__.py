"""Parts every r3flow process shares: routing codec, typed config, metrics, gRPC stubs."""
