-- The two ways past a record a task cannot deliver (docs/projector.md, "Rejections, skip
-- and dead letters"). In both, the record counts as delivered without effect: its position
-- joins the task's delivered past, the projection never applies it.

-- Records an operator skipped with `parsley-projector skip`, one row per record, never
-- updated or deleted (the audit trail; a rebuild of the model removes them with the rest of
-- its state). A restore reads them: a skipped record is fed to the engine with no causes
-- and marked so that its delivery is not handed to the projection.
--   record_found    what the skip command found in Kafka at the position: 'read' (the
--                   record; its key and parsley.causes headers are copied below), 'gone'
--                   (below the log start: retention removed it), 'absent' (no data record
--                   there: a transaction marker, an aborted or a compacted record);
--   causes_headers  every parsley.causes header of the record as read, in the framing of
--                   held.headers (name, value), so a repeated or null header is kept too;
--   refusal_reason, refusal_diagnosis
--                   the refusal the skip cleared.
CREATE TABLE parsley.skips (
    model              text        NOT NULL,
    task               integer     NOT NULL,
    topic_id           uuid        NOT NULL,
    partition          integer     NOT NULL CHECK (partition >= 0),
    position           bigint      NOT NULL CHECK (position >= 0),
    skipped_by         text        NOT NULL,
    skipped_at         timestamptz NOT NULL DEFAULT now(),
    reason             text        NOT NULL,
    refusal_reason     text,
    refusal_diagnosis  text,
    record_found       text        NOT NULL CHECK (record_found IN ('read', 'gone', 'absent')),
    record_key         bytea,
    causes_headers     bytea,
    PRIMARY KEY (model, task, topic_id, partition, position),
    FOREIGN KEY (model, task) REFERENCES parsley.tasks (model, task)
);

-- Records the projection rejected under a model's `on_rejected = "dead-letter"` policy,
-- written by the step that delivered them without effect (same transaction). The record is
-- kept whole: key, value, application headers (the framing of held.headers), timestamp and
-- its parsley.causes value (canonical encoding), with the projection's reason.
CREATE TABLE parsley.dead_letters (
    model             text        NOT NULL,
    task              integer     NOT NULL,
    topic_id          uuid        NOT NULL,
    partition         integer     NOT NULL CHECK (partition >= 0),
    position          bigint      NOT NULL CHECK (position >= 0),
    record_key        bytea,
    record_value      bytea,
    headers           bytea       NOT NULL,
    timestamp_ms      bigint,
    causes            bytea       NOT NULL,
    reason            text        NOT NULL,
    dead_lettered_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (model, task, topic_id, partition, position),
    FOREIGN KEY (model, task) REFERENCES parsley.tasks (model, task)
);
