-- A model's shape identity: a value that changes whenever the shape its gated reads depend on
-- changes — its width (task_count), its ordering-state format, or any of its recorded topic
-- identities (a row of parsley.topics added, changed or removed). A gateway caches a model's
-- shape under this value and has its gated statement return the topic identities only when
-- the recorded value is not the cached one (docs/gateway.md, "Read path").
--
-- Triggers keep it, so no writer has to remember to: a new random UUID every time, never a
-- counter, so a model deleted and recorded again (a rebuild), or a database restored from an
-- older dump, can never show a value a gateway cached for another shape.
ALTER TABLE parsley.models ADD COLUMN shape_id uuid NOT NULL DEFAULT gen_random_uuid();

-- The model row's own shape columns.
CREATE FUNCTION parsley.new_shape_id_of_model() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.shape_id := gen_random_uuid();
    RETURN NEW;
END
$$;

CREATE TRIGGER models_shape_changed
    BEFORE UPDATE OF model, task_count, format_version ON parsley.models
    FOR EACH ROW
    WHEN (OLD.model IS DISTINCT FROM NEW.model
          OR OLD.task_count IS DISTINCT FROM NEW.task_count
          OR OLD.format_version IS DISTINCT FROM NEW.format_version)
    EXECUTE FUNCTION parsley.new_shape_id_of_model();

-- A topic identity recorded, changed or removed: the model (or both models, for a row moved
-- from one to another) gets a new shape.
CREATE FUNCTION parsley.new_shape_id_of_topics() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        UPDATE parsley.models SET shape_id = gen_random_uuid() WHERE model = OLD.model;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        UPDATE parsley.models SET shape_id = gen_random_uuid() WHERE model = NEW.model;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER topics_recorded
    AFTER INSERT OR DELETE ON parsley.topics
    FOR EACH ROW EXECUTE FUNCTION parsley.new_shape_id_of_topics();

CREATE TRIGGER topics_changed
    AFTER UPDATE ON parsley.topics
    FOR EACH ROW
    WHEN (OLD.model IS DISTINCT FROM NEW.model
          OR OLD.topic_name IS DISTINCT FROM NEW.topic_name
          OR OLD.topic_id IS DISTINCT FROM NEW.topic_id)
    EXECUTE FUNCTION parsley.new_shape_id_of_topics();

-- TRUNCATE fires no row trigger: every model gets a new shape.
CREATE FUNCTION parsley.new_shape_ids() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE parsley.models SET shape_id = gen_random_uuid();
    RETURN NULL;
END
$$;

CREATE TRIGGER topics_truncated
    AFTER TRUNCATE ON parsley.topics
    FOR EACH STATEMENT EXECUTE FUNCTION parsley.new_shape_ids();
