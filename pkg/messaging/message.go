package messaging

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
)

// Message is the envelope every event travels in, from the outbox row to the consumer.
// ID is what makes redelivery detectable: it is the outbox row's primary key, the AMQP
// message_id, and the inbox key on the receiving side, and it never changes between attempts.
// It is a UUIDv7, time-ordered, as NewMessage makes it: Enqueue refuses any other version.
type Message struct {
	ID         uuid.UUID
	Type       string          // e.g. "OrderPlaced"; also the AMQP routing key, unless RoutingKey says otherwise
	Payload    json.RawMessage // the event itself, JSON
	OccurredAt time.Time
	// CorrelationID is optional; carried as the AMQP correlation_id and a header. A delivery's
	// that no message could carry on (over 255 bytes, a NUL) or carry unaltered (invalid UTF-8)
	// reads as "".
	CorrelationID string
	// TraceParent and TraceState are the W3C trace context the message belongs to, and Headers
	// its other AMQP headers: what else the trace propagator writes (baggage, B3), and the
	// caller's own. [Enqueue] fills the trace context from its ctx unless the message has one;
	// the relay sends them as headers; a consumer reads them back and continues the trace.
	TraceParent string
	TraceState  string
	Headers     map[string]string
	// Exchange and RoutingKey say where the message is published: an [Event]'s exchange, with
	// the message's Type as the routing key unless RoutingKey is set. A message enqueued without
	// an exchange goes to its relay's ([RelayConfig.Exchange]). On the consuming side they tell
	// where the delivery came through. A [Subscription] binds its queue by type (see
	// [Event.Binding]): a RoutingKey of another value is for consumers of other making.
	Exchange   string
	RoutingKey string
}

// routingKey is the key the message is published with.
func (m Message) routingKey() string {
	if m.RoutingKey != "" {
		return m.RoutingKey
	}
	return m.Type
}

// NewMessage builds a message with a fresh UUIDv7 (time-ordered, so outbox inserts append to
// the primary key index) and payload marshalled to JSON.
func NewMessage(msgType string, payload any) (Message, error) {
	if msgType == "" {
		return Message{}, errors.New("new message: empty type")
	}
	id, err := uuid.NewV7()
	if err != nil {
		return Message{}, fmt.Errorf("new message: generate id: %w", err)
	}
	body, err := json.Marshal(payload)
	if err != nil {
		return Message{}, fmt.Errorf("new message %s: marshal payload: %w", msgType, err)
	}
	return Message{ID: id, Type: msgType, Payload: body, OccurredAt: time.Now().UTC()}, nil
}

// decode unmarshals the payload into T. A payload that does not decode can never be handled,
// so the error is Permanent: the consumer dead-letters the message instead of retrying it.
func decode[T any](msg Message) (T, error) {
	var v T
	if err := json.Unmarshal(msg.Payload, &v); err != nil {
		return v, Permanent(fmt.Errorf("decode %s payload: %w", msg.Type, err))
	}
	return v, nil
}

// permanentError marks a failure that retrying cannot fix.
type permanentError struct{ err error }

func (e permanentError) Error() string { return e.err.Error() }
func (e permanentError) Unwrap() error { return e.err }

// Permanent marks err as one that no retry can fix (an undecodable or invalid message). A
// [Subscription] sends such a message to its dead-letter queue at once and logs the reason;
// but not when err carries a database outage's SQLSTATE (waited out), nor when the handler
// timeout cut the attempt off (a failure, tried again); and at shutdown a message whose handler
// failed is handed back, whatever its error.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return permanentError{err: err}
}

// IsPermanent reports whether err, or any error it wraps, was marked with [Permanent].
func IsPermanent(err error) bool {
	var p permanentError
	return errors.As(err, &p)
}

// unavailableError marks a failure of the environment (database down), not of the message.
type unavailableError struct{ err error }

func (e unavailableError) Error() string { return e.err.Error() }
func (e unavailableError) Unwrap() error { return e.err }

// Unavailable marks err as caused by a dependency being down. A [Subscription] keeps retrying such
// a message with backoff for as long as it takes, without counting the attempts against it,
// so an outage does not push good messages into the dead-letter queue; but before RabbitMQ 4.3
// the broker counts a delivery each time its consumer timeout (30 min by default) takes back
// the deliveries held through the outage, and at the delivery limit dead-letters them itself.
func Unavailable(err error) error {
	if err == nil {
		return nil
	}
	return unavailableError{err: err}
}

// IsUnavailable reports whether err was marked with [Unavailable].
func IsUnavailable(err error) bool {
	var u unavailableError
	return errors.As(err, &u)
}
