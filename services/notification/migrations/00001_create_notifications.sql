-- +goose Up
-- Readers and writers of a table queue behind a migration that waits for its lock for 2 s at
-- most: then the migration is rolled back and tried again (internal/migrate).
SET LOCAL lock_timeout = '2s';
-- One order confirmation per order. The row is written in the inbox's transaction as
-- 'pending'; the sender delivers it after the commit and marks it 'sent'. Delivery is work
-- outside the database, so the row, not the message, is what makes it happen exactly once.
CREATE TABLE notifications (
    id              uuid        PRIMARY KEY,  -- also the e-mail's Message-ID: the receiver's idempotency key
    order_id        uuid        NOT NULL UNIQUE,
    customer_id     text        NOT NULL,
    kind            text        NOT NULL,
    recipient       text        NOT NULL,
    subject         text        NOT NULL,
    body            text        NOT NULL,
    status          text        NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'sent')),
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text        NULL,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    message_id      uuid        NOT NULL,     -- the OrderPlaced message that created it
    created_at      timestamptz NOT NULL DEFAULT now(),
    sent_at         timestamptz NULL
);

CREATE INDEX notifications_pending_idx ON notifications (created_at, id) WHERE status = 'pending';
CREATE INDEX notifications_created_at_idx ON notifications (created_at DESC);

-- +goose Down
DROP TABLE notifications;
