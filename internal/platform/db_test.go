package platform

import (
	"context"
	"log/slog"
	"testing"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// A read through the services' GORM handle names its columns: pgx caches each statement it
// prepares, and a cached SELECT * fails once its table gains a column ("cached plan must not
// change result type"), as a rolling upgrade's migration does to the replicas still serving.
func TestReadsSurviveAColumnAddedUnderThem(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+1) // and the pool under test
	d := testenv.NewDatabase(t)
	testenv.Draw(t, 1)
	ctx := context.Background()
	db, err := OpenDB(ctx, slog.New(slog.DiscardHandler), "test", d.URL, 1)
	if err != nil {
		t.Fatal(err)
	}
	sqlDB, err := db.DB()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sqlDB.Close() })
	if err := d.DB.Exec("CREATE TABLE things (id int PRIMARY KEY, name text); INSERT INTO things VALUES (1, 'one')").Error; err != nil {
		t.Fatal(err)
	}
	type thing struct {
		ID   int
		Name string
	}
	read := func(when string) {
		var got thing
		if err := db.Table("things").Take(&got, "id = ?", 1).Error; err != nil || got.Name != "one" {
			t.Fatalf("%s: read %+v, %v; want thing one", when, got, err)
		}
	}
	read("before the migration") // prepared and cached on the pool's one connection
	if err := d.DB.Exec("ALTER TABLE things ADD COLUMN added_later int").Error; err != nil {
		t.Fatal(err)
	}
	read("after a column was added")
}
