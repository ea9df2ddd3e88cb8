-- +goose Up
CREATE TABLE inbox_messages (
    message_id   uuid        NOT NULL,
    consumer     text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    -- The key decides which delivery does the work: a second insert of the same pair is a
    -- duplicate, even when both deliveries run at the same moment.
    PRIMARY KEY (message_id, consumer)
);

-- For the cleanup of old rows.
CREATE INDEX inbox_messages_processed_at_idx ON inbox_messages (processed_at);

-- +goose Down
DROP TABLE inbox_messages;
