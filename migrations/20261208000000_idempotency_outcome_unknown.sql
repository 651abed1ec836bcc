-- A third state of an idempotency key: `unknown`, a write whose outcome the gateway could not
-- learn (Kafka did not confirm it either way, or the gateway that claimed the key died while
-- writing). A retry with the same key answers `409 idempotency-outcome-unknown` instead of
-- writing a second copy; the entry lives out its window like any other.
ALTER TABLE parsley.idempotency_keys DROP CONSTRAINT idempotency_keys_state_check;
ALTER TABLE parsley.idempotency_keys
    ADD CONSTRAINT idempotency_keys_state_check CHECK (state IN ('pending', 'done', 'unknown'));
