package main

import (
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// inbox show answers for one consumer or for all, and exits 3 when there is no record.
func TestInboxShowTellsWhoHandledAMessageAndWhen(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, 2*testenv.DefaultConnections) // the inbox's database and one without it
	d := testenv.NewDatabase(t)
	d.Migrate(t, platform.Library(messaging.MigrateInbox))
	id, other := uuid.New(), uuid.New()
	execSQL(t, d.DB, `INSERT INTO inbox_messages (message_id, consumer, processed_at) VALUES
		(?, 'notification', '2026-11-20 10:00:01.5+00'), (?, 'invoicing', '2026-11-20 10:00:00+00'), (?, 'invoicing', now())`, id, id, other)

	out := ok(t, "inbox", "show", "--id", id.String(), "--db", d.URL)
	want := "message " + id.String() + " was handled by invoicing at 2026-11-20T10:00:00Z\n" +
		"message " + id.String() + " was handled by notification at 2026-11-20T10:00:01.5Z\n"
	if out != want {
		t.Errorf("inbox show said\n%s\nwant\n%s", out, want)
	}
	res := okJSON[inboxResult](t, "inbox", "show", "--id", strings.ToUpper(id.String()), "--consumer", "notification", "--db", d.URL)
	if res.MessageID != id || deref(res.Consumer) != "notification" || !res.Handled || len(res.Records) != 1 ||
		!res.Records[0].ProcessedAt.Equal(time.Date(2026, 11, 20, 10, 0, 1, 5e8, time.UTC)) {
		t.Errorf("inbox show --consumer -o json: %+v", res)
	}

	code, stdout, stderr := ctl(t, "inbox", "show", "--id", other.String(), "--consumer", "notification", "--db", d.URL)
	if code != exitNoMatch || stderr != "" || !strings.Contains(stdout, "no record of message "+other.String()+" by consumer notification: not handled") {
		t.Errorf("inbox show of a message the consumer did not handle: exit %d, %q %q; want 3 saying so", code, stdout, stderr)
	}
	code, stdout, _ = ctl(t, "inbox", "show", "--id", uuid.NewString(), "--db", d.URL, "-o", "json")
	if res := decode[inboxResult](t, stdout); code != exitNoMatch || res.Handled || res.Consumer != nil || res.Records == nil || len(res.Records) != 0 {
		t.Errorf("inbox show -o json of an unknown message: exit %d, %+v; want 3, handled false, no records", code, res)
	}
	// A database without the inbox is a failure, not an answer.
	wantExit(t, exitFailure, []string{"inbox", "show", "--id", id.String(), "--db", outboxDB(t).URL}, "inbox_messages")
}
