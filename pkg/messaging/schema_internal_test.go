package messaging

import "testing"

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
