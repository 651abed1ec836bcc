-- The generic document projection's table, in the application schema `projection` (apart
-- from the ordering state in `parsley`). One JSON document per (model, record key), written
-- only by the step transactions of the task that received the key (the key's partition).
-- `topic_id`/`partition`/`position` name the last record applied to the document and
-- `version` counts the records applied to it since it was (re)created.

CREATE SCHEMA IF NOT EXISTS projection;

CREATE TABLE projection.documents (
    model      text        NOT NULL,
    key        text        NOT NULL,
    task       integer     NOT NULL CHECK (task >= 0),
    doc        jsonb       NOT NULL,
    topic_id   uuid        NOT NULL,
    partition  integer     NOT NULL,
    position   bigint      NOT NULL,
    version    bigint      NOT NULL DEFAULT 1,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (model, key)
);

CREATE INDEX documents_by_task ON projection.documents (model, task, key);
