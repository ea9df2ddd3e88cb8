package testenv

import (
	"context"
	"io/fs"
	"log/slog"
	"path"
	"strconv"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/outboxkit/outbox-inbox/internal/migrate"
)

// MigrateTo applies the goose files in dir of fsys whose version is at most version, recording
// them in versionTable: the schema as an earlier release left it, for a test of the migrations
// after it.
func (d *Database) MigrateTo(t testing.TB, fsys fs.FS, dir, versionTable string, version int) {
	t.Helper()
	entries, err := fs.ReadDir(fsys, dir)
	if err != nil {
		t.Fatal(err)
	}
	before := fstest.MapFS{}
	for _, e := range entries {
		prefix, _, _ := strings.Cut(e.Name(), "_")
		if v, err := strconv.Atoi(prefix); err != nil || v > version || !strings.HasSuffix(e.Name(), ".sql") {
			continue
		}
		data, err := fs.ReadFile(fsys, path.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		before[e.Name()] = &fstest.MapFile{Data: data}
	}
	sqlDB, err := d.DB.DB()
	if err != nil {
		t.Fatal(err)
	}
	if err := migrate.Up(context.Background(), slog.New(slog.DiscardHandler), sqlDB, before, versionTable); err != nil {
		t.Fatalf("migrate %s to %d: %v", d.Name, version, err)
	}
}
