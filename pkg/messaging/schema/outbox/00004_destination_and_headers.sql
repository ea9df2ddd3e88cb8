-- +goose Up
-- Where each row is published: its event's exchange and, when it is not the row's type, its
-- routing key. NULL for the rows before this version, which the relay keeps publishing to its
-- own exchange (RelayConfig.Exchange) with their type as the key, as before. And the row's
-- other AMQP headers: those the process's trace propagator writes beside traceparent and
-- tracestate (baggage, B3), and the caller's own. Nullable columns without a default add
-- nothing to the existing rows: no table rewrite.
ALTER TABLE outbox_messages
    ADD COLUMN exchange    text  NULL,
    ADD COLUMN routing_key text  NULL,
    ADD COLUMN headers     jsonb NULL;

-- +goose Down
ALTER TABLE outbox_messages
    DROP COLUMN headers,
    DROP COLUMN routing_key,
    DROP COLUMN exchange;
