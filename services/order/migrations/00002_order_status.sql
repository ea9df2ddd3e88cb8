-- +goose Up
-- Readers and writers of a table queue behind a migration that waits for its lock for 2 s at
-- most: then the migration is rolled back and tried again (internal/migrate).
SET LOCAL lock_timeout = '2s';
-- An order is placed, or cancelled; a cancellation is written with its OrderCancelled event.
-- The check is NOT VALID: checking the rows there are would read the whole table under the lock
-- ADD COLUMN holds; 00003 validates it under a lock that lets readers and writers through.
ALTER TABLE orders
    ADD COLUMN status        text        NOT NULL DEFAULT 'placed',
    ADD COLUMN cancelled_at  timestamptz NULL,
    ADD COLUMN cancel_reason text        NULL,
    ADD CONSTRAINT orders_status_check CHECK (status IN ('placed', 'cancelled')) NOT VALID;

-- +goose Down
ALTER TABLE orders DROP COLUMN status, DROP COLUMN cancelled_at, DROP COLUMN cancel_reason;
