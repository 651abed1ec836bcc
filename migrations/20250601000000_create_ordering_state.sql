-- Ordering state of the Postgres-hosted projector, in its own schema `parsley`, apart from
-- application tables. Every row belongs to one model; per-task rows are written only by the
-- step transactions of the task's current owner (see docs/projector.md).

CREATE SCHEMA IF NOT EXISTS parsley;

-- One row per model: its task count (the received topics' common partition count) and the
-- format of the ordering state it was written in. A build that does not know the format
-- refuses UNKNOWN_ORDERING_STATE_FORMAT rather than misread it.
CREATE TABLE parsley.models (
    model          text        PRIMARY KEY,
    task_count     integer     NOT NULL CHECK (task_count > 0),
    format_version integer     NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now()
);

-- The topic identities a model recorded: a name resolving to another topic ID later means
-- the topic was deleted and recreated (CHANNEL_IDENTITY_CHANGED).
CREATE TABLE parsley.topics (
    model       text        NOT NULL REFERENCES parsley.models (model),
    topic_name  text        NOT NULL,
    topic_id    uuid        NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (model, topic_name)
);

-- One row per task: the fencing epoch and owner, and the task's status.
--   running  the task steps normally;
--   failing  the last step failed (projection error, database trouble) and is retried with
--            backoff on the same records; last_error says why;
--   refused  the task stopped delivering with a named reason (sticky until an operator
--            clears it), naming the channel and position when there is one.
CREATE TABLE parsley.tasks (
    model              text        NOT NULL REFERENCES parsley.models (model),
    task               integer     NOT NULL CHECK (task >= 0),
    epoch              bigint      NOT NULL,
    owner              text        NOT NULL,
    status             text        NOT NULL DEFAULT 'running'
                                   CHECK (status IN ('running', 'failing', 'refused')),
    last_error         text,
    failures           integer     NOT NULL DEFAULT 0,
    failing_since      timestamptz,
    refusal_reason     text,
    refusal_diagnosis  text,
    refusal_topic_id   uuid,
    refusal_partition  integer,
    refusal_position   bigint,
    updated_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (model, task)
);

-- fed_up_to per received channel of a task: every position at or below it has been fed to
-- the task or will never yield a record. The task resumes reading at fed_up_to + 1.
CREATE TABLE parsley.channels (
    model      text    NOT NULL,
    task       integer NOT NULL,
    topic_id   uuid    NOT NULL,
    partition  integer NOT NULL CHECK (partition >= 0),
    fed_up_to  bigint  NOT NULL CHECK (fed_up_to >= -1),
    PRIMARY KEY (model, task, topic_id, partition),
    FOREIGN KEY (model, task) REFERENCES parsley.tasks (model, task)
);

-- Received, undelivered records, verbatim, in position order per channel. `causes` is the
-- record's parsley.causes value (the canonical encoding, byte for byte what was received);
-- `headers` holds the other headers in a length-prefixed framing (docs/projector.md).
CREATE TABLE parsley.held (
    model        text    NOT NULL,
    task         integer NOT NULL,
    topic_id     uuid    NOT NULL,
    partition    integer NOT NULL CHECK (partition >= 0),
    position     bigint  NOT NULL CHECK (position >= 0),
    record_key   bytea,
    record_value bytea,
    headers      bytea   NOT NULL,
    timestamp_ms bigint,
    causes       bytea   NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (model, task, topic_id, partition, position),
    FOREIGN KEY (model, task) REFERENCES parsley.tasks (model, task)
);

-- The frontier: per channel, the highest position known to be a cause of the task's future
-- sends (grows on receipt and on delivery).
CREATE TABLE parsley.frontier (
    model      text    NOT NULL,
    task       integer NOT NULL,
    topic_id   uuid    NOT NULL,
    partition  integer NOT NULL CHECK (partition >= 0),
    position   bigint  NOT NULL CHECK (position >= 0),
    PRIMARY KEY (model, task, topic_id, partition),
    FOREIGN KEY (model, task) REFERENCES parsley.tasks (model, task)
);

-- The clock: the task's delivered past, one row per (model, task, channel). It grows only
-- on delivery and is what reads are gated on. The meet over a model's tasks is
--   SELECT topic_id, partition, MIN(position), COUNT(*) FROM parsley.clock
--   WHERE model = $1 GROUP BY topic_id, partition
CREATE TABLE parsley.clock (
    model      text    NOT NULL,
    task       integer NOT NULL,
    topic_id   uuid    NOT NULL,
    partition  integer NOT NULL CHECK (partition >= 0),
    position   bigint  NOT NULL CHECK (position >= 0),
    PRIMARY KEY (model, task, topic_id, partition),
    FOREIGN KEY (model, task) REFERENCES parsley.tasks (model, task)
);

CREATE INDEX clock_by_channel ON parsley.clock (model, topic_id, partition);
