-- The custom projection's table: one row per record, with the status its value names.
-- IF NOT EXISTS: the example's tests run many models (one per run) over this same table.
CREATE SCHEMA IF NOT EXISTS order_events;

CREATE TABLE IF NOT EXISTS order_events.events (
    seq       bigserial PRIMARY KEY,
    model     text   NOT NULL,
    topic     text   NOT NULL,
    partition int    NOT NULL,
    position  bigint NOT NULL,
    key       text,
    status    text,
    causes    int    NOT NULL,
    UNIQUE (model, topic, partition, position)
);
