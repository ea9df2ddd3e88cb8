package migrate

import "testing"

// SetLockPolls makes goose give up on the migration lock after n polls, for the rest of t: a
// test that cannot run in parallel with others that migrate.
func SetLockPolls(t testing.TB, n uint64) {
	t.Helper()
	old := lockPolls
	lockPolls = n
	t.Cleanup(func() { lockPolls = old })
}
