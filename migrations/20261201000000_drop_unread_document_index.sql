-- `documents_by_task` (model, task, key) was never read: every statement on the table looks
-- documents up by (model, key), the primary key. Each document write paid for it all the
-- same — an entry per inserted row and per row version an update could not keep on its page
-- (not HOT), its WAL, and its share of every vacuum. Measured in docs/projector.md
-- ("Throughput").
DROP INDEX IF EXISTS projection.documents_by_task;
