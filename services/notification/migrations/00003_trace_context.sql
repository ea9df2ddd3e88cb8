-- +goose Up
-- Readers and writers of a table queue behind a migration that waits for its lock for 2 s at
-- most: then the migration is rolled back and tried again (internal/migrate).
SET LOCAL lock_timeout = '2s';
-- The W3C trace context (traceparent, tracestate) of the message handling that recorded the
-- notification: the sender delivers it later, from this row, and continues that trace, so the
-- delivery belongs to the request that caused it. '' for the rows before this version.
ALTER TABLE notifications
    ADD COLUMN trace_parent text NOT NULL DEFAULT '',
    ADD COLUMN trace_state  text NOT NULL DEFAULT '';

-- +goose Down
ALTER TABLE notifications
    DROP COLUMN trace_state,
    DROP COLUMN trace_parent;
