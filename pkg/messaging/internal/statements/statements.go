// Package statements holds the library's SQL, in one place: every statement that carries a
// guarantee (the claim, the marking, the backoff, the inbox's decision) is written here once,
// readable as SQL, with why it is written so. They use PostgreSQL's $n placeholders, which
// every driver the library adapts takes. Lists travel as one parameter (a PostgreSQL array
// literal, or a JSON document), so each statement's text is the same whatever the batch's size:
// drivers prepare it once.
package statements

// NotifyChannel is the PostgreSQL channel an enqueue notifies, and relays listen on.
const NotifyChannel = "outbox_messages"

// The outbox.
const (
	// InsertOutbox adds the rows of one JSON array ($1) of objects with the keys below, and
	// wakes the relays (see Notify), in one statement: one round trip. An INSERT in WITH runs
	// to completion whether or not the query reads it.
	InsertOutbox = `WITH inserted AS (
` + InsertOutboxQuiet + `)
` + Notify

	// InsertOutboxQuiet adds the rows as InsertOutbox does, without waking the relays: for
	// relays that poll (messaging.WithoutNotify). next_attempt_at, processed_at and attempts
	// take their defaults: due now, by the database's clock. jsonb_to_recordset reads a JSON
	// null as SQL NULL, even into a jsonb column: every object carries its payload, so a NULL
	// there is the payload null, stored as the JSON value it is.
	InsertOutboxQuiet = `INSERT INTO outbox_messages
    (id, type, payload, correlation_id, occurred_at, trace_parent, trace_state, exchange, routing_key, headers)
SELECT id, type, coalesce(payload, 'null'), correlation_id, occurred_at, trace_parent, trace_state, exchange, routing_key, headers
FROM jsonb_to_recordset($1::jsonb) AS r(
    id uuid, type text, payload jsonb, correlation_id text, occurred_at timestamptz,
    trace_parent text, trace_state text, exchange text, routing_key text, headers jsonb)`

	// Notify wakes the relays. Inside the enqueuing transaction it is delivered only if and when
	// that commits: a relay wakes exactly when the rows become visible to it. However often a
	// transaction notifies, PostgreSQL delivers one notification (same channel, same payload).
	// The price is at the commit: a transaction that notified takes a lock PostgreSQL shares
	// across the whole server ("database 0", async.c's PreCommit_Notify) and holds it until its
	// commit is flushed, so the commits that notify, in every database, go one at a time.
	Notify = `SELECT pg_notify('` + NotifyChannel + `', '')`

	// Listen subscribes a relay's connection to the notifications.
	Listen = `LISTEN ` + NotifyChannel

	// ClaimPlan, run first in each batch's transaction (unless the relay's sessions start with
	// the same settings, RelayConfig.SessionsPlanByIndex): its statements must use their indexes.
	// The claim must walk the partial index in order and stop after the batch; a planner
	// without statistics (a new table, a burst before autovacuum's first ANALYZE) guesses
	// that few rows are unsent and prefers to fetch them all and sort them: at every claim,
	// the whole backlog. The marking must find its rows by primary key; a generic plan cached
	// while the table was nearly empty scans it whole instead, and keeps doing so as the table
	// grows, until an ANALYZE: at 200 messages a second that took a core. Forbidding sorts and
	// sequential scans for the batch's transaction leaves them the indexes.
	ClaimPlan = `SELECT set_config('enable_sort', 'off', true), set_config('enable_seqscan', 'off', true)`

	// ScanPlan undoes ClaimPlan's settings, for a transaction that reads every unsent row on
	// sessions that start with them: with statistics, a sequential scan of the table reads
	// 1,000,000 unsent rows of 2,000,000 in 0.3 s, the walk of the partial index they leave
	// in 0.7-0.9 s.
	ScanPlan = `SELECT set_config('enable_sort', 'on', true), set_config('enable_seqscan', 'on', true)`

	// Claim takes the oldest due rows, at most $1. FOR UPDATE SKIP LOCKED, inside the batch's
	// transaction, makes concurrent relays, and the lanes of one relay, take disjoint rows
	// instead of publishing the same ones.
	Claim = claimDue + claimOldest

	// ClaimBounded is Claim ($1 rows) that also has the database end the batch's transaction,
	// its locks with it, once it sits idle more than $2 milliseconds (text): the longest the
	// batch waits for its confirms, and a margin. A relay host lost mid-batch (a partition, a
	// frozen machine) leaves its session idle in the transaction, which PostgreSQL otherwise
	// keeps, the rows locked and skipped by every other relay, until TCP gives the connection up:
	// some two hours at Linux's default keepalive. The setting is the transaction's (set_config's
	// true), and PostgreSQL reads it each time the session goes idle within it: a statement or a
	// commit that runs, or waits (for a lock, a synchronous standby), is not idle. The sub-select
	// runs once (an InitPlan), before the first row: in the claim, it costs no round trip of
	// its own, on sessions that set their plan settings themselves too.
	ClaimBounded = claimDue + `
  AND (SELECT set_config('idle_in_transaction_session_timeout', $2, true)) IS NOT NULL` + claimOldest

	// AnyDue says whether some row is due, locked or not: the claim's condition without its
	// lock, so it counts the rows another transaction's claim holds, which the claim's SKIP
	// LOCKED passed over (a plain read waits for no row lock, and sees the row as committed).
	// It walks the claim's partial index of the unsent rows, under ClaimPlan's settings, in the
	// transaction of a claim that found nothing, and stops at the first due row; with none due,
	// it walks past every parked or backed-off unsent row, as that empty claim did.
	AnyDue = `SELECT EXISTS (SELECT 1` + dueRows + `)`

	claimDue = `SELECT id, type, payload, correlation_id, occurred_at, attempts, trace_parent, trace_state, exchange, routing_key, headers` + dueRows
	dueRows  = `
FROM outbox_messages
WHERE processed_at IS NULL AND next_attempt_at <= now()`
	claimOldest = `
ORDER BY occurred_at, id
LIMIT $1
FOR UPDATE SKIP LOCKED`

	// MarkSent marks the rows ($1, an array of ids) the broker confirmed and routed, and only
	// those. clock_timestamp(), not now(): now() is when the transaction began, before the
	// publishing it waited for.
	MarkSent = `UPDATE outbox_messages SET processed_at = clock_timestamp() WHERE id = ANY($1::uuid[])`

	// RecordFailures never gives up on a row: it records, for each of the rows $1 (an array of
	// ids), why it failed and when to try it again, which $2 holds, a JSON object of each id's
	// {"error": text, "delay_ms": n} (delay_ms from now, not from the start of the
	// transaction), and returns each row's id and next attempt: one statement for all the rows
	// a batch's broker refused, found by primary key as MarkSent finds its rows. Only the
	// broker's verdict on one message gets here; a broker outage is the relay's to wait out, and
	// costs the row nothing.
	RecordFailures = `UPDATE outbox_messages
SET attempts = attempts + 1,
    last_error = $2::jsonb -> id::text ->> 'error',
    next_attempt_at = clock_timestamp() + ($2::jsonb -> id::text ->> 'delay_ms')::bigint * interval '1 millisecond'
WHERE id = ANY($1::uuid[])
RETURNING id, next_attempt_at`
)

