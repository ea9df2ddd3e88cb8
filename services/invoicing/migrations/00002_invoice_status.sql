-- +goose Up
-- Readers and writers of a table queue behind a migration that waits for its lock for 2 s at
-- most: then the migration is rolled back and tried again (internal/migrate).
SET LOCAL lock_timeout = '2s';
-- An invoice is issued, or void (its order was cancelled). A cancellation that arrives before
-- its order leaves a void row with no amount yet: the unique order_id then keeps the late
-- OrderPlaced from ever issuing one.
ALTER TABLE invoices
    ADD COLUMN status    text        NOT NULL DEFAULT 'issued' CHECK (status IN ('issued', 'void')),
    ADD COLUMN voided_at timestamptz NULL;

COMMENT ON COLUMN invoices.message_id IS 'the message that created the row: OrderPlaced, or an OrderCancelled that came first';

-- +goose Down
ALTER TABLE invoices DROP COLUMN status, DROP COLUMN voided_at;
