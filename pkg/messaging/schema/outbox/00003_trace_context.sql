-- +goose Up
-- The W3C trace context (traceparent, tracestate) of the span that enqueued the row: the relay
-- publishes the row as a child of it, so one trace follows an event from the request that
-- caused it to every consumer. '' for rows enqueued outside any trace, and for the rows before
-- this version. A constant default adds the columns without rewriting the table.
ALTER TABLE outbox_messages
    ADD COLUMN trace_parent text NOT NULL DEFAULT '',
    ADD COLUMN trace_state  text NOT NULL DEFAULT '';

-- +goose Down
ALTER TABLE outbox_messages
    DROP COLUMN trace_state,
    DROP COLUMN trace_parent;
