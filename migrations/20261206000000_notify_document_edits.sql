-- A change to the documents made outside a step also notifies their readers: a gateway keeps
-- covered snapshots of document reads in memory until the next notification of the key's
-- owner task or of the whole model (docs/gateway.md, "Kept snapshots"). A step's own
-- transaction notifies `'<model>:<task>'` itself and marks itself with the transaction-local
-- setting `parsley.step` (its first statement, store::leases::lock_renew_and_notify); any
-- other statement that inserts, updates or deletes documents (an edit by hand, a script, a
-- test's reset) sends `'*'`, which a gateway takes as a notification of every model (model
-- names cannot contain `*`). Like every NOTIFY, it is delivered when the transaction commits;
-- identical payloads of one transaction are delivered once.
CREATE FUNCTION parsley.notify_unless_stepping() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('parsley.step', true) IS DISTINCT FROM 'on' THEN
        PERFORM pg_notify('parsley_clock', '*');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER documents_edited
    AFTER INSERT OR UPDATE OR DELETE ON projection.documents
    FOR EACH STATEMENT EXECUTE FUNCTION parsley.notify_unless_stepping();
