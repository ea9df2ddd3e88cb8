// Package testhook lets package messagingtest reach into a subscription without a test hook in
// the library's public API: package messaging sets Deliver when it initialises.
package testhook

import "context"

// Deliver runs msgs (a []messaging.Message) through sub (a *messaging.Subscription) as one
// batch of deliveries from its queue would be, and reports which sub had handled already.
var Deliver func(ctx context.Context, sub, msgs any) (duplicates []bool, err error)
