// Package ctxerr keeps the driver adapters to the library's contract on a context's end (see
// package messaging's driver.go): each PostgreSQL driver reports a statement or a commit that
// the caller's context stopped in words of its own, and the library tells by errors.Is(err,
// ctx.Err()) a cancellation from an outage.
package ctxerr

import (
	"context"
	"errors"
	"fmt"
	"slices"
)

// queryCanceled is the SQLSTATE of a statement the server cancelled: how a driver that cancels
// a running statement when its context ends (lib/pq, pgx with
// pgconn.CancelRequestContextWatcherHandler) reports it.
const queryCanceled = "57014"

// Ended names ctx's end in err, a statement's or a commit's failure, when ctx has ended and err
// is the server's query_canceled or one of causes, the driver's own ways of reporting that end;
// err stays in the chain, for errors.Is and errors.As. Other errors (a constraint's, say) are
// left as they are, even after ctx ended.
func Ended(ctx context.Context, err error, causes ...error) error {
	cause := ctx.Err()
	if err == nil || cause == nil || errors.Is(err, cause) {
		return err
	}
	var coded interface{ SQLState() string }
	if (errors.As(err, &coded) && coded.SQLState() == queryCanceled) ||
		slices.ContainsFunc(causes, func(c error) bool { return errors.Is(err, c) }) {
		return fmt.Errorf("%w: %w", cause, err)
	}
	return err
}
