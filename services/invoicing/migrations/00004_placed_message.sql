-- +goose Up
-- Readers and writers of a table queue behind a migration that waits for its lock for 2 s at
-- most: then the migration is rolled back and tried again (internal/migrate).
SET LOCAL lock_timeout = '2s';
-- The OrderPlaced message that gave the invoice its amount, on the rows written from now on: on
-- an issued row, the message that created it; on a row a cancellation wrote before its order
-- arrived, NULL until that order's OrderPlaced comes. Any later OrderPlaced for the order finds
-- it set and changes nothing, even for an order whose total was 0. NULL by default: no row is
-- rewritten, so the rows written before keep NULL (the invoicer tells them apart as it did:
-- see awaitsItsOrderSQL).
ALTER TABLE invoices ADD COLUMN placed_message_id uuid NULL;

-- +goose Down
ALTER TABLE invoices DROP COLUMN placed_message_id;
