-- +goose Up
-- Until this version a broker outage counted against every row it caught, so rows could be
-- parked for minutes by failures that were not theirs. From now on only the broker's verdict on
-- one message parks it: make every parked row due now. A row really at fault parks again at
-- its next failure.
UPDATE outbox_messages
SET next_attempt_at = now()
WHERE processed_at IS NULL AND next_attempt_at > now();

-- +goose Down
-- Nothing to undo: being due now is a state the relay creates itself.
SELECT 1;
