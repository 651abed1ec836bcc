-- Every change a gateway's kept snapshots could hide is announced, whatever the session's
-- replication role: the triggers that notify the clock channel fire `ALWAYS`, so a restore
-- with `session_replication_role = replica` and logical replication's apply also notify
-- (an origin trigger fires only in the `origin` role). Edits to the clock rows outside a
-- step notify every model too, like edits to the documents (`parsley.step` marks a step's
-- own transaction, which notifies its task itself). A gateway keeps nothing while any of
-- these triggers is missing or not `ALWAYS` (store::listen::ANNOUNCING_TRIGGERS).
ALTER TABLE projection.documents ENABLE ALWAYS TRIGGER documents_edited;
ALTER TABLE projection.documents ENABLE ALWAYS TRIGGER documents_truncated;
ALTER TABLE parsley.models ENABLE ALWAYS TRIGGER models_recorded_or_removed;
ALTER TABLE parsley.models ENABLE ALWAYS TRIGGER models_reshaped;
ALTER TABLE parsley.models ENABLE ALWAYS TRIGGER models_shape_changed;
ALTER TABLE parsley.models ENABLE ALWAYS TRIGGER models_truncated;
ALTER TABLE parsley.topics ENABLE ALWAYS TRIGGER topics_recorded;
ALTER TABLE parsley.topics ENABLE ALWAYS TRIGGER topics_changed;

CREATE TRIGGER clock_edited
    AFTER INSERT OR UPDATE OR DELETE ON parsley.clock
    FOR EACH STATEMENT EXECUTE FUNCTION parsley.notify_unless_stepping();
CREATE TRIGGER clock_truncated
    BEFORE TRUNCATE ON parsley.clock
    FOR EACH STATEMENT EXECUTE FUNCTION parsley.notify_every_model();
ALTER TABLE parsley.clock ENABLE ALWAYS TRIGGER clock_edited;
ALTER TABLE parsley.clock ENABLE ALWAYS TRIGGER clock_truncated;
