-- +goose Up
-- Readers and writers of a table queue behind a migration that waits for its lock for 2 s at
-- most: then the migration is rolled back and tried again (internal/migrate).
SET LOCAL lock_timeout = '2s';
-- Every notification is updated twice soon after it is written: its lease, then its outcome.
-- The lease changes no indexed column, so with room left on its page PostgreSQL updates it in
-- place (a HOT update) without touching the table's four indexes. Rows written from now on
-- leave that room; the ones there already keep their pages as they are.
ALTER TABLE notifications SET (fillfactor = 70);

-- +goose Down
ALTER TABLE notifications RESET (fillfactor);
