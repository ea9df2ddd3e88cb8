-- +goose Up
CREATE TABLE outbox_messages (
    id              uuid        PRIMARY KEY,          -- UUIDv7: new rows land at the end of the index
    type            text        NOT NULL,
    payload         jsonb       NOT NULL,
    correlation_id  text        NOT NULL DEFAULT '',
    occurred_at     timestamptz NOT NULL,
    processed_at    timestamptz NULL,                 -- NULL until the broker confirmed the publish
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text        NULL,
    next_attempt_at timestamptz NOT NULL DEFAULT now()
);

-- Covers only the rows still to send, so it stays small however many sent rows the table keeps.
-- Its order matches the relay's claim query.
CREATE INDEX outbox_messages_unprocessed_idx
    ON outbox_messages (occurred_at, id)
    WHERE processed_at IS NULL;

-- +goose Down
DROP TABLE outbox_messages;
