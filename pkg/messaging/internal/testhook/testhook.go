// Package testhook lets package messagingtest, and the library's tests, reach into the library
// without a test hook in its public API: package messaging sets these when it initialises.
package testhook

import "context"

// Deliver runs msgs (a []messaging.Message) through sub (a *messaging.Subscription) as one
// batch of deliveries from its queue would be, and reports which sub had handled already.
var Deliver func(ctx context.Context, sub, msgs any) (duplicates []bool, err error)

// WithEnqueueBatchBytes returns ctx, under which an Enqueue splits its rows into inserts of at
// most n bytes of JSON each rather than megabytes: a test splits a few small messages.
var WithEnqueueBatchBytes func(ctx context.Context, n int) context.Context
