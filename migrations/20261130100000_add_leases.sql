-- Leases: which instance should run each task, and the instances that share a model's tasks.
-- A lease decides only who *should* run a task; the epoch, checked under the row lock by
-- every step, still decides who *may commit*. Times are the database server's clock
-- (`now()`), one clock for every instance; safety never depends on them.

-- lease_until: the owner runs the task until then unless it renews (every step and every
-- heartbeat do); NULL: nobody holds it (never taken by a balancing instance, or handed back).
-- last_step_at: when the owner's runner last stepped (committed or found nothing to do).
ALTER TABLE parsley.tasks
    ADD COLUMN lease_until  timestamptz,
    ADD COLUMN last_step_at timestamptz;

-- One row per (model, running instance). An instance renews its row every heartbeat and
-- deletes it when it stops cleanly; a row whose lease passed is an instance that died or
-- froze. `balanced`: the instance shares the model's tasks with the other balanced
-- instances (false: it runs a fixed list of tasks). `incarnation` tells two processes
-- under the same instance name apart.
CREATE TABLE parsley.members (
    model        text        NOT NULL REFERENCES parsley.models (model),
    instance     text        NOT NULL,
    incarnation  text        NOT NULL,
    balanced     boolean     NOT NULL,
    lease_until  timestamptz NOT NULL,
    joined_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (model, instance)
);
