// Package testhook lets package messagingtest reach into a subscription without a test hook in
// the library's public API: package messaging sets Deliver when it initialises.
package testhook

import "context"

// Deliver runs msg (a messaging.Message) through sub (a *messaging.Subscription) as a delivery
// from its queue would be, and reports whether sub had handled it already.
var Deliver func(ctx context.Context, sub, msg any) (duplicate bool, err error)
