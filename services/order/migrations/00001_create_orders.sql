-- +goose Up
-- Readers and writers of a table queue behind a migration that waits for its lock for 2 s at
-- most: then the migration is rolled back and tried again (internal/migrate).
SET LOCAL lock_timeout = '2s';
CREATE TABLE orders (
    id              uuid        PRIMARY KEY,
    customer_id     text        NOT NULL,
    total_cents     bigint      NOT NULL CHECK (total_cents >= 0),
    created_at      timestamptz NOT NULL,
    -- Idempotency-Key of the request that placed it, and a hash of that request's command:
    -- the same key with the same command returns this order; with another, a 422.
    idempotency_key text        NULL UNIQUE,
    request_hash    text        NULL
);

CREATE INDEX orders_created_at_idx ON orders (created_at DESC);

CREATE TABLE order_lines (
    order_id         uuid    NOT NULL REFERENCES orders (id) ON DELETE CASCADE,
    line_no          integer NOT NULL,
    sku              text    NOT NULL,
    quantity         bigint  NOT NULL CHECK (quantity > 0),
    unit_price_cents bigint  NOT NULL CHECK (unit_price_cents >= 0),
    PRIMARY KEY (order_id, line_no)
);

-- +goose Down
DROP TABLE order_lines;
DROP TABLE orders;
