"""gRPC metadata keys of the store's contract (beside proto/r3flow/v1/store.proto, which cannot
state metadata): both sides import them from here."""

from __future__ import annotations

# Trailing metadata of a RESOURCE_EXHAUSTED answer that is backpressure: wait this many ms and
# send again. A size refusal carries none (sending again cannot help).
RETRY_AFTER_KEY = "retry-after-ms"
# Beside it: which limit refused (CapacityError.reason: backlog, inflight, groups_ahead,
# redis_full, unacked).
REFUSAL_REASON_KEY = "r3flow-refusal-reason"

# Invocation metadata of an Append stream: how many messages the client is sending. The store
# commits a stream only when that many arrived: a message over gRPC's receive cap ends the
# server's request iterator like a clean half-close (the cancellation comes a moment later), so
# without the count a stream cut short there could be committed in part.
APPEND_MESSAGES_KEY = "r3flow-append-messages"
