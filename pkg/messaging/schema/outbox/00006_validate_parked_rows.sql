-- +goose Up
-- 00005 added outbox_messages_parked_never_due NOT VALID, so as not to read the table under
-- ALTER TABLE's lock; VALIDATE reads it under a lock that readers and writers pass. A row that
-- would fail it (never due, and not parked: left so by a version before 00002, which made such
-- rows due) is made due first, as 00002 did, so that the check cannot stop the upgrade.
UPDATE outbox_messages
SET next_attempt_at = now()
WHERE parked_at IS NULL AND next_attempt_at = 'infinity';
ALTER TABLE outbox_messages VALIDATE CONSTRAINT outbox_messages_parked_never_due;

-- +goose Down
-- A validated check is the same check: nothing to undo.
SELECT 1;
