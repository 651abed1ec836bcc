-- The bookkeeping of the models' own schema migrations (a model's `migrations` folder): one
-- row per applied file, so a file is applied once, and an applied file whose text changed is
-- refused by name (its checksum, sha256 of the file's bytes, no longer matches). Kept apart
-- from the project's own migrations (`public._sqlx_migrations`), whose versions a model's
-- files could otherwise collide with.
CREATE TABLE parsley.model_migrations (
    model      text        NOT NULL,
    version    bigint      NOT NULL,
    name       text        NOT NULL,
    checksum   bytea       NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (model, version)
);