// The inbox.
const (
	// ClaimInbox records that consumer $2 handles the messages $1 (an array of ids), and returns
	// the ids it recorded: the others were handled already. The primary key (message_id,
	// consumer) decides between two deliveries of one message, even concurrent ones: under READ
	// COMMITTED the second insert waits for the first transaction and then inserts nothing.
	// There is no check-then-insert race, and no unique-violation error that would abort the
	// transaction. Ids go in in order, so two batches holding the same messages wait for each
	// other instead of deadlocking.
	ClaimInbox = `INSERT INTO inbox_messages (message_id, consumer, processed_at)
SELECT id, $2, now() FROM unnest($1::uuid[]) AS id ORDER BY id
ON CONFLICT (message_id, consumer) DO NOTHING
RETURNING message_id`
)

// The operator's view of the outbox, and its actions on single rows. A parked row is unsent,
// and its next_attempt_at is 'infinity' (migration 00005 keeps the two in step): the claim
// passes over it. Rows are read with OutboxColumns, where a parked row's next attempt is NULL:
// drivers cannot scan 'infinity' into a time.
const (
	// OutboxColumns is what the operator's functions read of a row, payload aside.
	OutboxColumns = `id, type, correlation_id, occurred_at, processed_at, attempts, last_error,
       nullif(next_attempt_at, 'infinity'), exchange, routing_key, parked_at, parked_reason`

	// OutboxStats reads the backlog: how many rows wait, the age of the oldest, the most
	// attempts of any, parked rows aside, and how many are parked. One pass over every unsent
	// row.
	OutboxStats = `SELECT ` + outboxStatsColumns + `
FROM outbox_messages WHERE processed_at IS NULL`

	// OutboxStatsHead reads the same of the $1 oldest unsent rows only, walking the partial
	// index in order (under ClaimPlan's settings): it costs the same however large the backlog.
	// The oldest row's age is exact; the counts stop at $1, and the attempts are the oldest
	// rows'.
	OutboxStatsHead = `WITH head AS (
    SELECT occurred_at, attempts, parked_at FROM outbox_messages
    WHERE processed_at IS NULL
    ORDER BY occurred_at, id
    LIMIT $1)
SELECT ` + outboxStatsColumns + `
FROM head`

	outboxStatsColumns = `count(*) FILTER (WHERE parked_at IS NULL),
       coalesce(extract(epoch FROM now() - min(occurred_at) FILTER (WHERE parked_at IS NULL)), 0)::float8,
       coalesce(max(attempts) FILTER (WHERE parked_at IS NULL), 0),
       count(*) FILTER (WHERE parked_at IS NOT NULL)`

	// FailingOutbox lists up to $1 unsent rows the broker refused, parked ones aside, latest
	// next attempt first.
	FailingOutbox = `SELECT ` + OutboxColumns + `
FROM outbox_messages
WHERE processed_at IS NULL AND attempts > 0 AND parked_at IS NULL
ORDER BY next_attempt_at DESC, id
LIMIT $1`

	// ParkedOutbox lists up to $1 parked rows, the latest parked first.
	ParkedOutbox = `SELECT ` + OutboxColumns + `
FROM outbox_messages
WHERE processed_at IS NULL AND parked_at IS NOT NULL
ORDER BY parked_at DESC, id
LIMIT $1`

	// WaitingOutbox lists the rows RetryAll would make due (of type $1 unless it is ''), the
	// oldest first, at most $2 unless it is 0.
	WaitingOutbox = `SELECT ` + OutboxColumns + waitingOutbox

	// WaitingOutboxIDs lists the ids of the rows WaitingOutbox lists, in its order.
	WaitingOutboxIDs = `SELECT id` + waitingOutbox

	// ListedOutbox reads the rows $1 (an array of ids), the oldest first.
	ListedOutbox = `SELECT ` + OutboxColumns + `
FROM outbox_messages
WHERE id = ANY($1::uuid[])
ORDER BY occurred_at, id`

	waitingOutbox = `
FROM outbox_messages
WHERE processed_at IS NULL AND next_attempt_at > now() AND parked_at IS NULL AND ($1 = '' OR type = $1)
ORDER BY occurred_at, id
LIMIT nullif($2, 0)`

	// RetryAll makes every unsent row that waits out a backoff due now; parked rows wait for
	// their operator.
	RetryAll = `UPDATE outbox_messages SET next_attempt_at = now()
WHERE processed_at IS NULL AND next_attempt_at > now() AND parked_at IS NULL`

	// RetryListed makes due now those of the rows $1 (an array of ids) that still wait out a
	// backoff, and returns them.
	RetryListed = `UPDATE outbox_messages SET next_attempt_at = now()
WHERE id = ANY($1::uuid[]) AND processed_at IS NULL AND next_attempt_at > now() AND parked_at IS NULL
RETURNING ` + OutboxColumns

	// OutboxRow reads row $1, payload last.
	OutboxRow = `SELECT ` + OutboxColumns + `, payload FROM outbox_messages WHERE id = $1`

	// LockOutboxRow reads row $1 and locks it until the transaction ends: a single-row action
	// checks its state and changes it with no relay or operator in between. A row a relay is
	// publishing is locked by the relay's batch; this waits for the batch's verdict.
	LockOutboxRow = OutboxRow + ` FOR UPDATE`

	// The single-row actions, each run on a row LockOutboxRow holds, return it as OutboxRow
	// reads it: as it is now, or, deleted, as it was.

	// RetryOne makes the unsent row $1 due now.
	RetryOne = `UPDATE outbox_messages SET next_attempt_at = now()
WHERE id = $1 AND processed_at IS NULL AND parked_at IS NULL
RETURNING ` + OutboxColumns + `, payload`

	// ParkOne parks the unsent row $1, for the reason $2 ('' for none).
	ParkOne = `UPDATE outbox_messages SET parked_at = now(), parked_reason = nullif($2, ''), next_attempt_at = 'infinity'
WHERE id = $1 AND processed_at IS NULL AND parked_at IS NULL
RETURNING ` + OutboxColumns + `, payload`

	// UnparkOne makes the parked row $1 due now. Its attempts and last error stay: its history.
	UnparkOne = `UPDATE outbox_messages SET parked_at = NULL, parked_reason = NULL, next_attempt_at = now()
WHERE id = $1 AND processed_at IS NULL AND parked_at IS NOT NULL
RETURNING ` + OutboxColumns + `, payload`

	// DropOne deletes the unsent row $1.
	DropOne = `DELETE FROM outbox_messages WHERE id = $1 AND processed_at IS NULL
RETURNING ` + OutboxColumns + `, payload`
)

