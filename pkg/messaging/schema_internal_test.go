package messaging

import (
	"strings"
	"testing"
)

// A migration file checked out with CRLF line ends (git's autocrlf on Windows) reads as with LF.
func TestUpSectionReadsCRLF(t *testing.T) {
	for _, file := range []string{
		"-- +goose Up\nCREATE TABLE t ();\n-- +goose Down\nDROP TABLE t;\n",
		"-- +goose Up\r\nCREATE TABLE t ();\r\n-- +goose Down\r\nDROP TABLE t;\r\n",
	} {
		up, err := upSection(file)
		if err != nil || up != "CREATE TABLE t ();\n" {
			t.Errorf("upSection(%q) = %q, %v; want the Up section", file, up, err)
		}
	}
}

// A goose annotation the migrations here would ignore is refused, naming it: a file under NO
// TRANSACTION would otherwise run in a transaction, and fail at every start. StatementBegin
// and StatementEnd change nothing for a section run whole, and are taken.
func TestUpSectionRefusesGooseAnnotationsItWouldIgnore(t *testing.T) {
	for _, c := range []struct{ file, refused string }{
		{"-- +goose NO TRANSACTION\n-- +goose Up\nCREATE INDEX CONCURRENTLY i ON t (c);\n-- +goose Down\nDROP INDEX i;\n", "NO TRANSACTION"},
		{"-- +goose Up\n-- +goose no transaction\nCREATE INDEX CONCURRENTLY i ON t (c);\n", "no transaction"},
		{"-- +goose ENVSUB ON\n-- +goose Up\nCREATE TABLE ${T} ();\n", "ENVSUB ON"},
		{"-- +goose Up\nSELECT 1;\n-- +goose Down\n  --+goose NO TRANSACTION\nSELECT 1;\n", "NO TRANSACTION"},
	} {
		_, err := upSection(c.file)
		if err == nil || !strings.Contains(err.Error(), "-- +goose "+c.refused+":") {
			t.Errorf("upSection(%q) = %v; want it to refuse -- +goose %s", c.file, err, c.refused)
		}
	}
	const body = "CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$ BEGIN RETURN 1; END $$;\n"
	up, err := upSection("-- +goose Up\n-- +goose StatementBegin\n" + body + "-- +goose StatementEnd\n-- +goose Down\nDROP FUNCTION f;\n")
	if err != nil || !strings.Contains(up, body) {
		t.Errorf("upSection of a StatementBegin block = %q, %v; want the block", up, err)
	}
}

// The library's own migrations all read: a file that carried an annotation they would ignore
// fails here, before any database.
func TestEmbeddedMigrationsRead(t *testing.T) {
	for _, dir := range []string{"schema/outbox", "schema/inbox"} {
		if migrations, err := readMigrations(dir); err != nil || len(migrations) == 0 {
			t.Errorf("readMigrations(%q) = %d migrations, %v", dir, len(migrations), err)
		}
	}
}
