-- The checker's SQL model (`check_q` in config/check.toml): the same replace and merge
-- records the documents model applies, kept in a table of the model's own and read back
-- through the named query `document`. `version` counts the records applied to a key, as a
-- document's version does, so the checker judges the query's answers by the same rules.
CREATE SCHEMA IF NOT EXISTS check_q;

CREATE TABLE IF NOT EXISTS check_q.documents (
    key     text   PRIMARY KEY,
    doc     jsonb  NOT NULL,
    version bigint NOT NULL
);
