-- +goose Up
-- Readers and writers of a table queue behind a migration that waits for its lock for 2 s at
-- most: then the migration is rolled back and tried again (internal/migrate).
SET LOCAL lock_timeout = '2s';
-- An invoice is issued, or void (its order was cancelled). A cancellation that arrives before
-- its order leaves a void row with no amount yet: the unique order_id then keeps the late
-- OrderPlaced from ever issuing one. The check is NOT VALID: checking the rows there are would
-- read the whole table under the lock ADD COLUMN holds; 00003 validates it under a lock that
-- lets readers and writers through.
ALTER TABLE invoices
    ADD COLUMN status    text        NOT NULL DEFAULT 'issued',
    ADD COLUMN voided_at timestamptz NULL,
    ADD CONSTRAINT invoices_status_check CHECK (status IN ('issued', 'void')) NOT VALID;

COMMENT ON COLUMN invoices.message_id IS 'the message that created the row: OrderPlaced, or an OrderCancelled that came first';

-- +goose Down
ALTER TABLE invoices DROP COLUMN status, DROP COLUMN voided_at;