// The operator's view of the inbox.
const (
	// InboxRecords reads the records of message $1, of consumer $2 unless it is '': through
	// the primary key, whose first column is the message id.
	InboxRecords = `SELECT message_id, consumer, processed_at FROM inbox_messages
WHERE message_id = $1 AND ($2 = '' OR consumer = $2)
ORDER BY consumer`
)

// The cleanup.
//
// Each batch is one statement, in a short transaction of its own: it picks up to $n rows older
// than the cutoff, deletes them by their physical address (ctid, no second index lookup), and
// returns how many it picked and deleted and where the next batch starts.
//
// Every batch starts where the previous one stopped (keyset), never at the front of an index:
// restarting there would walk again every entry the earlier batches deleted (vacuum hasn't
// removed them yet; a long transaction anywhere keeps it from doing so) and every old row that
// stays. With a snapshot held open beside it, a restarting loop took 17 s for 1,000,000
// rows and its batches grew to 0.5 s; the keyset one took 3 s with no batch over 0.1 s.
//
// ARRAY(...) rather than IN (SELECT ...): the planner turns IN into a hash join that scans the
// whole table for every batch (1.3 s for 10,000 of 1,200,000 rows, against 17 ms). No sort
// anywhere (the batches run with sorts disabled, see CleanupPlan): a disabled sort still
// runs, but its prohibitive cost estimate makes PostgreSQL JIT-compile the statement, 0.5 s
// per batch. Hence max(ARRAY[id]) for the last id, as uuid has no max().
const (
	// The outbox walks its primary key in creation order (UUIDv7 ids), between the previous
	// batch ($1) and the first id of the millisecond after the cutoff ($2): a row sent before
	// the cutoff was created before it, so the recent rows, most of the table, are never read;
	// but for ids made far ahead of the clock, which a second walk takes, from an hour past now
	// to the last UUID. Unsent rows are passed over once per run, not once
	// per batch. An index on processed_at would find the rows as cheaply, but costs an insert
	// at every mark (12 % more WAL for the relay's marks) and its size beside every row kept.
	// The DELETE tests processed_at again: a row updated while the DELETE waits for its lock
	// (an operator re-queues it) is judged in its new version, and PostgreSQL's minor releases
	// before a 2025 fix do not check the ctid match against that version: there, this test
	// alone keeps the re-queued row from being deleted unsent.
	DeleteSentOutboxBatch = `WITH batch AS (
    SELECT ctid, id FROM outbox_messages
    WHERE id > $1 AND id < $2 AND processed_at IS NOT NULL AND processed_at < $3
    ORDER BY id
    LIMIT $4
), gone AS (
    DELETE FROM outbox_messages
    WHERE ctid = ANY (ARRAY(SELECT ctid FROM batch)) AND processed_at IS NOT NULL AND processed_at < $3
    RETURNING 1
)
SELECT (SELECT count(*) FROM batch), (SELECT count(*) FROM gone), (SELECT (max(ARRAY[id]))[1] FROM batch)`

	// The inbox walks its processed_at index (message ids are whatever the producers chose).
	// Rows share a processed_at (one transaction's batch), so the next batch starts at the
	// last one's time, not after it, and passes over the few entries it already deleted.
	DeleteInboxBatch = `WITH batch AS (
    SELECT ctid, processed_at FROM inbox_messages
    WHERE processed_at >= $1 AND processed_at < $2
    ORDER BY processed_at
    LIMIT $3
), gone AS (
    DELETE FROM inbox_messages
    WHERE ctid = ANY (ARRAY(SELECT ctid FROM batch)) AND processed_at < $2
    RETURNING 1
)
SELECT (SELECT count(*) FROM batch), (SELECT count(*) FROM gone), (SELECT max(processed_at) FROM batch)`
)

// CleanupPlan keeps a cleanup batch on its index. Without statistics (a new table, or before
// autovacuum's first ANALYZE) the planner guesses that few rows match and prefers to fetch
// every one of them and sort them: at every batch, all the old rows left.
const CleanupPlan = `SET LOCAL enable_sort = off`
