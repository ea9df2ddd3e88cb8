-- +goose Up
-- Readers and writers of a table queue behind a migration that waits for its lock for 2 s at
-- most: then the migration is rolled back and tried again (internal/migrate).
SET LOCAL lock_timeout = '2s';
CREATE TABLE invoices (
    id           uuid        PRIMARY KEY,
    -- One invoice per order, even if two different messages ever announced the same order.
    order_id     uuid        NOT NULL UNIQUE,
    customer_id  text        NOT NULL,
    amount_cents bigint      NOT NULL CHECK (amount_cents >= 0),
    message_id   uuid        NOT NULL,  -- the OrderPlaced message that created it
    created_at   timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX invoices_created_at_idx ON invoices (created_at DESC);

-- +goose Down
DROP TABLE invoices;
