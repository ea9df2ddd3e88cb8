-- +goose Up
-- Readers and writers of a table queue behind a migration that waits for its lock for 2 s at
-- most: then the migration is rolled back and tried again (internal/migrate).
SET LOCAL lock_timeout = '2s';
-- A notification whose recipient the mail server refuses for good (a 5yz answer to RCPT TO whose
-- enhanced status code says the address is bad: no such mailbox, bad syntax) is
-- 'undeliverable': its retries end, last_error keeps the refusal, and it leaves the partial
-- index of pending rows, which the leases and the backlog gauges read. An operator sends it
-- again by making it pending (docs/operations.md). The check on status is replaced, in one
-- statement: the new one is NOT VALID, and 00007 validates it, under a lock that lets readers
-- and writers through.
ALTER TABLE notifications
    DROP CONSTRAINT notifications_status_check,
    ADD CONSTRAINT notifications_status_check CHECK (status IN ('pending', 'sent', 'undeliverable')) NOT VALID;

-- +goose Down
-- As the Up: the rows' locks are waited for 2 s at most.
SET LOCAL lock_timeout = '2s';
-- The old schema has no undeliverable notification: they are pending again, due at once, and
-- retried for ever if their recipient is still refused.
UPDATE notifications SET status = 'pending', next_attempt_at = now() WHERE status = 'undeliverable';
ALTER TABLE notifications
    DROP CONSTRAINT notifications_status_check,
    ADD CONSTRAINT notifications_status_check CHECK (status IN ('pending', 'sent'));
