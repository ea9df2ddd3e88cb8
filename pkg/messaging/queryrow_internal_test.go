package messaging

import (
	"context"
	"errors"
	"testing"
)

// An error the server sends after the one row (a statement cancelled as it completed) shows in
// Err once Next has returned false, as pgx and database/sql report it: queryRow returns it
// instead of a success over an aborted transaction.
func TestQueryRowReportsAnErrorAfterItsRow(t *testing.T) {
	failed := errors.New("canceling statement due to statement timeout")
	var n int64
	err := queryRow(context.Background(), oneRowThenError{err: failed}, []any{&n}, "SELECT 1")
	if !errors.Is(err, failed) {
		t.Fatalf("queryRow = %v, want the error after the row, %v", err, failed)
	}
}

// oneRowThenError is an Executor whose query returns one row, then fails with err.
type oneRowThenError struct{ err error }

func (oneRowThenError) Exec(context.Context, string, ...any) (int64, error) {
	return 0, errors.New("oneRowThenError: Exec")
}

func (e oneRowThenError) Query(context.Context, string, ...any) (Rows, error) {
	return &rowThenError{err: e.err}, nil
}

// rowThenError is one row, of the value 1, then err: reported by Err only once Next has
// returned false, as a driver learns of it only as it reads on.
type rowThenError struct {
	err   error
	nexts int
}

func (r *rowThenError) Next() bool { r.nexts++; return r.nexts == 1 }

func (r *rowThenError) Scan(dest ...any) error {
	*dest[0].(*int64) = 1
	return nil
}

func (r *rowThenError) Err() error {
	if r.nexts > 1 {
		return r.err
	}
	return nil
}

func (r *rowThenError) Close() {}
