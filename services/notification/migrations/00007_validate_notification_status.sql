-- +goose Up
-- Readers and writers of a table queue behind a migration that waits for its lock for 2 s at
-- most: then the migration is rolled back and tried again (internal/migrate).
SET LOCAL lock_timeout = '2s';
-- Validates the check 00006 replaced NOT VALID: VALIDATE CONSTRAINT reads the whole table under a
-- SHARE UPDATE EXCLUSIVE lock, which readers and writers pass.
ALTER TABLE notifications VALIDATE CONSTRAINT notifications_status_check;
