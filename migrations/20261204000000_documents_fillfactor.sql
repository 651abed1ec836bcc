-- Leave a fifth of each page of `projection.documents` free, so an update of a document can
-- put its new version on the page of the old one (a HOT update: no new index entry, no
-- bottom-up index deletion later). With the table's pages full, that takes pruning the
-- page first, and pruning waits for every transaction older than the old version's
-- deleter — under a backlog, several tasks' long steps are always open, and 9 in 10 updates
-- went to another page, each with a new primary-key entry. Measured in docs/projector.md
-- ("Smaller statements and free space on the documents' pages"). Applies to pages written
-- from now on; existing pages keep theirs until the table is rewritten.
ALTER TABLE projection.documents SET (fillfactor = 80);
