-- Idempotency keys of the gateway's writes: a retried request with the same key (within the
-- same subject) and the same route and body answers the first acknowledgement instead of
-- writing again, on any gateway of a fleet.
--   pending  a gateway is writing the request (or died doing so: taken over once stale);
--   done     written; `response` holds the acknowledgement to answer retries with.
CREATE TABLE parsley.idempotency_keys (
    scope        text        NOT NULL,
    key          text        NOT NULL,
    request_hash bytea       NOT NULL,
    state        text        NOT NULL CHECK (state IN ('pending', 'done')),
    response     jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    PRIMARY KEY (scope, key)
);

CREATE INDEX idempotency_keys_by_expiry ON parsley.idempotency_keys (expires_at);
