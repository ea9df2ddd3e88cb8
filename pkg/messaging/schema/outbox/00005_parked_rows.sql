-- +goose Up
-- An operator parks a row the broker will never accept (a message too large, an exchange that
-- is gone for good) instead of watching it be retried every 5 minutes forever: it keeps its
-- place and its history, and no relay sends it until it is unparked or dropped. parked_at says
-- since when, parked_reason why. A parked row's next_attempt_at is 'infinity': the claim's own
-- condition (next_attempt_at <= now()) passes over it, so the claim, its index and its plan stay
-- as they are. The constraint keeps the two in step (parked exactly when never due); NOT VALID
-- checks every write from now on without reading the table, whose rows all pass (none is
-- parked yet). Nullable columns without a default add nothing to the existing rows: no
-- rewrite.
ALTER TABLE outbox_messages
    ADD COLUMN parked_at     timestamptz NULL,
    ADD COLUMN parked_reason text        NULL,
    ADD CONSTRAINT outbox_messages_parked_never_due
        CHECK ((parked_at IS NOT NULL) = (next_attempt_at = 'infinity')) NOT VALID;

-- +goose Down
-- Parked rows become due: without the columns nothing would tell them apart, and a row that
-- is never due and never shown would be lost.
UPDATE outbox_messages
SET next_attempt_at = now(), parked_at = NULL
WHERE parked_at IS NOT NULL;
ALTER TABLE outbox_messages
    DROP CONSTRAINT outbox_messages_parked_never_due,
    DROP COLUMN parked_reason,
    DROP COLUMN parked_at;
