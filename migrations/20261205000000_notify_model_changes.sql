-- A change to a model that is not a step also notifies its readers: a gateway keeps covered
-- snapshots of single-key reads in memory until the next notification of the key's owner
-- task or of the whole model (docs/gateway.md, "Kept snapshots"). Steps notify
-- `'<model>:<task>'` themselves; these triggers notify `'<model>'` on the clock channel when
-- a model is recorded, removed (a rebuild deletes it) or its shape changes, and for every
-- model before the models or the documents are truncated. Like every NOTIFY, it is delivered
-- when the transaction commits.
CREATE FUNCTION parsley.notify_model_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        PERFORM pg_notify('parsley_clock', OLD.model);
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        PERFORM pg_notify('parsley_clock', NEW.model);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER models_recorded_or_removed
    AFTER INSERT OR DELETE ON parsley.models
    FOR EACH ROW EXECUTE FUNCTION parsley.notify_model_changed();

CREATE TRIGGER models_reshaped
    AFTER UPDATE ON parsley.models
    FOR EACH ROW
    WHEN (OLD.shape_id IS DISTINCT FROM NEW.shape_id OR OLD.model IS DISTINCT FROM NEW.model)
    EXECUTE FUNCTION parsley.notify_model_changed();

-- TRUNCATE fires no row trigger: notify every model while the rows are still there.
CREATE FUNCTION parsley.notify_every_model() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('parsley_clock', model) FROM parsley.models;
    RETURN NULL;
END
$$;

CREATE TRIGGER models_truncated
    BEFORE TRUNCATE ON parsley.models
    FOR EACH STATEMENT EXECUTE FUNCTION parsley.notify_every_model();

CREATE TRIGGER documents_truncated
    BEFORE TRUNCATE ON projection.documents
    FOR EACH STATEMENT EXECUTE FUNCTION parsley.notify_every_model();
