// Package messaging implements the transactional outbox and inbox patterns over GORM/PostgreSQL
// and RabbitMQ (amqp091-go).
//
// The write side saves an event in the same transaction as the data it describes ([Enqueue]);
// a [Relay] moves unsent rows to RabbitMQ through a confirm-mode [Publisher], marking a row
// sent only once the broker has confirmed and routed it. That gives at-least-once delivery, so
// the read side claims every message in an inbox table in the same transaction as its work
// ([Inbox]), and a [Consumer] acknowledges a delivery only after that transaction commits.
//
// Each message carries the W3C trace context of the span that enqueued it, from the outbox
// row to the AMQP traceparent header to its handler's context, so one trace follows an event
// through every service; spans are recorded only when the process installs an OpenTelemetry
// provider (or gives one in the configs); the context travels either way.
//
// Nothing here knows about orders or invoices: a service brings its own payload types and its
// own business transaction.
package messaging
