-- +goose Up
-- Readers and writers of a table queue behind a migration that waits for its lock for 2 s at
-- most: then the migration is rolled back and tried again (internal/migrate).
SET LOCAL lock_timeout = '2s';
-- One notification per order and kind (order_confirmation, invoice, order_cancelled), instead
-- of one per order. The rows so far are all order confirmations, one per order, so they meet
-- both new constraints. The check is NOT VALID, and 00005 validates it, under a lock that lets
-- readers and writers through. (The unique index is built under this migration's lock: a
-- migration written today would build it CONCURRENTLY, which needs a run outside a
-- transaction that internal/migrate does not offer.)
ALTER TABLE notifications DROP CONSTRAINT notifications_order_id_key;
ALTER TABLE notifications ADD CONSTRAINT notifications_order_id_kind_key UNIQUE (order_id, kind);
ALTER TABLE notifications ADD CONSTRAINT notifications_kind_check
    CHECK (kind IN ('order_confirmation', 'invoice', 'order_cancelled')) NOT VALID;

-- +goose Down
-- The old schema holds only order confirmations: the other kinds are dropped.
DELETE FROM notifications WHERE kind <> 'order_confirmation';
ALTER TABLE notifications DROP CONSTRAINT notifications_kind_check;
ALTER TABLE notifications DROP CONSTRAINT notifications_order_id_kind_key;
ALTER TABLE notifications ADD CONSTRAINT notifications_order_id_key UNIQUE (order_id);
